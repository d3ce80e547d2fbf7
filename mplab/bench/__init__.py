"""Speed of low precision on the machine at hand, measured, never assumed.

    from mplab import bench
    bench.matmul_speed()                  # lesson 1: one matmul per precision
    bench.training_speed()                # lesson 4: a few training steps per precision
    python -m mplab.bench --quick         # the whole matrix: matmul and model-size sweeps

`speed` holds the lessons' tables; `sweep` the CLI's measurements (`BenchRow`s), `peaks` the
FLOPs and datasheet peaks behind utilisation, `why` the words, `plot` the figure.
"""

from mplab.hardware import UNITS, cpu_features, describe, has_units, resolve_device

from .peaks import DATASHEET_TFLOPS, datasheet_gpu, datasheet_peak, mfu, training_flops
from .speed import (
    BIGGER_SIZE,
    LESSON_SIZE,
    MatmulTiming,
    explain_matmul_speed,
    explain_training_speed,
    matmul_speed,
    time_matmul,
    training_speed,
)
from .sweep import BenchRow, Plan, matmul_sweep, model_sweep
from .why import crossover, explain_row, targets

__all__ = ["MatmulTiming", "time_matmul", "matmul_speed", "explain_matmul_speed",
           "training_speed", "explain_training_speed", "LESSON_SIZE", "BIGGER_SIZE",
           "BenchRow", "Plan", "matmul_sweep", "model_sweep", "crossover", "explain_row",
           "targets", "DATASHEET_TFLOPS", "datasheet_gpu", "datasheet_peak", "mfu",
           "training_flops", "UNITS", "cpu_features", "describe", "has_units",
           "resolve_device"]
