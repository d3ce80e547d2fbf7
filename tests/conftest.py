"""What the tests share: every lesson's exercises (found, not listed), a fresh learner
session, cells run as Jupyter runs them, the assertion that feedback explains, and the kind of
machine a hardware-dependent test runs as (the `machine` fixture), and a launcher that
reports a hung multi-process job with its stacks."""

import ast
import dataclasses
import functools
import importlib
import importlib.util
import os
import pkgutil
import re
import shlex
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

if os.environ.get("PYTEST_XDIST_WORKER"):
    # Two workers share the cores: one torch thread each, and in the kernels and tools they
    # start. The lesson models are small: a second thread gains them almost nothing, and
    # four threads spinning on two cores cost a lot.
    os.environ["OMP_NUM_THREADS"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

import mplab.exercises  # noqa: E402

if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)  # as OMP_NUM_THREADS says, should torch have started before it


class optional:  # noqa: N801 (used as a module: `nbformat = optional("nbformat")`)
    """A package the lessons or the grader need but mplab's library and GPU checks do not
    (ipywidgets, nbformat, nbclient, torchao, datasets, ...): the module itself where it is
    installed; elsewhere a stand-in whose first use skips the test using it, naming the
    package (a module that uses it at import is skipped whole)."""

    def __new__(cls, name: str):
        try:
            return importlib.import_module(name)
        except ImportError:
            return super().__new__(cls)

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attribute):
        pytest.skip(f"needs {self._name}, which is not installed", allow_module_level=True)


