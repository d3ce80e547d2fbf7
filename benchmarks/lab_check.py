"""Every failure of mplab.diagnosis.lab and its first fix, on one device: does diagnose name the
failure in the broken run, and stop naming it after the fix? Prints a table and the time of each
run.

    python benchmarks/lab_check.py                     # device auto (a GPU if there is one)
    python benchmarks/lab_check.py --device cuda --json lab_cuda.json

Three failures are a CPU's by nature (fp16 ignored, low precision without units, a GPU's
autocast line in a CPU run) and always run there; one the CPU cannot show (no_units, where it
has bf16 and fp16 units) is reported as such.
"""

from __future__ import annotations

import argparse
import inspect
import json
import time
import warnings

from mplab._display import Table
from mplab.diagnosis import diagnose, lab
from mplab.hardware import describe


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="auto", help="auto (default), cpu or cuda")
    p.add_argument("--json", metavar="FILE", help="write the rows as JSON to FILE")
    args = p.parse_args(argv)
    warnings.simplefilter("ignore")
    rows = []
    for name, failure in lab.FAILURES.items():
        settings = ({"device": args.device}
                    if "device" in inspect.signature(failure.runner).parameters else {})
        row = {"failure": name}
        try:
            for label, fix in (("broken", None), ("fixed", failure.fixes[0])):
                started = time.perf_counter()
                found = diagnose(failure.run(fix, **settings))
                row[f"{label} s"] = round(time.perf_counter() - started, 2)
                row[f"{label}: found"] = name in found
                row[f"{label}: cause"] = found.cause or "-"
            row["ok"] = row["broken: found"] and failure.fixed_in(found)
        except lab.CannotReproduce as err:  # a failure this machine cannot show
            row |= {"ok": True, "broken: cause": f"not here: {err}"[:60]}
        rows.append(row)
    table = Table(rows, title=f"mplab.diagnosis.lab on {describe(args.device)}")
    print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": describe(args.device), "rows": rows}, f, indent=1)
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
