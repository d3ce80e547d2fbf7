"""mplab's FP8, MX and NVFP4 quantisers against torchao's: values quantised per second, side by
side in one run. Target: mplab's time within 2x of torchao's on every recipe, on the CPU.

    python benchmarks/bench_quantizers.py                    # 4096 x 4096, then 1024 x 4096
    python benchmarks/bench_quantizers.py --size 8192 4096 --repeats 11

Each recipe (tensorwise and rowwise e4m3, MXFP8 floor and rceil, MXFP4, NVFP4) is called as a
user calls it, amax and scales included, mplab's and torchao's taking turns on one random
float32 tensor, one CPU thread; medians are reported (`mplab.bench.quantizer_speed`). The two
results are compared bit for bit first ("same bits"). mplab's returns float32 values on the
grid, the scaled tensor and the dequantised one; torchao's the packed bits, fp4 two to a byte.

    python benchmarks/bench_quantizers.py --slab     # only: a cast a slab at a time, or whole

`--slab` times `mplab.lowbit.quantize.scale_and_cast` (e4m3, one scale) on the size asked (4096 x
4096 by default) a `SLAB` of rows at a time, as it runs, against the whole tensor as one slab,
taking turns on one CPU thread: the figure behind `SLAB` (benchmarks/RECORDS.md).
"""

from __future__ import annotations

import argparse

import torch

from mplab.bench.quantizers import RATIO, TARGET_RATIO, quantizer_speed
from mplab.hardware import describe


def slabs(rows: int, columns: int, repeats: int) -> None:
    """scale_and_cast a SLAB at a time against the whole tensor at once, medians of turns."""
    import statistics
    import time

    from mplab.lowbit import quantize

    x = torch.randn(rows, columns, generator=torch.Generator().manual_seed(0))
    one, slab = torch.tensor(1.0), quantize.SLAB
    times: dict[int, list[float]] = {slab: [], x.numel(): []}
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for turn in range(repeats + 1):
            for size in times:
                quantize.SLAB = size
                t = time.perf_counter()
                quantize.scale_and_cast(x, one, "fp8_e4m3", one)
                if turn:  # the first turn warms up
                    times[size].append(time.perf_counter() - t)
    finally:
        quantize.SLAB = slab
        torch.set_num_threads(before)
    part, whole = (statistics.median(t) * 1e3 for t in times.values())
    print(f"scale_and_cast e4m3 on {rows} x {columns}, one thread: {part:.0f} ms a SLAB "
          f"({slab} values) at a time, {whole:.0f} ms as one slab ({whole / part:.1f}x; "
          f"medians of {repeats} turns)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, nargs=2, metavar=("ROWS", "COLUMNS"),
                        help="one size instead of 4096 x 4096 and 1024 x 4096")
    parser.add_argument("--repeats", type=int, default=7, help="timed turns per recipe")
    parser.add_argument("--budget", type=float, default=10.0,
                        help="seconds per recipe after which fewer turns are timed (at least 3)")
    parser.add_argument("--slab", action="store_true",
                        help="only time a cast a SLAB at a time against the whole tensor")
    args = parser.parse_args()
    sizes = [tuple(args.size)] if args.size else [(4096, 4096), (1024, 4096)]
    print(f"{describe('cpu')}; torch {torch.__version__}")
    if args.slab:
        slabs(*sizes[0], args.repeats)
        return
    verdicts = []
    for size in sizes:
        table = quantizer_speed(size, repeats=args.repeats, budget_s=args.budget)
        print()
        print(table)
        worst = max(table, key=lambda r: r[RATIO])
        met = "met" if worst[RATIO] <= TARGET_RATIO else "NOT met"
        verdicts.append(f"{size[0]}×{size[1]}: slowest against torchao {worst['recipe']} at "
                        f"{worst[RATIO]:.2f}×, the {TARGET_RATIO:g}× target {met}")
    print()
    print("\n".join(verdicts))


if __name__ == "__main__":
    main()
