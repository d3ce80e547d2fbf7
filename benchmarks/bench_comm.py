"""The gradients' trip across processes, side by side (lesson 8): DDP's fp32 all-reduce against
its bf16 and fp16 compress hooks, and FSDP2's reduce-scatter in fp32 against bf16.

    python benchmarks/bench_comm.py                 # 2 processes, gloo: about a minute on 2 cores
    python benchmarks/bench_comm.py --nproc 4 --steps 40

All runs start in one torchrun job (`mplab.train.launch`), train the lesson model in fp32
compute (so only the communication differs) on the same batches, and report, per run: the
bytes rank 0 handed to its gradient collectives in one step (counted where they were sent),
the median step time and its ratio to the fp32 run of the same kind, and the mean of the last
10 losses against that run's. On one machine's loopback gloo the bytes halve but the time
barely moves: the lesson model's 1.3 MB is no load; across machines the wire is the cost.
"""

from __future__ import annotations

import argparse
import statistics

from mplab._display import Table
from mplab.train.launch import train_across


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=30)
    args = p.parse_args()
    common = dict(precision="fp32", steps=args.steps, batch_size=8, eval_samples=0,
                  model="lesson-pretrained", warmup_steps=0)
    runs = {("ddp", "fp32"): dict(path="torch"),
            ("ddp", "bf16"): dict(path="torch", comm_hook="bf16"),
            ("ddp", "fp16"): dict(path="torch", comm_hook="fp16"),
            ("fsdp", "fp32"): dict(path="fsdp"),
            ("fsdp", "bf16"): dict(path="fsdp", reduce_dtype="bf16")}
    results = dict(zip(runs, train_across(args.nproc, *({**common, **r} for r in runs.values()))))
    rows = []
    for (kind, dtype), result in results.items():
        base = results[kind, "fp32"]
        sent = sum(c["bytes"] for c in result.ranks[0]["collectives"]
                   if c["op"] in ("all_reduce", "reduce_scatter"))
        mean, base_mean = (statistics.mean(r.losses[-10:]) for r in (result, base))
        rows.append({"run": f"{kind}, gradients in {dtype}", "bytes / step": sent,
                     "step ms": round(result.steady_step_seconds * 1e3, 2),
                     "time vs fp32": round(result.steady_step_seconds
                                           / base.steady_step_seconds, 3),
                     "loss vs fp32": f"{(mean - base_mean) / base_mean:+.3%}"})
    print(Table(rows, title=f"{args.nproc} processes (gloo), {args.steps} steps, lesson model"))


if __name__ == "__main__":
    main()
