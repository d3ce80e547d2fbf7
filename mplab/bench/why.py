"""The bench's measurements in words: why each row ran as fast as it did, where low precision
starts to pay (the crossover), and the targets. Every sentence is computed from the rows."""

from __future__ import annotations

from mplab.hardware import no_units_reason

from .sweep import BenchRow

__all__ = ["BEATS", "CPU_BF16_TARGET", "explain_row", "crossover", "targets"]

#: "Beats fp32" means at least this speed-up: a shared machine's timings wander by a few %.
BEATS = 1.1
#: The issue's targets: bf16 through mplab.train on the largest CPU size, on a GPU's big model.
CPU_BF16_TARGET = 1.6
GPU_BF16_TARGET, GPU_MFU_TARGET = 3.0, 0.40


def _no_units(rows: list[BenchRow], precision: str) -> bool:
    """The rows say this precision ran on a CPU without units for it."""
    return any(r.has_units is False for r in rows if r.precision == precision)


def _fp32_twin(row: BenchRow, rows: list[BenchRow]) -> BenchRow | None:
    return next((r for r in rows if r.precision == "fp32" and r.workload == row.workload), None)


def explain_row(row: BenchRow, rows: list[BenchRow], device: str) -> str:
    """Why this row ran as fast as it did (and, for a model, held the memory it did)."""
    p, s = row.precision, row.speedup_vs_fp32
    parts = []
    if row.has_units is False:
        units = no_units_reason(p)
        if s < 1 / BEATS:
            parts.append(f"{_times(1 / s)} slower than fp32: {units}, so torch converts every "
                         "element to fp32 and back; no size wins that back")
        else:
            parts.append(f"{s:.2f}× fp32 although {units}: too little work here for the "
                         "conversions to fp32 and back to show")
    elif row.kind == "matmul":
        parts += _why_matmul(row, rows, device)
    elif p != "fp32":
        parts.append(_why_model_speed(row, rows))
    if row.kind == "matmul":
        parts.append(_why_ragged(row, rows, device))
    if row.kind == "model" and p != "fp32":
        parts.append(_why_memory(row, rows))
        if row.loss_change is not None:
            parts.append(f"loss {row.loss_change:+.2%} against fp32 (same seed, same batches)")
    if row.kind == "model":
        parts.append(_mfu_note(row))
    return "; ".join(x for x in parts if x)


def _mfu_note(row: BenchRow) -> str:
    """What the row's MFU was measured against (the table shows only the share)."""
    if row.mfu is None:
        return row.mfu_reference or ""
    return f"MFU {row.mfu:.0%} of the {row.mfu_reference}" if row.mfu_reference else ""


def _why_matmul(row: BenchRow, rows: list[BenchRow], device: str) -> list[str]:
    p, s, n = row.precision, row.speedup_vs_fp32, row.n
    same = [r for r in rows if r.kind == "matmul" and r.precision == p]
    parts = []
    if p == "tf32":
        parts.append(f"{s:.1f}× fp32: fp32 storage, the matmul's inputs rounded to 10 mantissa "
                     "bits on the tensor cores")
    elif p != "fp32":
        biggest = max(same, key=lambda r: r.n)
        if s >= BEATS:
            parts.append(f"{s:.1f}× fp32: half the bytes to move, and units that do more {p} "
                         "multiplies per cycle")
        elif biggest.speedup_vs_fp32 >= BEATS and biggest.n > n:
            parts.append(f"{s:.2f}× fp32, where {biggest.n}² runs {biggest.speedup_vs_fp32:.1f}×: "
                         f"{n}×{n} is too small to keep the units busy (the launch and the "
                         "conversions cost as much as the faster multiplies save)")
        else:
            parts.append(f"{s:.2f}× fp32: half the bytes, but no faster arithmetic for it here")
    return parts


