"""Below 16 bits on a model's own tensors: each recipe's cost in signal, values flushed to zero,
values saturated, and bytes (lesson 9).

    tensors = layer_tensors(lesson_capture(), "bert.encoder.layer.0.intermediate.dense")
    recipe_table(tensors)                  # SQNR (dB) per tensor and recipe
    recipe_table(tensors, "flushed")       # the share flushed to zero, ...
    q = apply("MXFP4", tensors["activation grad"], block=32)
    plot_scaled(q)                         # the scaled values against the format's range

A recipe is a name in :data:`RECIPES`; :func:`apply` runs it (from :mod:`mplab.lowbit.quantize` and
:mod:`mplab.lowbit.microscaling`, both equal to torchao bit for bit) on a 2-D tensor.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from mplab._display import Table
from mplab.amp.capture import Capture
from mplab.lowbit import microscaling as M
from mplab.lowbit import quantize as Q

__all__ = ["RECIPES", "BLOCKS", "DEFAULT_BLOCK", "MEASURES", "apply", "layer_tensors",
           "recipes_table", "recipe_table", "scaled_histogram", "plot_scaled", "outlier_blocks",
           "delayed_table"]

#: recipe -> (what it is, the block sizes it takes; None: it has no block to choose)
RECIPES: dict[str, tuple[str, tuple[int, ...] | None]] = {
    "tensorwise e4m3": ("one fp32 scale for the tensor, e4m3 elements", None),
    "tensorwise e5m2": ("one fp32 scale for the tensor, e5m2 elements", None),
    "rowwise e4m3": ("one power-of-two scale per row, e4m3 elements", None),
    "block 1xN e4m3": ("one fp32 scale per 1xN tile of a row (DeepSeek-V3: N=128)",
                       (32, 64, 128)),
    "MXFP8": ("32 e4m3 elements per E8M0 scale (floor)", (8, 16, 32, 64, 128)),
    "MXFP8 rceil": ("32 e4m3 elements per E8M0 scale (rounded up from amax / 448)",
                    (8, 16, 32, 64, 128)),
    "MXFP6": ("32 fp6 e2m3 elements per E8M0 scale", (8, 16, 32, 64, 128)),
    "MXFP4": ("32 fp4 e2m1 elements per E8M0 scale", (8, 16, 32, 64, 128)),
    "NVFP4": ("16 fp4 elements per E4M3 scale, times an fp32 tensor scale", None),
}
BLOCKS = {name: blocks for name, (_, blocks) in RECIPES.items()}
DEFAULT_BLOCK = {"block 1xN e4m3": 128, "MXFP8": 32, "MXFP8 rceil": 32, "MXFP6": 32,
                  "MXFP4": 32}
#: What recipe_table can show: Quantized property -> (column title, how to print it)
MEASURES = {"sqnr_db": "SQNR (dB)", "flushed": "flushed to 0", "saturated": "saturated",
            "bytes_per_value": "bytes per value"}


def apply(recipe: str, x: torch.Tensor, block: int | None = None) -> Q.Quantized:
    """Run `recipe` on the 2-D tensor x, with `block` elements per scale where it takes one."""
    if recipe not in RECIPES:
        raise ValueError(f"unknown recipe {recipe!r}; accepted: " + ", ".join(map(repr, RECIPES)))
    blocks = BLOCKS[recipe]
    if block is None:
        block = DEFAULT_BLOCK.get(recipe)
    elif blocks is None:
        raise ValueError(f"{recipe} has no block size to choose; give block=None")
    elif block not in blocks:
        raise ValueError(f"{recipe} takes a block of {', '.join(map(str, blocks))}, got "
                         f"{block!r}")
    if recipe.startswith("tensorwise"):
        return Q.tensorwise(x, "fp8_" + recipe.split()[-1])
    if recipe == "rowwise e4m3":
        return Q.rowwise(x)
    if recipe == "block 1xN e4m3":
        return Q.blockwise(x, (1, block))
    if recipe == "NVFP4":
        return M.nvfp4(x)
    element = {"MXFP8": "fp8_e4m3", "MXFP8 rceil": "fp8_e4m3", "MXFP6": "fp6_e2m3",
               "MXFP4": "fp4_e2m1"}[recipe]
    return M.mx(x, element, block=block, mode="rceil" if recipe.endswith("rceil") else "floor")


def recipes_table() -> Table:
    """What each recipe of :data:`RECIPES` is, and the block sizes it takes."""
    return Table([{"recipe": name, "what": what,
                   "blocks": ", ".join(map(str, blocks)) if blocks else "-"}
                  for name, (what, blocks) in RECIPES.items()], title="The recipes")


def layer_tensors(cap: Capture, layer: str) -> dict[str, torch.Tensor]:
    """A Linear layer's four tensors from one captured step, as 2-D float32 (rows, features):
    its output activation, that output's gradient, its weight and its weight's gradient."""
    if layer not in cap.activations or f"{layer}.weight" not in cap.weights:
        linears = [n for n, t in cap.layer_types.items() if t == "Linear"]
        raise ValueError(f"{layer!r} is not a captured Linear layer; accepted: "
                         + ", ".join(map(repr, linears)))
    out = {"activation": _rows(cap.activations[layer]), "weight": cap.weights[f"{layer}.weight"],
           "weight grad": cap.weight_grads[f"{layer}.weight"]}
    if layer in cap.activation_grads:
        out["activation grad"] = _rows(cap.activation_grads[layer])
    order = ("activation", "activation grad", "weight", "weight grad")
    return {k: out[k] for k in order if k in out}


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1]).contiguous()  # (batch, tokens, features) -> rows


def recipe_table(tensors: dict[str, torch.Tensor], measure: str = "sqnr_db",
                 recipes=None) -> Table:
    """One row per tensor, one column per recipe: `measure` ("sqnr_db", "flushed",
    "saturated" or "bytes_per_value") of that recipe on that tensor. A recipe whose blocks do
    not fit the tensor's shape shows "-". The note names the best and worst recipe per tensor."""
    if measure not in MEASURES:
        raise ValueError(f"measure must be one of {', '.join(map(repr, MEASURES))}, got "
                         f"{measure!r}")
    recipes = list(recipes or RECIPES)
    rows, best = [], []
    for name, x in tensors.items():
        row: dict = {"tensor": name, "shape": "x".join(map(str, x.shape))}
        got = {}
        for recipe in recipes:
            try:
                value = getattr(apply(recipe, x), measure)
            except ValueError:  # blocks that do not tile this shape
                row[recipe] = "-"
                continue
            got[recipe] = value
            row[recipe] = _cell(value, measure)
        rows.append(row)
        if got and measure == "sqnr_db":
            hi, lo = max(got, key=got.get), min(got, key=got.get)
            best.append(f"{name}: best {hi} ({got[hi]:.1f} dB), worst {lo} ({got[lo]:.1f} dB)")
    note = "; ".join(best)
    return Table(rows, title=f"{MEASURES[measure]} by recipe", note=note)


