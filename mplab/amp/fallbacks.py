"""The silent fallbacks an audit names: one check per fallback, each declared with its code.

    @fallback("scaler_with_bf16")
    def _scaler_with_bf16(s: Seen) -> str | None:   # the sentence, or None: not this run

`FALLBACKS` lists every code; `Seen` is what the audit saw, as each check reads it; a check
returns its sentence, built from the run's own figures, and `FALLBACK_CHECKS` runs them in
order (`find_fallbacks`). The code is what other modules read (mplab.diagnose, the exercises);
the sentence is for people. Add a fallback: a code in FALLBACKS, a check declared with it, and
its place in FALLBACK_CHECKS (a test holds the three together).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import torch

from mplab.numerics.formats import dtype_name, dtype_of

__all__ = ["LOW_PRECISION", "FALLBACKS", "Fallback", "known_code", "read_fallback", "Seen",
           "fallback", "FALLBACK_CHECKS", "find_fallbacks", "autocast_supported", "asked_dtype",
           "device_of"]

#: The dtypes mixed precision computes in.
LOW_PRECISION = (torch.float16, torch.bfloat16)
_LOW = LOW_PRECISION

#: Every silent fallback the audit names, by its code, each found by one `@fallback` check.
#: Other modules read the code (mplab.diagnose); the text, in the run's own figures, is for people.
FALLBACKS = {
    "fp16_ignored": "fp16 was asked for, but Accelerate (or the Trainer) ignored it on a CPU",
    "autocast_inactive": "low precision was asked for, but the matmuls ran in fp32: the "
                         "forward pass did not run inside an active autocast",
    "autocast_off": "torch switched autocast off: it does not support the dtype on the device",
    "low_precision_weights": "the weights are in low precision: no fp32 master weights",
    "low_precision_states": "the optimizer's states are in low precision",
    "scaler_with_bf16": "a GradScaler is used with bf16",
    "low_precision_reduce": "the gradients were summed across ranks in low precision",
}


@dataclass(frozen=True)
class Fallback:
    """One silent fallback: `code` (a key of FALLBACKS) and `text`, what happened in words."""

    code: str
    text: str

    def __post_init__(self):
        known_code(self.code)

    def __str__(self) -> str:
        return self.text


#: How this module's own sentences began in records written before fallbacks had codes
#: (mplab.train --json files of older runs), so those records still load with their codes.
_BEFORE_CODES = (("fp16 was asked for, but", "fp16_ignored"),
                 ("autocast is off:", "autocast_off"),
                 ("the weights are ", "low_precision_weights"),
                 ("the optimizer's states are", "low_precision_states"),
                 ("a GradScaler is used with bf16", "scaler_with_bf16"),
                 ("", "autocast_inactive"))  # "<precision> was asked for, but the matmuls ..."


def read_fallback(found) -> Fallback:
    """A fallback as a record holds it: {"code", "text"}, or an older record's sentence."""
    if isinstance(found, dict):
        return Fallback(**found)
    if isinstance(found, str):
        for start, code in _BEFORE_CODES:
            if found.startswith(start) and (start or "was asked for, but the matmuls" in found):
                return Fallback(code, found)
    raise ValueError(f"an audit's fallback is {{'code': ..., 'text': ...}}; got {found!r:.80}")


@dataclass(frozen=True)
class Seen:
    """What the audit saw, as each fallback check reads it: `Seen.of(report, model, ...)`."""

    report: Any                  # the Audit so far (mplab.amp.audit): dtypes, autocast, scaler
    model: torch.nn.Module
    result: object               # the finished run (mplab.train's TrainResult), or None
    accelerator: object          # an Accelerator, or None
    asked: torch.dtype | None    # the low dtype asked for; None: fp32, or nothing asked
    compute: torch.dtype | None  # the dtype the matmuls ran in; None: not observed
    autocast: dict | None        # the report's autocast
    path: str | None             # the run's training path: "torch", "accelerate", "trainer"
    device: str | None           # the autocast's device, else the model's

    @classmethod
    def of(cls, report, model: torch.nn.Module, result=None, accelerator=None) -> Seen:
        return cls(report, model, result, accelerator,
                   asked=asked_dtype(report.asked) if report.asked else None,
                   compute=report.compute_dtype, autocast=report.autocast,
                   path=getattr(result, "path", None),
                   device=(report.autocast or {}).get("device") or device_of(model))

    @property
    def fell_to_fp32(self) -> bool:
        """Low precision was asked for, and the matmuls were seen running in a wider dtype."""
        return self.asked is not None and self.compute is not None and self.compute not in _LOW


