"""python -m mplab.bench: will mixed precision help on this machine, and why?

    python -m mplab.bench --quick                       # CPU: few sizes (benchmarks/RECORDS.md)
    python -m mplab.bench --device cuda --json bench.json --plot bench.png

Measures fp32 against bf16 and fp16 (and tf32 on a GPU), side by side in one run: a matmul
sweep (sizes that are and are not multiples of 8), then the lesson transformer's training step
through `mplab.train` from the lesson model up to sizes where low precision pays (and on a GPU
a >= 100M-parameter model); then the quantisers' own cost, mplab's FP8/MX/NVFP4 recipes against
torchao's on one CPU thread (`mplab.bench.quantizers`). Prints a table, each row's explanation,
the crossover, the targets and the quantisers' table; `--json` writes the record
(`mplab.bench.record`): {"device", "rows": [...], "crossover", "targets", "meta": {date, device,
versions, command, preset}, "quantizers": {"title", "note", "rows"}, ...}, `--plot` the
speed-up and memory figure.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from mplab.hardware import describe, recommended_precision, resolve_device

from .quantizers import PRESETS, quantizer_record, quantizer_speed, quantizer_table
from .record import cli_command, finite, record_table, run_plan
from .share import training_share
from .sweep import Plan

__all__: list[str] = []


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m mplab.bench",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="few sizes and steps (a CPU run takes under a minute)")
    p.add_argument("--device", default="auto", help="auto (default), cpu or cuda")
    p.add_argument("--json", metavar="FILE",
                   help="write the record (rows, crossover, targets, meta) as JSON to FILE")
    p.add_argument("--plot", metavar="FILE", help="write the speed-up and memory figure (PNG)")
    p.add_argument("--share", action="store_true",
                   help="also the share of one layer's bf16 GEMM speed-up a bf16 training step "
                        "keeps (hidden 512, 4 layers, 3 rounds: about 20 s on 2 CPU cores)")
    p.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)  # the tests' sizes
    p.add_argument("--lesson", action="store_true", help=argparse.SUPPRESS)  # lesson 7's plan
    args = p.parse_args(argv)
    args.command = cli_command(sys.argv[1:] if argv is None else list(argv))
    if args.device.lower() not in ("auto", "cpu", "cuda") and not args.device.startswith("cuda:"):
        p.error(f"--device {args.device!r}: accepted: auto, cpu, cuda")
    for flag in ("json", "plot"):
        file = getattr(args, flag)
        if file is not None and not Path(file).expanduser().parent.is_dir():
            p.error(f"--{flag} {file!r}: the folder {str(Path(file).parent)!r} does not exist")
    return args


def run(args: argparse.Namespace) -> dict:
    """Measure, explain and record (`record.run_plan`, lesson 7's path too), then print the
    record; return what --json writes."""
    dev = resolve_device(args.device)
    plan = Plan.for_device(dev.type, quick=args.quick, tiny=args.tiny,
                           lesson=getattr(args, "lesson", False))
    print(f"mplab.bench on {describe(dev.type)}; torch {torch.__version__}")
    print("to train in here: {} ({})".format(*recommended_precision(dev)))
    print(f"{plan.name} run: precisions {', '.join(plan.precisions)}; "
          f"{plan.steps} training steps per row (the first is warm-up)\n", flush=True)

    def progress(row):
        print(f"  {row.workload:<28} {row.precision:<5} {row.throughput:10.1f} {row.unit}",
              flush=True)

    result = run_plan(plan, progress, command=getattr(args, "command", None))
    if not getattr(args, "lesson", False):  # --lesson's record is lesson_bench's: none there
        result["quantizers"] = quantizers(plan.name)
    if getattr(args, "share", False):
        result["share"] = share = training_share(device=dev.type)
    report(result)
    if getattr(args, "share", False):
        print(f"\nbf16 against fp32, hidden 512 / 4 layers, medians of "
              f"{len(share['rounds'])} rounds: one layer's GEMMs at {share['tokens']} tokens "
              f"{share['gemm_speedup']:.2f}x, a training step through mplab.train "
              f"{share['step_speedup']:.2f}x: the step keeps {share['share']:.2f} of the GEMMs' "
              f"speed-up (attention: {share['attention']})")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.json}")
    if args.plot:
        from .plot import bench_plot

        bench_plot(result).savefig(args.plot)
        print(f"wrote {args.plot}")
    return result


def quantizers(preset: str) -> dict | None:
    """The quantisers' cost at the preset's size, as record data (None without torchao)."""
    kwargs = PRESETS.get(preset, PRESETS["full"])
    print(f"\nquantisers, mplab against torchao, a {kwargs['size'][0]}×{kwargs['size'][1]} "
          "tensor on one CPU thread:", flush=True)

    def progress(row):
        print(f"  {row['recipe']:<16} mplab {row['mplab M values/s']:8.1f}, torchao "
              f"{row['torchao M values/s']:8.1f} M values/s", flush=True)

    try:
        return finite(quantizer_record(quantizer_speed(**kwargs, progress=progress)))
    except ImportError as err:
        print(f"  skipped: {err}")
        return None


def report(result: dict) -> None:
    """Print a record: the table, each row's why, the skips, MFU, crossover and targets."""
    rows, cuda = result["rows"], result["device_type"] == "cuda"
    print()
    print(record_table(result))
    print("\nWhy:")
    for r in rows:
        if r["explanation"]:
            print(f"  {r['workload']}, {r['precision']}: {r['explanation']}.")
    for note in result["skipped"]:
        print(f"  {note}")
    print("\nUtilisation (MFU): model FLOPs per step = 6 × (parameters in matmuls) × tokens + "
          "12 × layers × hidden × sequence length × tokens (forward + backward), over the "
          "step's time, against "
          + ("the GPU's datasheet peak in that precision." if cuda else
             "the best matmul throughput measured on this machine in that precision (the "
             "matmul sweep above): a CPU publishes no peak per precision. On a CPU both are "
             "timed on one thread, so that a busy second core cannot stall them."))
    print("\nWill it help? The crossover (smallest size where low precision beats fp32 by "
          "10 % or more):")
    for c in result["crossover"]:
        print(f"  {c['text']}")
    print("\nTargets:")
    for line in result["targets"]:
        print(f"  {line}")
    if result.get("quantizers"):
        print()
        print(quantizer_table(result["quantizers"]))
    print(f"\n{len(rows)} rows in {result['seconds']:.0f} s")


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        run(args)
    except ValueError as err:  # a device this machine lacks, a size it cannot run
        print(f"mplab.bench: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
