"""What the machine at hand can do: the device to use, the CPU's low-precision units, and how
to time work on it (`time_matmul`, `synchronize`), for every floor above that measures.

`MPLAB_CPU_FEATURES` makes mplab read the CPU as another kind would report it, to run the
lessons or the tests as on that machine (the logic, not the speed, which stays this CPU's):
a kind (`avx2`: no low-precision units; `avx512_bf16`; `amx`: bf16 and fp16 units) or a
comma-separated list of the flags below, e.g. `MPLAB_CPU_FEATURES=avx2 python -m pytest`.
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from mplab._display import Table
from mplab.numerics.formats import get_format

__all__ = ["UNITS", "CPU_KINDS", "CPU_FEATURES_ENV", "CUDA_UNITS", "LOW_BIT_HARDWARE",
           "low_bit_table", "has_units", "cuda_units",
           "recommended_precision", "attention_backend", "runs_fast", "resolve_device",
           "no_units_reason", "cpu_features", "describe", "synchronize", "MatmulTiming",
           "time_matmul"]

# CPU flags that decide whether bf16 / fp16 matmuls have hardware behind them (x86 names).
_LOW_PRECISION_FLAGS = {
    "avx512_bf16": "bf16 dot products in AVX-512",
    "amx_bf16": "bf16 matrix tiles (AMX)",
    "avx512_fp16": "fp16 arithmetic in AVX-512",
    "amx_fp16": "fp16 matrix tiles (AMX)",
    "f16c": "fp16 <-> fp32 conversion only (no fp16 arithmetic)",
}

#: The flags that give each low precision arithmetic units on a CPU.
UNITS = {"bf16": ("avx512_bf16", "amx_bf16"), "fp16": ("avx512_fp16", "amx_fp16")}
#: The CPUs mplab is run on, by the low-precision flags each reports.
CPU_KINDS = {
    "avx2": (),                                                  # no bf16 or fp16 units
    "avx512_bf16": ("avx512_bf16", "f16c"),                      # bf16 units (e.g. Zen 4)
    "amx": ("avx512_bf16", "amx_bf16", "avx512_fp16", "amx_fp16", "f16c"),  # both (Xeon 6)
}
CPU_FEATURES_ENV = "MPLAB_CPU_FEATURES"


def has_units(precision: str) -> bool:
    """Does this CPU have arithmetic units for `precision` ("bf16" or "fp16")? fp32: always."""
    if precision == "fp32":
        return True
    if precision not in UNITS:
        raise ValueError(f"unknown precision {precision!r}; accepted: 'fp32', "
                         + ", ".join(map(repr, UNITS)))
    feats = cpu_features()
    return any(feats[flag] for flag in UNITS[precision])


#: The CUDA compute capability from which a GPU multiplies in each precision natively: fp16 from
#: Pascal (6.0; tensor cores from Volta 7.0, the T4 is 7.5), bf16 and tf32 from Ampere (8.0),
#: fp8 from Ada and Hopper (8.9).
CUDA_UNITS = {"fp16": (6, 0), "bf16": (8, 0), "tf32": (8, 0), "fp8": (8, 9), "mx": (10, 0),
              "nvfp4": (10, 0)}

#: Which chips multiply in which format below 16 bits (vendors' architecture documents; the
#: NVIDIA rows' capabilities are `CUDA_UNITS`'): "mx" is MXFP8/6/4 with E8M0 block scales
#: applied by the tensor cores, "nvfp4" fp4 with E4M3 scales per 16 values.
LOW_BIT_HARDWARE = (
    {"chips": "NVIDIA Ampere (A100; compute capability 8.0)", "capability": (8, 0),
     "fp8": "no (emulated)", "mx": "no", "nvfp4": "no"},
    {"chips": "NVIDIA Ada (L4, L40, RTX 40; 8.9)", "capability": (8, 9),
     "fp8": "OCP e4m3, e5m2", "mx": "no", "nvfp4": "no"},
    {"chips": "NVIDIA Hopper (H100, H200, H800; 9.0)", "capability": (9, 0),
     "fp8": "OCP e4m3, e5m2 (a scale per tensor or row, applied to the sum)", "nvfp4": "no",
     "mx": "no: scales along the sum are applied outside the tensor cores (DeepSeek-V3 "
           "scaled each 128-long partial sum in fp32 CUDA cores)"},
    {"chips": "NVIDIA Blackwell (B200, GB200: 10.0; RTX 50: 12.0)", "capability": (10, 0),
     "fp8": "OCP e4m3, e5m2", "mx": "MXFP8, MXFP6, MXFP4", "nvfp4": "yes"},
    {"chips": "AMD MI300 (CDNA 3)", "capability": None,
     "fp8": "FNUZ e4m3, e5m2 (not OCP: no inf, no -0, bias one higher)", "mx": "no",
     "nvfp4": "no"},
    {"chips": "AMD MI350, MI355 (CDNA 4)", "capability": None,
     "fp8": "OCP e4m3, e5m2", "mx": "MXFP8, MXFP6, MXFP4", "nvfp4": "no"},
    {"chips": "CPUs (x86, Arm)", "capability": None, "fp8": "no (emulated, as lesson 9 does)",
     "mx": "no", "nvfp4": "no"},
)


def cuda_units(precision: str, device=None) -> bool:
    """Does this GPU have units for `precision`, by its compute capability? Where it has none
    for bf16 (T4, V100), `torch.cuda.is_bf16_supported()` still says True: bf16 is emulated
    there, in fp32 arithmetic, several times slower than fp16. fp32: always."""
    if precision == "fp32":
        return True
    if precision not in CUDA_UNITS:
        raise ValueError(f"unknown precision {precision!r}; accepted: 'fp32', "
                         + ", ".join(map(repr, CUDA_UNITS)))
    return tuple(torch.cuda.get_device_capability(device)) >= CUDA_UNITS[precision]


def low_bit_table() -> Table:
    """`LOW_BIT_HARDWARE` as a table, the row of this machine's GPU marked (the newest NVIDIA
    generation its compute capability reaches)."""
    here = torch.cuda.get_device_capability() if torch.cuda.is_available() else None
    reached = [r for r in LOW_BIT_HARDWARE
               if here and r["capability"] and tuple(here) >= r["capability"]]
    mine = max(reached, key=lambda r: r["capability"]) if reached else None
    rows = [{"chips": r["chips"], "FP8": r["fp8"], "MX block scales": r["mx"],
             "NVFP4": r["nvfp4"], "this machine": "<- here" if r is mine else ""}
            for r in LOW_BIT_HARDWARE]
    return Table(rows, title="which chips multiply below 16 bits",
                 note="this machine: " + (f"a GPU of compute capability {here[0]}.{here[1]}"
                                          if here else "no GPU: every format is emulated"))


def recommended_precision(device="auto") -> tuple[str, str]:
    """(precision, why) to train in on `device`: bf16 where it has bf16 units, else fp16 with a
    GradScaler on a GPU (a T4 or V100: fp16 units, bf16 emulated), else fp32 on a CPU without
    bf16 units (fp16 and bf16 there run tens of times slower)."""
    dev = resolve_device(device)
    if dev.type == "cuda":
        name = torch.cuda.get_device_name(dev)
        if cuda_units("bf16", dev):
            return "bf16", f"{name} has bf16 units: the same range as fp32, no GradScaler needed"
        return "fp16", (f"{name} (compute capability "
                        f"{'.'.join(map(str, torch.cuda.get_device_capability(dev)))}) has fp16 "
                        "units and no bf16 units (bf16 is emulated there, slowly): fp16 with a "
                        "GradScaler")
    if has_units("bf16"):
        return "bf16", "this CPU has bf16 units"
    return "fp32", (f"{no_units_reason('bf16')}: fp16 and bf16 run tens of times slower than "
                    "fp32 here")


def attention_backend(precision: str, device="auto") -> tuple[str | None, str]:
    """(backend, why): the scaled-dot-product attention backend training in `precision` on
    `device` should use, by `torch.nn.attention.SDPBackend` name, or None for torch's own
    choice. On a CPU in bf16 torch picks its flash kernel, whose backward runs several times
    slower there than the math backend's (benchmarks/RECORDS.md "attention backend")."""
    if resolve_device(device).type == "cpu" and precision == "bf16":
        return "MATH", ("math: torch's CPU flash attention runs a bf16 backward several times "
                        "slower than the math backend")
    return None, "torch's choice"