def fallback(code: str):
    """Declare the fallback (a key of FALLBACKS) a check names; list it in FALLBACK_CHECKS."""
    known_code(code)

    def declare(check):
        check.code = code
        return check
    return declare


def known_code(code: str) -> None:
    """Refuse a code that is not a key of FALLBACKS, naming those that are."""
    if code not in FALLBACKS:
        raise ValueError(f"unknown fallback code {code!r}; accepted: "
                         + ", ".join(map(repr, FALLBACKS)))


@fallback("fp16_ignored")
def _fp16_ignored(s: Seen) -> str | None:
    who = ("the Trainer (through Accelerate)" if s.path == "trainer" else "Accelerate"
           if s.accelerator is not None or s.path == "accelerate" else None)
    if not (s.fell_to_fp32 and s.asked == torch.float16 and s.device == "cpu" and who):
        return None
    return (f"fp16 was asked for, but {who} ignores fp16 on a CPU, without a warning: no "
            f"autocast, no GradScaler, and the matmuls ran in {dtype_name(s.compute)}. This was "
            "an fp32 run. On a CPU use bf16; fp16 needs a GPU")


@fallback("autocast_inactive")
def _autocast_inactive(s: Seen) -> str | None:
    ac = s.autocast
    switched_off = ac and not ac["enabled"] and ac["dtype"] is not None  # _autocast_off says why
    if not s.fell_to_fp32 or _fp16_ignored(s) is not None or switched_off:
        return None
    return (f"{s.report.asked} was asked for, but the matmuls ran in {dtype_name(s.compute)}: "
            "autocast did not act (did the forward pass run inside the autocast context, on "
            "its device?)")


@fallback("autocast_off")
def _autocast_off(s: Seen) -> str | None:
    ac = s.autocast
    if not (ac and ac["by"] == "torch.autocast" and not ac["enabled"] and ac["dtype"] is not None)\
            or s.report.asked == "fp32" or autocast_supported(ac["device"], ac["dtype"]):
        return None  # (mplab's fp32 runs hold autocast(enabled=False): nothing fell back)
    accepted = [dtype_name(d) for d in _LOW if autocast_supported(ac["device"], d)]
    why = (f"torch does not support {dtype_name(ac['dtype'])} autocast on {ac['device']}"
           if accepted or ac["device"] != "cuda" else
           "this machine has no CUDA GPU, so torch cannot autocast on 'cuda'")
    return (f"autocast is off: {why} (it disabled it with one UserWarning), so everything ran "
            f"in {dtype_name(s.compute) or 'float32'}. Accepted there: "
            + (", ".join(accepted) if accepted else
               f"nothing; autocast on the device the model is on, {device_of(s.model)!r}"))


@fallback("low_precision_weights")
def _low_precision_weights(s: Seen) -> str | None:
    if s.report.param_dtype not in _LOW:
        return None
    saved = getattr(getattr(s.model, "config", None), "dtype", None)
    how = (f"the checkpoint was saved in {dtype_name(saved)} and loaded as saved "
           "(transformers' dtype='auto')" if saved in _LOW else "the model was cast to it")
    weights = dtype_name(s.report.param_dtype)
    return (f"the weights are {weights}: {how}, so there are no fp32 master weights and every "
            f"update is rounded to {weights}: pure low precision, not mixed. Load or keep the "
            "weights in float32 (mplab.models.load_pretrained(..., dtype=torch.float32), "
            "model.float())")


