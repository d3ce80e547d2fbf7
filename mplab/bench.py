"""Speed of low precision on the machine at hand, measured, never assumed."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from mplab._display import Table
from mplab.formats import get_format
from mplab.hardware import UNITS, has_units, resolve_device


@dataclass(frozen=True)
class MatmulTiming:
    """One n×n @ n×n matmul in one precision: median (and best) seconds over `repeats` runs."""

    precision: str
    n: int
    device: str
    seconds: float
    repeats: int
    best: float = 0.0

    @property
    def gflops(self) -> float:
        return 2 * self.n ** 3 / self.seconds / 1e9

    @property
    def bytes_per_matrix(self) -> int:
        return self.n * self.n * get_format(self.precision).bits // 8


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_matmul(n: int, precision="fp32", device="auto", budget_s: float = 0.5,
                max_repeats: int = 50, threads: int | None = None) -> MatmulTiming:
    """Time `a @ b` for random n×n matrices stored in `precision`, repeating until `budget_s`
    is spent. One warm-up run first; slow precisions (fp16 on a CPU without fp16 units) get
    few repeats. `threads` times a CPU matmul on that many threads (then restores torch's).

    One thread is the fair ratio on a shared 2-core machine: a two-thread fp32 matmul (0.6 ms
    at n=256) waits 10-15 ms whenever the other core is busy; one thread never waits, and the
    low/fp32 ratio per thread is the hardware's.
    """
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"n must be a positive int, got {n!r}")
    f = get_format(precision)
    if f.dtype() is None:
        raise ValueError(f"{f.name} is not a storage dtype; time fp32 with TF32 matmuls instead")
    dev = resolve_device(device)
    gen = torch.Generator().manual_seed(0)
    a, b = (torch.randn(n, n, generator=gen).to(dev, f.dtype()) for _ in range(2))
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        a @ b
        _sync(dev)
        times, start = [], time.perf_counter()
        while len(times) < max_repeats and (time.perf_counter() - start < budget_s
                                            or not times):
            t0 = time.perf_counter()
            a @ b
            _sync(dev)
            times.append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(before)
    return MatmulTiming(f.name, n, dev.type, statistics.median(times), len(times), min(times))


def matmul_speed(n: int | None = None, precisions=("fp32", "bf16", "fp16"), device="auto",
                 budget_s: float = 0.5) -> Table:
    """Matmul time per precision side by side, with the speed relative to the first (fp32).

    n defaults to 512 on a CPU and 8192 on a GPU (big enough to keep the matrix units busy).
    """
    dev = resolve_device(device)
    n = n or (8192 if dev.type == "cuda" else 512)
    timings = [time_matmul(n, p, dev.type, budget_s) for p in precisions]
    base = timings[0].seconds
    rows = [{"precision": t.precision, "device": t.device, "n": t.n,
             "bytes per matrix": t.bytes_per_matrix, "ms per matmul": t.seconds * 1e3,
             "GFLOP/s": t.gflops,
             f"speed vs {timings[0].precision}": base / t.seconds, "runs": t.repeats}
            for t in timings]
    return Table(rows, title=f"{n}×{n} matmul on {dev.type}")


def explain_matmul_speed(table: Table) -> str:
    """Say in words what a `matmul_speed` table shows, and why, for this machine."""
    rows = {r["precision"]: r for r in table}
    speed = {name: r[next(k for k in r if k.startswith("speed vs"))] for name, r in rows.items()}
    device = next(iter(rows.values()))["device"]
    lines = []
    for name in ("bf16", "fp16"):
        if name not in speed:
            continue
        s = speed[name]
        if s >= 1.2:
            lines.append(f"{name} ran {s:.1f}× faster than fp32: half the bytes to move, and "
                         f"matrix units that do more {name} multiplies per cycle.")
        elif s >= 0.8:
            lines.append(f"{name} ran at about fp32's speed ({s:.2f}×): half the bytes, but no "
                         "faster arithmetic for it here.")
        else:
            why = (f"this CPU has no {name} arithmetic units (no {' / '.join(UNITS[name])}), so "
                   "torch falls back to a generic kernel that converts every element to fp32 "
                   "and back" if device == "cpu" and not has_units(name)
                   else "this device's library has no fast kernel for it")
            lines.append(f"{name} ran {1 / s:.0f}× SLOWER than fp32: {why}. "
                         "Fewer bits only pay off where the hardware computes in them.")
    return "\n".join(lines)
