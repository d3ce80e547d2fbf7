"""The lessons' speed tables: one matmul and a few training steps per precision, side by side
(lessons 1 and 4). Measured on the machine at hand, never assumed."""

from __future__ import annotations

import warnings

from mplab._display import Table
from mplab.hardware import (
    UNITS,
    cpu_features,
    describe,
    has_units,
    no_units_reason,
    resolve_device,
    runs_fast,
    time_matmul,
)

__all__ = ["matmul_speed", "explain_matmul_speed", "LESSON_SIZE", "BIGGER_SIZE", "training_speed",
           "model_shape", "explain_training_speed", "size_effect"]


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
            why = (f"{no_units_reason(name)}, so torch falls back to a generic kernel that "
                   "converts every element to fp32 and back"
                   if device == "cpu" and not has_units(name)
                   else "this device's library has no fast kernel for it")
            lines.append(f"{name} ran {1 / s:.0f}× SLOWER than fp32: {why}. "
                         "Fewer bits only pay off where the hardware computes in them.")
    return "\n".join(lines)


#: Model sizes for `training_speed`: the lesson model, and one big enough for bf16 units to pay.
LESSON_SIZE = {"hidden_size": 128, "num_hidden_layers": 2}
BIGGER_SIZE = {"hidden_size": 512, "num_hidden_layers": 4}


def training_speed(sizes=(LESSON_SIZE, BIGGER_SIZE), precisions=("fp32", "bf16"),
                   device="auto", steps: int = 4, batch_size: int = 32) -> Table:
    """A few training steps of the lesson transformer through `mplab.train` at each size and
    precision, side by side: the steady time per step (the median after the warm-up step) and
    the speed relative to the first precision. A size is `lesson_model`'s config overrides
    (`hidden_size`, `num_hidden_layers`; heads and feed-forward follow the hidden size). A
    precision this CPU has no units for is timed at the first size only: it runs tens of times
    slower, and no size changes that (the title says so)."""
    from mplab.models import lesson_model
    from mplab.train import TrainWarning, train

    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 2:
        raise ValueError(f"steps must be an integer >= 2 (the first is warm-up), got {steps!r}")
    dev = resolve_device(device)
    rows, slow = [], [p for p in precisions if not runs_fast(p, dev)]
    for i, size in enumerate(sizes):
        shape = model_shape(size)
        base = None
        for precision in precisions:
            if precision in slow and i > 0:
                continue
            with warnings.catch_warnings():  # the slow-hardware notes: the table says it
                warnings.simplefilter("ignore", TrainWarning)
                run = train(model=lesson_model(**shape), precision=precision, device=dev.type,
                            steps=steps, batch_size=batch_size, eval_samples=0,
                            warmup_steps=0, progress=False, watch=False)
            seconds = run.steady_step_seconds
            base = base or seconds
            rows.append({"hidden": shape["hidden_size"], "layers": shape["num_hidden_layers"],
                         "parameters": run.parameters, "precision": precision,
                         "matmuls ran in": str(run.compute_dtype).removeprefix("torch."),
                         "ms per step": seconds * 1e3,
                         f"speed vs {precisions[0]}": base / seconds, "device": dev.type})
    title = f"training steps of batch {batch_size} on {describe(dev.type)}"
    if slow and len(sizes) > 1:
        title += (f" ({' and '.join(slow)} timed at the first size only: no units for "
                  f"{'them' if len(slow) > 1 else 'it'} here)")
    return Table(rows, title=title)


