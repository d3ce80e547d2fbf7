"""Where the libraries disagree, measured: each cell is a fresh call to that library.

    disagreements()          # a Table: one row per probe on which two answers really differ
    disagreement_rows()      # the same rows as plain dicts; include_agreeing=True for every probe

Each probe is a float32 input cast to one format by torch (``tensor.to(dtype)``), ml_dtypes
(``array.astype``), mplab (:func:`mplab.numerics.formats.round_to`) and torchao (the cast its float8
training uses, ``to_fp8_saturated``, which clamps first; its MX element casts for fp4 and fp6).
"—" marks a library with no such cast (torch has no unpacked fp4 or fp6; torchao no e8m0 cast).

For e8m0 the row also holds the scale of an MXFP8 block (fp8_e4m3 elements) whose amax is |input| *
2^8, 8 being fp8_e4m3's emax, so that the OCP MX rule, 2^(floor(log2 amax) - emax), comes to
2^floor(log2 |input|): it rounds down where the cast of the input rounds to nearest. The columns:
that rule as mplab computes it (:func:`mplab.lowbit.microscaling.mx_scale_exponent`), and torchao's
``to_mx`` in its FLOOR and RCEIL modes. Nothing here is typed in: a library that changes its mind in
a new version changes the table.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import torch

from mplab._display import Table
from mplab.lowbit.microscaling import mx_scale_exponent
from mplab.lowbit.quantize import load_torchao
from mplab.numerics import formats

__all__ = ["PROBES", "ML_DTYPES", "MX_ELEMENT", "CAST_COLUMNS", "MX_COLUMNS", "disagreements",
           "disagreement_rows", "cells_differ"]

#: The inputs probed, per format: where a cast overflows, meets NaN or has no zero to give.
PROBES: dict[str, tuple[float, ...]] = {
    "fp8_e4m3": (449.0, 464.0, 465.0, 480.0, 1e9, math.inf, -math.inf),
    "fp8_e5m2": (61439.0, 61440.0, 1e9, math.inf),
    "fp8_e4m3fnuz": (247.0, 248.0, 1e9, math.inf),
    "fp8_e5m2fnuz": (1e9, math.inf),
    "fp6_e2m3": (math.nan, math.inf),
    "fp6_e3m2": (math.nan,),
    "fp4_e2m1": (math.nan, math.inf, -math.inf),
    "e8m0": (0.0, -2.0, 3.0, 0.75, 1.875),
}
#: ml_dtypes' name for each format (mplab's names follow torch where torch has the dtype).
ML_DTYPES = {"fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2",
             "fp8_e4m3fnuz": "float8_e4m3fnuz", "fp8_e5m2fnuz": "float8_e5m2fnuz",
             "fp6_e2m3": "float6_e2m3fn", "fp6_e3m2": "float6_e3m2fn",
             "fp4_e2m1": "float4_e2m1fn", "e8m0": "float8_e8m0fnu"}
#: The element format whose MX block scale the e8m0 rows show (MXFP8, torchao's default).
MX_ELEMENT = "fp8_e4m3"
CAST_COLUMNS = ("torch", "ml_dtypes", "mplab", "torchao")
MX_COLUMNS = ("OCP MX floor", "torchao FLOOR", "torchao RCEIL")
NONE = "—"  # the library has no such operation


def _torch_cast(x: float, f: formats.FloatFormat):
    if f.dtype() is None:
        return NONE
    return torch.tensor([x], dtype=torch.float32).to(f.dtype()).double().item()


def _ml_dtypes_cast(x: float, f: formats.FloatFormat) -> float:
    return float(np.array([x], np.float32).astype(getattr(ml_dtypes, ML_DTYPES[f.name]))
                 .astype(np.float64)[0])


def _torchao_cast(x: float, f: formats.FloatFormat):
    load_torchao()
    from torchao.float8.float8_utils import to_fp8_saturated
    from torchao.prototype.mx_formats import kernels

    t = torch.tensor([x], dtype=torch.float32)
    if f.name.startswith("fp8"):
        return to_fp8_saturated(t, f.dtype()).double().item()
    if f.name in ("fp4_e2m1", "fp6_e2m3", "fp6_e3m2"):  # kernels' names: f32_to_f4_unpacked
        kind = f.name.removeprefix("fp").removesuffix("_e2m1")
        cast = getattr(kernels, f"f32_to_f{kind}_unpacked")
        back = getattr(kernels, f"f{kind}_unpacked_to_f32")
        return back(cast(t)).double().item()
    return NONE


def _mx_block(x: float) -> torch.Tensor:
    """One MX block (32 elements) whose amax is |x| * 2^emax of the element format."""
    block = torch.zeros(1, 32)
    block[0, 0] = x * 2.0 ** formats.get_format(MX_ELEMENT).emax
    return block


def _mx_scales(x: float) -> dict:
    load_torchao()
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.prototype.mx_formats.mx_tensor import to_mx

    block = _mx_block(x)
    k = int(mx_scale_exponent(block.abs().amax(), MX_ELEMENT, "floor"))
    out = {"OCP MX floor": formats.from_bits(k + 127, "e8m0")}  # 128, NaN, is code 0xFF
    for mode in ("FLOOR", "RCEIL"):
        scale, _ = to_mx(block, formats.dtype_of(MX_ELEMENT), 32, ScaleCalculationMode[mode])
        out[f"torchao {mode}"] = scale.double().item()
    return out


def _probe(name: str, x: float) -> dict:
    f = formats.get_format(name)
    row = {"cast to": name, "input": x, "torch": _torch_cast(x, f),
           "ml_dtypes": _ml_dtypes_cast(x, f), "mplab": formats.round_to(x, f),
           "torchao": _torchao_cast(x, f)}
    row.update(_mx_scales(x) if name == "e8m0" else dict.fromkeys(MX_COLUMNS, NONE))
    return row


def _same(a: float, b: float) -> bool:
    """Equal as bit patterns go: NaN equals NaN, 0.0 differs from -0.0."""
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return a == b and math.copysign(1, a) == math.copysign(1, b)


def cells_differ(row: dict, columns=CAST_COLUMNS + MX_COLUMNS) -> bool:
    """Whether two of the row's answers in these columns differ ("—" is no answer)."""
    values = [row[c] for c in columns if row[c] != NONE]
    return any(not _same(values[0], v) for v in values[1:])