def runs_fast(precision: str, device="auto") -> bool:
    """Does `precision` compute at full speed on `device`? fp32 and tf32 always; on a GPU the
    precisions it has units for (`cuda_units`: bf16 on a T4 is emulated); bf16 or fp16 on a CPU
    only with units for it (without, tens of times slower). Lessons and tests pick their sizes
    and step counts from it."""
    if precision in ("fp32", "tf32"):
        return True
    dev = resolve_device(device)
    if dev.type == "cuda":
        return cuda_units(precision, dev)
    return has_units(precision)


def resolve_device(device: str = "auto") -> torch.device:
    """"auto" picks CUDA when there is a GPU, else the CPU; "cpu" and "cuda" are taken as asked."""
    if not isinstance(device, str | torch.device):
        raise TypeError(f"device must be 'auto', 'cpu' or 'cuda', got {device!r}")
    name = str(device).lower()
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r} was asked for, but this machine has no CUDA GPU; "
                             "use 'auto' or 'cpu'")
        return torch.device(name)
    if name == "cpu":
        return torch.device("cpu")
    raise ValueError(f"unknown device {device!r}; accepted: 'auto', 'cpu', 'cuda'")


def no_units_reason(precision: str) -> str:
    """The words for a CPU without `precision` units: "this CPU has no bf16 arithmetic units
    (no avx512_bf16 / amx_bf16)"."""
    return (f"this CPU has no {precision} arithmetic units (no "
            f"{' / '.join(UNITS[precision])})")


