"""A run that raised, read for its mixed precision cause: `diagnose(err)` on the exception.

    try:
        my_training_loop()
    except Exception as err:
        print(mplab.diagnose(err))     # the cause, where in your code it was raised, the fix

The checks read the error's type and message (and those of the errors it was raised from),
where in your code it was raised, and whether that was inside a `backward`; each declares the
cause it names (`@emits`), as the checks of a finished run do, and the first that knows the
error names it. An error none of them knows is still diagnosed, as `crashed`, with its message
and place: never a traceback from inside mplab. (A loss that became inf/NaN in `mplab.train`
raises `NonFiniteLossError`, whose record `diagnose` reads as a run's.)
"""

from __future__ import annotations

import re
import traceback
from dataclasses import dataclass
from pathlib import Path

from .findings import Diagnosis, Finding, emits

__all__ = ["Crash", "CRASH_CHECKS", "diagnose_crash"]

#: Libraries whose frames are not "your code": where an error is raised is the innermost frame
#: outside them and outside the hooks mplab puts on a run (`_HOOKS`); mplab's own loops count
#: as code (the lab's runs, mplab.train's paths).
_LIBRARIES = ("torch", "transformers", "accelerate", "lightning", "pytorch_lightning", "peft")
_HOOKS = (("mplab", "train", "watch.py"), ("mplab", "train", "recorder.py"))


@dataclass(frozen=True)
class Crash:
    """What the checks read of an error: its `kind` (the class name), `messages` (its own, then
    those of the errors it was raised from or during), `where` ("file:line, in function" of
    the innermost frame of your code, None if it has no traceback) and `in_backward` (raised
    while a `backward` of your code ran: a custom autograd Function's)."""

    kind: str
    messages: tuple[str, ...]
    where: str | None
    in_backward: bool

    @classmethod
    def of(cls, err: BaseException) -> Crash:
        chain, seen = [], set()
        while err is not None and id(err) not in seen:
            seen.add(id(err))
            chain.append(err)
            err = err.__cause__ or err.__context__
        frames = [f for f in traceback.extract_tb(chain[0].__traceback__) if _yours(f.filename)]
        where = (f"{Path(frames[-1].filename).name}:{frames[-1].lineno}, in {frames[-1].name}"
                 if frames else None)
        return cls(type(chain[0]).__name__, tuple(str(e) for e in chain), where,
                   any(f.name == "backward" for f in frames[1:]))

    def says(self, *patterns: str) -> re.Match | None:
        """The first match of any pattern in the messages, in order."""
        for message in self.messages:
            for pattern in patterns:
                found = re.search(pattern, message)
                if found:
                    return found
        return None

    @property
    def evidence(self) -> list[str]:
        said = [f"{self.kind}: {_short(self.messages[0])}"]
        said += [f"raised from: {_short(m)}" for m in self.messages[1:2] if m]
        return said + [f"raised at {self.where}" if self.where else "raised outside your code"]


def _yours(filename: str) -> bool:
    parts = Path(filename).parts
    return not (any(lib in parts for lib in _LIBRARIES) or filename.startswith("<frozen")
                or any(parts[-len(hook):] == hook for hook in _HOOKS))


def _short(message: str, most: int = 300) -> str:
    one = " ".join(message.split())
    return one if len(one) <= most else one[:most - 3] + "..."


# ---- the checks, most specific first -----------------------------------------------------------

@emits("fp16_weights_scaled")
def _fp16_weights_scaled(c: Crash) -> Finding | None:
    if not c.says(r"Attempting to unscale FP16 gradients"):
        return None
    return Finding(
        "fp16_weights_scaled", "broken",
        "the GradScaler found fp16 gradients, so the weights that train are fp16 (a model made "
        ".half(), a checkpoint loaded in fp16, LoRA adapters created in the base model's fp16): "
        "a scaler refuses to unscale them, as their small values are already lost",
        c.evidence,
        "keep the weights that train in fp32 and let autocast compute in fp16: model.float() "
        "before the optimizer is built, or with PEFT/LoRA the trainable ones only (for p in "
        "model.parameters(): if p.requires_grad: p.data = p.data.float()); or train in bf16, "
        "which needs no scaler")


@emits("scaler_called_twice")
def _scaler_called_twice(c: Crash) -> Finding | None:
    found = c.says(r"(unscale_|step)\(\) has already been called")
    if not found:
        return None
    call = found.group(1)
    return Finding(
        "scaler_called_twice", "broken",
        f"scaler.{call}() ran a second time for the same optimizer before scaler.update(): "
        "each iteration takes one unscale_, one step and one update per optimizer",
        c.evidence,
        "call scaler.unscale_(optimizer) once, after the last micro-batch's backward and before "
        "clipping, not inside the micro-batch loop or a helper that clips again; Accelerate's "
        "accelerator.clip_grad_norm_ unscales by itself; then scaler.step(optimizer) and "
        "scaler.update() once each")


