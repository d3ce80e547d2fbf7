"""Where a bf16 speed-up goes: one training step of the lesson transformer profiled op by op
(torch.profiler) in fp32 and in bf16 autocast, on this machine, side by side.

    found = step_profile(hidden=256, layers=2)          # torch's attention backend
    found = step_profile(hidden=256, attention="mplab")  # the backend mplab.train picks
    found["table"]; print(explain_profile(found))

The linear layers' matmuls (`mm`, `addmm`) are what bf16 units speed up most. Their share `p`
of the fp32 step and their own speed-up `g` bound the step's (Amdahl): `1 / ((1 - p) + p / g)`
if every other op took as long as in fp32. A step faster than that had other ops speed up too
(half the bytes to move); one slower had ops that got slower in bf16: the casts autocast adds,
or an op torch runs badly in bf16, like the CPU flash attention's backward
(benchmarks/RECORDS.md, "attention backend").
"""

from __future__ import annotations

import contextlib
import copy
import math
import os
import sys

import torch

from mplab._display import Table
from mplab.hardware import attention_backend, has_units, no_units_reason, resolve_device

from .speed import model_shape

__all__ = ["MATMULS", "step_profile", "explain_profile", "amdahl_bound"]

# the linear layers' GEMMs (what one layer's GEMM bound times); attention's own matmuls (bmm,
# or inside a flash kernel) count as attention, the same under either backend
MATMULS = ("aten::mm", "aten::addmm")
ATTENTIONS = ("flash", "math", "torch", "mplab")


def amdahl_bound(share: float, speedup: float) -> float:
    """The step's speed-up if the part `share` of its time ran `speedup` times faster and the
    rest as before."""
    return 1.0 / ((1.0 - share) + share / speedup)