def disagreement_rows(include_agreeing: bool = False) -> list[dict]:
    """Every probe's row (`include_agreeing`), or only those where two answers differ."""
    rows = [_probe(name, x) for name, xs in PROBES.items() for x in xs]
    return rows if include_agreeing else [r for r in rows if cells_differ(r)]


def _pairs_differ(rows: list[dict], a: str, b: str) -> list[dict]:
    return [r for r in rows if NONE not in (r[a], r[b]) and not _same(r[a], r[b])]


def _formats_of(rows: list[dict]) -> str:
    return ", ".join(dict.fromkeys(r["cast to"] for r in rows))


def _note(rows: list[dict]) -> str:
    shown = [r for r in rows if cells_differ(r)]
    agreed = [r for r in rows if not cells_differ(r)]
    parts = [f"{len(shown)} of {len(rows)} probes disagree."]
    for a, b in (("torch", "ml_dtypes"), ("torch", "torchao"), ("ml_dtypes", "torchao")):
        diff = _pairs_differ(rows, a, b)
        if diff:
            parts.append(f"{a} vs {b}: {len(diff)} ({_formats_of(diff)}).")
    casts = [r for r in rows if r["torch"] != NONE]
    follows_torch = len(casts) - len(_pairs_differ(casts, "mplab", "torch"))
    rest = [r for r in rows if r["torch"] == NONE]
    follows_ml = len(rest) - len(_pairs_differ(rest, "mplab", "ml_dtypes"))
    parts.append(f"mplab's cast equals torch's on {follows_torch} of the {len(casts)} probes "
                 f"torch casts, ml_dtypes' on {follows_ml} of the {len(rest)} it does not.")
    mx = [r for r in rows if r["torchao FLOOR"] != NONE]
    if mx:
        cast_vs_rule = _pairs_differ(mx, "torch", "OCP MX floor")
        floor_vs_rceil = _pairs_differ(mx, "torchao FLOOR", "torchao RCEIL")
        rule = len(mx) - len(_pairs_differ(mx, "OCP MX floor", "torchao FLOOR"))
        parts.append(
            f"MX columns: the scale of an MXFP8 block with amax |input| * 2^"
            f"{formats.get_format(MX_ELEMENT).emax}; a plain cast of the input differs from the "
            f"OCP floor on {len(cast_vs_rule)} of {len(mx)}, torchao FLOOR from RCEIL on "
            f"{len(floor_vs_rceil)}, mplab's floor equals torchao's FLOOR on {rule}.")
    if agreed:
        parts.append("Agreeing, left out: " + "; ".join(
            f"{r['cast to']} of {r['input']!r}" for r in agreed) + ".")
    return " ".join(parts)


def disagreements() -> Table:
    """The probes on which torch, ml_dtypes, mplab and torchao (or the MX scale rules) give
    different answers, one row each, with a note counting who differs from whom."""
    rows = disagreement_rows(include_agreeing=True)
    versions = (f"torch {torch.__version__.split('+')[0]}, ml_dtypes {ml_dtypes.__version__}, "
                f"torchao {load_torchao().__version__}")
    return Table([r for r in rows if cells_differ(r)], note=_note(rows),
                 title=f"Where the libraries disagree (measured: {versions})")
