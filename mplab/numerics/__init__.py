"""Numbers in a narrow format, exactly: what a format stores (lesson 1), what a cast to it does to
a tensor (lesson 2), and what breaks in it (lessons 2 and 7).

    from mplab.numerics import formats, explain, casts
    formats.round_to(0.1, "bf16"); formats.to_bits(1.0, "fp16")   # exact, bit for bit with torch
    explain.format_table()                    # each format's range and precision, in a table
    casts.cast_stats(values, "fp16", scale=2**10)                # what flushes, what overflows

`parse` reads a number a learner types; `formats` holds the formats as data, with exact
conversions; `explain` says what a format stores; `casts` what a cast does to a tensor;
`histograms` where values sit on the log2 axis; `failures` swamping, stalled sums and an
overflow turning NaN; `bf16_updates` pure bf16 weights and the two fixes for swamped updates.
Nothing here trains, loads data or draws: every module stands on torch alone.
"""

from mplab.numerics import bf16_updates, casts, explain, failures, formats, histograms, parse
from mplab.numerics.formats import ALL_FORMATS, FORMATS, FloatFormat, get_format

__all__ = ["parse", "formats", "explain", "casts", "histograms", "failures", "bf16_updates",
           "FloatFormat", "FORMATS", "ALL_FORMATS", "get_format"]
