"""Below 16 bits (lesson 9): FP8, MX and NVFP4 recipes from scratch, each equal to torchao and
`torch._scaled_mm` bit for bit, and what they do to a model's own tensors.

    from mplab import lowbit
    lowbit.apply("MXFP8", x)                  # any recipe on a tensor: a `quantize.Quantized`
    lowbit.recipe_table(lowbit.layer_tensors(cap, "encoder.layers.0.ff.0"))   # SQNR per recipe
    from mplab.lowbit import quantize, microscaling
    quantize.rowwise(x, "fp8_e4m3"); microscaling.mx(x, "fp4_e2m1")

`quantize` holds the element cast and the FP8 scalings (tensorwise, rowwise, blockwise, delayed)
and the scaled matmul; `microscaling` the block scales of MX and NVFP4; `tensors` the recipes
on a model's tensors (re-exported here); `disagree` where torch, ml_dtypes, torchao and the OCP
rule differ, measured; `accumulator` a model of the FP8 GEMM's short running sum; `qdq` mplab's
own FP8 training recipe (a quantise-dequantise around each Linear).
"""

from mplab.lowbit import accumulator, disagree, microscaling, qdq, quantize, tensors
from mplab.lowbit.tensors import (
    BLOCKS,
    DEFAULT_BLOCK,
    MEASURES,
    RECIPES,
    apply,
    delayed_table,
    layer_tensors,
    outlier_blocks,
    plot_scaled,
    recipe_table,
    recipes_table,
    scaled_histogram,
)

__all__ = ["quantize", "microscaling", "tensors", "disagree", "accumulator", "qdq", "BLOCKS",
           "DEFAULT_BLOCK", "MEASURES", "RECIPES", "apply", "delayed_table", "layer_tensors",
           "outlier_blocks", "plot_scaled", "recipe_table", "recipes_table", "scaled_histogram"]