@fallback("low_precision_states")
def _low_precision_states(s: Seen) -> str | None:
    if s.report.optimizer_state_dtype not in _LOW:
        return None
    return (f"the optimizer's states are {dtype_name(s.report.optimizer_state_dtype)}: Adam's "
            "running averages lose the small updates they exist to keep; they follow the "
            "weights' dtype, so keep the weights in float32")


@fallback("scaler_with_bf16")
def _scaler_with_bf16(s: Seen) -> str | None:
    bf16_run = s.compute == torch.bfloat16 or (s.compute is None and s.asked == torch.bfloat16)
    if not (s.report.scaler and s.report.scaler["enabled"] and bf16_run):
        return None
    return ("a GradScaler is used with bf16: bf16 has fp32's exponent range, so its gradients "
            "do not underflow and need no scaling; the scaler only costs time and can skip "
            "steps for nothing. Use it with fp16 only")


@fallback("low_precision_reduce")
def _low_precision_reduce(s: Seen) -> str | None:
    reduced = sorted({row["dtype"] for rank in getattr(s.result, "ranks", None) or []
                      for row in rank["collectives"]
                      if row["op"] in ("reduce_scatter", "all_reduce")
                      and row["dtype"] in ("bfloat16", "float16")})
    if not reduced:
        return None
    return (f"the gradients were summed across ranks in {', '.join(reduced)}: every rank's "
            "contribution is rounded to 8 (bf16) or 11 (fp16) bits before the sum, and the sum "
            "itself too, an error that grows with the number of ranks. Keep reduce_dtype='fp32' "
            "(MixedPrecisionPolicy) or DDP's fp32 all-reduce unless the bandwidth is worth it")


#: The fallback checks, in the order the audit names what they find (FALLBACKS' order).
FALLBACK_CHECKS = (_fp16_ignored, _autocast_inactive, _autocast_off, _low_precision_weights,
                   _low_precision_states, _scaler_with_bf16, _low_precision_reduce)


def find_fallbacks(report, model, result=None,
                   accelerator=None) -> tuple[list[Fallback], list[str]]:
    """Every fallback check on what the audit saw, in order; then the notes, what is normal
    but surprising (nothing fell back, so they have no code)."""
    seen, found, notes = Seen.of(report, model, result, accelerator), [], []
    for check in FALLBACK_CHECKS:
        text = check(seen)
        if text is not None:
            found.append(Fallback(check.code, text))
    if seen.compute in _LOW and report.output_dtype == torch.float32 and (
            (seen.autocast or {}).get("by", "").startswith("Accelerate")
            or seen.path in ("accelerate", "trainer")):
        notes.append(f"the model's output is float32 although its matmuls ran in "
                     f"{dtype_name(seen.compute)}: Accelerate converts a prepared model's "
                     "outputs to fp32 (convert_outputs_to_fp32), so the loss is computed in fp32")
    if not report.grad_dtypes:
        notes.append("no gradients to look at (none since the last zero_grad); give batch= "
                     "to run one step")
    return found, notes


def autocast_supported(device: str, dtype: torch.dtype) -> bool:
    """Whether torch keeps autocast on for `dtype` on `device` here (asked of torch itself)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return bool(torch.autocast(device, dtype=dtype)._enabled)
        except RuntimeError:
            return False


def asked_dtype(precision: str) -> torch.dtype | None:
    """The low dtype a precision asks for ("bf16" -> torch.bfloat16); None for fp32 / "no"."""
    try:
        dtype = dtype_of(precision)
    except ValueError:  # "no", Accelerate's name for fp32, or one mplab does not audit
        return None
    return dtype if dtype in _LOW else None


def device_of(model) -> str | None:
    """The device type of the model's first parameter (None: it has none)."""
    p = next(model.parameters(), None)
    return p.device.type if p is not None else None
