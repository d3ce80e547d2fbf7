"""The share of the hardware's bf16 speed-up that training through mplab.train keeps: one
layer's GEMMs fp32 against bf16 (the bound) and the lesson transformer's training step fp32
against bf16, measured side by side, several rounds (issue 37: at least 0.8 on a CPU with bf16
units).

    python benchmarks/bench_share.py                    # hidden 512, 4 layers, 3 rounds
    python benchmarks/bench_share.py --hidden 256 --rounds 5
"""

import argparse

from mplab.bench import training_share


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    shares = []
    for i in range(args.rounds):
        r = training_share(hidden=args.hidden, layers=args.layers)
        shares.append(r["share"])
        print(f"round {i + 1}: GEMMs {r['gemm_speedup']:.2f}x, step {r['step_speedup']:.2f}x "
              f"(fp32 {r['fp32_step_s'] * 1e3:.0f} ms, bf16 {r['bf16_step_s'] * 1e3:.0f} ms): "
              f"share {r['share']:.2f}", flush=True)
    print(f"share: {min(shares):.2f}-{max(shares):.2f} (issue 37's goal: at least 0.8); "
          f"attention: {r['attention']}")


if __name__ == "__main__":
    main()
