"""What the machine at hand can do: the device to use and the CPU's low-precision units."""

from __future__ import annotations

import platform
from pathlib import Path

import torch

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


def has_units(precision: str) -> bool:
    """Does this CPU have arithmetic units for `precision` ("bf16" or "fp16")? fp32: always."""
    if precision == "fp32":
        return True
    if precision not in UNITS:
        raise ValueError(f"unknown precision {precision!r}; accepted: 'fp32', "
                         + ", ".join(map(repr, UNITS)))
    feats = cpu_features()
    return any(feats[flag] for flag in UNITS[precision])


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


def cpu_features() -> dict[str, bool]:
    """Which low-precision units this CPU reports (from /proc/cpuinfo; all False elsewhere)."""
    flags = next((set(line.partition(":")[2].split()) for line in _cpuinfo_lines()
                  if line.startswith("flags")), set())
    return {flag: flag in flags for flag in _LOW_PRECISION_FLAGS}


def describe(device: str = "auto") -> str:
    """One line naming the device, e.g. 'cpu: Intel(R) Xeon(R) ... (2 threads; bf16 units: yes)'."""
    dev = resolve_device(device)
    if dev.type == "cuda":
        return f"cuda: {torch.cuda.get_device_name(dev)}"
    model = next((line.partition(":")[2].strip() for line in _cpuinfo_lines()
                  if line.startswith("model name")), platform.processor() or platform.machine())
    yes_no = {True: "yes", False: "no"}
    return (f"cpu: {model} ({torch.get_num_threads()} threads; bf16 units: "
            f"{yes_no[has_units('bf16')]}, fp16 units: {yes_no[has_units('fp16')]})")


def _cpuinfo_lines() -> list[str]:
    try:
        return Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return []
