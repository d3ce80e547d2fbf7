"""Several processes from a notebook (lesson 8): start them with torchrun, run a function in
each, and read back what rank 0 returned.

    from mplab.train.launch import train_across
    fsdp, ddp = train_across(2, dict(path="fsdp", precision="bf16", steps=20),
                                dict(path="torch", precision="bf16", steps=20))

`run_across(nproc, "module:function", jobs)` is the general form: every process calls
`function(**job)` for each job in turn, in one process group, so the processes start (and
import torch) once for all the jobs. A job given as a pair `("module:other", kwargs)` calls
that function instead, so one start serves a lesson's different runs. It is
`sys.executable -m torch.distributed.run --standalone --nproc_per_node N -m mplab.train.launch
IN OUT`, the same command a terminal runs. A job that raises on rank 0 comes back as
`{"error": type, "message": text}`, as raised, and the next job runs; a TrainResult comes back
as one. `start_across` is the same without waiting: it returns a `Launch` whose `results()`
waits, so a notebook goes on while the processes import and train.
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import traceback
import uuid
from pathlib import Path

from .result import TrainResult

__all__ = ["Launch", "start_across", "run_across", "train_across"]


class Launch:
    """Processes started by `start_across`, running; `results()` waits for them and returns
    rank 0's results (JSON data; a TrainResult as a TrainResult)."""

    def __init__(self, nproc: int, calls: list, timeout: float):
        self.nproc, self.timeout = nproc, timeout
        self.functions = sorted({function for function, _ in calls})
        self._folder = tempfile.TemporaryDirectory(prefix="mplab-launch-")
        given = Path(self._folder.name, "jobs.json")
        self._back = Path(self._folder.name, "results.json")
        given.write_text(json.dumps(calls))
        command = [sys.executable, "-m", "mplab.train.launch", "--nproc", str(nproc),
                   str(given), str(self._back)]
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        # to a file, not a pipe: nobody reads a pipe while the notebook goes on, and a full
        # one would stop the processes
        self._log = open(Path(self._folder.name, "output.txt"), "w+")
        self._process = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT,
                                         env=env, start_new_session=True)
        self._results: list | None = None
        self._error: Exception | None = None

    @property
    def running(self) -> bool:
        return self._results is None and self._process.poll() is None

    def results(self) -> list:
        """Wait (at most `timeout` seconds from this call) and return the results."""
        if self._error is not None:
            raise self._error
        if self._results is None:
            try:
                self._process.wait(timeout=self.timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self._process.pid, signal.SIGKILL)  # torchrun and every rank
                self._process.wait()
                self._close()
                self._error = TimeoutError(
                    f"{self.nproc} processes running {', '.join(self.functions)} did not "
                    f"finish in {self.timeout:g} s")
                raise self._error from None
            try:
                self._log.seek(0)
                output = self._log.read()
                if self._process.returncode != 0 or not self._back.is_file():
                    tail = "\n".join(output.strip().splitlines()[-15:])
                    self._error = RuntimeError(f"{self.nproc} processes running "
                                               f"{', '.join(self.functions)} failed (exit "
                                               f"{self._process.returncode}):\n{tail}")
                    raise self._error
                self._results = [TrainResult.from_dict(r["train_result"])
                                 if isinstance(r, dict) and "train_result" in r else r
                                 for r in json.loads(self._back.read_text())]
            finally:
                self._close()
        return self._results

    def _close(self) -> None:
        self._log.close()
        self._folder.cleanup()


def start_across(nproc: int, function: str | None, jobs: list, *,
                 timeout: float = 600) -> Launch:
    """Start `nproc` processes that call `function(**job)` for each job (or a
    `(function, job)` pair's own function) and return at once; `.results()` waits."""
    if isinstance(nproc, bool) or not isinstance(nproc, int) or not 1 <= nproc <= 16:
        raise ValueError(f"nproc must be an integer from 1 to 16 (processes on this machine), "
                         f"got {nproc!r}")
    return Launch(nproc, [_call(function, job) for job in jobs], timeout)


def run_across(nproc: int, function: str | None, jobs: list, *,
               timeout: float = 600) -> list:
    """Start `nproc` processes, call `function(**job)` in every one of them for each job (or a
    pair's own function), and return rank 0's results (JSON data; a TrainResult as one)."""
    return start_across(nproc, function, jobs, timeout=timeout).results()


def _call(function: str, job) -> list:
    """A job as [function, kwargs]: a dict runs `function`, a (function, dict) pair its own."""
    if isinstance(job, tuple | list) and len(job) == 2:
        function, job = job
    if not isinstance(function, str) or ":" not in function:
        raise ValueError(f"function must be 'module:name', got {function!r}")
    if not isinstance(job, dict):
        raise ValueError(f"each job must be a dict of keyword arguments or a "
                         f"('module:name', dict) pair, got {job!r:.80}")
    return [function, job]


def train_across(nproc: int, *configs: dict, timeout: float = 600) -> list[TrainResult]:
    """`mplab.train.train(**config)` for each config, in `nproc` processes (torchrun): each
    process trains its share of every global batch; rank 0's TrainResults come back. A config
    that raised comes back as its error, a dict."""
    jobs = [{"progress": False, **config} for config in configs]
    return run_across(nproc, "mplab.train:train", jobs, timeout=timeout)


def _worker(given: str, back: str) -> int:
    calls = json.loads(Path(given).read_text())
    import torch.distributed as dist

    # One group for every job: a group destroyed and joined again under torchrun's store waits
    # forever. gloo for CPU tensors, NCCL for CUDA ones.
    dist.init_process_group()
    rank = dist.get_rank()
    results = []
    for function, job in calls:
        module, _, name = function.partition(":")
        try:
            value = getattr(importlib.import_module(module), name)(**job)
        except Exception as err:  # shown to the learner as raised, and the next job runs
            value = {"error": type(err).__name__, "message": str(err),
                     "traceback": traceback.format_exc(limit=3)}
        results.append({"train_result": value.as_dict()} if isinstance(value, TrainResult)
                       else value)
    if rank == 0:
        Path(back).write_text(json.dumps(results))
    dist.destroy_process_group()
    return 0


def _start(nproc: int, given: str, back: str) -> int:
    """torchrun's own launcher (`elastic_launch`, what `torch.distributed.run --standalone`
    calls) with its ranks forked from this process once it has imported what the jobs need:
    every rank of a `python -m torch.distributed.run` imports torch and transformers itself,
    which on a 2-core machine cost a lesson most of its time (benchmarks/RECORDS.md). Nothing
    here runs a torch op before the fork, so no thread (nor CUDA) is forked with it."""
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from mplab import models

    for function, _ in json.loads(Path(given).read_text()):
        try:
            importlib.import_module(function.partition(":")[0])
        except ImportError:
            pass  # the job's rank says so, as raised
    models.model_classes()
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc,
                          run_id=str(uuid.uuid4()), rdzv_backend="c10d",
                          rdzv_endpoint="localhost:0", max_restarts=0, start_method="fork")
    elastic_launch(config, _worker)(given, back)
    return 0


if __name__ == "__main__":
    # under torchrun: one rank; with --nproc N: start N ranks
    if sys.argv[1] == "--nproc":
        sys.exit(_start(int(sys.argv[2]), *sys.argv[3:5]))
    sys.exit(_worker(*sys.argv[1:3]))
