"""Every training command the README shows runs as written: each `python -m mplab.train`,
`torchrun` and `accelerate launch` line of its bash blocks, shortened only by `--steps`
(argparse keeps the last), evaluation on; and trains as one process does on the same global
batch. Tools start as `sys.executable -m ...`."""

import json
import os
import re
import shlex
import sys
import warnings
from pathlib import Path

import pytest
from conftest import launch

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
LAUNCHERS = {"python": [sys.executable],
             "torchrun": [sys.executable, "-m", "torch.distributed.run"],
             "accelerate": [sys.executable, "-m", "accelerate.commands.launch"]}


def bash_lines(text: str) -> list[str]:
    """The command lines of the README's ```bash blocks."""
    blocks = re.findall(r"```bash\n(.*?)```", text, flags=re.S)
    return [line.strip() for block in blocks for line in block.splitlines() if line.strip()]


def training_commands(text: str) -> list[str]:
    return [line for line in bash_lines(text)
            if re.match(r"(python -m mplab\.train|torchrun|accelerate launch)\b", line)]


COMMANDS = training_commands(README)


def test_the_readme_shows_each_way_to_launch_training():
    starts = {shlex.split(c)[0] for c in COMMANDS}
    assert starts == {"python", "torchrun", "accelerate"}, COMMANDS
    assert any("--path trainer" in c for c in COMMANDS)
    assert any("--path accelerate" in c for c in COMMANDS)


def as_run(command: str) -> list[str]:
    """The command with its launcher as `sys.executable -m ...`, plus `--steps 3`."""
    words = shlex.split(command)
    launcher, rest = words[0], words[1:]
    if launcher == "accelerate":
        assert rest[0] == "launch", command
        rest = rest[1:]
    return LAUNCHERS[launcher] + rest + ["--steps", "3"]


def processes(words: list[str]) -> int:
    """How many processes a launcher line starts (1 for plain python)."""
    for flag in ("--nproc_per_node", "--num_processes"):
        if flag in words:
            return int(words[words.index(flag) + 1])
    return 1


def one_process_twin(command: str):
    """The same run in this process, on the same global batch: (TrainResult, processes)."""
    from mplab.train import TrainConfig, TrainWarning, train
    from mplab.train.__main__ import parser

    words = shlex.split(command)
    args = vars(parser().parse_args(words[words.index("mplab.train") + 1:] + ["--steps", "3"]))
    args.pop("json")
    n = processes(words)
    config = TrainConfig(**args | {"batch_size": args["batch_size"] * n, "progress": False})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TrainWarning)
        return train(config), n


@pytest.mark.slow  # up to two processes import torch and transformers (benchmarks/RECORDS.md)
@pytest.mark.parametrize("command", COMMANDS)
def test_each_readme_training_command_runs_as_written(command, tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    done = launch(as_run(command), cwd=tmp_path, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.count("mplab.train:") == 1, done.stdout[-2000:]  # rank 0's summary
    summary = done.stdout[done.stdout.index("mplab.train:"):]
    assert re.search(r"steps\s+3 of 3", summary), summary
    assert re.search(r"eval accuracy\s+0\.\d{3}", summary), summary  # it evaluated
    words = shlex.split(command)
    if "--json" in words:
        record = json.loads((tmp_path / words[words.index("--json") + 1]).read_text())
        assert len(record["losses"]) == 3 and record["eval_accuracy"] is not None
    if processes(words) == 1:
        return  # the same process as the twin would be
    twin, n = one_process_twin(command)
    said = re.search(r"global batch\s+(\d+) \((\d+) process", summary)
    assert (int(said[1]), int(said[2])) == (twin.global_batch_size, n), summary
    first, last = map(float, re.search(r"loss first -> last\s+(\S+) -> (\S+)", summary).groups())
    # FSDP2's bf16 policy computes the loss inside the model in bf16, whose last place at 0.7 is
    # 2**-8: each process's loss is rounded there before the mean, the twin's only after it
    close = 2**-8 if "--path fsdp" in command else 2e-4
    assert (first, last) == pytest.approx((twin.losses[0], twin.final_loss), abs=close)
    # each process evaluates its share of the reviews and the shares are gathered: the same
    # accuracy as one process (to a review or two: bf16 rounds other batch shapes otherwise)
    accuracy = float(re.search(r"eval accuracy\s+(\S+)", summary)[1])
    assert accuracy == pytest.approx(twin.eval_accuracy, abs=2.5e-3), summary