def _why_ragged(row: BenchRow, rows: list[BenchRow], device: str) -> str:
    """A matmul whose size is not a multiple of 8, against the nearest one that is, in its
    precision: what the pair measured here, and whether the multiple-of-8 rule explains it."""
    n, p = row.n, row.precision
    twin = min((r for r in rows if r.kind == "matmul" and r.precision == p and r.n % 8 == 0),
               key=lambda r: abs(r.n - n), default=None)
    if not n % 8 or twin is None:
        return ""
    ratio = row.throughput / twin.throughput
    measured = (f"{_rate(row.throughput)} GFLOP/s against {_rate(twin.throughput)} at "
                f"{twin.n} ({ratio:.2f}×)")
    if row.has_units is False:
        # The rule comes from units that take their operands in tiles; a CPU without units
        # for the precision converts every element, so nothing makes the rule hold there.
        rule = ("the multiple-of-8 rule is about units that take tiles (tensor cores, AMX), "
                f"and this CPU has none for {p}, so ")
        if ratio < 1 / BEATS:
            return f"{n} is not a multiple of 8: {measured}; {rule}that rule does not explain it"
        how = "about as fast as" if ratio <= BEATS else "faster than"
        return (f"{n} is not a multiple of 8, yet it ran {how} {twin.n}: {measured}; "
                f"{rule}it need not hold here")
    if ratio < 1 / BEATS:
        tile = ("tensor cores take their tiles in multiples of 8 (16 bytes) and pad or fall "
                "back to slower kernels otherwise" if device == "cuda" else
                "the vector units take 16 or 32 elements at a time and run the ragged edge in "
                "a tail loop")
        return f"{n} is not a multiple of 8: {measured}; {tile}"
    if ratio <= BEATS:
        return (f"{n} is not a multiple of 8, yet it ran about as fast as {twin.n}: {measured}; "
                "the ragged edge is too small a share of this matmul to show")
    return (f"{n} is not a multiple of 8, yet it ran faster than {twin.n}: {measured}, against "
            f"the multiple-of-8 rule: here another cost weighed more at {twin.n} than the "
            f"ragged edge did at {n} (a rerun of `python -m mplab.bench` shows whether it "
            "repeats)")


def _why_model_speed(row: BenchRow, rows: list[BenchRow]) -> str:
    p, s = row.precision, row.speedup_vs_fp32
    base = _fp32_twin(row, rows)
    share = (f"the fp32 step ran its matmuls at {base.mfu:.0%} of the matmul peak"
             if base is not None and base.mfu is not None else "")
    if s >= BEATS:
        return (f"{s:.1f}× fp32: {row.hidden}-wide matrices keep the {p} units busy"
                + (f" ({share})" if share else ""))
    return (f"{s:.2f}× fp32: {row.hidden}-wide matrices are too small to pay"
            + (f" ({share}, so most of the step is elsewhere)" if share else "")
            + ": launches, autocast's casts of weights and activations, and memory-bound ops "
            "(layer norm, softmax, GELU, AdamW's update) that fewer bits do not speed up")


def _why_memory(row: BenchRow, rows: list[BenchRow]) -> str:
    base = _fp32_twin(row, rows)
    if base is None or not base.peak_memory_bytes:
        return ""
    ratio = row.peak_memory_bytes / base.peak_memory_bytes
    what = ("MORE than fp32's" if ratio > 1.02 else
            "not the 0.5× people expect" if ratio > 0.6 else "about half")
    return (f"peak memory {ratio:.2f}× fp32's ({_mib(row.peak_memory_bytes)} against "
            f"{_mib(base.peak_memory_bytes)}), {what}: the weights are kept in two precisions "
            f"(the fp32 master copy, and autocast's {row.precision} copies of them), AdamW's "
            "two states stay fp32, and only the activations saved for the backward shrink")


def _times(x: float) -> str:
    return f"{x:.0f}×" if x >= 10 else f"{x:.1f}×"


def _rate(x: float) -> str:
    return f"{x:.0f}" if x >= 10 else f"{x:.1f}"


def _mib(n: int) -> str:
    return f"{n / 2**20:.0f} MiB"


