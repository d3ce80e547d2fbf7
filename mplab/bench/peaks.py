"""How much of the device a training step used: its model FLOPs against a peak.

On a GPU the peak is the datasheet's (dense, no sparsity) for the precision the matmuls ran
in; on a CPU, which publishes no such figure per precision, it is the best matmul throughput
measured on this machine in that precision (`python -m mplab.bench` times a matmul sweep first).
"""

from __future__ import annotations

__all__ = ["DATASHEET_TFLOPS", "datasheet_gpu", "datasheet_peak", "matmul_parameters",
           "training_flops", "mfu"]

#: Datasheet peaks in TFLOP/s, dense (without 2:4 sparsity), by GPU.
_HOPPER_SXM = {"bf16": 989.0, "fp16": 989.0, "tf32": 494.0, "fp32": 67.0}
DATASHEET_TFLOPS = {
    "H100 SXM": _HOPPER_SXM,
    "H200 SXM": _HOPPER_SXM,
    "H100 PCIe": {"bf16": 756.0, "fp16": 756.0, "tf32": 378.0, "fp32": 51.0},
    "A100": {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5},
}


def datasheet_gpu(device_name: str) -> str | None:
    """The `DATASHEET_TFLOPS` entry for a `torch.cuda.get_device_name()`, or None when the GPU
    is not in the table (then no utilisation is claimed for it).

    "NVIDIA H100 80GB HBM3" is the SXM part, "NVIDIA H100 PCIe" the PCIe one; the H100 NVL has
    its own figures and is not in the table."""
    if not isinstance(device_name, str):
        raise TypeError(f"device_name must be a GPU's name (a str), got {device_name!r}")
    name = device_name.lower()
    if "h200" in name:
        return "H200 SXM"
    if "h100" in name and "nvl" not in name:
        return "H100 PCIe" if "pcie" in name else "H100 SXM"
    if "a100" in name:
        return "A100"
    return None


def datasheet_peak(device_name: str, precision: str) -> float | None:
    """The datasheet peak in FLOP/s of that GPU in `precision` (fp32, tf32, bf16, fp16); None
    for a GPU the table does not know."""
    gpu = datasheet_gpu(device_name)
    if gpu is None:
        return None
    peaks = DATASHEET_TFLOPS[gpu]
    if precision not in peaks:
        raise ValueError(f"unknown precision {precision!r}; accepted: "
                         + ", ".join(map(repr, peaks)))
    return peaks[precision] * 1e12


def matmul_parameters(model) -> int:
    """The parameters that take part in matmuls: every `nn.Linear`'s weight. Embedding tables
    are looked up, not multiplied, and biases and norms are additions: they count no FLOPs."""
    import torch

    return sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))


def training_flops(matmul_params: int, tokens: int, layers: int, hidden: int,
                   seq_len: float) -> float:
    """Model FLOPs of one training step (forward and backward), the formula of the PaLM paper
    and nanoGPT's `estimate_mfu`:

        6 × matmul_params × tokens  +  12 × layers × hidden × seq_len × tokens

    Each weight does a multiply and an add per token forward (2) and twice that backward (4);
    attention's QKᵀ and AV add 2 × 2 × seq_len × hidden per token and layer forward, × 3 with
    the backward. `tokens` = batch × seq_len (padding included: it is computed on)."""
    for name, value in (("matmul_params", matmul_params), ("tokens", tokens),
                        ("layers", layers), ("hidden", hidden)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
    if not seq_len >= 0:
        raise ValueError(f"seq_len must be a number >= 0, got {seq_len!r}")
    return 6.0 * matmul_params * tokens + 12.0 * layers * hidden * seq_len * tokens


def mfu(flops_per_step: float, step_seconds: float, peak_flops: float | None) -> float | None:
    """Model FLOPs utilisation: the FLOP/s the step achieved over the peak; None without one."""
    if peak_flops is None or not peak_flops > 0:
        return None
    if not step_seconds > 0:
        raise ValueError(f"step_seconds must be > 0, got {step_seconds!r}")
    return flops_per_step / step_seconds / peak_flops
