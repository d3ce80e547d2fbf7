"""Speed of low precision on the machine at hand, measured, never assumed.

    from mplab import bench
    bench.matmul_speed()                  # lesson 1: one matmul per precision
    bench.training_speed()                # lesson 4: a few training steps per precision
    python -m mplab.bench --quick         # the whole matrix: matmul and model-size sweeps
    record = bench.lesson_bench()         # lesson 7: the same record, in seconds
    bench.record_table(record)            # its rows as the CLI prints them
    bench.bench_plot(record)              # speed-up against model size, and memory
    bench.compare_with_reference(record, bench.reference_results())
    bench.step_costs(model, batch)        # lesson 7: one step per precision, side by side
    bench.quantizer_speed()               # mplab's FP8/MX/NVFP4 quantisers against torchao's
    bench.training_share()                # the share of the GEMMs' bf16 speed-up a step keeps
    bench.step_profile()                  # lesson 7: where it goes, op by op, fp32 and bf16

`speed` holds the lessons' tables; `steps` one step's cost per precision, side by side;
`sweep` the CLI's measurements (`BenchRow`s), `peaks` the FLOPs and datasheet peaks behind
utilisation, `why` the words, `record` one run as the record the CLI prints and `--json`
writes, `reference` other machines' records beside it, `plot` the figure, `quantizers` the
cost of quantising a tensor (values per second, mplab beside torchao), `share` the step's
share of its matmuls' bf16 speed-up, `profile` one step op by op.
"""

from mplab.hardware import (
    UNITS,
    MatmulTiming,
    cpu_features,
    describe,
    has_units,
    resolve_device,
    time_matmul,
)

from .peaks import DATASHEET_TFLOPS, datasheet_gpu, datasheet_peak, mfu, training_flops
from .profile import amdahl_bound, explain_profile, step_profile
from .quantizers import quantizer_record, quantizer_speed, quantizer_table
from .record import lesson_bench, machine_name, record_table, run_plan
from .reference import (
    REFERENCE_DIR,
    compare_with_reference,
    explain_reference,
    reference_filename,
    reference_results,
)
from .share import gemm_speedup, training_share
from .speed import (
    BIGGER_SIZE,
    LESSON_SIZE,
    explain_matmul_speed,
    explain_training_speed,
    matmul_speed,
    size_effect,
    training_speed,
)
from .steps import explain_step_costs, step_costs
from .sweep import BenchRow, Plan, matmul_sweep, model_sweep
from .why import crossover, explain_row, targets

__all__ = ["MatmulTiming", "time_matmul", "matmul_speed", "explain_matmul_speed",
           "training_speed", "explain_training_speed", "LESSON_SIZE", "BIGGER_SIZE",
           "BenchRow", "Plan", "matmul_sweep", "model_sweep", "crossover", "explain_row",
           "targets", "DATASHEET_TFLOPS", "datasheet_gpu", "datasheet_peak", "mfu",
           "training_flops", "UNITS", "cpu_features", "describe", "has_units",
           "resolve_device", "lesson_bench", "run_plan", "REFERENCE_DIR", "reference_results",
           "reference_filename", "compare_with_reference", "explain_reference", "bench_plot",
           "record_table", "machine_name", "step_costs", "explain_step_costs", "size_effect",
           "quantizer_speed", "quantizer_record", "quantizer_table", "gemm_speedup",
           "training_share", "step_profile", "explain_profile", "amdahl_bound"]


def __getattr__(name: str):
    if name == "bench_plot":  # matplotlib loads only when a figure is asked for
        from .plot import bench_plot

        return bench_plot
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
