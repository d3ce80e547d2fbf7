"""What the grading sandbox guarantees a teacher: one class of lesson-1 submissions, hostile ones
graded together with honest ones in a single ``grade_class(..., jobs=2, sandbox=True)`` run
(issue: the security review's cases), each case a submission of its own, each guarantee a test
that checks its real effect (files on the host, processes alive, exact scores).

The hostile cells that probe what they can reach end with ``raise RuntimeError("probe {json}")``:
the report then carries, as the cell's problem, what the cell found, so a test can assert both
that the probe ran to its end and that it found nothing. A cell that hunts for the answer key
instead answers with the key it found (full points) or a wrong answer (a "failed" check).

Should the sandbox ever break, what the probes do to the host stays small: they create files
(never overwrite one) in the test's folders, /tmp, /, HOME and the Python environment's folders,
and the fixture removes what they created; they overwrite notebooks only at the test's own
paths; their processes carry names of this run's own, and the fixture ends them by pid.
"""

import contextlib
import csv
import hashlib
import importlib.util
import io
import json
import os
import re
import resource
import signal
import site
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("nbclient", reason="needs nbclient, which is not installed")

import mplab  # noqa: E402
from mplab.exercises import lesson1  # noqa: E402
from mplab.exercises.release import release  # noqa: E402
from mplab.grade.classroom import (  # noqa: E402
    Limits,
    fresh_folder,
    grade_class,
    gradebook_rows,
    submissions,
    write_csv,
)
from mplab.grade.sandbox import unavailable  # noqa: E402

pytestmark = pytest.mark.slow  # one class graded in sandboxes: about a minute

# The one generator of lesson-1 submissions is the class benchmark's.
BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_grade_class.py"
_spec = importlib.util.spec_from_file_location("bench_grade_class", BENCH)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)

IDS = list(lesson1.EXERCISES)
POINTS = {xid: e.points for xid, e in lesson1.EXERCISES.items()}
FULL = sum(POINTS.values())
LATER = IDS[1:]  # the exercises a hostile 1.1 leaves to the key's answers
# 1.5 GB: the lesson's kernel (torch) does not start under an address space of 1 GB.
LIMITS = Limits(memory_gb=1.5, file_mb=16, disk_mb=64, output_mb=4, processes=64)
TIMEOUT, CELL_TIMEOUT = 50, 20
# The processes the submissions start name themselves (/proc/PID/comm, 15 characters at most)
# with this run's own names, should another run of this file share the machine.
_RUN = f"{os.getpid() % 10**6:06d}"
MARKS = {"detach": f"gsdet{_RUN}", "hang": f"gshang{_RUN}", "fork": f"gsfork{_RUN}"}
SECRET = f"mplab-secret-{os.urandom(8).hex()}"
SECRET_VARS = ("MPLAB_TEACHER_TOKEN", "AWS_SECRET_ACCESS_KEY")
WRONG = {  # an answer each check fails (a "failed" row, 0 points)
    "1.1": "answer = 12345.0",
    "1.2": "answer = 1.0",
    "1.3": "answer = 0.0",
    "1.4": "answer = dict.fromkeys([0.0001, 60000.0, 1e-06, 123456.0, 2e-08], 'bf16')",
    "1.5": "def decode(bits, exp_bits, man_bits, bias):\n    return 0.0",
}


def check(xid: str) -> str:
    """The line that checks an exercise's answer, as the notebook's cell ends."""
    return f"ex.check({xid!r}, {lesson1.EXERCISES[xid].arg})"


def cell(body: str, **config) -> str:
    """A hostile cell: its settings (`CFG`, what the test knows of the host) and its code."""
    return f"CFG = {config!r}\n{body.strip()}\n"


def submission(folder: Path, name: str, cells: dict) -> Path:
    """A quick lesson-1 submission (the import cell and the exercise cells)."""
    return bench.submission(folder, name, cells, whole=False)


def later_keys() -> dict:
    return dict.fromkeys(LATER)


# ---- the hostile cells ------------------------------------------------------------------------

# Double-forked out of the kernel's session, with an empty environment (the grader's own scan
# for a kernel's processes cannot tell it is one of them), named argv[1]; after argv[3] s it
# overwrites the files argv[2] lists, again and again, for 10 minutes.
DETACHED = r"""
import json, os, sys, time
mark, targets, delay = sys.argv[1], json.loads(sys.argv[2]), float(sys.argv[3])
if os.fork():
    os._exit(0)
os.setsid()
if os.fork():
    os._exit(0)
with open("/proc/self/comm", "w") as f:
    f.write(mark)
time.sleep(delay)
end = time.time() + 600
while time.time() < end:
    for path in targets:
        try:
            with open(path, "w") as f:
                f.write("overwritten by a process a submission left behind\n")
        except OSError:
            pass
    time.sleep(0.2)
"""

START_DETACHED = """
import json, subprocess, sys
subprocess.run([sys.executable, "-S", "-c", CFG["code"], CFG["mark"], json.dumps(CFG["targets"]),
                "3"], env={}, start_new_session=True, stdin=subprocess.DEVNULL,
               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=10)
"""

HANG = """
import time
while True:  # a cell that swallows the interrupt, too
    try:
        time.sleep(0.5)
    except BaseException:
        pass
"""

# A module that, imported by anything on the host, leaves a marker there; then it hands over
# to the module it shadows (so that a kernel of the submission's own still starts).
PLANTED = '''
try:
    with open({marker!r}, "a") as _f:
        _f.write(__file__ + "\\n")
except Exception:
    pass
import importlib as _i, os as _o, sys as _s
_here = _o.path.dirname(_o.path.abspath(__file__))
if _o.path.basename(_here) == "mplab":
    _here = _o.path.dirname(_here)
_s.path[:] = [p for p in _s.path if _o.path.abspath(p or ".") != _here]
_s.modules.pop(__name__, None)
with __import__("contextlib").suppress(ImportError):
    _s.modules[__name__] = _i.import_module(__name__)
'''

