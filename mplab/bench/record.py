"""One bench run as a record: measure, explain, record. `python -m mplab.bench` prints it and
`--json` writes it; `lesson_bench` returns it to lesson 7; data/reference/ keeps one per
measured machine.

    record = lesson_bench()     # {"device", "rows": [...], "crossover", "targets", "meta", ...}
    record = run_plan(Plan.preset("cpu", quick=True))

The record is plain JSON data (an unmeasurable figure, such as an infinite speed-up, is None):
`json.loads(json.dumps(record)) == record`.
"""

from __future__ import annotations

import datetime
import math
import platform
import re
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

import torch

from mplab._display import Table
from mplab.hardware import describe

from .peaks import datasheet_gpu
from .sweep import BenchRow, Plan, best_gflops, matmul_sweep, model_sweep
from .why import crossover, explain_row, targets

__all__ = ["lesson_bench", "run_plan", "measure", "explain", "record", "meta", "cli_command",
           "finite", "machine_name", "record_table"]

_REPO = Path(__file__).resolve().parents[2]


def lesson_bench(device: str = "auto", progress=None, *, tiny: bool = False) -> dict:
    """Lesson 7's bench: the record `python -m mplab.bench --json` writes, for a plan short
    enough for a lesson: 255² and 256² matmuls (one a multiple of 8, one not) and a 512² one,
    then the lesson transformer at hidden 128/2 layers, 256/4 and 512/4 through `mplab.train`,
    fp32 against bf16 (and fp16 where it is cheap; tf32 on a GPU): seconds on a CPU, much of
    the first call importing transformers (benchmarks/RECORDS.md).

    `progress(row)` is called with each `BenchRow` as it is measured; `tiny` runs the tests'
    sizes (seconds)."""
    plan = Plan.for_device(device, tiny=tiny, lesson=True)
    call = f"mplab.bench.lesson_bench(device={device!r}{', tiny=True' if tiny else ''})"
    return run_plan(plan, progress, command=call)


def run_plan(plan: Plan, progress=None, *, command: str | None = None) -> dict:
    """Measure what `plan` says, explain every row, and return the record: {"device",
    "device_type", "torch", "quick", "preset", "seconds", "rows", "crossover", "targets",
    "skipped", "meta"}. `command` is what the record says produced it (meta["command"])."""
    started = time.perf_counter()
    rows = measure(plan, progress)
    explain(rows, plan.device)
    return record(plan, rows, time.perf_counter() - started, command)


def measure(plan: Plan, progress=None) -> list[BenchRow]:
    """The matmul sweep, then the model sweep, whose CPU utilisation is against the best
    matmul measured in the first."""
    matmuls = matmul_sweep(plan, progress)
    return matmuls + model_sweep(plan, best_gflops(matmuls), progress)


def explain(rows: list[BenchRow], device_type: str) -> None:
    """Fill each row's `explanation` (`why.explain_row`)."""
    for row in rows:
        row.explanation = explain_row(row, rows, device_type)


def record(plan: Plan, rows: list[BenchRow], seconds: float, command: str | None) -> dict:
    """The measured rows with their crossover, targets, skip notes and `meta`, as JSON data."""
    models = {r.precision for r in rows if r.kind == "model"}
    found = [crossover(rows, p, plan.device) for p in plan.precisions
             if p != "fp32" and p in models]
    return finite({"device": describe(plan.device), "device_type": plan.device,
                   "torch": torch.__version__, "quick": plan.name == "quick",
                   "preset": plan.name, "seconds": seconds,
                   "rows": [r.as_dict() for r in rows], "crossover": found,
                   "targets": targets(rows, plan.device), "skipped": list(plan.skipped),
                   "meta": meta(plan, command)})


def meta(plan: Plan, command: str | None = None) -> dict:
    """Where, when and with what a record was measured: what a reference file must say."""
    gpu = torch.cuda.get_device_name() if plan.device == "cuda" else None
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "device": describe(plan.device),
            "gpu": gpu,
            "datasheet_gpu": datasheet_gpu(gpu) if gpu else None,
            "cuda": torch.version.cuda if gpu else None,
            "host": describe("cpu"),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": _version("transformers"),
            "accelerate": _version("accelerate"),
            "mplab_commit": _commit(),
            "preset": plan.name,
            "quick": plan.name == "quick",
            "steps": plan.steps,
            "batch_size": plan.batch_size,
            "command": command or " ".join(["python", *sys.argv])}


def cli_command(argv: list[str]) -> str:
    """The command line a CLI run records: `python -m mplab.bench --quick ...`."""
    import shlex

    return " ".join(["python -m mplab.bench", *map(shlex.quote, argv)])


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _commit() -> str | None:
    """mplab's git commit (with "-dirty" if the tree has changes), or None outside a checkout."""
    try:
        done = subprocess.run(["git", "-C", str(_REPO), "describe", "--always", "--dirty",
                               "--abbrev=12"], capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() or None if done.returncode == 0 else None


def finite(value):
    """JSON has no inf/NaN: they become None (null)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite(v) for v in value]
    return value


# What describe() says of a CPU's units, at the end of the line a bench record stores.
_UNITS_SAID = re.compile(r"; bf16 units: \w+, fp16 units: \w+\)$")


def machine_name(device="auto") -> str:
    """The device as `mplab.hardware.describe` names it, without what it says of the CPU's
    low-precision units ("cpu: AMD EPYC (2 threads)"): lesson 7 asks a learner to find those
    (`hardware.cpu_features()`), so its bench's header does not print them. A bench record's
    "device" (describe()'s whole line, as it was written) may be given instead of a device."""
    if device in ("auto", "cpu", "cuda"):
        return describe(device, units=False)
    return _UNITS_SAID.sub(")", str(device))


def record_table(record: dict) -> Table:
    """A record's rows as the CLI prints them: throughput, speed-up, peak memory, MFU and
    the loss against fp32, one row per workload and precision."""
    def number(value, fmt):
        return "-" if value is None else format(value, fmt)

    return Table([{"workload": r["workload"], "precision": r["precision"],
                   "throughput": f"{number(r['throughput'], '.1f')} {r['unit']}",
                   "vs fp32": number(r["speedup_vs_fp32"], ".2f") + "×",
                   "peak memory": f"{r['peak_memory_bytes'] / 2**20:.1f} MiB",
                   "MFU": number(r["mfu"], ".0%"),
                   "loss vs fp32": number(r["loss_change"], "+.2%")} for r in record["rows"]],
                 title=f"mixed precision on {machine_name(record['device'])}")
