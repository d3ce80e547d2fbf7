"""Every training command the README shows runs as written: each `python -m mplab.train`,
`torchrun` and `accelerate launch` line of its bash blocks, shortened only by `--steps`
(argparse keeps the last), evaluation on. Tools start as `sys.executable -m ...`."""

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

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


@pytest.mark.slow  # about 10 s each: up to two processes import torch and transformers
@pytest.mark.parametrize("command", COMMANDS)
def test_each_readme_training_command_runs_as_written(command, tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(as_run(command), cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.count("mplab.train:") == 1, done.stdout[-2000:]  # rank 0's summary
    summary = done.stdout[done.stdout.index("mplab.train:"):]
    assert re.search(r"steps\s+3 of 3", summary), summary
    assert re.search(r"eval accuracy\s+0\.\d{3}", summary), summary  # it evaluated
    if "--json" in command:
        record = json.loads((tmp_path / shlex.split(command)[shlex.split(command).index("--json")
                                                           + 1]).read_text())
        assert len(record["losses"]) == 3 and record["eval_accuracy"] is not None