def cpu_features() -> dict[str, bool]:
    """Which low-precision units this CPU reports (from /proc/cpuinfo; all False elsewhere),
    or the kind `MPLAB_CPU_FEATURES` names."""
    override = os.environ.get(CPU_FEATURES_ENV, "").strip()
    if override:
        flags = set(_flags_of(override))
    else:
        flags = next((set(line.partition(":")[2].split()) for line in _cpuinfo_lines()
                      if line.startswith("flags")), set())
    return {flag: flag in flags for flag in _LOW_PRECISION_FLAGS}


def _flags_of(override: str) -> tuple[str, ...]:
    if override in CPU_KINDS:
        return CPU_KINDS[override]
    flags = tuple(f.strip() for f in override.split(",") if f.strip())
    unknown = sorted(set(flags) - set(_LOW_PRECISION_FLAGS))
    if unknown:
        raise ValueError(f"{CPU_FEATURES_ENV}={override!r}: unknown {', '.join(unknown)}; "
                         f"accepted: a kind ({', '.join(CPU_KINDS)}) or flags from "
                         f"{', '.join(_LOW_PRECISION_FLAGS)}, separated by commas")
    return flags


def describe(device: str = "auto", units: bool = True) -> str:
    """One line naming the device, e.g. 'cpu: Intel(R) Xeon(R) ... (2 threads; bf16 units: yes,
    fp16 units: no)'; `units=False` leaves out what it says of a CPU's units."""
    dev = resolve_device(device)
    if dev.type == "cuda":
        return f"cuda: {torch.cuda.get_device_name(dev)}"
    model = next((line.partition(":")[2].strip() for line in _cpuinfo_lines()
                  if line.startswith("model name")), platform.processor() or platform.machine())
    if not units:
        return f"cpu: {model} ({torch.get_num_threads()} threads)"
    yes_no = {True: "yes", False: "no"}
    return (f"cpu: {model} ({torch.get_num_threads()} threads; bf16 units: "
            f"{yes_no[has_units('bf16')]}, fp16 units: {yes_no[has_units('fp16')]})")


def _cpuinfo_lines() -> list[str]:
    try:
        return Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return []


# ---- timing work on a device ------------------------------------------------------------------

def synchronize(device) -> None:
    """Wait for the device's queued work (a GPU runs asynchronously; a CPU has none queued)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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


def time_matmul(n: int, precision="fp32", device="auto", budget_s: float = 0.5,
                max_repeats: int = 50, threads: int | None = None) -> MatmulTiming:
    """Time `a @ b` for random n×n matrices stored in `precision`, repeating until `budget_s`
    is spent. One warm-up run first; slow precisions (fp16 on a CPU without fp16 units) get
    few repeats. `threads` times a CPU matmul on that many threads (then restores torch's).

    One thread is the fair ratio on a shared 2-core machine: a two-thread fp32 matmul waits
    many times its own time whenever the other core is busy (benchmarks/RECORDS.md); one
    thread never waits, and the low/fp32 ratio per thread is the hardware's.
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
        synchronize(dev)
        times, start = [], time.perf_counter()
        while len(times) < max_repeats and (time.perf_counter() - start < budget_s
                                            or not times):
            t0 = time.perf_counter()
            a @ b
            synchronize(dev)
            times.append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(before)
    return MatmulTiming(f.name, n, dev.type, statistics.median(times), len(times), min(times))
