"""Several processes from a notebook (lesson 8): start them with torchrun, run a function in
each, and read back what rank 0 returned.

    from mplab.train.launch import train_across
    fsdp, ddp = train_across(2, dict(path="fsdp", precision="bf16", steps=20),
                                dict(path="torch", precision="bf16", steps=20))

`run_across(nproc, "module:function", jobs)` is the general form: every process calls
`function(**job)` for each job in turn, in one process group, so the processes start (and
import torch) once for all the jobs. It is `sys.executable -m torch.distributed.run
--standalone --nproc_per_node N -m mplab.train.launch IN OUT`, the same command a terminal runs.
A job that raises on rank 0 comes back as `{"error": type, "message": text}`, as raised, and
the next job runs; a TrainResult comes back as one.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

from .result import TrainResult


def run_across(nproc: int, function: str, jobs: list[dict], *, timeout: float = 600) -> list:
    """Start `nproc` processes, call `function(**job)` in every one of them for each job, and
    return rank 0's results (JSON data; a TrainResult as a TrainResult)."""
    if isinstance(nproc, bool) or not isinstance(nproc, int) or not 1 <= nproc <= 16:
        raise ValueError(f"nproc must be an integer from 1 to 16 (processes on this machine), "
                         f"got {nproc!r}")
    if not isinstance(function, str) or ":" not in function:
        raise ValueError(f"function must be 'module:name', got {function!r}")
    if not all(isinstance(job, dict) for job in jobs):
        raise ValueError("each job must be a dict of keyword arguments")
    with tempfile.TemporaryDirectory(prefix="mplab-launch-") as folder:
        given, back = Path(folder, "jobs.json"), Path(folder, "results.json")
        given.write_text(json.dumps({"function": function, "jobs": list(jobs)}))
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   f"--nproc_per_node={nproc}", "-m", "mplab.train.launch", str(given),
                   str(back)]
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
        if done.returncode != 0 or not back.is_file():
            tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-15:])
            raise RuntimeError(f"{nproc} processes running {function} failed (exit "
                               f"{done.returncode}):\n{tail}")
        results = json.loads(back.read_text())
    return [TrainResult.from_dict(r["train_result"]) if isinstance(r, dict)
            and "train_result" in r else r for r in results]


def train_across(nproc: int, *configs: dict, timeout: float = 600) -> list[TrainResult]:
    """`mplab.train.train(**config)` for each config, in `nproc` processes (torchrun): each
    process trains its share of every global batch; rank 0's TrainResults come back. A config
    that raised comes back as its error, a dict."""
    jobs = [{"progress": False, **config} for config in configs]
    return run_across(nproc, "mplab.train:train", jobs, timeout=timeout)


def _worker(given: str, back: str) -> int:
    spec = json.loads(Path(given).read_text())
    module, _, name = spec["function"].partition(":")
    function = getattr(importlib.import_module(module), name)
    import torch.distributed as dist

    # One group for every job: a group destroyed and joined again under torchrun's store waits
    # forever. gloo for CPU tensors, NCCL for CUDA ones.
    dist.init_process_group()
    rank = dist.get_rank()
    results = []
    for job in spec["jobs"]:
        try:
            value = function(**job)
        except Exception as err:  # shown to the learner as raised, and the next job runs
            value = {"error": type(err).__name__, "message": str(err),
                     "traceback": traceback.format_exc(limit=3)}
        results.append({"train_result": value.as_dict()} if isinstance(value, TrainResult)
                       else value)
    if rank == 0:
        Path(back).write_text(json.dumps(results))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(_worker(*sys.argv[1:3]))