def step_profile(hidden: int = 256, layers: int = 2, batch_size: int = 16,
                 max_length: int = 32, steps: int = 3, attention: str = "torch",
                 device="auto", top: int = 12) -> dict:
    """Profile `steps` training steps (forward, backward, a fused AdamW step; one untimed
    step first) of the lesson transformer at `hidden` / `layers` on `batch_size` reviews of
    `max_length` tokens, in fp32 and in bf16 autocast, from the same weights. `attention`:
    "torch" (torch's choice of backend for each precision), "mplab" (what mplab.train runs:
    `hardware.attention_backend`), "flash" or "math".

    Returns {"table": the `top` ops by time (ms per step, each precision, bf16's speed-up,
    the op's kind), then the rest together and the step, "matmul_share", "matmul_speedup",
    "bound", "step_speedup" (all ops' time, fp32 over bf16), "slower" (the ops bf16 made
    slower, worst first, each (op, fp32 ms, bf16 ms)), "fp32_ms", "bf16_ms" (per step),
    "by_kind" ({kind: (fp32 ms, bf16 ms)}: "matmul", "attention", "cast or copy", "other"),
    "attention" (the backend each precision ran), "device" ("cpu" or "cuda"), "shape"}.
    Times are the ops' own (self) time as the profiler saw them, on torch's threads."""
    if attention not in ATTENTIONS:
        raise ValueError(f"attention must be one of {', '.join(map(repr, ATTENTIONS))}, "
                         f"got {attention!r}")
    for name, value, low in (("layers", layers, 1), ("batch_size", batch_size, 1),
                             ("max_length", max_length, 2), ("steps", steps, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be a whole number of at least {low}, got {value!r}")
    from mplab.models import lesson_model

    dev = resolve_device(device)
    shape = model_shape({"hidden_size": hidden, "num_hidden_layers": layers})
    base = lesson_model(**shape)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(5, base.config.vocab_size, (batch_size, max_length), generator=gen)
    batch = {"input_ids": ids.to(dev), "attention_mask": torch.ones_like(ids).to(dev),
             "labels": torch.randint(0, 2, (batch_size,), generator=gen).to(dev)}
    ops, used = {}, {}
    for precision in ("fp32", "bf16"):
        ops[precision], used[precision] = _profile(copy.deepcopy(base).to(dev), batch,
                                                   precision, attention, dev, steps)
    return _summary(ops, used, steps, top, dev.type) | {"shape": shape | {
        "batch_size": batch_size, "max_length": max_length}}


def _backend(attention: str, precision: str, dev: torch.device) -> str | None:
    if attention == "torch":
        return None
    if attention == "mplab":
        return attention_backend(precision, dev)[0]
    return {"flash": "FLASH_ATTENTION", "math": "MATH"}[attention]


def _profile(model, batch: dict, precision: str, attention: str, dev: torch.device,
             steps: int) -> tuple[dict, str]:
    """{op: self time in µs over the profiled steps}, and the attention backend used."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.profiler import ProfilerActivity, profile

    backend = _backend(attention, precision, dev)
    kernel = (sdpa_kernel(getattr(SDPBackend, backend)) if backend else
              contextlib.nullcontext())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    autocast = torch.autocast(dev.type, dtype=torch.bfloat16, enabled=precision == "bf16")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda"
                                           else [])

    def step():
        with autocast:
            loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    prof = profile(activities=activities)
    with kernel:
        step()  # warm-up: the first step allocates and picks kernels
        with _quiet_stderr():
            prof.start()
        for _ in range(steps):
            step()
        with _quiet_stderr():
            prof.stop()
    key = "self_device_time_total" if dev.type == "cuda" else "self_cpu_time_total"
    found = {e.key: getattr(e, key) for e in prof.key_averages()
             if e.key.startswith("aten::") and getattr(e, key) > 0}
    # a fused kernel is named by its op (flash, efficient, cudnn); the math backend runs as
    # bmm and softmax, whatever dispatched it
    ran = " ".join(k for k in found if "scaled_dot_product" in k)
    name = next((kind for kind in ("flash", "efficient", "cudnn") if kind in ran),
                "math" if found.get("aten::bmm") else "none")
    return found, name + ("" if backend else " (torch's choice)")


@contextlib.contextmanager
def _quiet_stderr():
    """Standard error closed at the C level: torch 2.13's profiler prints a "USDT: ...
    profiler_start" line on every start and stop, below Python (KINETO_LOG_LEVEL silences
    it only when set before torch is imported)."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _kind(op: str) -> str:
    if op in MATMULS:
        return "matmul"
    if "scaled_dot_product" in op or op in ("aten::bmm", "aten::_softmax",
                                            "aten::_softmax_backward_data"):
        return "attention"
    if op in ("aten::copy_", "aten::_to_copy", "aten::to"):
        return "cast or copy"
    return "other"


def _summary(ops: dict, used: dict, steps: int, top: int, device: str) -> dict:
    fp32, bf16 = ({k: v / steps / 1e3 for k, v in ops[p].items()} for p in ("fp32", "bf16"))
    total32, total16 = sum(fp32.values()), sum(bf16.values())
    mm32 = sum(fp32.get(k, 0.0) for k in MATMULS)
    mm16 = sum(bf16.get(k, 0.0) for k in MATMULS)
    share = mm32 / total32 if total32 else math.nan
    speedup = mm32 / mm16 if mm16 else math.nan
    names = sorted(set(fp32) | set(bf16), key=lambda k: -max(fp32.get(k, 0), bf16.get(k, 0)))

    def row(op: str, kind: str, a: float, b: float) -> dict:
        return {"op": op, "kind": kind, "fp32 ms": round(a, 2), "bf16 ms": round(b, 2),
                "bf16 speed-up": round(a / b, 2) if a and b else None}

    rows = [row(k.removeprefix("aten::"), _kind(k), fp32.get(k, 0.0), bf16.get(k, 0.0))
            for k in names[:top]]
    rest = names[top:]
    if rest:
        rows.append(row("(all other ops)", "", sum(fp32.get(k, 0.0) for k in rest),
                        sum(bf16.get(k, 0.0) for k in rest)))
    rows.append(row("the step", "", total32, total16))
    kinds = {}
    for k in names:
        a, b = kinds.get(_kind(k), (0.0, 0.0))
        kinds[_kind(k)] = (a + fp32.get(k, 0.0), b + bf16.get(k, 0.0))
    # slower by a tenth and by at least 2 % of the bf16 step: not one small op's noise
    slower = sorted(((k.removeprefix("aten::"), fp32[k], bf16[k]) for k in fp32
                     if k in bf16 and bf16[k] > 1.1 * fp32[k] and
                     bf16[k] - fp32[k] > 0.02 * total16), key=lambda r: r[1] - r[2])
    return {"table": Table(rows, title="one training step, op by op: each op's own (self) "
                                       "time per step"),
            "matmul_share": share, "matmul_speedup": speedup,
            "bound": amdahl_bound(share, speedup), "step_speedup": total32 / total16,
            "slower": slower, "fp32_ms": total32, "bf16_ms": total16, "by_kind": kinds,
            "attention": {"fp32": used["fp32"], "bf16": used["bf16"]}, "device": device}


def explain_profile(found: dict) -> str:
    """The profile in words, from its own figures: the matmuls' share and speed-up, the
    bound they set, what the step reached, and the ops that got slower."""
    share, speedup, bound = found["matmul_share"], found["matmul_speedup"], found["bound"]
    step = found["step_speedup"]
    words = [f"The matmuls (mm, addmm) took {share:.0%} of the fp32 step and ran "
             f"{speedup:.2f}x as fast in bf16 (their fp32 time over their bf16 time): had every "
             f"other op taken as long as in fp32, the step would have run {bound:.2f}x as fast "
             f"(Amdahl's bound). It ran {step:.2f}x as fast (its ops took "
             f"{found['fp32_ms']:.1f} ms a step in fp32, {found['bf16_ms']:.1f} ms in bf16)."]
    if speedup < 1:
        words.append("The matmuls themselves ran slower in bf16: "
                     + (no_units_reason("bf16") if found["device"] == "cpu" and
                        not has_units("bf16") else "no bf16 units sped them up")
                     + ", so bf16 cannot pay here (exercise 7.1).")
    elif step >= bound:
        words.append("That is at or past the bound: the other ops gained too (bf16 moves half "
                     "the bytes), more than any op lost.")
    else:
        words.append(f"Its speed-up is {step / bound:.0%} of the bound.")
    if found["slower"]:
        words.append("Slower in bf16: " + "; ".join(
            f"{op} {a:.1f} -> {b:.1f} ms" for op, a, b in found["slower"][:4]) + ".")
        for op, a, b in found["slower"]:
            if "flash_attention" in op and "backward" in op:
                words.append(f"{op} is torch's CPU flash attention backward, {b / a:.1f}x as "
                             "long in bf16 as in fp32 here: mplab.train runs bf16 on a CPU "
                             "with the math backend instead (`step_profile(attention="
                             "\"mplab\")` profiles the step it trains).")
    else:
        words.append("No op got slower in bf16 by more than a tenth.")
    words.append(f"Attention ran {found['attention']['fp32']} in fp32, "
                 f"{found['attention']['bf16']} in bf16.")
    return " ".join(words)