def _cell(value: float, measure: str) -> str:
    if measure == "sqnr_db":
        return "inf" if math.isinf(value) else f"{value:.1f}"
    if measure == "bytes_per_value":
        return f"{value:.4g}"
    return f"{100 * value:.2f} %"


def scaled_histogram(q: Q.Quantized, bins_per_octave: int = 2) -> dict:
    """The scaled values' magnitudes (what the format was asked to hold, the tensor's values
    after its scale) binned by log2, with the format's range: values under half its smallest
    are flushed to 0, past its largest by more than half a step saturated; per bin, how many of
    each. Zeros of the source are left out (a zero stays a zero) and counted apart."""
    everything = q.scaled.abs().double().flatten()
    a = everything[(everything > 0) & torch.isfinite(everything)].numpy()
    f = q.format
    lo, hi = float(f.min_subnormal), float(f.max_finite)
    logs = np.log2(a) if a.size else np.zeros(0)
    start = math.floor(min(logs.min(initial=0), math.log2(lo) - 2))
    stop = math.ceil(max(logs.max(initial=0), math.log2(hi) + 1)) + 1
    edges = np.arange(start, stop + 1e-9, 1 / bins_per_octave)
    flushed = a < lo / 2
    saturated = a > hi + 2.0 ** (f.emax - f.man_bits - 1)
    counts, _ = np.histogram(logs, bins=edges)
    return {"edges": edges, "counts": counts, "smallest": lo, "largest": hi,
            "flushed_counts": np.histogram(logs[flushed], bins=edges)[0],
            "saturated_counts": np.histogram(logs[saturated], bins=edges)[0],
            "flushed": int(flushed.sum()), "saturated": int(saturated.sum()),
            "values": int(a.size), "zeros": int((everything == 0).sum()), "format": f.name}