INJECT = """
import os, site, sys
from pathlib import Path
code = CFG["code"]
dirs = [os.getcwd(), *map(str, Path(os.getcwd()).parents), "/tmp", os.path.expanduser("~"),
        site.getusersitepackages(), "/dev/shm", *CFG["host_dirs"]]
written = []
for d in dirs:
    for rel in ("numpy.py", "decimal.py", "json.py", "csv.py", "sitecustomize.py",
                "usercustomize.py", "mplab/__init__.py", "zz_mplab_planted.pth"):
        path = Path(d) / rel
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "x") as f:  # never overwrite a file that is there
                f.write("import os\\n" if rel.endswith(".pth") else code)
            written.append(str(path))
        except OSError:
            pass
""" + WRONG["1.1"] + "\n" + check("1.1")

# Each of the key reader's cells hunts the key one way; it answers with the first key found
# (which earns full points) or, finding none, with a wrong answer (a "failed" check).
KEY_HUNT = '''
import glob, importlib.machinery, importlib.util, math, os, re, sys


def keys_in(path, xid):
    """Exercise xid's key in the lesson module at path, or ""."""
    try:
        name = "found_key_%d" % len(sys.modules)
        if path.endswith(".pyc"):
            spec = importlib.util.spec_from_loader(
                name, importlib.machinery.SourcelessFileLoader(name, path))
        else:
            spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        return str(module.EXERCISES[xid].key)
    except BaseException:
        return ""


def lessons_under(folder):
    """The lesson-1 modules (source and compiled) a folder of mplab's may hold."""
    found = []
    for sub in ("mplab/exercises", "exercises", ""):
        here = os.path.join(folder, sub)
        try:
            found += [os.path.join(here, "lesson1.py")] + glob.glob(
                os.path.join(glob.escape(here), "__pycache__", "lesson1*.pyc"))
        except Exception:
            pass
    exist = []
    for path in found:
        try:
            if os.path.isfile(path):
                exist.append(path)
        except (OSError, ValueError):
            pass
    return exist


def answer_with(keys, wrong, arg):
    for code in [k for k in keys if k and k.strip()] + [wrong]:
        namespace = {"ex": ex, "math": math}
        try:
            exec(code, namespace)
            return namespace[arg]
        except Exception:
            continue
'''

KEY_ROUTES = {
    # the installed mplab, as the kernel imports it, and every lesson module it holds
    "1.1": """
keys = []
import mplab.exercises.lesson1 as l
keys += [l.EXERCISES["1.1"].key, ex.EXERCISES["1.1"].key, keys_in(l.__file__, "1.1")]
keys.append(getattr(ex.solution("1.1"), "code", "") or "")
for m in list(sys.modules.values()):
    found = getattr(m, "EXERCISES", None)
    if isinstance(found, dict) and "1.1" in found:
        keys.append(str(getattr(found["1.1"], "key", "")))
""",
    # every path the sandbox's processes name: command lines, environments, maps, cwd, root
    "1.2": """
keys, folders = [], set()
for path in glob.glob("/proc/*/cmdline") + glob.glob("/proc/*/environ") + glob.glob(
        "/proc/*/maps"):
    try:
        data = open(path, "rb").read().decode("utf-8", "replace")
    except OSError:
        continue
    for token in re.split(r"[\\0:=\\s]", data):
        if token.startswith("/"):
            folders.add(os.path.dirname(token))
for link in glob.glob("/proc/*/cwd") + glob.glob("/proc/*/root"):
    try:
        folders.add(os.readlink(link))
    except OSError:
        pass
for folder in list(folders):
    while folder not in ("/", ""):
        folders.add(folder)
        folder = os.path.dirname(folder)
for folder in sorted(folders):
    keys += [keys_in(p, "1.2") for p in lessons_under(folder)]
""",
    # every lesson1 module on the file system, through / and through /proc/1/root
    "1.3": """
keys = []
for top in ("/proc/1/root", "/"):
    for folder, subfolders, files in os.walk(top):
        if folder in (top.rstrip("/") + "/proc", top.rstrip("/") + "/sys"):
            subfolders[:] = []
            continue
        keys += [keys_in(os.path.join(folder, f), "1.3") for f in files
                 if f.startswith("lesson1") and f.endswith((".py", ".pyc"))]
""",
    # the instructor's key folder and the grader's own mplab, by their paths on the host
    "1.4": """
keys = []
for path in CFG["host_paths"]:
    candidates = lessons_under(path) if os.path.isdir(path) else [path]
    keys += [keys_in(p, "1.4") for p in candidates if os.path.isfile(p)]
""",
    # where the installed distribution says its source is (an editable install's mapping)
    "1.5": """
import importlib.metadata
keys, folders = [], set()
try:
    dist = importlib.metadata.distribution("mplab")
    for f in dist.files or []:
        located = str(f.locate())
        folders.add(os.path.dirname(located))
        try:
            text = open(located, encoding="utf-8", errors="replace").read()
        except OSError:
            continue
        folders.update(re.findall(r"(/[^'\\"\\s]+)", text))
except Exception:
    pass
for folder in sorted(folders):
    keys += [keys_in(p, "1.5") for p in lessons_under(folder)]
    keys += [keys_in(p, "1.5") for p in lessons_under(os.path.dirname(folder))]
""",
}


def key_reader_cell(xid: str, host_paths: list) -> str:
    arg = lesson1.EXERCISES[xid].arg
    body = (KEY_HUNT + KEY_ROUTES[xid]
            + f"{arg} = answer_with(keys, {WRONG[xid]!r}, {arg!r})\n" + check(xid))
    return cell(body, host_paths=host_paths)


