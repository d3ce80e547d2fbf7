"""Reference results: bench records measured on other machines, beside the learner's own.

A reference is one JSON file per measured machine in data/reference/: the record that
`python -m mplab.bench --json FILE` writes, "meta" included (date, device, versions, command,
preset). `bash benchmarks/gpu_check.sh` writes one named by `reference_filename`; nothing
else puts figures there, and with no file mplab shows no figure for that hardware.

    refs = reference_results()                      # [] until a GPU run is committed
    compare_with_reference(lesson_bench(), refs)    # a Table: your rows beside theirs
    explain_reference(mine, refs)                   # the same in a sentence or two
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from mplab._display import Table
from mplab.data import DATA_DIR

__all__ = ["REFERENCE_DIR", "ROW_KEYS", "META_KEYS", "reference_results", "reference_filename",
           "reference_label", "compare_with_reference", "explain_reference"]

REFERENCE_DIR = DATA_DIR / "reference"
ROW_KEYS = ("workload", "kind", "precision", "throughput", "unit", "speedup_vs_fp32")
META_KEYS = ("date", "device", "torch", "preset", "command")
_HOW = ("a reference is the record `python -m mplab.bench --json FILE` writes, with its "
        "\"meta\" (see data/reference/README.md)")


def reference_results(folder: str | Path | None = None) -> list[dict]:
    """The reference records in `folder` (default: the repository's data/reference/), one per
    `*.json` file in name order, each as written plus "file" (its path). A file that cannot be
    read, is not JSON, or is not a bench record raises ValueError naming it."""
    if folder is None:
        folder = REFERENCE_DIR
        if not folder.is_dir():
            return []
    folder = Path(folder).expanduser()
    if not folder.is_dir():
        raise ValueError(f"reference folder {str(folder)!r} does not exist (or is not a "
                         "folder); the repository's is data/reference/")
    return [_load(path) for path in sorted(folder.glob("*.json"))]


def _load(path: Path) -> dict:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"reference file {str(path)!r} cannot be read: {err}") from None
    try:
        record = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"reference file {str(path)!r} is not valid JSON ({err.msg} at line "
                         f"{err.lineno}, column {err.colno}); {_HOW}") from None
    problem = _problem(record)
    if problem:
        raise ValueError(f"reference file {str(path)!r} is not a bench record: {problem}; "
                         f"{_HOW}")
    return record | {"file": str(path)}


def _problem(record) -> str:
    """What makes `record` not a bench record with meta ("" if nothing)."""
    if not isinstance(record, dict):
        return f"it holds a JSON {type(record).__name__}, not an object"
    meta = record.get("meta")
    if not isinstance(meta, dict):
        return "it has no \"meta\" object"
    missing = [k for k in META_KEYS if k not in meta]
    if missing:
        return f"its \"meta\" lacks {', '.join(map(repr, missing))}"
    rows = record.get("rows")
    if not isinstance(rows, list) or not rows:
        return "it has no \"rows\" (a non-empty list)"
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            return f"rows[{i}] is not an object"
        lacks = [k for k in ROW_KEYS if k not in row]
        if lacks:
            return f"rows[{i}] lacks {', '.join(map(repr, lacks))}"
    return ""


def reference_filename(record: dict) -> str:
    """The file name a record takes in data/reference/: bench_<device>_<date>.json, e.g.
    bench_nvidia-h200_2025-01-31.json (the GPU's name, else the CPU's; the UTC date)."""
    problem = _problem(record)
    if problem:
        raise ValueError(f"not a bench record with meta: {problem}")
    meta = record["meta"]
    device = meta.get("gpu") or meta["device"].split(" (")[0]
    slug = re.sub(r"[^a-z0-9]+", "-", device.lower()).strip("-") or "device"
    return f"bench_{slug}_{meta['date'][:10]}.json"


def reference_label(record: dict) -> str:
    """A reference's name in a table: its device and date, e.g. 'NVIDIA H200, 2025-01-31'."""
    meta = record["meta"]
    device = meta.get("gpu") or meta["device"].removeprefix("cpu: ").split(" (")[0]
    return f"{device}, {meta['date'][:10]}"


def compare_with_reference(mine: dict, references: list[dict]) -> Table:
    """Your rows (a bench record: `lesson_bench()`, a `--json` file) beside each reference's
    row of the same workload and precision: speed-up over fp32, throughput and MFU. "-" where
    a reference has no such row (a size it did not run, a precision it lacks)."""
    rows = _rows(mine, "mine")
    labels = _labels(references)
    twins = [{(r["workload"], r["precision"]): r for r in _rows(ref, f"references[{i}]")}
             for i, ref in enumerate(references)]
    table = []
    for r in rows:
        line = {"workload": r["workload"], "precision": r["precision"], "unit": r["unit"],
                "your vs fp32": _rounded(r["speedup_vs_fp32"], 2),
                "your throughput": _rounded(r["throughput"], 1),
                "your MFU": _rounded(r.get("mfu"), 3)}
        for label, theirs in zip(labels, twins):
            twin = theirs.get((r["workload"], r["precision"]))
            line[f"{label}: vs fp32"] = _rounded(twin and twin["speedup_vs_fp32"], 2)
            line[f"{label}: throughput"] = _rounded(twin and twin["throughput"], 1)
            line[f"{label}: MFU"] = _rounded(twin and twin.get("mfu"), 3)
        table.append(line)
    matched = sum(any((r["workload"], r["precision"]) in t for t in twins) for r in rows)
    where = mine.get("device", "this machine")
    title = (f"your run ({where}) beside {len(references)} reference run"
             f"{'s' * (len(references) != 1)}: {matched} of {len(rows)} rows matched by "
             "workload and precision" if references else
             f"your run ({where}); no reference run recorded")
    return Table(table, title=title)


def explain_reference(mine: dict, references: list[dict]) -> str:
    """In words: what the references say beside your run, or that there are none (and so no
    figure for hardware nobody measured)."""
    rows = _rows(mine, "mine")
    if not references:
        return ("No reference GPU run has been recorded yet (data/reference/ holds none), so "
                "there is nothing to set beside your figures: mplab shows no figure for "
                "hardware nobody measured. A session with a GPU records one with "
                "`bash benchmarks/gpu_check.sh` (data/reference/README.md says how).")
    sentences = []
    for label, ref in zip(_labels(references), references):
        theirs = {(r["workload"], r["precision"]): r for r in ref["rows"]}
        pairs = [(r, theirs[r["workload"], r["precision"]]) for r in rows
                 if (r["workload"], r["precision"]) in theirs]
        meta = ref["meta"]
        head = (f"{label} ({meta['preset']} run, torch {meta['torch']}): "
                f"{len(pairs)} of your {len(rows)} rows have a twin there")
        low = [(r, t) for r, t in pairs
               if r["kind"] == "model" and r["precision"] != "fp32"
               and r["speedup_vs_fp32"] is not None and t["speedup_vs_fp32"] is not None]
        if low:
            r, t = max(low, key=lambda pair: (pair[0].get("parameters") or 0,
                                              pair[0]["precision"] == "bf16"))
            batch = (f", batch {r['batch_size']} here and {t['batch_size']} there"
                     if r.get("batch_size") and t.get("batch_size") else "")
            head += (f"; at {r['workload']}, {r['precision']} ran {r['speedup_vs_fp32']:.2f}× "
                     f"fp32 here and {t['speedup_vs_fp32']:.2f}× there ({r['throughput']:.0f} "
                     f"against {t['throughput']:.0f} {r['unit']}{batch})")
        elif not pairs:
            head += (" (it measured " + ", ".join(dict.fromkeys(t["workload"]
                                                               for t in ref["rows"]))
                     + ")")
        sentences.append(head + ".")
    return " ".join(sentences)


def _rows(record: dict, name: str) -> list[dict]:
    if not isinstance(record, dict) or not isinstance(record.get("rows"), list):
        raise ValueError(f"{name} must be a bench record (a dict with 'rows', as lesson_bench() "
                         f"returns and --json writes), got {type(record).__name__}")
    return record["rows"]


def _labels(references: list[dict]) -> list[str]:
    if not isinstance(references, list | tuple):
        raise ValueError("references must be a list of records, as reference_results() "
                         f"returns, got {type(references).__name__}")
    labels = []
    for i, ref in enumerate(references):
        problem = _problem(ref)
        if problem:
            raise ValueError(f"references[{i}] is not a bench record with meta: {problem}")
        label = reference_label(ref)
        labels.append(label if label not in labels else f"{label} #{i + 1}")
    return labels


def _rounded(value, digits: int):
    return "-" if value is None else round(value, digits)
