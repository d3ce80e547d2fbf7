"""Why did my run break? `mplab.diagnose(result)` names the likely cause and the fix.

    diagnose(train(precision="fp16", steps=50))   # a TrainResult from mplab.train
    diagnose(recorder.finish())                   # your own loop (mplab.train.Recorder)
    diagnose("run.json")                          # what `python -m mplab.train --json` wrote
    diagnose(err)                                 # a NonFiniteLossError: the run it stopped;
                                                  # any other error a run raised: its cause

A run a library trains is recorded by one line, and diagnosed as a loop of your own is:
`Trainer(..., callbacks=[watch := Watch()])` (Hugging Face), `lightning.Trainer(...,
callbacks=[watch := LightningWatch()])`, `watch = watch_accelerator(accelerator)` after
`accelerator.prepare`; then `watch.diagnose()`.

It reads only the record: the losses, the scale after each step, the steps the optimizer
skipped, the gradient norms, what the hooks saw (gradient entries that were 0, low-precision
weights a step left unchanged, the scaler's calls per iteration), the device's units and the
audit (which dtypes really ran). Each `Finding` says the cause, the evidence in the run's own
numbers, and the fix. The checks run in order of harm; a run with none is reported healthy.

What other modules tell it comes as codes, never as their sentences: the audit's fallback
codes (`mplab.amp.audit.FALLBACKS`), `TrainResult.stop_reason`, `TrainResult.path` (`OWN_LOOP`),
a bench row's `has_units`. Each check declares the causes it can name (`@emits`); `CAUSES`
is the one list of them, and `mplab.diagnosis.lab` reproduces each one a training run can show.
"""

from __future__ import annotations

import json
from pathlib import Path

from mplab.train.errors import NonFiniteLossError
from mplab.train.result import TrainResult

from .benches import BENCH_CHECKS, diagnose_bench
from .crashes import CRASH_CHECKS, diagnose_crash
from .findings import CAUSES, SEVERITIES, Diagnosis, Finding, emits
from .runs import RUN_CHECKS, diagnose_run

# lab (the failure lab) is imported on first use: it trains; the watches too: each imports
# its library (transformers, lightning, accelerate)
__all__ = ["diagnose", "Diagnosis", "Finding", "CAUSES", "SEVERITIES", "emits", "RUN_CHECKS",
           "BENCH_CHECKS", "CRASH_CHECKS", "lab", "Watch", "LightningWatch", "watch_accelerator"]


def __getattr__(name: str):
    if name == "Watch":
        from .attach import Watch

        return Watch
    if name == "LightningWatch":
        from .attach_lightning import LightningWatch

        return LightningWatch
    if name == "watch_accelerator":
        from .attach_accelerate import watch_accelerator

        return watch_accelerator
    raise AttributeError(f"module 'mplab.diagnosis' has no attribute {name!r}")


def diagnose(result) -> Diagnosis:
    """Diagnose a run: a `TrainResult`, its `as_dict()`, a JSON file of one (a path), the
    `NonFiniteLossError` that stopped it, or any other error a run raised (its cause, from the
    error and where it was raised). A benchmark record (`python -m mplab.bench --json`,
    `bench.lesson_bench()`) is read too: will low precision help on that machine, and why not."""
    if isinstance(result, BaseException) and not isinstance(result, NonFiniteLossError):
        return diagnose_crash(result)
    result = _load(result)
    return diagnose_bench(result) if isinstance(result, dict) else diagnose_run(result)


# ---- reading the record ---------------------------------------------------------------------

def _load(result) -> TrainResult:
    if isinstance(result, NonFiniteLossError):
        return result.result
    if isinstance(result, TrainResult):
        return result
    if isinstance(result, (str, Path)):
        path = Path(result).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"diagnose({str(result)!r}): no such file; give a "
                                    "TrainResult or the JSON file `--json` wrote")
        try:
            result = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise ValueError(f"{str(path)!r} is not JSON ({err}): a record cut short while "
                             "it was written? Record the run again") from err
    if isinstance(result, dict):
        if "rows" in result and "losses" not in result:
            if not isinstance(result.get("crossover"), list):
                raise ValueError("a bench record needs its 'crossover' list, as "
                                 "`python -m mplab.bench --json` writes it")
            return result
        if "losses" not in result:
            raise ValueError(f"not a training record: no 'losses' among its keys "
                             f"{sorted(result)[:8]}")
        return TrainResult.from_dict(result)
    raise TypeError(f"diagnose() reads a TrainResult, its as_dict(), a JSON file's path, a "
                    f"bench record or the error a run raised; got {type(result).__name__}")