@emits("scaler_unused")
def _scaler_unused(c: Crash) -> Finding | None:
    if not c.says(r"_scale is None", r"No inf checks were recorded"):
        return None
    return Finding(
        "scaler_unused", "broken",
        "scaler.step(optimizer) ran, but this iteration's gradients did not come through "
        "scaler.scale(loss).backward() (or there were none): the scaler has nothing to unscale",
        c.evidence,
        "backpropagate through the scaler every iteration: scaler.scale(loss).backward(), then "
        "scaler.step(optimizer) and scaler.update(); and check that the optimizer holds the "
        "parameters that get gradients")


#: Where torch says an op met two dtypes (CPU and CUDA wordings).
_TWO_DTYPES = (
    r"expected m1 and m2 to have the same dtype, but got: (?:c10::)?(\w+) != (?:c10::)?(\w+)",
    r"mat1 and mat2 must have the same dtype, but got (\w+) and (\w+)",
    r"expected scalar type (\w+) but found (\w+)",
    r"Input type \((?:c10::)?([\w.]+)\) and (?:weight|bias) type \((?:c10::)?([\w.]+)\)",
    r"got (\w+) for the destination and (\w+) for the source",
    r"expected (?:both|all)? ?\w* ?to have the same dtype, but got (\w+) and (\w+)",
)


@emits("mixed_dtypes")
def _mixed_dtypes(c: Crash) -> Finding | None:
    found = c.says(*_TWO_DTYPES)
    if not found:
        return None
    dtypes = f"{found.group(1)} and {found.group(2)}"
    if c.in_backward:
        return Finding(
            "mixed_dtypes", "broken",
            f"a custom autograd Function's backward got {dtypes} tensors: autocast ran its "
            "forward in low precision, and its backward runs outside autocast, on the dtypes "
            "the forward saved",
            c.evidence,
            "tell autocast about the Function: decorate its forward with "
            "@torch.amp.custom_fwd(device_type=..., cast_inputs=torch.float32) to run it in "
            "fp32, or with @torch.amp.custom_fwd(device_type=...) and its backward with "
            "@torch.amp.custom_bwd(device_type=...) to run the backward as autocast ran the "
            "forward")
    return Finding(
        "mixed_dtypes", "broken",
        f"an op got {dtypes} tensors: a tensor cast by hand (.half(), .to(dtype)), a weight in "
        "another dtype than its input, or an op outside autocast's lists meeting autocast's "
        "output",
        c.evidence,
        "let autocast do the casting: run the forward inside torch.autocast and keep weights "
        "and inputs in fp32 rather than .half()-ing them; where two dtypes must meet, cast one "
        "to the other's (x.to(w.dtype)); a custom op gets @torch.amp.custom_fwd / custom_bwd")


@emits("fill_out_of_range")
def _fill_out_of_range(c: Crash) -> Finding | None:
    found = c.says(r"value cannot be converted to type (?:c10::)?(\w+) without overflow")
    if not found:
        return None
    dtype = found.group(1)
    return Finding(
        "fill_out_of_range", "broken",
        f"a constant written into a {dtype} tensor does not fit it: a mask or fill value such "
        "as -1e9 (fp16 holds at most ±65504), meeting a tensor that autocast or .half() made "
        f"{dtype}",
        c.evidence,
        "fill with the tensor's own limit, torch.finfo(scores.dtype).min (what transformers "
        "does), or -inf where every row keeps at least one finite value")


@emits("precision_refused")
def _precision_refused(c: Crash) -> Finding | None:
    found = c.says(r"was asked for, but .* has no bf16 (?:support|units)",
                   r"does not support bfloat16",
                   r"not implemented for '(?:Half|BFloat16|Float8\w*)'",
                   r"Torch not compiled with CUDA enabled")
    if not found:
        return None
    return Finding(
        "precision_refused", "broken",
        "the device cannot run what was asked of it: a precision it has no kernel or units for "
        "(bf16 on a GPU older than Ampere, an op without fp16 kernels on this device), or a "
        "CUDA autocast or scaler on a machine without CUDA",
        c.evidence,
        "ask for what the device runs: fp16 with a GradScaler on a GPU without bf16, bf16 or "
        "fp32 on a CPU, and autocast and GradScaler on the device the model is on "
        "(mplab.hardware.describe() says what this one has)")


@emits("crashed")
def _crashed(c: Crash) -> Finding:
    return Finding(
        "crashed", "broken",
        f"the run raised {c.kind}, which mplab does not know as a mixed precision error",
        c.evidence,
        "read the traceback where it was raised; to see whether mixed precision is involved, "
        "run the same loop in fp32 (autocast and the scaler switched off)")


#: In order: the first that knows the error names it; `_crashed` knows every error.
CRASH_CHECKS = (_fp16_weights_scaled, _scaler_called_twice, _scaler_unused, _mixed_dtypes,
                _fill_out_of_range, _precision_refused, _crashed)


def diagnose_crash(err: BaseException) -> Diagnosis:
    """The cause of the error a run raised, where in your code, and the fix."""
    if not isinstance(err, BaseException):
        raise TypeError(f"diagnose_crash reads an exception, got {type(err).__name__}")
    crash = Crash.of(err)
    found = next(f for f in (check(crash) for check in CRASH_CHECKS) if f is not None)
    return Diagnosis(f"a run that raised {crash.kind}", [found])

