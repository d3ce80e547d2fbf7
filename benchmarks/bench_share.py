"""The share of the hardware's bf16 speed-up that training through mplab.train keeps: one
layer's GEMMs fp32 against bf16 (the bound) and the lesson transformer's training step fp32
against bf16, measured side by side, in rounds (issue 37: at least 0.8 on a CPU with bf16
units).

    python benchmarks/bench_share.py                    # hidden 512, 4 layers, 5 rounds
    python benchmarks/bench_share.py --hidden 256 --rounds 7
    python benchmarks/bench_share.py --no-watch         # the same runs without the layers' watch
"""

import argparse

from mplab.bench import training_share


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--no-watch", action="store_true",
                   help="train with watch=False (what the layers' watch costs the share)")
    args = p.parse_args()
    r = training_share(hidden=args.hidden, layers=args.layers, rounds=args.rounds,
                       watch=not args.no_watch)
    for i, f in enumerate(r["rounds"], 1):
        print(f"round {i}: GEMMs at {f['tokens']} tokens {f['gemm_speedup']:.2f}x, step "
              f"{f['step_speedup']:.2f}x (fp32 {f['fp32_step_s'] * 1e3:.0f} ms, bf16 "
              f"{f['bf16_step_s'] * 1e3:.0f} ms): share {f['share']:.2f}", flush=True)
    shares = [f["share"] for f in r["rounds"]]
    print(f"share: median {r['share']:.2f}, {min(shares):.2f}-{max(shares):.2f} "
          f"(issue 37's goal: at least 0.8); watch {'off' if args.no_watch else 'on'}; "
          f"attention: {r['attention']}")


if __name__ == "__main__":
    main()
