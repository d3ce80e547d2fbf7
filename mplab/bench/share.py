"""How much of the hardware's bf16 speed-up a training step keeps: the bf16/fp32 step speed
through `mplab.train`, divided by the bf16/fp32 speed of the GEMMs of one of the model's layers
(its bound: a step cannot gain more than its matmuls do), both measured in one run.

    share = training_share(hidden=512, layers=4)   # {"gemm_speedup", "step_speedup", "share"}
    python -m mplab.bench --share                  # the same, printed
    python benchmarks/bench_share.py               # the same, several rounds

A share well below 1 means the step loses time outside its matmuls (an op slower in bf16, the
loop's own work); benchmarks/RECORDS.md "attention backend" is one such op, found this way.
"""

from __future__ import annotations

import statistics
import time
import warnings

import torch

from mplab.hardware import resolve_device, synchronize

from .speed import model_shape

__all__ = ["gemm_speedup", "training_share"]


def gemm_speedup(hidden: int, intermediate: int, tokens: int, device="auto",
                 repeats: int = 5) -> dict:
    """The forward and backward GEMMs of one transformer layer (q, k, v and output projections
    of `hidden`, the feed-forward's two of `intermediate`) for `tokens` rows, timed in fp32 and
    in bf16 taking turns, on torch's threads: {"fp32_s", "bf16_s", "speedup"} (medians)."""
    dev = resolve_device(device)
    gen = torch.Generator().manual_seed(0)
    shapes = [(hidden, hidden)] * 4 + [(hidden, intermediate), (intermediate, hidden)]
    made = {}
    for dtype in (torch.float32, torch.bfloat16):
        made[dtype] = [(torch.randn(tokens, n_in, generator=gen).to(dev, dtype),
                        torch.randn(n_out, n_in, generator=gen).to(dev, dtype),
                        torch.randn(tokens, n_out, generator=gen).to(dev, dtype))
                       for n_in, n_out in shapes]

    def layer(dtype) -> float:
        synchronize(dev)
        start = time.perf_counter()
        for x, w, grad in made[dtype]:
            x @ w.T  # forward
            grad @ w  # the input's gradient
            grad.T @ x  # the weight's gradient
        synchronize(dev)
        return time.perf_counter() - start

    times = {torch.float32: [], torch.bfloat16: []}
    for dtype in times:
        layer(dtype)  # warm-up
    for _ in range(repeats):
        for dtype in times:
            times[dtype].append(layer(dtype))
    fp32, bf16 = (statistics.median(times[d]) for d in (torch.float32, torch.bfloat16))
    return {"fp32_s": fp32, "bf16_s": bf16, "speedup": fp32 / bf16}


def training_share(hidden: int = 512, layers: int = 4, batch_size: int = 32,
                   max_length: int = 40, steps: int = 12, rounds: int = 3,
                   device="auto", watch: bool = True) -> dict:
    """The lesson transformer at `hidden`/`layers` trained `steps` steps through `mplab.train`
    in fp32 and in bf16, and one layer's GEMMs at the tokens a step computed on, in
    `rounds` rounds (the precisions' order alternating, so a shared machine's drift falls on
    both). A round's step speed-up is its throughput ratio: the fp32 run's steps after the
    first (warm-up) against the bf16 run's, the same batches; its share, that over the
    round's GEMM speed-up. Returns the medians over rounds, {"gemm_speedup",
    "step_speedup", "share", "fp32_step_s", "bf16_step_s", "tokens", "attention", "rounds"},
    "rounds" holding each round's figures. `watch=False`: the runs without the layers'
    watch (`TrainConfig.watch`), to see what it costs."""
    from mplab.models import lesson_model
    from mplab.train import TrainWarning, train

    if not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"rounds must be a whole number of at least 1, got {rounds!r}")
    shape = model_shape({"hidden_size": hidden, "num_hidden_layers": layers})
    dev = resolve_device(device)
    found, attention = [], None
    for r in range(rounds):
        step = {}
        for precision in ("fp32", "bf16") if r % 2 == 0 else ("bf16", "fp32"):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", TrainWarning)  # slow-hardware notes: said below
                run = train(model=lesson_model(**shape), precision=precision,
                            device=dev.type, steps=steps, batch_size=batch_size,
                            max_length=max_length, eval_samples=0, warmup_steps=0,
                            progress=False, watch=watch)
            step[precision] = statistics.mean(run.step_seconds[1:] or run.step_seconds)
            attention = run.attention if precision == "bf16" else attention
        # the bound at the tokens the steps really computed on (batches of similar length,
        # each padded to its longest review: fewer than batch_size * max_length)
        tokens = round(run.tokens_per_s * run.train_seconds / len(run.step_seconds))
        gemm = gemm_speedup(hidden, shape["intermediate_size"], tokens, dev)
        speedup = step["fp32"] / step["bf16"]
        found.append({"gemm_speedup": gemm["speedup"], "step_speedup": speedup,
                      "share": speedup / gemm["speedup"], "fp32_step_s": step["fp32"],
                      "bf16_step_s": step["bf16"], "tokens": tokens})
    median = {key: statistics.median(f[key] for f in found) for key in found[0]}
    return median | {"attention": attention, "rounds": found}
