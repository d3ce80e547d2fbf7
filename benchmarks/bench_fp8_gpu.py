"""Real FP8 matmuls on a GPU against bf16, side by side in one run (issue 18's GPU check).

    python benchmarks/bench_fp8_gpu.py [--sizes 4096 8192] [--json FILE]

For each size n: an n x n x n bf16 matmul, and torch._scaled_mm on e4m3 operands with tensorwise and
rowwise scales (mplab.lowbit.quantize's recipes, run on the GPU, so the operands are what lesson 9
builds), timed interleaved with CUDA events (median of the rounds); the TFLOP/s of each and its
speed-up over bf16; and the FP8 result against mplab.lowbit.quantize.scaled_mm's exact
dequantise-and-multiply in fp32 (the GPU's accumulator is not the CPU's: the relative error is
printed, not asserted). Needs a GPU with FP8 tensor cores (compute capability 8.9+).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

from mplab.lowbit import quantize as Q


def timed(fn, rounds: int) -> float:
    """Median milliseconds of fn() over `rounds`, after two warm-up calls."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def one_size(n: int, rounds: int) -> list[dict]:
    g = torch.Generator().manual_seed(n)
    a, b = torch.randn(n, n, generator=g).cuda(), torch.randn(n, n, generator=g).cuda()
    a16, b16 = a.bfloat16(), b.bfloat16()
    rows, flops = [], 2 * n ** 3
    ms = {"bf16": timed(lambda: a16 @ b16.t(), rounds)}
    for recipe in ("tensorwise", "rowwise"):
        qa, qb = getattr(Q, recipe)(a), getattr(Q, recipe)(b)
        a8, b8 = qa.codes.view(torch.float8_e4m3fn), qb.codes.view(torch.float8_e4m3fn)
        sa = qa.scale if recipe == "tensorwise" else qa.scale.reshape(-1, 1)
        sb = qb.scale if recipe == "tensorwise" else qb.scale.reshape(1, -1)

        def mm(a8=a8, b8=b8, sa=sa, sb=sb):
            return torch._scaled_mm(a8, b8.t(), scale_a=sa, scale_b=sb,
                                    out_dtype=torch.bfloat16)

        ms[f"fp8 {recipe}"] = timed(mm, rounds)
        exact = Q.scaled_mm(qa, qb, torch.float32)
        err = ((mm().float() - exact).norm() / exact.norm()).item()
        rows.append({"n": n, "recipe": recipe, "rel_error_vs_exact": err})
    out = []
    for name, t in ms.items():
        row = {"n": n, "matmul": name, "ms": round(t, 4),
               "tflops": round(flops / t / 1e9, 1), "speedup_vs_bf16": round(ms["bf16"] / t, 2)}
        row.update(next((r for r in rows if f"fp8 {r['recipe']}" == name), {}))
        out.append(row)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[4096, 8192])
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--json", metavar="FILE")
    args = p.parse_args(argv)
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        print("no GPU with FP8 tensor cores (compute capability 8.9+) here: nothing to measure")
        return 0
    print(torch.cuda.get_device_name(), "| torch", torch.__version__)
    rows = [r for n in args.sizes for r in one_size(n, args.rounds)]
    for r in rows:
        err = f"  rel. error vs exact {r['rel_error_vs_exact']:.2e}" if "recipe" in r else ""
        print(f"n={r['n']:>5}  {r['matmul']:<15} {r['ms']:9.4f} ms  {r['tflops']:7.1f} TFLOP/s"
              f"  x{r['speedup_vs_bf16']:.2f} vs bf16{err}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
