"""The measurements behind `python -m mplab.bench`: a matmul sweep and a model-size sweep of
the lesson transformer's training step, each precision against fp32, side by side in one run.

    plan = Plan.for_device("cpu", quick=True)
    rows = matmul_sweep(plan) + model_sweep(plan, reference=best_gflops(matmul rows))

Every row is a `BenchRow`; `mplab.bench.why` puts them into words.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import asdict, dataclass, field

import torch

from mplab.hardware import has_units, resolve_device, runs_fast, time_matmul

from .peaks import datasheet_gpu, datasheet_peak, matmul_parameters, mfu, training_flops
from .speed import model_shape

__all__ = ["BenchRow", "Plan", "tf32", "matmul_sweep", "best_gflops", "model_sweep", "train_row",
           "cpu_peak", "CpuMemoryProbe", "memory_changes", "peak_live_bytes"]


@dataclass
class BenchRow:
    """One workload in one precision. `throughput` is in `unit` (GFLOP/s for a matmul,
    samples/s for a training step); `mfu` is None where no peak is known."""

    workload: str
    kind: str                      # "matmul" or "model"
    precision: str
    throughput: float
    unit: str
    speedup_vs_fp32: float
    peak_memory_bytes: int
    memory_kind: str
    mfu: float | None = None
    mfu_reference: str | None = None
    best_throughput: float | None = None  # matmul: the best run's (a CPU's reference peak)
    n: int | None = None           # matmul: n×n @ n×n
    hidden: int | None = None      # model: its shape and size
    layers: int | None = None
    parameters: int | None = None
    step_seconds: float | None = None
    batch_size: int | None = None  # model: samples per step (throughput is samples/s)
    flops_per_step: float | None = None
    loss_change: float | None = None
    matmuls_ran_in: str | None = None
    has_units: bool | None = None  # a CPU's units for this precision; None on a GPU
    explanation: str = ""

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Plan:
    """What one bench run measures: sizes, precisions, steps. `for_device` gives the presets."""

    device: str
    precisions: tuple[str, ...]
    matmul_sizes: tuple[int, ...]
    model_sizes: tuple[tuple[int, int], ...]      # (hidden, layers), smallest first
    steps: int
    batch_size: int
    big_model: tuple[int, int] | None = None      # GPU only: a model that fills the device
    big_batch_size: int = 512
    matmul_budget_s: float = 0.3
    # On a CPU without units for a precision, its matmuls run tens of times slower than fp32
    # (benchmarks/RECORDS.md): past these sizes the run would take minutes, so they are
    # skipped (and the output says so).
    slow_matmul_limit: int = 1024
    slow_model_sizes: int = 1
    # fp32 at a size where no other precision is timed: a row with no speed-up to show. The
    # CLI keeps it (a bigger fp32 matmul is a better peak for MFU); the lesson leaves it out.
    fp32_alone: bool = True
    name: str = "custom"                          # the preset's: full, quick, lesson or tiny
    skipped: list[str] = field(default_factory=list, compare=False)

    @classmethod
    def for_device(cls, device: str = "auto", quick: bool = False, tiny: bool = False,
                   lesson: bool = False) -> Plan:
        """The preset for the device asked for ("auto": a GPU if there is one)."""
        return cls.preset(resolve_device(device).type, quick, tiny, lesson)

    @classmethod
    def preset(cls, device_type: str, quick: bool = False, tiny: bool = False,
               lesson: bool = False) -> Plan:
        """The sizes for a "cpu" or "cuda" run: full, `quick`, `lesson` (lesson 7's, seconds
        on 2 CPU cores) or `tiny` (the tests'; it wins over the others)."""
        if device_type not in ("cpu", "cuda"):
            raise ValueError(f"unknown device type {device_type!r}; accepted: 'cpu', 'cuda'")
        # The lesson model and two bigger ones: on a CPU with bf16 units the crossover falls
        # among them (the speed-ups measured: benchmarks/RECORDS.md).
        lesson_sizes = ((128, 2), (256, 4), (512, 4))
        if device_type == "cuda":
            precisions = ("fp32", "tf32", "bf16", "fp16")
            if tiny:
                return cls("cuda", precisions, (255, 256), ((64, 1), (128, 1)), 3, 8,
                           name="tiny")
            if lesson:
                return cls("cuda", precisions, (4095, 4096), lesson_sizes, 6, 256,
                           matmul_budget_s=0.1, name="lesson")
            if quick:  # every lesson size, so that a reference run matches a lesson's rows
                return cls("cuda", precisions, (1000, 1024, 4095, 4096),
                           (*lesson_sizes, (1024, 8)), 10, 256, big_model=(1024, 12),
                           name="quick")
            return cls("cuda", precisions, (1000, 1024, 4095, 4096, 8192),
                       ((128, 2), (256, 4), (512, 4), (768, 8), (1024, 8)), 20, 256,
                       big_model=(1024, 12), name="full")
        precisions = ("fp32", "bf16", "fp16")
        if tiny:
            return cls("cpu", precisions, (31, 32), ((64, 1), (128, 1)), 2, 4,
                       matmul_budget_s=0.02, slow_matmul_limit=32, name="tiny")
        if lesson:
            # 3 steps: one warm-up, two timed. A precision without units here (fp16 on this
            # EPYC, bf16 on an AVX2-only CPU) runs only where it is cheap: the 255² and 256²
            # matmuls (2 repeats) and the lesson model; the output says what it skipped.
            # fp32 then runs only beside them: alone at the larger sizes it shows no speed-up
            # and took a large share of the lesson's bench (benchmarks/RECORDS.md).
            return cls("cpu", precisions, (255, 256, 512), lesson_sizes, 3, 32,
                       matmul_budget_s=0.1, slow_matmul_limit=256, fp32_alone=False,
                       name="lesson")
        if quick:
            return cls("cpu", precisions, (255, 256, 1024), lesson_sizes, 4, 32,
                       matmul_budget_s=0.2, slow_matmul_limit=256, name="quick")
        return cls("cpu", precisions, (255, 256, 1000, 1024), lesson_sizes, 8, 32,
                   matmul_budget_s=0.5, slow_matmul_limit=1024, name="full")


def _units(precision: str, device: str) -> bool | None:
    """Whether the CPU has units for `precision` (fp32 always); None on a GPU."""
    return has_units(_storage(precision)) if device == "cpu" else None


@contextlib.contextmanager
def tf32(enabled: bool):
    """fp32 matmuls on TF32 tensor cores (10-bit mantissa inputs, fp32 accumulate) or not."""
    before = torch.backends.cuda.matmul.allow_tf32
    with warnings.catch_warnings():  # torch >= 2.9 prefers fp32_precision; both still work
        warnings.simplefilter("ignore")
        torch.backends.cuda.matmul.allow_tf32 = enabled
    try:
        yield
    finally:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.backends.cuda.matmul.allow_tf32 = before


def _storage(precision: str) -> str:
    return "fp32" if precision == "tf32" else precision


# ---- the matmul sweep -------------------------------------------------------------------------

def matmul_sweep(plan: Plan, progress=None) -> list[BenchRow]:
    """Each size × precision: GFLOP/s (median), speed-up over fp32 at that size, memory."""
    rows = []
    for n in plan.matmul_sizes:
        base = None
        slow = [p for p in plan.precisions
                if not runs_fast(p, plan.device) and n > plan.slow_matmul_limit]
        for precision in plan.precisions:
            if precision in slow:
                plan.skipped.append(f"matmul {n}² in {precision}: skipped (no {precision} units "
                                    "here: it runs tens of times slower than fp32, so it is "
                                    f"timed up to {plan.slow_matmul_limit}² only)")
                continue
            if _alone(plan, precision, slow):
                plan.skipped.append(f"matmul {n}² in fp32: not timed (no other precision "
                                    "is timed at this size to compare it with)")
                continue
            fast = runs_fast(precision, plan.device)
            if plan.device == "cuda":
                torch.cuda.reset_peak_memory_stats()
            with tf32(precision == "tf32"):
                t = time_matmul(n, _storage(precision), plan.device,
                                budget_s=plan.matmul_budget_s if fast else 0.0,
                                max_repeats=50 if fast else 2,
                                threads=1 if plan.device == "cpu" else None)
            if plan.device == "cuda":
                memory, kind = torch.cuda.max_memory_allocated(), "cuda max_memory_allocated"
            else:
                memory, kind = 3 * t.bytes_per_matrix, "a, b and a @ b (their bytes)"
            gflops = 2 * n ** 3 / t.seconds / 1e9
            base = base or gflops
            rows.append(BenchRow(f"matmul {n}×{n}", "matmul", precision, gflops, "GFLOP/s",
                                 gflops / base, memory, kind, n=n,
                                 flops_per_step=2.0 * n ** 3, step_seconds=t.seconds,
                                 best_throughput=2 * n ** 3 / t.best / 1e9,
                                 has_units=_units(precision, plan.device)))
            if progress:
                progress(rows[-1])
    return rows


def _alone(plan: Plan, precision: str, slow: list[str]) -> bool:
    """fp32 at a size where every other precision is skipped, in a plan that leaves it out."""
    return (precision == "fp32" and not plan.fp32_alone and bool(slow)
            and all(p in slow for p in plan.precisions if p != "fp32"))


def best_gflops(rows: list[BenchRow]) -> dict[str, float]:
    """The best matmul throughput measured per precision (GFLOP/s): a CPU's reference peak.

    A CPU's matmuls (and training steps) are timed on one thread: on a shared 2-core machine
    a two-thread 256² matmul waits many times its own time whenever the other core is busy
    (benchmarks/RECORDS.md), which no median survives."""
    best: dict[str, float] = {}
    for r in rows:
        if r.kind == "matmul":
            best[r.precision] = max(best.get(r.precision, 0.0),
                                    r.best_throughput or r.throughput)
    return best


# ---- the model-size sweep --------------------------------------------------------------------

def model_sweep(plan: Plan, reference: dict[str, float] | None = None,
                progress=None) -> list[BenchRow]:
    """Each model size × precision through `mplab.train`: samples/s of the steady steps,
    speed-up and peak memory against fp32 at that size, loss change (`versus()`), and MFU."""
    sizes = list(plan.model_sizes)
    batches = [plan.batch_size] * len(sizes)
    if plan.big_model:
        sizes.append(plan.big_model)
        batches.append(plan.big_batch_size)
    with _cpu_threads(plan.device):
        return _sweep_sizes(plan, sizes, batches, reference, progress)


@contextlib.contextmanager
def _cpu_threads(device: str):
    """A CPU's training steps run on one thread, like its matmuls: on a shared 2-core
    machine two-thread steps of the lesson model took tens of times longer when the other core
    was busy (benchmarks/RECORDS.md); one thread never waits for the other, and the ratios are
    the hardware's."""
    before = torch.get_num_threads()
    if device == "cpu":
        torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _sweep_sizes(plan, sizes, batches, reference, progress) -> list[BenchRow]:
    _warm_up(plan)
    rows = []
    for i, ((hidden, layers), batch) in enumerate(zip(sizes, batches)):
        base = None
        slow = [p for p in plan.precisions
                if not runs_fast(p, plan.device) and i >= plan.slow_model_sizes]
        for precision in plan.precisions:
            if precision in slow:
                plan.skipped.append(f"hidden {hidden}/{layers} layers in {precision}: skipped "
                                    f"(no {precision} units here; measured at the smallest size)")
                continue
            if _alone(plan, precision, slow):
                plan.skipped.append(f"hidden {hidden}/{layers} layers in fp32: not timed (no "
                                    "other precision is timed at this size to compare it with)")
                continue
            row, run = train_row(plan, hidden, layers, precision, batch, reference or {})
            if base is None:
                base = (row, run)
            row.speedup_vs_fp32 = row.throughput / base[0].throughput
            if run is not base[1]:
                row.loss_change = run.versus(base[1])["loss_change"]
            else:
                row.loss_change = 0.0
            rows.append(row)
            if progress:
                progress(row)
    return rows


def _warm_up(plan: Plan) -> None:
    """One short run per fast precision first: the first training steps of a process pay for
    kernel setup (the first fp32 steps took many times a steady step's time,
    benchmarks/RECORDS.md)."""
    from mplab.models import lesson_model

    hidden, layers = plan.model_sizes[0]
    for precision in plan.precisions:
        if runs_fast(precision, plan.device):
            _train(plan, lesson_model(**model_shape({"hidden_size": hidden,
                                                      "num_hidden_layers": layers})),
                   precision, 2, plan.batch_size)


def _train(plan: Plan, model, precision: str, steps: int, batch_size: int, on_step=None):
    from mplab.train import TrainWarning, train

    big = plan.big_model is not None and model.config.hidden_size >= plan.big_model[0]
    with warnings.catch_warnings(), tf32(precision == "tf32"):
        warnings.simplefilter("ignore", TrainWarning)  # slow-hardware notes: the bench says it
        # watch=False: the zero count of fp16 runs and the weight snapshots of low-precision
        # ones cost time in the step; off, each precision pays only for its own arithmetic
        return train(model=model, precision=_storage(precision), device=plan.device,
                     steps=steps, batch_size=batch_size, eval_samples=0, warmup_steps=0,
                     lr=1e-4 if big else 1e-3, progress=False, on_step=on_step, watch=False)


def train_row(plan: Plan, hidden: int, layers: int, precision: str, batch_size: int,
              reference: dict[str, float]):
    """(BenchRow, TrainResult) of one size in one precision."""
    from mplab.models import lesson_model

    size = {"hidden_size": hidden, "num_hidden_layers": layers}
    if plan.big_model and (hidden, layers) == plan.big_model:
        size |= {"intermediate_size": 4 * hidden, "max_position_embeddings": 128}
    model = lesson_model(**model_shape(size))
    probe = CpuMemoryProbe(model) if plan.device == "cpu" else None
    run = _train(plan, model, precision, plan.steps, batch_size,
                 on_step=probe.on_step if probe else None)
    seconds = run.steady_step_seconds
    tokens = round(run.tokens_per_s / run.samples_per_s * batch_size) if run.samples_per_s else 0
    flops = training_flops(matmul_parameters(model), tokens, layers, hidden,
                           tokens / batch_size)
    if plan.device == "cuda":
        name = torch.cuda.get_device_name()
        gpu = datasheet_gpu(name)
        peak = datasheet_peak(name, precision) if gpu else None
        ref = (f"{gpu} datasheet {precision} peak" if gpu
               else f"{name} is not in the datasheet table: no MFU")
        memory, kind = run.peak_memory_bytes, run.peak_memory_kind
    else:
        peak, ref = cpu_peak(precision, reference)
        memory, kind = probe.peak_bytes, probe.kind
    utilisation = mfu(flops, seconds, peak)
    if utilisation is not None and utilisation > 1:  # the reference was no peak after all
        ref = (f"no MFU: the step ran its matmuls faster than the reference ({ref}), so that "
               "is not this device's peak")
        utilisation = None
    row = BenchRow(f"train hidden {hidden}, {layers} layer{'s' * (layers > 1)}", "model", precision,
                   batch_size / seconds, "samples/s", 1.0, memory, kind,
                   mfu=utilisation, mfu_reference=ref, hidden=hidden,
                   layers=layers, parameters=run.parameters, step_seconds=seconds,
                   batch_size=batch_size, flops_per_step=flops,
                   matmuls_ran_in=str(run.compute_dtype).removeprefix("torch."),
                   has_units=_units(precision, plan.device))
    return row, run


def cpu_peak(precision: str, reference: dict[str, float]) -> tuple[float | None, str]:
    """(FLOP/s, what it is) a CPU's utilisation is measured against: the best matmul
    measured here in `precision` (one thread); without units for it, fp32's, for then fp32 is
    the fastest this CPU computes and `precision` only converts to it and back."""
    units = _units(precision, "cpu")
    against = precision if units else "fp32"
    gflops = reference.get(against)
    if not gflops:
        return None, f"no {against} matmul measured here: no MFU"
    said = "" if units else f"; no {precision} units here: fp32 is this CPU's peak"
    return gflops * 1e9, (f"the fastest {against} matmul run measured here (one thread; the "
                          f"table's rows give each size's median), {gflops:.0f} GFLOP/s{said}")


class CpuMemoryProbe:
    """The peak bytes of tensors alive during a CPU run's first step: the model's parameters
    and buffers, plus the most that the step's own allocations (tensors, activations, the
    optimizer states, autocast's weight copies) held at once, as torch's profiler counts them.

    A CPU has no `max_memory_allocated`, and the process's peak RSS (what `TrainResult` reports
    on a CPU) only grows over a process, so it cannot compare two runs made one after the
    other. Only the first (warm-up) step is profiled: the steady steps are timed unprofiled."""

    kind = "tensors alive at the peak of the first step (torch.profiler)"

    def __init__(self, model):
        from torch.profiler import ProfilerActivity, profile

        self.resident = sum(t.numel() * t.element_size()
                            for t in (*model.parameters(), *model.buffers()))
        self.peak_bytes = self.resident
        self._profile = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        with _quiet_stderr():
            self._profile.start()

    def on_step(self, step: int, result) -> None:
        if step == 1:
            with _quiet_stderr():
                self._profile.stop()
            self.peak_bytes = self.resident + peak_live_bytes(memory_changes(self._profile))


def memory_changes(profile) -> list[tuple[int, int]]:
    """(time in ns, bytes allocated (+) or freed (-)) of each allocation a finished
    `torch.profiler.profile(profile_memory=True)` recorded.

    Read off the profiler's raw "[memory]" records, not off `profile.events()`: there every op
    carries the allocations made inside it, so an allocation counts once per op it is nested
    in (a training step of the 512/4 model added up to 774 MiB instead of 107), and building
    those events took most of a bench row's time (benchmarks/RECORDS.md)."""
    return [(e.start_ns(), e.nbytes()) for e in profile.profiler.kineto_results.events()
            if e.name() == "[memory]"]


@contextlib.contextmanager
def _quiet_stderr():
    """Kineto (torch >= 2.12) writes "USDT: profiler_start / profiler_stop" straight to file
    descriptor 2 at every start and stop, whatever KINETO_LOG_LEVEL says: silence just those."""
    import os
    import sys

    sys.stderr.flush()
    saved = os.dup(2)
    with open(os.devnull, "w") as null:
        os.dup2(null.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def peak_live_bytes(changes) -> int:
    """The highest running total of (time, bytes) allocations (+) and frees (-) in time order.

    Only frees of blocks this profile saw allocated count (matched by size): the profiler
    also reports frees of blocks allocated under an earlier profiler (another run's), which
    are not the step's memory; none of a block allocated before any profiler ran."""
    live = peak = 0
    allocated: dict[int, int] = {}  # size -> blocks of it allocated and not yet freed
    for _, change in sorted(changes, key=lambda pair: pair[0]):
        if change < 0:
            if not allocated.get(-change):
                continue  # not allocated during this profile
            allocated[-change] -= 1
        elif change:
            allocated[change] = allocated.get(change, 0) + 1
        live += change
        peak = max(peak, live)
    return peak
