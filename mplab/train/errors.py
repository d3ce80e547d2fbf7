"""What a run warns about and how it fails: the warning and the error every training path
raises, the precision a device refuses, the cost of low precision on a CPU without its units, and
why a loss became inf/NaN."""

from __future__ import annotations

import torch

from mplab.hardware import cuda_units, has_units, no_units_reason, time_matmul

__all__ = ["TrainWarning", "NonFiniteLossError", "check_precision", "low_precision_cost",
           "non_finite_message"]


class TrainWarning(UserWarning):
    """Something about a run the learner should know: slow hardware, a setting with a cost."""


class NonFiniteLossError(FloatingPointError):
    """The loss became inf or NaN; `.result` holds the record up to the step before."""

    def __init__(self, message: str, result):
        super().__init__(message)
        self.result = result


def check_precision(precision: str, device: torch.device) -> None:
    """bf16 needs a GPU with bf16 units (Ampere or newer); fp16 and bf16 run on any CPU."""
    if precision == "bf16" and device.type == "cuda" and not cuda_units("bf16", device):
        # torch.cuda.is_bf16_supported() says True here too: bf16 is emulated, slowly
        name = torch.cuda.get_device_name(device)
        raise ValueError(f"precision 'bf16' was asked for, but {name} has no bf16 units "
                         f"(compute capability {torch.cuda.get_device_capability(device)}; "
                         "bf16 needs 8.0, Ampere, or later); accepted on this GPU: 'fp16' (with "
                         "a GradScaler, what mplab recommends here), 'fp32'")


def low_precision_cost(precision: str, device: torch.device) -> tuple[float, str] | None:
    """(slowdown, warning) where fp16/bf16 on a CPU is measured slow, else None: how many
    times as long a 256x256 matmul takes in `precision` as in fp32, and the words for it.

    Times the matmul in fp32 and in `precision` on one thread (a fraction of a second,
    benchmarks/RECORDS.md): bigger matmuls show the gap better, but this is paid before every
    CPU run in low precision.
    """
    if device.type != "cpu" or precision == "fp32":
        return None
    fp32, low = (time_matmul(256, p, "cpu", budget_s=0.2, max_repeats=8, threads=1).best
                 for p in ("fp32", precision))
    ratio = low / fp32
    if ratio < 1.5:
        return None
    why = (no_units_reason(precision) if not has_units(precision)
           else "torch has no fast kernel for it here")
    return ratio, (f"{precision} on this CPU is slow: a 256x256 matmul (1 thread) took "
                   f"{low * 1e3:.2f} ms in {precision} against {fp32 * 1e3:.3f} ms in fp32 "
                   f"({ratio:.0f}x slower), because {why}. Training runs correctly but slower "
                   "than fp32; use fp32 here, or a GPU (or a CPU with AMX / AVX-512 units) to "
                   "see low precision pay off.")


def non_finite_message(step: int, loss: float, precision: str, lr: float,
                       losses: list[float]) -> str:
    """Why a loss became inf/NaN, most likely first, for the step it happened at."""
    before = (f" The {len(losses)} step{'s' if len(losses) != 1 else ''} before "
              f"{'were' if len(losses) != 1 else 'was'} finite." if losses else "")
    head = (f"step {step}: the loss is {loss}, so training stopped (every later step would be "
            f"{loss} too).{before}")
    causes = []
    if not losses:
        causes.append("the very first loss is not finite, before any update: look at the "
                      "model and the data (a model pretrained in bf16 can overflow in fp16)")
    if precision == "fp16":
        causes.append("an activation overflowed fp16 (largest value 65504) in the forward "
                      "pass; a GradScaler cannot help there, it only scales gradients. Try "
                      "bf16 (fp32's range) or fp32, and find the layer with mplab.amp.trace")
    if losses and (max(losses[-5:]) > 2 * min(losses) or lr >= 1e-2):
        causes.append(f"the learning rate (lr={lr:g}) is too high: the weights diverged "
                      f"(the loss went from {min(losses):.4g} up to {max(losses[-5:]):.4g} "
                      f"before it broke). Lower it, e.g. to {lr / 10:g}, or clip gradients "
                      "with max_grad_norm")
    if not causes:
        causes.append(f"the weights diverged; lower the learning rate (lr={lr:g}) or clip "
                      "gradients with max_grad_norm")
    return head + "\nLikely cause: " + "\nOr: ".join(causes) + "."
