"""A bench record read for whether low precision pays on its machine: per precision, no units
(it never pays), too small (it pays from some size up, or at no size measured), or it pays."""

from __future__ import annotations

from .findings import SEVERITIES, Diagnosis, Finding, emits

__all__ = ["diagnose_bench", "BENCH_CHECKS"]


@emits("no_units", "too_small", "pays")
def diagnose_bench(record: dict) -> Diagnosis:
    """Per low precision the benchmark trained: no units (it never pays), too small (it pays
    from some size up, or at no size measured), or it pays; in the record's own figures."""
    findings = []
    for found in record["crossover"]:
        p = found["precision"]
        models = [r for r in record["rows"] if r.get("kind") == "model" and r["precision"] == p]
        speeds = ", ".join(f"{r['workload'].removeprefix('train ')}: "
                           f"{r['speedup_vs_fp32']:.2f}× fp32" for r in models)
        evidence = [f"{p} trained {speeds}", found["text"]]
        if any(r.get("has_units") is False for r in models):
            findings.append(Finding("no_units", "warning",
                                    f"this device has no {p} units: {p} never pays here",
                                    evidence, f"train in fp32 here; {p} pays on hardware with "
                                    f"{p} units: a GPU, or a CPU with {_CPU_UNITS[p]}"))
        elif found["workload"] is None:
            findings.append(Finding("too_small", "warning",
                                    f"{p} paid at no size measured: the matrices are too small "
                                    "to keep the units busy", evidence,
                                    "stay in fp32 for models this size; measure larger ones "
                                    "(`python -m mplab.bench` without --quick)"))
        elif models and models[0]["speedup_vs_fp32"] < 1:
            findings.append(Finding("too_small", "note",
                                    f"{p} pays from {found['workload'].removeprefix('train ')} "
                                    "up; below that the matrices are too small", evidence,
                                    f"use {p} for models that size or larger"))
        else:
            findings.append(Finding("pays", "note", f"{p} pays at every size measured",
                                    evidence, ""))
    findings.sort(key=lambda f: SEVERITIES.index(f.severity))
    return Diagnosis(f"mplab.bench record on {record.get('device', '?')}", findings)


_CPU_UNITS = {"bf16": "AVX-512-BF16 or AMX", "fp16": "AVX-512-FP16 or AMX-FP16",
              "tf32": "none: tf32 is a GPU format"}



BENCH_CHECKS = (diagnose_bench,)
