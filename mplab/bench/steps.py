"""What one training step costs in each precision, measured side by side: a model's forward
and backward pass under autocast, and the GradScaler pass (`unscale_` and `update`) that fp16
adds to a step.

    costs = step_costs(model, batch)     # one row per precision, one thread on a CPU
    print(explain_step_costs(costs, {"the fp16 lab loop": broken, "your bf16 loop": mine}))

Lesson 7 sets it beside the step times its loops recorded: those ran one after the other, on
every thread, with their optimizer and hooks, so their ratio says less than this one does.
"""

from __future__ import annotations

import statistics
import time

import torch

from mplab._display import Table
from mplab.hardware import has_units, no_units_reason, resolve_device, synchronize
from mplab.numerics.formats import dtype_of
from mplab.train import PRECISIONS

from .why import BEATS

__all__ = ["FORWARD_BACKWARD", "SCALER_PASS", "step_costs", "explain_step_costs"]

FORWARD_BACKWARD = "forward and backward (ms)"
SCALER_PASS = "GradScaler unscale_ and update (ms)"


def step_costs(model: torch.nn.Module, batch: dict, precisions=("fp32", "bf16", "fp16"),
               device="auto", repeats: int = 3) -> Table:
    """Time `model(**batch).loss` forward and backward under autocast in each precision, the
    median of `repeats` after one warm-up, on one thread on a CPU (the other core of a shared
    machine then cannot stall it). fp16's row also times what its GradScaler adds: `unscale_`
    (a pass over every gradient, checking for inf/NaN) and `update`. The model's weights are
    left as they were (no optimizer step); its gradients are cleared."""
    if not isinstance(repeats, int) or isinstance(repeats, bool) or repeats < 1:
        raise ValueError(f"repeats must be a whole number >= 1, got {repeats!r}")
    unknown = [p for p in precisions if p not in PRECISIONS]
    if unknown or not precisions:
        raise ValueError(f"unknown precision {unknown[0] if unknown else precisions!r}; "
                         f"accepted: {', '.join(map(repr, PRECISIONS))}")
    dev = resolve_device(device)
    model = model.to(dev)
    batch = {k: v.to(dev) for k, v in batch.items()}
    before = torch.get_num_threads()
    if dev.type == "cpu":
        torch.set_num_threads(1)
    try:
        rows = [_costs(model, batch, p, dev, repeats) for p in precisions]
    finally:
        torch.set_num_threads(before)
        model.zero_grad(set_to_none=True)
    return Table(rows, title=f"one step of {type(model).__name__} per precision, side by side"
                             + (" (one thread)" if dev.type == "cpu" else ""))


def _costs(model, batch, precision: str, dev: torch.device, repeats: int) -> dict:
    autocast = torch.autocast(dev.type, dtype=dtype_of(precision), enabled=precision != "fp32")
    scaler = torch.amp.GradScaler(dev.type) if precision == "fp16" else None
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # unscale_ reads its gradients
    passes, scaling = [], []
    for i in range(repeats + 1):  # the first is the warm-up
        model.zero_grad(set_to_none=True)
        synchronize(dev)
        start = time.perf_counter()
        with autocast:
            loss = model(**batch).loss
        (scaler.scale(loss) if scaler else loss).backward()
        synchronize(dev)
        middle = time.perf_counter()
        if scaler:
            scaler.unscale_(optimizer)
            scaler.update()
            synchronize(dev)
        if i:
            passes.append(middle - start)
            scaling.append(time.perf_counter() - middle)
    return {"precision": precision, FORWARD_BACKWARD: statistics.median(passes) * 1e3,
            SCALER_PASS: statistics.median(scaling) * 1e3 if scaler else None,
            "units": has_units(precision) if dev.type == "cpu" else None,
            "device": dev.type, "threads": 1 if dev.type == "cpu" else None}


