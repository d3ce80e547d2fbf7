"""The quantisers' own cost: mplab's FP8, MX and NVFP4 recipes against torchao's, in values per
second, side by side in one run.

    table = quantizer_speed()                   # a 1024 x 4096 tensor, on one CPU thread
    table = quantizer_speed((4096, 4096), repeats=9)
    table = quantizer_speed(**PRESETS["quick"])  # the CLI's sizes: tiny, quick, full
    entry = quantizer_record(table)             # what `python -m mplab.bench --json` keeps
    quantizer_table(entry)                      # and back to the table it prints

Each recipe is timed as a user calls it, amax and scales included: mplab's function
(`quantize.tensorwise` and `rowwise`, `microscaling.mx` and `nvfp4`) against torchao 0.18's entry
point for the same recipe (float8 training's `hp_tensor_to_float8_dynamic`, `to_mx`, and
`nvfp4_quantize` with the tensor scale from amax). The two take turns on the same input, the
first of each turn alternating, and each side's median is kept, so that a busy machine slows
both alike. Their first results are compared bit for bit (element codes and scales): the timed
functions are the ones that agree.

They do not return the same things. mplab's call returns the values on the format's grid as
float32, the scaled tensor and what it dequantises to; the bit patterns (`Quantized.codes`) are
worked out when asked, untimed. torchao's returns the bits, fp4 packed two to a byte, which is
most of what its fp4 recipes cost on a CPU.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from mplab._display import Table
from mplab.lowbit import microscaling, quantize

__all__ = ["quantizer_speed", "quantizer_recipes", "quantizer_note", "quantizer_record",
           "quantizer_table", "Recipe", "RECIPES", "TARGET_RATIO", "PRESETS"]

RECIPES = ("tensorwise e4m3", "rowwise e4m3", "MXFP8 floor", "MXFP8 rceil", "MXFP4", "NVFP4")
#: The issue's goal: mplab's time at most this many times torchao's, recipe by recipe.
TARGET_RATIO = 2.0
#: quantizer_speed's arguments per CLI preset: --tiny for the tests, --quick for a few seconds.
PRESETS = {"tiny": {"size": (32, 256), "repeats": 3, "budget_s": 0.05},
           "quick": {"size": (512, 4096), "repeats": 5, "budget_s": 0.4},
           "full": {"size": (1024, 4096), "repeats": 7, "budget_s": 2.0}}
RATIO = "mplab/torchao time"


@dataclass(frozen=True)
class Recipe:
    """One recipe both ways: `mplab(x)` and `torchao(x)` as timed, and `same_bits(mine, theirs)`,
    whether their results hold the same element codes and scales."""

    name: str
    mplab: Callable[[torch.Tensor], object]
    torchao: Callable[[torch.Tensor], object]
    same_bits: Callable[[object, object], bool]


def quantizer_recipes() -> dict[str, Recipe]:
    """The recipes, by name (`RECIPES`), each as mplab and torchao compute it."""
    try:
        quantize.load_torchao()
    except ImportError as err:
        raise ImportError("the quantiser benchmark times mplab against torchao, which is not "
                          "installed here (pip install -r requirements.txt)") from err
    from torchao.float8.config import ScalingGranularity
    from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
    from torchao.float8.float8_training_tensor import LinearMMConfig
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.prototype.mx_formats.kernels import unpack_uint4
    from torchao.prototype.mx_formats.mx_tensor import to_mx
    from torchao.prototype.mx_formats.nvfp4_tensor import nvfp4_quantize, per_tensor_amax_to_scale

    e4m3, fp4, config = torch.float8_e4m3fn, torch.float4_e2m1fn_x2, LinearMMConfig()

    def float8(axiswise: bool):
        if axiswise:  # torchao's "rowwise": per row, scales rounded down to a power of two
            return lambda x: hp_tensor_to_float8_dynamic(
                x, e4m3, config, scaling_granularity=ScalingGranularity.AXISWISE,
                axiswise_dim=-1, round_scales_to_power_of_2=True)
        return lambda x: hp_tensor_to_float8_dynamic(x, e4m3, config)

    def float8_bits(q, t) -> bool:  # torchao multiplies by its scale, mplab's is the inverse
        return (torch.equal(q.codes, t._data.view(torch.uint8))
                and torch.equal(q.scale, t._scale.reciprocal()))

    def unpacked(data, shape, packed: bool):
        data = data.view(torch.uint8)
        return (unpack_uint4(data) if packed else data).reshape(shape)

    def block_bits(packed: bool):  # to_mx and nvfp4_quantize: (scales, data, ...); the
        # scales' bytes are their codes
        return lambda q, t: (torch.equal(q.scale_codes, t[0].view(torch.uint8).reshape(
            q.scale_codes.shape)) and torch.equal(q.codes, unpacked(t[1], q.codes.shape, packed)))

    def torchao_nvfp4(x):  # the tensor scale from amax, as torchao's NVFP4 training has it
        tensor_scale = per_tensor_amax_to_scale(x.abs().amax())
        return (*nvfp4_quantize(x, 16, tensor_scale), tensor_scale)

    def nvfp4_bits(q, t) -> bool:
        return block_bits(True)(q, t) and torch.equal(q.tensor_scale, t[2])

    floor, rceil = ScaleCalculationMode.FLOOR, ScaleCalculationMode.RCEIL
    table = [
        Recipe(RECIPES[0], quantize.tensorwise, float8(False), float8_bits),
        Recipe(RECIPES[1], quantize.rowwise, float8(True), float8_bits),
        Recipe(RECIPES[2], lambda x: microscaling.mx(x, "fp8_e4m3"),
               lambda x: to_mx(x, e4m3, 32, floor), block_bits(False)),
        Recipe(RECIPES[3], lambda x: microscaling.mx(x, "fp8_e4m3", mode="rceil"),
               lambda x: to_mx(x, e4m3, 32, rceil), block_bits(False)),
        Recipe(RECIPES[4], lambda x: microscaling.mx(x, "fp4_e2m1"),
               lambda x: to_mx(x, fp4, 32, floor), block_bits(True)),
        Recipe(RECIPES[5], microscaling.nvfp4, torchao_nvfp4, nvfp4_bits),
    ]
    return {r.name: r for r in table}


def quantizer_speed(size=(1024, 4096), repeats: int = 7, budget_s: float = 2.0,
                    progress=None, seed: int = 0) -> Table:
    """Time every recipe, mplab's against torchao's, on one random float32 tensor of `size`
    (rows, columns; columns a multiple of 32), on one CPU thread (on a shared 2-core machine a
    second thread waits whenever the other core is busy). Per recipe: one untimed call each,
    whose results are compared bit for bit, then up to `repeats` timed turns, at least three,
    stopping once `budget_s` seconds are spent. `progress(row)` is called after each recipe.

    Returns a Table, one row per recipe: millions of values quantised per second each side,
    the ratio of mplab's median time to torchao's, and whether their bits agreed; its note
    says which recipes are within `TARGET_RATIO` of torchao."""
    if (not isinstance(size, tuple | list) or len(size) != 2
            or not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in size)
            or size[1] % 32):
        raise ValueError(f"size must be two positive ints (rows, columns), the columns a "
                         f"multiple of 32 (an MX block), got {size!r}")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be a positive int, got {repeats!r}")
    if isinstance(budget_s, bool) or not isinstance(budget_s, int | float) or budget_s <= 0:
        raise ValueError(f"budget_s must be a positive number of seconds, got {budget_s!r}")
    recipes = quantizer_recipes()
    x = torch.randn(*size, generator=torch.Generator().manual_seed(seed))
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rows = []
        for recipe in recipes.values():
            rows.append(_measure(recipe, x, repeats, budget_s))
            if progress is not None:
                progress(rows[-1])
    finally:
        torch.set_num_threads(before)
    import torchao

    return Table(rows, title=f"quantising a {size[0]}×{size[1]} float32 tensor: mplab against "
                             f"torchao {torchao.__version__}, on one CPU thread",
                 note=quantizer_note(rows))


def _measure(recipe: Recipe, x: torch.Tensor, repeats: int, budget_s: float) -> dict:
    same = recipe.same_bits(recipe.mplab(x), recipe.torchao(x))  # also the warm-up
    times: dict[str, list[float]] = {"mplab": [], "torchao": []}
    sides = [("mplab", recipe.mplab), ("torchao", recipe.torchao)]
    started = time.perf_counter()
    for turn in range(repeats):
        for side, quantise in sides if turn % 2 == 0 else sides[::-1]:
            t0 = time.perf_counter()
            out = quantise(x)
            times[side].append(time.perf_counter() - t0)
            del out  # freed outside the timing, before the other side runs
        if turn + 1 >= min(3, repeats) and time.perf_counter() - started > budget_s:
            break
    mine, theirs = statistics.median(times["mplab"]), statistics.median(times["torchao"])
    return {"recipe": recipe.name,
            "mplab M values/s": _rate(x.numel(), mine),
            "torchao M values/s": _rate(x.numel(), theirs),
            RATIO: round(mine / theirs, 2),
            "same bits": "yes" if same else "NO",
            "turns": len(times["mplab"])}


def _rate(values: int, seconds: float) -> float:
    return float(f"{values / seconds / 1e6:.3g}")


def quantizer_note(rows: list[dict]) -> str:
    """What the table's rows say: which recipes are within `TARGET_RATIO` of torchao's time,
    with every measured ratio, and any whose bits differed."""
    def said(rs):
        return ", ".join(f"{r['recipe']} {r[RATIO]:.2f}×" for r in rs)

    within = [r for r in rows if r[RATIO] <= TARGET_RATIO]
    over = [r for r in rows if r[RATIO] > TARGET_RATIO]
    if not over:
        text = f"mplab is within {TARGET_RATIO:g}× of torchao's time on every recipe: "
        text += said(within)
    else:
        text = (f"mplab is within {TARGET_RATIO:g}× of torchao's time on {len(within)} of "
                f"{len(rows)} recipes" + (f" ({said(within)})" if within else "")
                + f"; NOT within {TARGET_RATIO:g}×: {said(over)}")
    text += (" (mplab's median time over torchao's, the two interleaved; below 1 mplab is "
             "faster).")
    differ = [r["recipe"] for r in rows if r["same bits"] != "yes"]
    if differ:
        text += f" The two sides' bits DIFFER for {', '.join(differ)}."
    return text


def quantizer_record(table: Table) -> dict:
    """The table as JSON data: {"title", "note", "rows"}."""
    return {"title": table.title, "note": table.note, "rows": [dict(r) for r in table.rows]}


def quantizer_table(entry: dict) -> Table:
    """A record's "quantizers" entry as the table the CLI prints."""
    return Table(entry["rows"], title=entry["title"], note=entry["note"])