# Another student's notebook, read, copied, overwritten, blanked: by its host path, and any
# lesson notebook found on the file system (written to only where it could be a classmate's:
# the test's own paths, /tmp, /sandbox, /dev/shm, so that a broken sandbox harms nothing else).
STUDENTS_FILES = """
import glob, json, os, shutil
own = os.path.abspath(CFG["own"])
candidates = set(CFG["host_paths"])
for pattern in ("/tmp/mplab-class-*/*/*.ipynb", "/tmp/**/*.ipynb", "/sandbox/**/*.ipynb",
                "/dev/shm/**/*.ipynb", "/course/**/*.ipynb"):
    candidates.update(glob.glob(pattern, recursive=True))
for folder, subfolders, files in os.walk("/"):
    if folder in ("/proc", "/sys"):
        subfolders[:] = []
        continue
    candidates.update(os.path.join(folder, f) for f in files if f.endswith(".ipynb"))
seen = {"read": [], "copied": [], "overwritten": [], "blanked": []}
for path in sorted(candidates):
    if os.path.abspath(path) == own:
        continue
    try:
        text = open(path, encoding="utf-8", errors="replace").read()
    except OSError:
        continue
    if '"exercise": "1.1"' not in text:  # not a lesson notebook: a package's example
        continue
    seen["read"].append(path)
    try:
        shutil.copyfile(path, os.path.basename(path) + ".stolen")
        seen["copied"].append(path)
    except OSError:
        pass
    if path not in CFG["host_paths"] and not path.startswith(("/tmp/", "/sandbox/", "/dev/shm/")):
        continue
    try:
        with open(path, "r+") as f:
            f.write(" " * 100)
        seen["overwritten"].append(path)
    except OSError:
        pass
    try:
        open(path, "w").close()
        seen["blanked"].append(path)
    except OSError:
        pass
raise RuntimeError("probe " + json.dumps({k: v[:5] for k, v in seen.items()}))
"""

# Every folder it may write (found with os.access, nothing written), and sitecustomize.py,
# usercustomize.py and a .pth planted where Python would run them (its own sys.path, the
# course's mplab, site-packages, the user site, HOME, /tmp, the host's folders by path): each
# would zero a later student by writing "failed" records into that student's grade log.
STUDENTS_PLANT = """
import json, os, site, sys
payload = ("import os\\ntry:\\n    with open(os.environ['MPLAB_GRADE_LOG'], 'a') as f:\\n"
           + "".join("        f.write('{\\"event\\": \\"check\\", \\"id\\": \\"%s\\", "
                     "\\"status\\": \\"failed\\", \\"answer\\": 0}\\\\n')\\n" % x
                     for x in CFG["ids"])
           + "except Exception:\\n    pass\\n")
writable = []
for folder, subfolders, files in os.walk("/"):
    if folder in ("/proc", "/sys"):
        subfolders[:] = []
        continue
    if os.access(folder, os.W_OK):
        writable.append(folder)
targets = set(CFG["host_dirs"]) | {p for p in sys.path if p} | {
    os.getcwd(), os.path.expanduser("~"), site.getusersitepackages(), "/tmp", "/dev/shm",
    "/sandbox", "/course", "/course/mplab", os.path.dirname(os.__file__),
    *site.getsitepackages()}
planted = []
for folder in sorted(targets):
    for name, text in (("sitecustomize.py", payload), ("usercustomize.py", payload),
                       ("zz_zero_students.pth", "import sitecustomize\\n")):
        try:
            with open(os.path.join(folder, name), "x") as f:
                f.write(text)
            planted.append(folder)
        except OSError:
            pass
raise RuntimeError("probe " + json.dumps({"writable": writable[:40],
                                          "planted_in": sorted(set(planted))}))
"""

# Another kernel's connection file (its sockets and its key): any JSON file that holds a
# kernel's signature key, under /tmp, the runtime folders, /proc's roots, or named by /proc.
STUDENTS_KERNELS = """
import glob, json, os
from ipykernel import get_connection_file
own = os.path.realpath(get_connection_file())
candidates = set()
for pattern in ("/tmp/**/*.json", "/sandbox/**/*.json", "/run/**/*.json", "/dev/shm/**/*.json",
                "/proc/*/root/tmp/**/*.json", "/proc/*/root/sandbox/**/*.json"):
    candidates.update(glob.glob(pattern, recursive=True))
for path in glob.glob("/proc/*/cmdline"):
    try:
        args = open(path, "rb").read().decode("utf-8", "replace").split("\\0")
    except OSError:
        continue
    candidates.update(a for a in args if a.endswith(".json"))
for link in glob.glob("/proc/*/fd/*"):
    try:
        candidates.add(os.readlink(link))
    except OSError:
        pass
found = set()
for path in candidates:
    try:
        if os.path.isfile(path) and "signature_scheme" in open(path).read():
            found.add(os.path.realpath(path))
    except (OSError, ValueError):
        pass
pids = [p for p in os.listdir("/proc") if p.isdigit()]
raise RuntimeError("probe " + json.dumps({"own_found": own in found,
                                          "foreign": sorted(found - {own})[:5],
                                          "pids": len(pids)}))
"""

# 200 sleepers started from the kernel itself (which the grader never ends for its children),
# as fast as posix_spawn goes, three times 1 s apart (the grader's round of ending them done):
# the most alive at once, counted as they start (started less those already ended), and the
# error that stopped a round, if any. They run /bin/sleep through a link named after the
# cell's mark, so that /proc names them so.
SPAWNER = """
import json, os, signal, time
os.symlink("/bin/sleep", CFG["mark"])
path = os.path.abspath(CFG["mark"])
most, stopped = 0, []
for _ in range(3):
    time.sleep(1)
    children, ended = [], 0
    for _ in range(200):
        try:
            children.append(os.posix_spawn(path, [path, "600"], {}))
        except OSError as e:
            stopped.append(type(e).__name__)
            break
        while True:
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            ended += 1
        most = max(most, len(children) - ended)
    for pid in children:
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except OSError:
            pass
"""

# Three children of 800 MB each (every page written), past the class's 1.5 GB together, each
# filling its memory 2 s after the one before: the out-of-memory killer ends the largest process,
# and a child bigger than the kernel (about 300 MB with torch's CPU build, 600 MB with its CUDA
# build) is it, where three children filling at once would each be smaller than the kernel.
HOG = """
import json, subprocess, sys
child = ("import sys, time\\ntime.sleep(1 + 2 * int(sys.argv[1]))\\n"
         "b = b'x' * (800 * 2**20)\\ntime.sleep(8)")
children = [subprocess.Popen([sys.executable, "-S", "-c", child, str(i)]) for i in range(3)]
codes = [c.wait() for c in children]
raise RuntimeError("probe " + json.dumps({"codes": codes}))
"""