def explain_step_costs(costs: Table, runs: dict | None = None) -> str:
    """Say in words what a `step_costs` table measured: each low precision against fp32, fp16
    against bf16, and the GradScaler's share of an fp16 step; then, for `runs` (label ->
    TrainResult, e.g. two loops of the lesson), what their recorded steps say beside it."""
    rows = {r["precision"]: r for r in costs}
    if "fp32" not in rows:
        raise ValueError("the table has no fp32 row; give what bench.step_costs measured with "
                         "fp32 among its precisions")
    ms = {p: r[FORWARD_BACKWARD] for p, r in rows.items()}
    where = "one thread" if rows["fp32"]["device"] == "cpu" else "this GPU"
    lines = [f"Side by side on {where}, one forward and backward pass took "
             + ", ".join(f"{ms[p]:.1f} ms in {p}" for p in rows) + "."]
    low = [p for p in rows if p != "fp32"]
    emulated = [p for p in low if rows[p]["units"] is False]
    if emulated:
        lines.append(_sentence(" and ".join(no_units_reason(p) if i == 0 else f"no {p} units"
                                            for i, p in enumerate(emulated)))
                     + f": torch converts {'both' if len(emulated) > 1 else 'it'} to fp32 and "
                     "back around each small block of work, so "
                     + " and ".join(f"{p} took {ms[p] / ms['fp32']:.1f}× fp32's time"
                                    for p in emulated) + ".")
    fast = [p for p in low if p not in emulated]
    if fast:
        units = "With units for it" if rows["fp32"]["device"] == "cpu" else "Here"
        lines.append(f"{units}, " + ", ".join(f"{p} ran at {ms['fp32'] / ms[p]:.2f}× fp32's "
                                              "speed" for p in fast) + ".")
    if "fp16" in ms and "bf16" in ms:
        ratio = ms["fp16"] / ms["bf16"]
        if 1 / BEATS <= ratio <= BEATS:
            same = ("neither is emulated more slowly than the other" if
                    {"fp16", "bf16"} <= set(emulated) else "neither is faster here")
            lines.append(f"fp16 and bf16 cost about the same (fp16 {ratio:.2f}× bf16's time): "
                         f"{same}.")
        else:
            lines.append(f"fp16 is the {'slower' if ratio > 1 else 'faster'} of the two here: "
                         f"{ratio:.2f}× bf16's time.")
    scaling = rows.get("fp16", {}).get(SCALER_PASS)
    if scaling is not None:
        lines.append(f"The GradScaler's unscale_ and update, which only fp16 needs, took "
                     f"{scaling:.2f} ms, {scaling / ms['fp16']:.0%} of fp16's forward and "
                     "backward.")
    if runs:
        lines.append(_recorded(rows, ms, runs))
    return " ".join(lines)


def _sentence(text: str) -> str:
    return text[:1].upper() + text[1:]


def _recorded(rows: dict, ms: dict, runs: dict) -> str:
    """The runs' recorded steps, beside the side-by-side figures."""
    said, spreads = [], []
    for label, run in runs.items():
        step, times = run.steady_step_seconds, sorted(run.step_seconds[1:])
        if step is None:
            continue
        named = label if run.precision in label else f"{label}, {run.precision}"
        said.append(f"{step * 1e3:.1f} ms ({named})")
        spreads.append(f"{times[0] * 1e3:.0f}-{times[-1] * 1e3:.0f} ms")
    if not said:
        return ""
    text = f"The loops recorded a steady step of {' and '.join(said)}"
    timed = [r for r in runs.values() if r.steady_step_seconds and r.precision in ms]
    if len(timed) == 2 and timed[0].precision != timed[1].precision:
        a, b = timed
        text += (f": {a.steady_step_seconds / b.steady_step_seconds:.2f}× apart, against "
                 f"{ms[a.precision] / ms[b.precision]:.2f}× side by side")
    text += (". A recorded step holds more than its forward and backward (the optimizer, any "
             "clipping, the Recorder's counts), and each loop ran at its own moment")
    if rows["fp32"]["device"] == "cpu":
        text += (f" on {torch.get_num_threads()} threads, which wait whenever another "
                 "process holds a core")
    return text + (f" (their steps ranged {' and '.join(spreads)}): compare precisions by "
                   "what is measured side by side.")