#: The packages the lessons, the grader and lesson 9's comparisons need, and mplab's library
#: and GPU checks do not (pyproject's extras): the ones the GPU image lacks, as
#: benchmarks/gpu_image.txt lists them.
OPTIONAL = next(line.split(":", 1)[1].split() for line in
                (Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_image.txt")
                .read_text().splitlines() if line.startswith("# absent:"))


def _missing_optional(error) -> str | None:
    """The optional package whose absence raised `error` (or an error it came from), if any."""
    while error is not None:
        if isinstance(error, ModuleNotFoundError) and error.name and \
                error.name.split(".")[0] in OPTIONAL:
            return error.name.split(".")[0]
        error = error.__cause__ or error.__context__
    return None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A test that reaches for an optional package that is not installed is skipped, naming it:
    on the pins every one is installed, so nothing is skipped there."""
    outcome = yield
    report = outcome.get_result()
    if report.failed and call.excinfo is not None:
        missing = _missing_optional(call.excinfo.value)
        if missing:
            report.outcome = "skipped"
            report.longrepr = (str(item.path), item.location[1] or 0,
                               f"Skipped: needs {missing}, which is not installed")


#: The exercises whose checks compare with an optional package (lesson 9's with torchao).
EXERCISE_NEEDS = {"9.1": "torchao", "9.4": "torchao"}


def checkable(xid: str) -> bool:
    """Can exercise `xid` be checked here (the package its check compares with installed)?"""
    return xid not in EXERCISE_NEEDS or importlib.util.find_spec(EXERCISE_NEEDS[xid]) is not None


def skip_unless_checkable(xid: str) -> None:
    if not checkable(xid):
        pytest.skip(f"exercise {xid}'s check compares with {EXERCISE_NEEDS[xid]}, which is not "
                    "installed")


@functools.cache
def lessons() -> list:
    """Every lesson module, mplab/exercises/lesson*.py, in lesson order."""
    names = [m.name for m in pkgutil.iter_modules(mplab.exercises.__path__)
             if re.fullmatch(r"lesson\d+", m.name)]
    return [importlib.import_module(f"mplab.exercises.{name}")
            for name in sorted(names, key=lambda name: int(name.removeprefix("lesson")))]


def exercise_ids() -> list[str]:
    """Every exercise id of every lesson, in order."""
    return [xid for lesson in lessons() for xid in lesson.EXERCISES]


def lesson_of(xid: str):
    """The lesson module an exercise id ("3.2") belongs to."""
    return importlib.import_module(f"mplab.exercises.lesson{xid.split('.')[0]}")


@pytest.fixture(autouse=True)
def fresh_session(monkeypatch):
    """Not grading, no grade log, and no hint stages or reveals left over from another test."""
    monkeypatch.delenv("MPLAB_GRADING", raising=False)
    monkeypatch.delenv("MPLAB_GRADE_LOG", raising=False)
    for name, module in list(sys.modules.items()):
        if name.startswith("mplab.exercises.lesson") and hasattr(module, "LESSON"):
            module.LESSON.reset()


def notebook_names(xid: str) -> dict:
    """What the earlier cells of an exercise's notebook define that its cells use: `ex`, the
    lesson module, in lesson 2 the capture `cap`, in lesson 6 TrainingArguments."""
    names = {"ex": lesson_of(xid)}
    if xid.startswith("2."):
        from mplab import fixtures  # the notebook's cap = fixtures.lesson_capture() (cached)

        names["cap"] = fixtures.lesson_capture()
    if xid.startswith("6."):
        from transformers import TrainingArguments  # lesson 6's setup imports it; 6.1 uses it

        names["TrainingArguments"] = TrainingArguments
    if xid.startswith("7."):
        from mplab import hardware  # lesson 7 imports it for the benchmark's header

        names["hardware"] = hardware
    if xid.startswith("8."):
        from torch.distributed.fsdp import MixedPrecisionPolicy  # lesson 8's setup imports it

        names["MixedPrecisionPolicy"] = MixedPrecisionPolicy
        names["parameters"] = lesson_of(xid)._lesson_parameters()  # printed before 8.4
    if xid.startswith("9."):
        from mplab import lowbit  # lesson 9's setup imports it; 9.2 uses it

        ex = lesson_of(xid)
        names.update(lowbit=lowbit, mx_block=ex.block_9_1(), spiky=ex.x_9_2(),
                     amaxes=list(ex.AMAX_9_3))
    return names


def run_cell(source: str, **names):
    """Run a notebook cell the way Jupyter does; returns (the last expression's value, the
    namespace). `names` are what earlier cells defined (ex, cap, ...)."""
    import math

    import torch

    tree = ast.parse(source)
    last = tree.body.pop()
    namespace = {"math": math, "torch": torch, **names}
    exec(compile(tree, "<cell>", "exec"), namespace)
    return eval(compile(ast.Expression(last.value), "<cell>", "eval"), namespace), namespace


def feedback(xid: str, answer) -> str:
    """What a fresh check of `answer` says, asserting it did not pass (failed, or an error)."""
    ex = lesson_of(xid)
    ex.LESSON.reset()
    result = ex.check(xid, answer)
    assert result.status in ("failed", "error"), result
    return result.message


def failed_saying(result, *words, hiding=()):
    """Assert a check failed (0 points), its feedback mentions each of `words` (the concept
    missed), gives away none of `hiding` (the answer) and shows no traceback."""
    assert result.status == "failed" and result.points == 0, result
    for w in words:
        assert w.lower() in result.message.lower(), result.message
    for text in hiding:
        assert text not in result.message, f"the feedback gives away {text!r}: {result.message}"
    assert "Traceback" not in result.message
    return result.message


@pytest.fixture
def graded_apart(tmp_path, monkeypatch):
    """grade(xid, answer): the answer checked as a grading kernel checks it (logging its record:
    the value, or the record of a function's calls), and that record checked again by the
    grader, here, as from another process: (the kernel's Result, the grader's Result)."""
    import json

    def grade(xid: str, answer):
        log = tmp_path / f"grade-{xid}.jsonl"
        monkeypatch.setenv("MPLAB_GRADE_LOG", str(log))
        monkeypatch.setenv("MPLAB_GRADING", "1")
        lesson = lesson_of(xid)
        kernel = lesson.check(xid, answer)
        monkeypatch.delenv("MPLAB_GRADE_LOG")
        record = json.loads(log.read_text().splitlines()[-1])
        function = "function" in record
        data = json.loads(json.dumps(record["function" if function else "answer"]))
        return kernel, lesson.LESSON.regrade(xid, data, function=function)

    return grade


#: The shared run's length: 400 steps (about 3 epochs) reach 0.86 accuracy, 300 only 0.78.
COURSE_STEPS = 400


@pytest.fixture(scope="session")
def course_run():
    """The lesson model trained 400 fp32 steps through mplab.train with the course's exact
    call, `model(input_ids, labels=labels)` (no mask) on length-grouped batches: the one long
    run the suite shares (its time: benchmarks/RECORDS.md). (result, trained model)."""
    from mplab import models
    from mplab.train import train

    model = models.lesson_model(seed=0)
    result = train(model=model, steps=COURSE_STEPS, attention_mask=False, by_length=True,
                   progress=False, device="cpu")
    print(f"\n{COURSE_STEPS} fp32 steps, no attention mask: {result.train_seconds:.1f} s training "
          f"({result.seconds:.1f} s in all), accuracy {result.eval_accuracy:.3f}")
    return result, model


# ---- the machine a test runs as ---------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Machine:
    """A kind of machine the suite runs as: its name, the device "auto" picks there, and
    whether its CPU has bf16 and fp16 units (what `hardware.cpu_features()` reports)."""

    kind: str
    device: str
    cpu_bf16: bool
    cpu_fp16: bool

    def units(self, precision: str) -> bool:
        """Does the device compute `precision` at full speed (a GPU: always)?"""
        if precision == "fp32" or self.device == "cuda":
            return True
        return {"bf16": self.cpu_bf16, "fp16": self.cpu_fp16}[precision]


def machine_kinds() -> list[str]:
    """Every CPU kind mplab meets (`hardware.CPU_KINDS`), and CUDA where there is a GPU."""
    import torch

    from mplab import hardware

    return list(hardware.CPU_KINDS) + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(params=machine_kinds())
def machine(request, monkeypatch) -> Machine:
    """Run a test whose expectation depends on the hardware as on each kind of machine: the
    CPU kinds through MPLAB_CPU_FEATURES (subprocesses inherit it) with "auto" kept on the
    CPU, and a real GPU where there is one (its host CPU as it is). The logic is checked on
    every kind, even where the speed cannot be: the arithmetic runs on this machine's units."""
    import torch

    from mplab import hardware

    kind = request.param
    if kind != "cuda":
        monkeypatch.setenv(hardware.CPU_FEATURES_ENV, kind)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    return Machine(kind, hardware.resolve_device("auto").type, hardware.has_units("bf16"),
                   hardware.has_units("fp16"))


def launch(command: list[str], *, timeout: float, **kwargs) -> subprocess.CompletedProcess:
    """Run a command that starts training processes (torchrun, accelerate launch), capturing
    its output as text.

    A job that hangs is not left to the test's timeout: every Python process it started
    prints its stack (faulthandler, on SIGABRT) and the command runs once more, with the
    stacks kept as a warning for whoever reads the log (a torchrun job of the Trainer path hung
    once in CI, printing nothing, where 20 reruns on a like machine did not); a second hang
    fails, with the stacks.
    """
    env = {**kwargs.pop("env", os.environ), "PYTHONFAULTHANDLER": "1"}
    for attempt in (1, 2):
        job = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, env=env, start_new_session=True, **kwargs)
        try:
            out, err = job.communicate(timeout=timeout)
            return subprocess.CompletedProcess(command, job.returncode, out, err)
        except subprocess.TimeoutExpired:
            os.killpg(job.pid, signal.SIGABRT)  # each process prints where it waits
            time.sleep(3)
            os.killpg(job.pid, signal.SIGKILL)
            out, err = job.communicate()
            stacks = f"{shlex.join(command)} hung past {timeout:g} s; its stacks:\n{err[-6000:]}"
            if attempt == 2:
                pytest.fail(stacks)
            warnings.warn(stacks, stacklevel=2)