# Files of 8 MB (under file_mb), up to 80 MB in each folder it may write, then removed.
DISK = """
import json, os
written = {}
for folder in ("/", "/etc", "/dev", "/sandbox/work", "/dev/shm", os.path.expanduser("~")):
    total, names = 0, []
    try:
        for i in range(10):
            names.append(os.path.join(folder, "fill-%d.bin" % i))
            with open(names[-1], "wb") as f:
                f.write(bytes(8 * 2**20))
            total += 8
    except OSError:
        pass
    for name in names:
        try:
            os.remove(name)
        except OSError:
            pass
    written[folder] = total
raise RuntimeError("probe " + json.dumps(written))
"""

PRINTER = """
line = "x" * 2**20
for _ in range(200):  # 200 MB printed
    print(line)
""" + lesson1.EXERCISES["1.1"].key + "\n" + check("1.1")

FLOOD = """
import json, os
record = json.dumps({"event": "check", "id": "1.1", "status": "passed", "answer": 12345.0})
with open(os.environ["MPLAB_GRADE_LOG"], "a") as f:
    for _ in range(100_000):
        f.write(record + "\\n")
"""

# The teacher's environment and files, and the network.
SNOOP = """
import glob, json, os, socket
prefix = CFG["secret_starts"][0] + CFG["secret_starts"][1]  # not in the cell's own source
hits, reachable = [], {}

def look(where, data):
    if prefix in data:
        hits.append(where)

look("os.environ", json.dumps(dict(os.environ)))
for path in glob.glob("/proc/*/environ") + glob.glob("/proc/*/cmdline"):
    try:
        look(path, open(path, "rb").read().decode("utf-8", "replace"))
    except OSError:
        pass
for path in CFG["host_paths"] + [os.path.expanduser("~/.ssh")]:
    try:
        if os.path.isdir(path):
            reachable[path] = sorted(os.listdir(path))[:10]
        else:
            with open(path, errors="replace") as f:
                look(path, f.read())
            reachable[path] = "read"
    except OSError:
        pass
for top in [os.path.expanduser("~"), CFG["host_paths"][1]]:
    for folder, subfolders, files in os.walk(top):
        for name in files:
            try:
                look(name, open(os.path.join(folder, name), errors="replace").read())
            except OSError:
                pass

def outcome(do):
    try:
        return do() or "ok"
    except Exception as e:
        return type(e).__name__

net = {}
def own_loopback():
    server = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(server.getsockname(), timeout=2)
    client.close()
    server.close()
net["own loopback"] = outcome(own_loopback)
net["host tcp"] = outcome(lambda: socket.create_connection(("127.0.0.1", CFG["port"]),
                                                           timeout=2).close())
def unix():
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(2)
    s.connect(CFG["abstract"].encode())
    s.close()
net["host abstract unix"] = outcome(unix)
def route():  # a UDP connect looks the route up and sends nothing
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.connect(("192.0.2.1", 9))
    s.close()
net["route out"] = outcome(route)
net["resolve"] = outcome(lambda: socket.getaddrinfo("mplab-probe.invalid", 80) and None)
net["interfaces"] = sorted(name for _, name in socket.if_nameindex())
raise RuntimeError("probe " + json.dumps({"hits": hits[:5], "reachable": reachable,
                                          "env": sorted(os.environ), "net": net}))
"""

ANSI = "\x1b[31mred\x1b[0m \x1b]8;;x.invalid\x07link\x1b]8;;\x07 \x07\x08bell\rcr\x00nul\x9bcsi"


# ---- the class ----------------------------------------------------------------------------------

def alive(marks) -> dict:
    """How many live processes carry each name in `marks` (as bench.left_behind counts)."""
    count = dict.fromkeys(marks, 0)
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            comm = Path(f"/proc/{pid}/comm").read_text().strip()
            state = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        if comm in count and state[state.rindex(")") + 2] not in "ZX":
            count[comm] += 1
    return count


class Most:
    """The most live processes of each name seen while the class grades (every 0.1 s)."""

    def __init__(self, marks):
        self.seen = dict.fromkeys(marks, 0)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self):
        while not self._stop.wait(0.1):
            for mark, n in alive(self.seen).items():
                self.seen[mark] = max(self.seen[mark], n)

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join()
        return self.seen


class Listener:
    """A TCP server on the host's loopback and an abstract unix socket, counting connections."""

    def __init__(self):
        self.tcp = socket.create_server(("127.0.0.1", 0))
        self.port = self.tcp.getsockname()[1]
        self.abstract = f"\0mplab-grade-sandbox-{os.getpid()}"
        self.unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.unix.bind(self.abstract)
        self.unix.listen()
        self.connections = 0
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._accept, args=(s,), daemon=True)
                         for s in (self.tcp, self.unix)]
        for t in self._threads:
            t.start()

    def _accept(self, server):
        server.settimeout(0.2)
        while not self._stop.is_set():
            with contextlib.suppress(TimeoutError, OSError):
                conn, _ = server.accept()
                self.connections += 1
                conn.close()

    def close(self) -> int:
        self._stop.set()
        for t in self._threads:
            t.join()
        self.tcp.close()
        self.unix.close()
        return self.connections


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def probe(report: dict, xid: str) -> dict:
    """What a probing cell of `report` found (its "probe {json}" problem)."""
    for p in report["problems"]:
        if p["exercise"] == xid and "probe {" in p["problem"]:
            return json.loads(p["problem"].split("probe ", 1)[1])
    raise AssertionError(f"the probe of {xid} did not run to its end: {report['problems']}")


def rows(report: dict, ids=IDS) -> list:
    """Each exercise's grade with its message (the same where the grades are the same)."""
    return [(e["id"], e["status"], e["points"], e["message"]) for e in report["exercises"]
            if e["id"] in ids]


def problems(report: dict) -> str:
    return " | ".join([report.get("error", "")] + [p["problem"] for p in report["problems"]])