def plot_scaled(q: Q.Quantized, title: str = "") -> Figure:
    """A bar per log2 bin of the scaled values, the format's range shaded; in each bin the
    values flushed to zero (under half the smallest value) and saturated (past the largest)
    in red, stacked on the kept ones in blue. The source's exact zeros are counted in the
    legend, not drawn (log2 0 has no place on the axis)."""
    h = scaled_histogram(q)
    fig = Figure(figsize=(7.5, 3.2), layout="constrained")
    ax = fig.add_subplot()
    e = h["edges"]
    centres, width = (e[:-1] + e[1:]) / 2, (e[1] - e[0]) * 0.95
    lost = h["flushed_counts"] + h["saturated_counts"]
    kept = h["counts"] - lost
    ax.bar(centres, kept, width=width, color="#4c72b0", label="kept")
    ax.bar(centres, lost, width=width, bottom=kept, color="#c44e52",
           label="flushed to 0 or saturated")
    flush_at, top = math.log2(h["smallest"] / 2), math.log2(h["largest"])
    ax.axvspan(math.log2(h["smallest"]), top, color="#55a868", alpha=0.12,
               label=f"{h['format']}: 2^{math.log2(h['smallest']):g} to {h['largest']:g}")
    ax.axvline(flush_at, color="#c44e52", ls="--", lw=1)
    ax.axvline(top, color="#c44e52", ls="--", lw=1)
    handles, labels = ax.get_legend_handles_labels()
    if h["zeros"]:  # an entry without a mark: log2 0 has no place on the axis
        handles.append(Patch(color="none"))
        labels.append(f"{h['zeros']:,} exact zeros, not drawn "
                      f"({h['zeros'] / (h['zeros'] + h['values']):.0%} of the tensor)")
    ax.set_title(title or f"{q.recipe}: {100 * q.flushed:.2f} % flushed, "
                 f"{100 * q.saturated:.2f} % saturated, SQNR {q.sqnr_db:.1f} dB", fontsize=10)
    ax.set_xlabel("log2 |scaled value|  (the value after its scale, in the format's units)")
    ax.set_ylabel("values")
    ax.legend(handles, labels, loc="upper left", fontsize=8)
    return fig


def outlier_blocks(x: torch.Tensor, recipe: str = "MXFP4", blocks=None) -> Table:
    """How much of x each block size of `recipe` flushes to zero and its SQNR: smaller blocks
    keep an outlier from setting the scale of the values around it."""
    rows = []
    for block in blocks or BLOCKS[recipe]:
        q = apply(recipe, x, block)
        rows.append({"block": block, "flushed to 0": f"{100 * q.flushed:.2f} %",
                     "SQNR (dB)": round(q.sqnr_db, 1),
                     "bytes per value": round(q.bytes_per_value, 4)})
    return Table(rows, title=f"{recipe} by block size")


def delayed_table(steps, history_len: int = 4, algo: str = "max", margins=(0, 1)) -> Table:
    """A run of delayed scaling (:class:`mplab.lowbit.quantize.DelayedScaling`, e4m3) over `steps`
    (one tensor a step), once per margin: each step's amax, what its values were multiplied
    by before the cast, and the share saturated."""
    runs = {m: Q.DelayedScaling(history_len=history_len, algo=algo, margin=m) for m in margins}
    rows = []
    for step, x in enumerate(steps):
        row: dict = {"step": step, "amax": round(float(x.abs().max()), 4)}
        for m, d in runs.items():
            q = d.quantize(x)
            row[f"times (margin {m})"] = round(1 / q.scale.item(), 4)
            row[f"saturated (margin {m})"] = f"{100 * q.saturated:.1f} %"
        rows.append(row)
    return Table(rows, title=f"delayed scaling: history {history_len}, {algo}")
