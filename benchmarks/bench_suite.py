"""Where the test suite's time goes: the README's test command, timed per part.

    python benchmarks/bench_suite.py                  # the whole suite
    python benchmarks/bench_suite.py -m "not browser" # any pytest arguments

Runs `python -m pytest` once (with a JUnit report) and prints the seconds per test file, the
slowest tests, and the wall time against the 12 minutes the suite may take on 2 AVX2 cores
(the suite runs on two workers, so the tests' seconds add up to more than the wall time).
The suite passes or fails as it would; this script's exit status is pytest's.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

from mplab._display import Table
from mplab.hardware import describe

BUDGET_S = 12 * 60
ROOT = Path(__file__).resolve().parent.parent


def main(argv: list[str]) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "junit.xml"
        started = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                               f"--junitxml={report}", *argv], cwd=ROOT)
        wall = time.perf_counter() - started
        cases = ET.parse(report).getroot().iter("testcase")
        times = [(c.get("classname", ""), c.get("name", ""), float(c.get("time", 0)))
                 for c in cases]
    per_file: dict[str, list[float]] = defaultdict(list)
    for classname, _, seconds in times:
        per_file[classname.split(".")[-1]].append(seconds)
    total = sum(t for *_, t in times)
    print()
    print(Table([{"file": name, "tests": len(ts), "seconds": round(sum(ts), 1),
                  "share": f"{sum(ts) / total:.0%}" if total else "-"}
                 for name, ts in sorted(per_file.items(), key=lambda kv: -sum(kv[1]))],
                title=f"the suite per file on {describe('cpu')}"))
    print()
    slowest = sorted(times, key=lambda t: -t[2])[:15]
    print(Table([{"test": f"{c.split('.')[-1]}::{n}", "seconds": round(t, 1)}
                 for c, n, t in slowest], title="the slowest tests"))
    verdict = "within" if wall <= BUDGET_S else "OVER"
    print(f"\n{wall:.0f} s from start to end, {verdict} the {BUDGET_S // 60} min budget on 2 AVX2 "
          f"cores ({total:.0f} s in the tests, summed over the workers)")
    return done.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
