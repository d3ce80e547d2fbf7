"""Running a notebook's cells in fresh kernels, and what a run said.

:class:`Run` runs the code cells one by one in a kernel (:class:`_Kernel`), starting a new one
and replaying what succeeded when a cell hangs or kills it, and tells a sink what happened;
:class:`Outcome` is the sink the grader scores from, small whatever a notebook logs. The grader
(:mod:`mplab.grade.notebook`) runs them in its own process for one notebook, and a sandbox's
runner (:mod:`mplab.grade.sandbox`) inside the sandbox for each of a class's.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import subprocess
import time
from pathlib import Path

from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError, CellTimeoutError, DeadKernelError
from traitlets.config import Config

from mplab.exercises import GRADE_LOG_ENV

__all__ = ["Run", "Outcome", "clean", "MAX_RECORD_BYTES"]

_QUIET = logging.getLogger("mplab.grade.kernel")  # nbclient logs every timeout as an error
_QUIET.addHandler(logging.NullHandler())
_QUIET.propagate = False


class _Unprinted(NotebookClient):
    """A client that keeps no output: a sandboxed run reports only grade-log records and
    problems, whatever a cell prints."""

    def output(self, outs, msg, display_id, cell_index):
        return None


class _Kernel:
    """One fresh kernel running the notebook's cells; thrown away when a cell hangs or kills it.

    Closing it ends the processes the kernel left too (a cell that forks 1,000 sleepers, say:
    RLIMIT_NPROC does not bind root). jupyter_client starts a kernel in a session of its own
    (``start_new_session``: the kernel's pid is its session's and its process group's id) and,
    shutting a live kernel down, kills that group; it kills nothing once the kernel has died
    (``os._exit``, a limit's SIGKILL), and a child that left the group (``setpgid``) or the
    session (``setsid``) escapes it. So after the shutdown :meth:`close` scans /proc and kills,
    until none is left, every live process in the kernel's session or group and every one
    started with this grading's environment (its own MPLAB_GRADE_LOG path, which no other
    grading shares); it spares one that carries another grading's, should the kernel's pid
    have been reused. A process that left the session and cleared its environment still
    escapes: grade untrusted notebooks in a container (see :mod:`mplab.grade.classroom`).
    """

    def __init__(self, nb, cwd: Path, env: dict, startup_timeout: float, setup: str = "",
                 sandboxed: bool = False):
        # In a sandbox nothing reads the outputs (a 1 GB print must not fill the runner) and
        # the kernel's connection is unix sockets beside its connection file: no network.
        client = _Unprinted if sandboxed else NotebookClient
        config = Config({"KernelManager": {"transport": "ipc"}}) if sandboxed else Config()
        self.client = client(
            nb, kernel_name="python3", resources={"metadata": {"path": str(cwd)}}, config=config,
            interrupt_on_timeout=False,  # a loop may swallow KeyboardInterrupt: kill instead
            shutdown_kernel="immediate", startup_timeout=max(1, int(startup_timeout)), log=_QUIET,
            # code the kernel runs in its own process before any cell (a class's limits)
            extra_arguments=[f"--IPKernelApp.exec_lines={setup}"] if setup else [])
        self._stack = contextlib.ExitStack()
        # The kernel process's own stderr is kernel logging (a learner's prints come back as
        # messages), so it stays out of the report.
        self._stack.enter_context(self.client.setup_kernel(env=env, stderr=subprocess.DEVNULL))
        provisioner = getattr(self.client.km, "provisioner", None)
        self._pid = getattr(provisioner, "pid", None)  # its session's and its group's id
        log = env.get(GRADE_LOG_ENV)
        self._mark = f"{GRADE_LOG_ENV}={log}".encode() if log else None

    def run(self, index: int, timeout: float) -> None:
        """Run one cell; raises CellExecutionError, CellTimeoutError or DeadKernelError."""
        self.client.timeout = max(1, int(timeout))
        self.client.execute_cell(self.client.nb.cells[index], index)

    def close(self) -> None:
        """Shut the kernel down, then end every process it left (see the class's doc)."""
        try:
            with contextlib.suppress(Exception):  # the kernel may be dead already
                self._stack.close()
        finally:
            self._end_left_behind()

    def _left_behind(self) -> list[int] | None:
        """The live processes this kernel left (None where there is no /proc to read)."""
        try:
            names = os.listdir("/proc")
        except OSError:
            return None
        grade_log = GRADE_LOG_ENV.encode() + b"="
        found = []
        for name in names:
            if not name.isdigit() or int(name) == os.getpid():
                continue
            try:
                with open(f"/proc/{name}/stat", "rb") as f:
                    stat = f.read()
                # pid (comm) state ppid pgrp session ...: comm may hold spaces and parentheses
                state, _, group, session = stat[stat.rindex(b")") + 2:].split()[:4]
                if state in (b"Z", b"X"):  # dead already, its parent yet to read its status
                    continue
                with open(f"/proc/{name}/environ", "rb") as f:
                    environ = f.read().split(b"\0")
            except (OSError, ValueError):  # gone meanwhile, or not ours to read
                continue
            if self._mark is not None and self._mark in environ:
                found.append(int(name))
            elif (self._pid in (int(group), int(session))
                  and not any(v.startswith(grade_log) for v in environ)):
                found.append(int(name))
        return found

    def _end_left_behind(self, patience: float = 10.0) -> None:
        import signal

        deadline = time.monotonic() + patience
        while True:
            left = self._left_behind()
            if left is None:  # no /proc: the kernel's group, as jupyter_client kills it
                if self._pid:
                    with contextlib.suppress(OSError):
                        os.killpg(self._pid, signal.SIGKILL)
                return
            if not left or time.monotonic() > deadline:
                return
            for pid in left:  # a forking one's new children are found in the next round
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.01)


#: The longest grade-log line read (an answer of MAX_ANSWER_BYTES, base64, in JSON): a longer
#: one is not a record mplab wrote.
MAX_RECORD_BYTES = 8 << 20
_CONTROL = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def clean(value):
    """`value` (a report, or part of one) with terminal escapes and control characters taken
    out of its text: what a learner's code printed or raised is shown, never interpreted."""
    if isinstance(value, str):
        return _CONTROL.sub("", value)
    if isinstance(value, list):
        return [clean(v) for v in value]
    if isinstance(value, dict):
        return {k: clean(v) for k, v in value.items()}
    return value


class Run:
    """Runs a notebook's code cells and says what happened to `sink`, in order:
    ``sink("cell", index)`` as a cell starts, ``sink("log", record)`` for each line the
    exercises logged, ``sink("problem", index, text)`` for each cell that failed,
    ``sink("done", index)`` as it ends."""

    def __init__(self, nb, cwd: Path, log: Path, env: dict, deadline: float, cell_timeout: float,
                 sink, setup: str = "", sandboxed: bool = False):
        self.nb, self.cwd, self.log, self.env, self.setup = nb, cwd, log, env, setup
        self.deadline, self.cell_timeout, self.sink = deadline, cell_timeout, sink
        self.sandboxed = sandboxed
        self.kernel: _Kernel | None = None
        self.succeeded: list[int] = []
        self._offset = 0

    def _left(self) -> float:
        return self.deadline - time.monotonic()

    def _new_log_lines(self) -> list[dict]:
        records = []
        with open(self.log, "rb") as f:
            f.seek(self._offset)
            while True:
                line = f.readline(MAX_RECORD_BYTES + 1)
                if not line.endswith(b"\n"):  # cut off by a dying kernel, or far too long
                    if len(line) <= MAX_RECORD_BYTES:
                        break
                    while line and not line.endswith(b"\n"):  # skip the rest of it
                        line = f.readline(1 << 20)
                    self._offset = f.tell()
                    continue
                self._offset = f.tell()
                with contextlib.suppress(ValueError):
                    record = json.loads(line)
                    if isinstance(record, dict):
                        records.append(record)
        return records

    def _kernel(self) -> _Kernel:
        return _Kernel(self.nb, self.cwd, self.env, min(60, self._left()), self.setup,
                       self.sandboxed)

    def _start_kernel(self) -> None:
        """A fresh kernel, brought to where the last one was by replaying what succeeded."""
        self.kernel = self._kernel()
        for index in self.succeeded:
            if self._left() < 1:
                break
            try:
                self.kernel.run(index, min(self.cell_timeout, self._left()))
            except CellExecutionError:
                pass
            except (CellTimeoutError, DeadKernelError):  # it did not misbehave the first time
                self.kernel.close()
                self.kernel = self._kernel()
                break
        self._new_log_lines()  # the replay's checks were already counted the first time

    def _run_cell(self, index: int) -> str | None:
        """Run one cell; what went wrong, or None."""
        out_of_time = "not run: the grading time limit ran out before this cell"
        try:
            if self._left() < 1:
                return out_of_time
            if self.kernel is None:
                self._start_kernel()
            budget = min(self.cell_timeout, self._left())  # after any restart and replay
            if budget < 1:
                return out_of_time
            self.kernel.run(index, budget)
        except CellExecutionError as e:
            return f"the cell raised {e.ename}: {e.evalue}"
        except CellTimeoutError:
            self._drop_kernel()
            return ("the cell did not finish: " + (
                f"it ran past the cell time limit ({self.cell_timeout:g} s)"
                if budget == self.cell_timeout else "the grading time limit ran out"))
        except DeadKernelError:
            self._drop_kernel()
            return "the cell killed the Python kernel"
        except Exception as e:  # the kernel would not start or answer: still report the rest
            self._drop_kernel()
            return f"not run: the kernel failed ({type(e).__name__}: {e})"
        self.succeeded.append(index)
        return None

    def _drop_kernel(self) -> None:
        if self.kernel is not None:
            self.kernel.close()
            self.kernel = None

    def run(self, close: bool = True) -> None:
        """Run every code cell; without `close`, the last kernel is left running (a
        sandbox's runner leaves it to the end of its PID namespace, which is quicker)."""
        try:
            for index, cell in enumerate(self.nb.cells):
                if cell.cell_type != "code" or not cell.source.strip():
                    continue
                self.sink("cell", index)
                problem = self._run_cell(index)
                for record in self._new_log_lines():
                    self.sink("log", record)
                if problem:
                    self.sink("problem", index, problem)
                self.sink("done", index)
        except BaseException:
            self._drop_kernel()
            raise
        if close:
            self._drop_kernel()


class Outcome:
    """What a run of a notebook said, kept small whatever it says: for each exercise its last
    word (the last check's record, or a problem of its cell after it), the statuses the log
    claimed for the checks before, whether its solution was viewed; the cells' problems.
    Fed by :class:`Run` directly, or by a sandbox's runner over a pipe
    (:mod:`mplab.grade.sandbox`)."""

    MAX_PROBLEMS = 1000  # one a cell at most, from an honest runner
    MAX_CLAIMED = 20

    def __init__(self, ids, cell_exercise: dict):
        self.cell_exercise = cell_exercise
        self.last: dict[str, tuple] = {}
        self.claimed: dict[str, list] = {xid: [] for xid in ids}
        self.viewed: set[str] = set()
        self.problems: list[tuple[int, str]] = []
        self.cell: int | None = None  # the cell that last started
        self.finished = False  # and whether it ended
        self.said_end = False

    def __call__(self, kind: str, *args) -> None:
        if kind == "cell":
            self.cell, self.finished = args[0], False
        elif kind == "done":
            self.finished = True
        elif kind == "log":
            self._log(args[0])
        elif kind == "problem":
            self.problem(*args)

    def _log(self, record: dict) -> None:
        xid = str(record.get("id"))
        if xid not in self.claimed:
            return
        if record.get("event") == "solution":
            self.viewed.add(xid)
        elif record.get("event") == "check":
            before = self.last.get(xid)
            if before is not None and before[0] == "check":  # the log's word, not regraded
                self.claimed[xid] = (self.claimed[xid] + [str(before[1].get("status"))[:20]]
                                     )[-self.MAX_CLAIMED:]
            self.last[xid] = ("check", record)

    def problem(self, index: int, text: str) -> None:
        if len(self.problems) >= self.MAX_PROBLEMS:
            return
        self.problems.append((index, text))
        xid = self.cell_exercise.get(index)
        if xid in self.claimed:
            self.last[xid] = ("problem", text)

    def note(self, text: str) -> None:
        """A problem of the cell running now (the grader's, not the learner's) that leaves
        its exercise's grade as it is."""
        if len(self.problems) < self.MAX_PROBLEMS:
            self.problems.append((self.cell if self.cell is not None else -1, text))

    def unrun(self, text: str) -> None:
        """The run was ended: every exercise cell from the one running on gets `text`."""
        start = -1 if self.cell is None else self.cell + self.finished
        for index in sorted(i for i, x in self.cell_exercise.items() if x and i >= start):
            self.problem(index, text)