def model_shape(size: dict) -> dict:
    """lesson_model's config for a size: heads and feed-forward follow `hidden_size`."""
    hidden = size.get("hidden_size", 128)
    if not isinstance(hidden, int) or hidden < 64 or hidden % 64:
        raise ValueError(f"hidden_size must be a multiple of 64, got {hidden!r}")
    heads = max(4, hidden // 64)
    return {"num_attention_heads": heads, "intermediate_size": 2 * hidden, **size}


def explain_training_speed(table: Table, matmul_n: int = 1024) -> str:
    """Say in words why each low precision ran as fast as it did in a `training_speed` table,
    from the measurements and this machine: its units for that precision, and whether the
    model's matrices are big enough to keep them busy (a bare `matmul_n`² matmul, timed here,
    shows what the units can do on their own)."""
    rows = list(table)
    if not rows:
        raise ValueError("the table is empty; pass what bench.training_speed returns")
    speed_key = next(k for k in rows[0] if k.startswith("speed vs "))
    base = speed_key.removeprefix("speed vs ")
    device = rows[0]["device"]
    lines, bare, reasoned = [], {}, set()
    for r in rows:
        p = r["precision"]
        if p == base:
            continue
        s, model = r[speed_key], f"hidden {r['hidden']}, {r['layers']} layers"
        if device == "cpu" and not has_units(p):
            ran = f"{1 / s:.0f}× slower than {base}" if s < 0.5 else f"at {s:.2f}× {base}'s speed"
            # the reason once per precision: it is the same at every size
            why = ("" if p in reasoned else f": {no_units_reason(p)}, so every {p} matmul is "
                   f"converted to {base} and back; no model size can win that back")
            reasoned.add(p)
            lines.append(f"{model}: {p} ran {ran}{why}.")
            continue
        if p not in bare:
            bare[p] = (time_matmul(matmul_n, base, device, budget_s=0.2).seconds
                       / time_matmul(matmul_n, p, device, budget_s=0.2).seconds)
        units = "tensor cores" if device == "cuda" else f"{p} units ({_present(p)})"
        if s >= 1.15:
            lines.append(f"{model}: {p} ran {s:.1f}× faster than {base}: its {r['hidden']}-wide "
                         f"matrices are big enough to keep the {units} busy, and half the bytes "
                         "move.")
        elif bare[p] >= 1.15:
            lines.append(f"{model}: {p} ran at {s:.2f}× {base}'s speed. The {units} are there "
                         f"(a bare {matmul_n}² matmul runs {bare[p]:.1f}× faster in {p}), but "
                         f"this model's matrices are too small ({r['hidden']} wide): casting "
                         f"weights and activations to {p}, and the ops that stay in {base}, cost "
                         "as much as the faster multiplies save.")
        else:
            lines.append(f"{model}: {p} ran at {s:.2f}× {base}'s speed, and even a bare "
                         f"{matmul_n}² matmul runs only {bare[p]:.2f}× faster in {p} here: "
                         f"torch has no fast {p} kernel on this {device}.")
    return "\n".join(lines)


def size_effect(speeds: Table) -> str:
    """What a `bench.training_speed` table shows about model size: per low precision, its speed
    against the baseline at each size timed, or, where it was timed at one size only (no units
    for it on this CPU), why the size effect cannot show here."""
    rows = list(speeds)
    key = next((k for k in (rows[0] if rows else {}) if k.startswith("speed vs ")), None)
    if key is None:
        raise ValueError("size_effect takes the table bench.training_speed returns")
    base, device = key.removeprefix("speed vs "), rows[0]["device"]
    sizes = list(dict.fromkeys((r["hidden"], r["layers"]) for r in rows))
    lines = []
    for p in dict.fromkeys(r["precision"] for r in rows if r["precision"] != base):
        timed = {(r["hidden"], r["layers"]): r[key] for r in rows if r["precision"] == p}
        ran = ", then ".join(f"{s:.2f}× {base}'s speed at hidden {h}, {n} layers"
                             for (h, n), s in timed.items())
        if len(timed) < len(sizes):
            why = (f": {no_units_reason(p)}, so every {p} matmul is converted to {base} and "
                   "back" if device == "cpu" and p in UNITS and not has_units(p) else "")
            lines.append(f"{p} ran at {ran} and was timed at no other size{why}. Whether bigger "
                         f"matrices let faster {p} multiplies win cannot show here; where there "
                         f"are {p} units (a GPU, or a CPU with them) the table times every size.")
        elif len(timed) > 1:
            first, last = list(timed.values())[0], list(timed.values())[-1]
            trend = ("it gained with size: bigger matrices give the faster multiplies more of "
                     "each step" if last > 1.1 * first else "it lost ground with size"
                     if last < first / 1.1 else "size made no clear difference here")
            lines.append(f"{p} ran at {ran}; {trend}.")
    return "\n".join(lines)


def _present(precision: str) -> str:
    feats = cpu_features()
    return ", ".join(f for f in UNITS[precision] if feats[f])