def crossover(rows: list[BenchRow], precision: str, device: str) -> dict:
    """The smallest model size where `precision` beats fp32 (speed-up >= BEATS), and why it
    lies there: {"precision", "workload" (None if none did), "parameters", "speedup", "text"}."""
    models = sorted((r for r in rows if r.kind == "model" and r.precision == precision),
                    key=lambda r: r.parameters)
    if not models:
        raise ValueError(f"no model rows in {precision!r}; give what mplab.bench measures")
    first = next((r for r in models if r.speedup_vs_fp32 >= BEATS), None)
    found = {"precision": precision, "workload": first and first.workload,
             "parameters": first and first.parameters,
             "speedup": first and first.speedup_vs_fp32}
    if _no_units(rows, precision):
        found["text"] = (f"{precision}: no crossover on this CPU, nor can there be: it has no "
                         f"{precision} units, so every {precision} matmul is converted to fp32 "
                         f"and back ({models[0].speedup_vs_fp32:.2f}× fp32 at {_size(models[0])}"
                         "; larger sizes only add conversions).")
        return found
    shares = [(_size(r), _fp32_twin(r, rows)) for r in models]
    trend = ", ".join(f"{size}: {b.mfu:.0%}" for size, b in shares
                      if b is not None and b.mfu is not None)
    bare = max((r for r in rows if r.kind == "matmul" and r.precision == precision),
               key=lambda r: r.n, default=None)
    why = ("Low precision speeds up only the matmuls, and the share of the step spent in them "
           f"grows with the size (fp32 matmul utilisation, {trend})")
    if bare is not None and trend:
        x = bare.speedup_vs_fp32
        predicted = ", ".join(f"{size}: {_amdahl(b.mfu, x):.2f}×" for size, b in shares
                              if b is not None and b.mfu is not None)
        why += (f"; with a bare {bare.n}² matmul {x:.1f}× faster in {precision}, Amdahl's law, "
                f"1 / ((1 - f) + f / {x:.1f}) with f that utilisation, predicts {predicted}")
    if first is None:
        found["text"] = (f"{precision}: no crossover up to {_size(models[-1])} "
                         f"({models[-1].speedup_vs_fp32:.2f}× there). {why}.")
    elif first is models[0]:
        found["text"] = (f"{precision}: it pays already at the smallest size measured, "
                         f"{_size(first)} ({first.speedup_vs_fp32:.2f}×). {why}.")
    else:
        below = models[models.index(first) - 1]
        found["text"] = (f"{precision}: the crossover is {_size(first)} ({first.parameters:,} "
                         f"parameters, {first.speedup_vs_fp32:.2f}×); at {_size(below)} it ran "
                         f"{below.speedup_vs_fp32:.2f}×. {why}.")
    return found


def _amdahl(share: float, speedup: float) -> float:
    share = min(max(share, 0.0), 1.0)
    return 1 / ((1 - share) + share / speedup)


def _size(row: BenchRow) -> str:
    return f"hidden {row.hidden}/{row.layers} layers"


def targets(rows: list[BenchRow], device: str) -> list[str]:
    """The issue's targets, each with the measured figure and whether it was met."""
    bf16 = [r for r in rows if r.kind == "model" and r.precision == "bf16"]
    if not bf16:
        return ["no bf16 model rows: no target to check"]
    largest = max(bf16, key=lambda r: r.parameters)
    if device == "cpu":
        if _no_units(rows, "bf16"):
            return [f"target bf16 >= {CPU_BF16_TARGET}× fp32 applies to a CPU with bf16 units "
                    f"(AVX-512-BF16 or AMX); this one has none (measured "
                    f"{largest.speedup_vs_fp32:.2f}×)"]
        met = "met" if largest.speedup_vs_fp32 >= CPU_BF16_TARGET else "NOT met"
        return [f"target bf16 >= {CPU_BF16_TARGET}× fp32 through mplab.train at "
                f"{_size(largest)}: measured {largest.speedup_vs_fp32:.2f}× ({met})"]
    mfu = "unknown (GPU not in the datasheet table)" if largest.mfu is None else \
        f"{largest.mfu:.0%}"
    met = ("met" if largest.speedup_vs_fp32 >= GPU_BF16_TARGET and largest.mfu is not None
           and largest.mfu >= GPU_MFU_TARGET else "NOT met")
    return [f"target bf16 >= {GPU_BF16_TARGET:.0f}× fp32 with MFU >= {GPU_MFU_TARGET:.0%} on "
            f"{_size(largest)} ({largest.parameters / 1e6:.0f}M parameters): measured "
            f"{largest.speedup_vs_fp32:.2f}×, MFU {mfu} ({met})"]