def strings(value):
    """Every string in a report, keys included."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from strings(k)
            yield from strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from strings(v)


CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")
CSV_NAME = "=cmd|' -C calc'!A0"  # a notebook whose file name a spreadsheet would run
BAD_JSON_NAME = "@SUM(1+1)*cmd"  # not a notebook: its row's error starts with its name
ESCAPE_NAME = "\x1b[2J\x1b[31mwipe"  # a file name that clears a teacher's terminal


@pytest.fixture(scope="module", autouse=True)
def sandbox_required():
    """CI has user namespaces: a machine without them fails this file, saying why."""
    why = unavailable()
    if why:
        pytest.fail(f"this machine cannot make a grading sandbox: {why}")


@pytest.fixture(scope="module")
def klass(tmp_path_factory):
    """The class, graded once: {"by": stem -> report, ...what the tests check against}."""
    root = tmp_path_factory.mktemp("sandboxed-class")
    folder, out = root / "submissions", root / "out"
    folder.mkdir()
    out.mkdir()
    keydir = root / "key"
    release(root / "learner", key=keydir, notebooks=False)
    marker = out / "imported-on-the-host.txt"  # written by a planted module, if ever imported
    grades, reports_dir = out / "grades.csv", out / "reports"
    secret_file = root / "teacher" / "secret.txt"
    secret_file.parent.mkdir()
    secret_file.write_text(f"TOKEN={SECRET}\n")

    honest = {"key": dict.fromkeys(IDS), "blank": {},
              "half": {"1.1": None, "1.2": None, "1.3": WRONG["1.3"] + "\n" + check("1.3")}}
    honest_paths = {name: submission(folder, name, cells) for name, cells in honest.items()}
    package = Path(mplab.__file__).resolve().parent
    host_dirs = [str(folder), str(out), str(root), *site.getsitepackages(), str(Path.home())]
    # where a broken sandbox would let the planted modules land on the host (removed after)
    python_dirs = [os.path.dirname(os.__file__), *site.getsitepackages(),
                   *[p for p in sys.path if p and os.path.isdir(p)]]
    planted = [Path(d) / rel for d in {*host_dirs, *python_dirs, tempfile.gettempdir(), "/"}
               for rel in ("numpy.py", "decimal.py", "json.py", "csv.py", "sitecustomize.py",
                           "usercustomize.py", "mplab/__init__.py", "zz_mplab_planted.pth",
                           "zz_zero_students.pth")]
    there_before = {p for p in planted if p.exists()}
    listener = Listener()

    submission(folder, "00-hang", {
        "1.1": cell(START_DETACHED + HANG, code=DETACHED, mark=MARKS["hang"], targets=[]),
        **dict.fromkeys(LATER, HANG)})
    submission(folder, "01-detach", {
        "1.1": cell(START_DETACHED, code=DETACHED, mark=MARKS["detach"],
                    targets=[str(grades), str(reports_dir / "key.json"), str(marker)])
        + lesson1.EXERCISES["1.1"].key + "\n" + check("1.1"),
        **later_keys()})
    submission(folder, "02-students", {
        "1.1": cell(STUDENTS_FILES, own="02-students.ipynb",
                    host_paths=[str(p) for p in honest_paths.values()]),
        "1.2": cell(STUDENTS_PLANT, ids=IDS, host_dirs=host_dirs),
        "1.3": cell(STUDENTS_KERNELS)})
    submission(folder, "03-inject", {
        "1.1": cell(INJECT, code=PLANTED.format(marker=str(marker)), host_dirs=host_dirs),
        **later_keys()})
    host_keys = [str(keydir), str(keydir / "lesson1.py"), str(package),
                 str(package / "exercises" / "lesson1.py"), str(package.parent)]
    submission(folder, "04-keyread", {x: key_reader_cell(x, host_keys) for x in IDS})
    submission(folder, "05-hog", {"1.1": HOG, **later_keys()})
    submission(folder, "06-forker", {
        "1.1": cell(SPAWNER, mark=MARKS["fork"]) + bench.forker(200, None, MARKS["fork"])["1.1"]
        + '\nraise RuntimeError("probe " + json.dumps({"most": most, "stopped": stopped}))',
        **later_keys()})
    submission(folder, "07-printer", {"1.1": PRINTER, **later_keys()})
    submission(folder, "08-flood", {"1.1": FLOOD, **later_keys()})
    submission(folder, "11-disk", {"1.1": DISK, **later_keys()})
    submission(folder, "09-snoop", {"1.1": cell(
        SNOOP, secret_starts=["mplab-secret-", SECRET[13:17]], port=listener.port,
        abstract=listener.abstract,
        host_paths=[str(secret_file), str(secret_file.parent), str(Path.home() / ".ssh"),
                    str(Path.home())])})
    submission(folder, "10-shell", {
        "1.1": f"!touch {out / 'bang.txt'}\n{WRONG['1.1']}\n{check('1.1')}",
        "1.2": f"%%bash\necho pwned > {out / 'bash.txt'}\ncat /etc/hostname",
        "1.3": f"%sx touch {out / 'sx.txt'}\n{WRONG['1.3']}\n{check('1.3')}",
        "1.4": f"import os\nos.system('touch {out / 'system.txt'}')\n{WRONG['1.4']}\n"
               f"{check('1.4')}"})
    submission(folder, CSV_NAME, {
        "1.1": 'raise Exception(\'=HYPERLINK("x.invalid","see")\')',
        "1.2": f"raise Exception({ANSI!r})",
        "1.3": f"print({ANSI!r})\n{WRONG['1.3']}\n{check('1.3')}",
        "1.4": f"answer = {ANSI!r}\n{check('1.4')}"})
    (folder / f"{BAD_JSON_NAME}.ipynb").write_text("not a notebook")
    (folder / f"{ESCAPE_NAME}.ipynb").write_text("not a notebook either")
    # what is refused, and what is skipped
    (folder / "linked-key.ipynb").symlink_to(honest_paths["key"])
    (folder / "passwd.ipynb").symlink_to("/etc/passwd")
    os.mkfifo(folder / "x.ipynb")
    (folder / "y.ipynb").mkdir()
    (folder / "notes.txt").write_text("not graded")
    (folder / "README").write_text("not graded either")
    before = {name: digest(p) for name, p in honest_paths.items()}

    most = Most(MARKS.values())
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    started = time.monotonic()
    try:
        with pytest.MonkeyPatch.context() as mp:
            for name in SECRET_VARS:
                mp.setenv(name, SECRET)
            reports = grade_class(folder, jobs=2, limits=LIMITS, timeout=TIMEOUT,
                                  cell_timeout=CELL_TIMEOUT, progress=False, key=keydir,
                                  sandbox=True)
        took = time.monotonic() - started
        rss_after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        seen = most.stop()
        connections = listener.close()
        write_csv(reports, grades, reports_dir)
        written = time.monotonic()
        wrote = grades.read_bytes(), {p.name: p.read_bytes() for p in reports_dir.iterdir()}
        # the honest ones again, alone and without a sandbox: the grades to keep
        alone = root / "alone"
        alone.mkdir()
        for path in honest_paths.values():
            (alone / path.name).write_bytes(path.read_bytes())
        unsandboxed = grade_class(alone, jobs=2, limits=LIMITS, timeout=TIMEOUT,
                                  cell_timeout=CELL_TIMEOUT, progress=False, key=keydir,
                                  sandbox=False)
        yield {
            "by": {Path(r["notebook"]).stem: r for r in reports}, "reports": reports,
            "folder": folder, "out": out, "keydir": keydir, "marker": marker,
            "grades": grades, "reports_dir": reports_dir, "honest": honest_paths,
            "before": before, "seen": seen, "connections": connections, "took": took,
            "rss_growth": rss_after - rss_before, "written": written,
            "csv": wrote[0], "json": wrote[1],
            "planted": [p for p in planted if p not in there_before],
            "alone": {Path(r["notebook"]).stem: r for r in unsandboxed}}
    finally:
        most.stop()
        listener.close()
        # a broken sandbox's leftovers: this run's own processes (by their unique names, pid by
        # pid) and the modules planted on the host
        for pid in filter(str.isdigit, os.listdir("/proc")):
            with contextlib.suppress(OSError):
                if Path(f"/proc/{pid}/comm").read_text().strip() in MARKS.values():
                    os.kill(int(pid), signal.SIGKILL)
        for path in planted:
            if path not in there_before and path.is_file():
                path.unlink()
                with contextlib.suppress(OSError):  # an mplab/ folder made for it
                    if path.name == "__init__.py":
                        path.parent.rmdir()


def report_of(klass, name: str) -> dict:
    return klass["by"][name]


# ---- 1. honest students -------------------------------------------------------------------------

def test_honest_students_keep_exactly_the_points_their_answers_earn(klass):
    key, blank, half = (report_of(klass, n) for n in ("key", "blank", "half"))
    assert [(e["id"], e["status"], e["points"]) for e in key["exercises"]] == [
        (x, "passed", POINTS[x]) for x in IDS]
    assert key["total"] == key["max"] == FULL and not key["flags"] and not key["problems"]
    assert key["key"] == str(klass["keydir"]) and key["sandbox"] == "bubblewrap"
    assert blank["total"] == 0
    assert {e["status"] for e in blank["exercises"]} == {"not attempted"}
    assert [e["status"] for e in half["exercises"]] == [
        "passed", "passed", "failed", "not attempted", "not attempted"]
    assert half["total"] == POINTS["1.1"] + POINTS["1.2"]
    for name, report in (("key", key), ("blank", blank), ("half", half)):
        assert report["error"] == "" and report["elapsed_s"] < TIMEOUT
        alone = klass["alone"][name]
        assert alone["sandbox"] == "none" and rows(report) == rows(alone)


def test_the_gradebook_names_the_lesson_it_graded_with_a_key(klass):
    """Graded with key= (the instructor's key folder), each row still says "lesson1"."""
    assert {report_of(klass, n)["lesson"] for n in ("key", "blank", "half")} == {"lesson1"}


# ---- 2. code for the grader to import -----------------------------------------------------------

def test_modules_a_submission_plants_never_run_in_the_grader(klass):
    """numpy.py, decimal.py, json.py, csv.py, sitecustomize.py, usercustomize.py, mplab/ and a
    .pth, written to its working folder, the folders above it, /tmp, HOME, the user site, and
    to the host's own folders by path: none reaches the host, none is imported there (each
    would leave a marker), not while grading, not by a Python started afterwards."""
    inject = report_of(klass, "03-inject")
    assert not klass["marker"].exists()
    assert [str(p) for p in klass["planted"] if p.exists()] == []
    fresh = subprocess.run([sys.executable, "-c", "import numpy, decimal, json, csv"],
                           cwd=klass["folder"], capture_output=True, text=True, timeout=60)
    assert fresh.returncode == 0, fresh.stderr
    assert not klass["marker"].exists()
    # it earns what its answers earn: 1.1 was wrong, the rest the key's
    assert rows(inject, ["1.1"])[0][1:3] == ("failed", 0)
    assert rows(inject, LATER) == rows(report_of(klass, "key"), LATER)
    assert inject["total"] == FULL - POINTS["1.1"]


# ---- 3. the answer key --------------------------------------------------------------------------

def test_a_submission_finds_no_answer_key_anywhere(klass):
    """Each exercise hunts the key its own way (the installed mplab, /proc's paths, the whole
    file system and /proc/1/root, the --key folder and the grader's mplab by their host paths,
    the installed distribution's record) and answers with the first key it finds: every check
    failed, so none was found; the honest key still earns full marks with key=."""
    reader = report_of(klass, "04-keyread")
    assert [(e["id"], e["status"], e["points"]) for e in reader["exercises"]] == [
        (x, "failed", 0) for x in IDS], reader["problems"]
    assert reader["total"] == 0
    assert report_of(klass, "key")["total"] == FULL


# ---- 4. other students --------------------------------------------------------------------------

def test_no_submission_reads_or_changes_another(klass):
    attacker = report_of(klass, "02-students")
    assert probe(attacker, "1.1") == {"read": [], "copied": [], "overwritten": [], "blanked": []}
    for name, path in klass["honest"].items():
        assert digest(path) == klass["before"][name], f"{name}'s submission changed"
    assert report_of(klass, "key")["total"] == FULL
    assert report_of(klass, "half")["total"] == POINTS["1.1"] + POINTS["1.2"]


def test_what_a_submission_plants_stays_in_its_own_sandbox(klass):
    """sitecustomize.py, usercustomize.py and a .pth wherever it may write: into its own
    folders only, never into what every sandbox of the class shares (the course's release of
    mplab, the Python environment, /usr), nor on the host; the students graded after it keep
    their points."""
    found = probe(report_of(klass, "02-students"), "1.2")
    assert "/sandbox/work" in found["planted_in"]  # the probe could write its own folder
    assert "/sandbox/work" in found["writable"]
    shared = {"/usr", "/course"} | {str(Path(p).resolve()) for p in (
        sys.prefix, sys.base_prefix, sys.exec_prefix, *site.getsitepackages())}
    for where in (found["planted_in"], found["writable"]):
        assert [p for p in where if any(p == s or p.startswith(s + "/") for s in shared)] == []
    assert [str(p) for p in klass["planted"] if p.exists()] == []
    assert report_of(klass, "key")["total"] == FULL
    assert rows(report_of(klass, "half"))[:2] == rows(report_of(klass, "key"))[:2]


def test_no_submission_reaches_another_kernel(klass):
    """Its own connection file is found (the search works), no other kernel's is, while the
    hanging submission's kernel runs beside it; and it sees only its sandbox's processes."""
    found = probe(report_of(klass, "02-students"), "1.3")
    assert found["own_found"] and found["foreign"] == []
    assert found["pids"] < 10


# ---- 5. processes left behind -------------------------------------------------------------------

def test_a_detached_process_outlives_no_grading(klass):
    """Double-forked with setsid and an empty environment, it would overwrite the gradebook, a
    report and a marker file again and again from 3 s after it started: it was alive while its
    submission graded, and after grade_class and write_csv (and a few seconds more) it is gone
    and the files are exactly what the grader wrote."""
    assert klass["seen"][MARKS["detach"]] == 1
    time.sleep(max(0.0, klass["written"] + 4 - time.monotonic()))
    assert alive(MARKS.values()) == dict.fromkeys(MARKS.values(), 0)
    assert klass["grades"].read_bytes() == klass["csv"]
    assert klass["csv"].decode().startswith("file,lesson,")
    assert all(json.loads(v)["notebook"] for v in klass["json"].values())
    assert {p.name: p.read_bytes() for p in klass["reports_dir"].iterdir()} == klass["json"]
    assert not klass["marker"].exists()
    detach = report_of(klass, "01-detach")
    assert detach["total"] == FULL  # a process it left is no fault in its answers


# ---- 6. what is not a regular notebook ----------------------------------------------------------

def test_links_fifos_and_folders_are_refused_and_other_files_skipped(klass):
    by = klass["by"]
    for name in ("linked-key", "passwd", "x", "y"):
        assert by[name]["error"].startswith("refused"), by[name]
        assert by[name]["total"] == 0 and by[name]["exercises"] == []
    assert "symbolic link" in by["linked-key"]["error"]
    assert "symbolic link" in by["passwd"]["error"]
    _, refused, skipped = submissions(klass["folder"])
    assert {p.name for p in skipped} == {"notes.txt", "README"}
    assert {p.stem for p in refused} == {"linked-key", "passwd", "x", "y"}
    assert "notes" not in by and "README" not in by
    table = {r["file"]: r for r in gradebook_rows(klass["reports"])}
    assert table["x.ipynb"]["errors"].startswith("refused")


def test_write_csv_replaces_links_and_never_writes_through_them(klass, tmp_path):
    precious = tmp_path / "precious.txt"
    precious.write_text("the teacher's file\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    reports_dir = tmp_path / "reports"
    reports_dir.mkdir()
    link = tmp_path / "grades.csv"
    link.symlink_to(precious)
    (reports_dir / "key.json").symlink_to(precious)
    write_csv(klass["reports"], link, reports_dir)
    assert precious.read_text() == "the teacher's file\n"
    assert not link.is_symlink() and link.read_bytes() == klass["csv"]
    assert not (reports_dir / "key.json").is_symlink()
    assert json.loads((reports_dir / "key.json").read_text())["total"] == FULL
    # a reports folder that is a link to another folder is refused, and nothing lands there
    linked_dir = tmp_path / "linked-reports"
    linked_dir.symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(OSError):
        write_csv(klass["reports"], tmp_path / "g2.csv", linked_dir)
    assert list(elsewhere.iterdir()) == []
    assert fresh_folder(reports_dir) and "not an empty folder" in fresh_folder(reports_dir)
    assert fresh_folder(linked_dir) and "symbolic link" in fresh_folder(linked_dir)
    assert fresh_folder(elsewhere) is None and fresh_folder(tmp_path / "new") is None


# ---- 7. limits, per submission ------------------------------------------------------------------

def test_memory_past_the_limit_costs_only_the_hog(klass):
    """Three children of 800 MB each (every page written) under 1.5 GB together: enough of
    them were ended (SIGKILL: by the memory cgroup's out-of-memory killer where the grader may
    make one, else by the grader's watch, which ends all three) for the rest to fit, the
    kernel went on, and the hog's other exercises kept the key's points."""
    hog = report_of(klass, "05-hog")
    codes = probe(hog, "1.1")["codes"]
    killed = codes.count(-signal.SIGKILL)
    assert killed >= 1 and killed + codes.count(0) == 3 and (3 - killed) * 800 < 1536, codes
    assert "GiB" in problems(hog) and "the class allows" in problems(hog)
    assert rows(hog, LATER) == rows(report_of(klass, "key"), LATER)


def test_a_fork_bomb_is_held_to_the_process_limit(klass):
    """200 sleepers under processes=64, forked by a bare Python (a third leaving the kernel's
    process group, a third its session), then 200 more started by the kernel itself, three
    times 1 s apart: the bomb's other exercises keep the key's points, none of its processes
    is left, and the kernel never had more than the limit alive at once."""
    forker = report_of(klass, "06-forker")
    found = probe(forker, "1.1")  # the cell ran to its end
    assert rows(forker, LATER) == rows(report_of(klass, "key"), LATER)
    assert klass["seen"][MARKS["fork"]] > 0  # they were alive while it graded
    assert alive([MARKS["fork"]])[MARKS["fork"]] == 0
    assert 0 < found["most"] <= LIMITS.processes, (
        f"{found['most']} of its sleepers were alive at once ({found})")


def test_printing_200_mb_costs_nothing(klass):
    printer = report_of(klass, "07-printer")
    assert rows(printer) == rows(report_of(klass, "key")), printer["problems"]
    assert printer["elapsed_s"] < TIMEOUT


def test_a_grade_log_flood_is_cut_at_the_output_limit(klass):
    """100,000 "passed" records (7 MB) past the class's 4 MB: the sandbox is ended as soon as
    the limit is reached, well before the time limit, and no record earns a point."""
    flood = report_of(klass, "08-flood")
    assert "output limit" in problems(flood)
    assert rows(flood, ["1.1"])[0][2] == 0
    assert flood["elapsed_s"] < TIMEOUT / 2
    assert all(len(e["attempts"]) <= 21 for e in flood["exercises"])


def test_no_folder_holds_more_than_the_disk_limit(klass):
    """Up to 80 MB in every folder a submission may write (its own tmpfs, /dev/shm, and the
    folders bubblewrap made for it: /, /etc, /dev): none takes more than disk_mb."""
    written = probe(report_of(klass, "11-disk"), "1.1")
    assert 0 < written["/sandbox/work"] <= LIMITS.disk_mb, written
    assert {f: mb for f, mb in written.items() if mb > LIMITS.disk_mb} == {}
    assert rows(report_of(klass, "11-disk"), LATER) == rows(report_of(klass, "key"), LATER)


def test_the_grader_memory_stays_bounded(klass):
    assert klass["rss_growth"] < 300 * 2**20, f"{klass['rss_growth'] / 2**20:.0f} MB"


# ---- 8. the time limit --------------------------------------------------------------------------

def test_a_hanging_submission_ends_at_the_time_limit_with_all_it_started(klass):
    hang = report_of(klass, "00-hang")
    assert TIMEOUT - 10 <= hang["elapsed_s"] <= TIMEOUT + 5, hang["elapsed_s"]
    assert klass["seen"][MARKS["hang"]] == 1  # its detached sleeper was alive meanwhile
    assert alive([MARKS["hang"]])[MARKS["hang"]] == 0
    assert hang["total"] == 0
    assert "time limit" in problems(hang)


# ---- 9. environment and network -----------------------------------------------------------------

def test_the_teachers_environment_files_and_network_are_out_of_reach(klass):
    """The cell looks for the teacher's secret (set in the grader's environment, and in a file
    of the teacher's) in its environment, every /proc/*/environ and cmdline it can read, its
    HOME and the teacher's folders by their host paths; it connects to a server of the test on
    the host's loopback (TCP and an abstract unix socket), and looks for a way out."""
    found = probe(report_of(klass, "09-snoop"), "1.1")
    net = found["net"]
    assert net["host tcp"] != "ok" and net["host abstract unix"] != "ok", net
    assert net["route out"] != "ok" and net["resolve"] != "ok", net
    assert net["interfaces"] == ["lo"], net
    assert klass["connections"] == 0
    assert not set(SECRET_VARS) & set(found["env"])
    everything = klass["csv"].decode() + "".join(v.decode() for v in klass["json"].values())
    assert SECRET not in everything
    assert not any(SECRET in s for s in strings(klass["reports"]))
    # the teacher's files: out of sight; of the host's HOME only the folders that lead to the
    # Python environment the sandbox binds (read-only) are there, empty but for that path
    home = Path.home()
    bound = {Path(p).resolve() for p in (sys.prefix, sys.base_prefix, *site.getsitepackages())}
    leading = sorted({p.relative_to(home).parts[0] for p in bound if p.is_relative_to(home)})
    reachable = found["reachable"]
    assert reachable.pop(str(home), leading) == leading
    assert reachable == {}
    assert found["hits"] == [], f"the teacher's secret was readable in {found['hits']}"


# ---- 10. shell --------------------------------------------------------------------------------

def test_shell_escapes_and_bash_cells_are_flagged(klass):
    shell = report_of(klass, "10-shell")
    flagged = {(f["cell"], f["line"]) for f in shell["flags"] if f["what"] == "shell"}
    # cell 1 imports the exercises; cells 2 to 5 answer 1.1 to 1.4
    assert {(2, 1), (3, 1), (4, 1), (5, 2)} <= flagged, shell["flags"]
    for name in ("bang.txt", "bash.txt", "sx.txt", "system.txt"):
        assert not (klass["out"] / name).exists()


# ---- 11. CSV injection and control characters ---------------------------------------------------

def test_no_gradebook_cell_is_a_formula(klass):
    table = list(csv.reader(io.StringIO(klass["csv"].decode(), newline="")))
    header, body = table[0], table[1:]
    for row in body:
        for value in row:
            assert value[:1] not in ("=", "+", "-", "@", "\t", "\r"), (value, row)
    files = {row[header.index("file")]: row for row in body}
    assert f"'{CSV_NAME}.ipynb" in files
    bad = files[f"'{BAD_JSON_NAME}.ipynb"]
    assert bad[header.index("errors")].startswith(f"'{BAD_JSON_NAME}.ipynb is not a")
    injected = report_of(klass, CSV_NAME)
    assert '=HYPERLINK("x.invalid","see")' in problems(injected)  # shown, as text


def test_control_characters_a_cell_raises_never_reach_the_report(klass):
    injected = report_of(klass, CSV_NAME)
    raised = rows(injected, ["1.2"])[0]
    assert raised[1] == "error" and "red" in raised[3] and "bell" in raised[3]
    for report in klass["reports"]:
        if Path(report["notebook"]).stem != ESCAPE_NAME:
            bad = [s for s in strings(report) if CONTROL.search(s)]
            assert bad == [], bad


def test_control_characters_in_a_file_name_never_reach_the_gradebook(klass):
    """A file named with terminal escapes (clearing the screen) gets its row, its name shown
    without them, in the reports, the CSV and the printed table alike."""
    escaped = next(r for r in klass["reports"] if "wipe" in r["notebook"])
    assert "not a Jupyter notebook" in escaped["error"]
    assert [s for s in strings(escaped) if CONTROL.search(s)] == []
    assert not CONTROL.search(klass["csv"].decode().replace("\r\n", "\n").replace("\n", ""))


def test_the_class_took_its_time_together(klass):
    """One run grades them all: the hanging one bounds it, with the rest beside it."""
    assert len(klass["reports"]) == len(list(klass["folder"].glob("*.ipynb")))
    assert klass["took"] < 3 * TIMEOUT
    assert stat.S_ISFIFO(os.lstat(klass["folder"] / "x.ipynb").st_mode)  # left as it was
