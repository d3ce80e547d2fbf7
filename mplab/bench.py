"""Speed of low precision on the machine at hand, measured, never assumed."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from mplab._display import Table
from mplab.formats import get_format
from mplab.hardware import cpu_features, resolve_device


@dataclass(frozen=True)
class MatmulTiming:
    """One n×n @ n×n matmul in one format: median seconds over `repeats` runs."""

    format: str
    n: int
    device: str
    seconds: float
    repeats: int

    @property
    def gflops(self) -> float:
        return 2 * self.n ** 3 / self.seconds / 1e9

    @property
    def bytes_per_matrix(self) -> int:
        return self.n * self.n * get_format(self.format).bits // 8


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_matmul(n: int, fmt="fp32", device="auto", budget_s: float = 0.5,
                max_repeats: int = 50) -> MatmulTiming:
    """Time `a @ b` for random n×n matrices stored in `fmt`, repeating until `budget_s` is spent.

    One warm-up run first; slow formats (fp16 on a CPU without fp16 units) get few repeats.
    """
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"n must be a positive int, got {n!r}")
    f = get_format(fmt)
    if f.dtype() is None:
        raise ValueError(f"{f.name} is not a storage dtype; time fp32 with TF32 matmuls instead")
    dev = resolve_device(device)
    gen = torch.Generator().manual_seed(0)
    a, b = (torch.randn(n, n, generator=gen).to(dev, f.dtype()) for _ in range(2))
    a @ b
    _sync(dev)
    times, start = [], time.perf_counter()
    while len(times) < max_repeats and (time.perf_counter() - start < budget_s or len(times) < 1):
        t0 = time.perf_counter()
        a @ b
        _sync(dev)
        times.append(time.perf_counter() - t0)
    return MatmulTiming(f.name, n, dev.type, statistics.median(times), len(times))


def matmul_speed(n: int | None = None, formats=("fp32", "bf16", "fp16"), device="auto",
                 budget_s: float = 0.5) -> Table:
    """Matmul time per format side by side, with the speed relative to the first (fp32).

    n defaults to 512 on a CPU and 8192 on a GPU (big enough to keep the matrix units busy).
    """
    dev = resolve_device(device)
    n = n or (8192 if dev.type == "cuda" else 512)
    timings = [time_matmul(n, f, dev.type, budget_s) for f in formats]
    base = timings[0].seconds
    rows = [{"format": t.format, "device": t.device, "n": t.n,
             "bytes per matrix": t.bytes_per_matrix, "ms per matmul": t.seconds * 1e3,
             "GFLOP/s": t.gflops,
             f"speed vs {timings[0].format}": base / t.seconds, "runs": t.repeats}
            for t in timings]
    return Table(rows, title=f"{n}×{n} matmul on {dev.type}")


def explain_matmul_speed(table: Table) -> str:
    """Say in words what a `matmul_speed` table shows, and why, for this machine."""
    rows = {r["format"]: r for r in table}
    speed = {name: r[next(k for k in r if k.startswith("speed vs"))] for name, r in rows.items()}
    device = next(iter(rows.values()))["device"]
    lines = []
    feats = cpu_features() if device == "cpu" else {}
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
            units = {"bf16": ("avx512_bf16", "amx_bf16"), "fp16": ("avx512_fp16", "amx_fp16")}[name]
            why = (f"this CPU has no {name} arithmetic units (no {' / '.join(units)}), so torch "
                   "falls back to a generic kernel that converts every element to fp32 and back"
                   if device == "cpu" and not any(feats.get(u) for u in units)
                   else "this device's library has no fast kernel for it")
            lines.append(f"{name} ran {1 / s:.0f}× SLOWER than fp32: {why}. "
                         "Fewer bits only pay off where the hardware computes in them.")
    return "\n".join(lines)
