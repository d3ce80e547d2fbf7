"""mplab's from-scratch GradScaler against torch.amp.GradScaler: time per iteration, side by side.

    python benchmarks/bench_scaler.py              # 1 thread, 30 repetitions
    python benchmarks/bench_scaler.py --reps 60 --threads 2

One iteration is what a training loop asks of the scaler around an fp32 AdamW step:
``scale(loss)``, ``unscale_`` (inf/NaN check and unscaling), ``step`` (the host sync and
``AdamW.step``) and ``update``. The backward pass is left out of every timing: before each
repetition the same scaled gradients are copied back into ``.grad``, untimed. torch checks and
unscales in one fused C++ kernel; mplab in two public ops (``aminmax``, ``_foreach_mul_``).

Two workloads: ~9M parameters in 200 tensors shaped like a small transformer (16 layers of
width 192, 8192-token embedding), where memory traffic dominates, and 200 tensors of 64 values,
where Python overhead dominates; and, where torch has it on CPU, fused AdamW, with and without
the explicit ``unscale_`` (without it the scaler only checks). Repetitions of the two scalers
are interleaved (alternating which goes first) and medians are reported.
Target: at most 1.3x torch for the 9M model's AdamW iteration.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from mplab.amp.scaler import GradScaler

TARGET_RATIO = 1.3


def transformer_shapes(width=192, layers=16, vocab=8192, context=512) -> list[tuple[int, ...]]:
    """Parameter shapes of a small GPT-like model: 8 + 12 per layer tensors (200 for 16)."""
    shapes = [(vocab, width), (context, width), (width,), (width,)]  # embeddings, their norm
    for _ in range(layers):
        shapes += [(width,), (width,), (3 * width, width), (3 * width,), (width, width), (width,)]
        shapes += [(width,), (width,), (4 * width, width), (4 * width,), (width, 4 * width)]
        shapes += [(width,)]
    return shapes + [(width,), (width,), (2, width), (2,)]  # final norm, classifier


class Workload:
    """Parameters, one AdamW per scaler, and a fixed set of scaled gradients to restore."""

    def __init__(self, shapes, fused=False, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.grads = [torch.randn(s, generator=g) * 2.0**16 for s in shapes]  # already scaled
        self.runs = {}
        for name, cls in (("torch", torch.amp.GradScaler), ("mplab", GradScaler)):
            params = [torch.nn.Parameter(torch.randn(s, generator=g) * 0.02) for s in shapes]
            opt = torch.optim.AdamW(params, lr=1e-4, fused=fused or None)
            self.runs[name] = (params, opt, cls("cpu"))
        self.loss = torch.tensor(2.5)

    def restore(self, name):
        params, _, _ = self.runs[name]
        for p, g in zip(params, self.grads):
            if p.grad is None:
                p.grad = g.clone()
            else:
                p.grad.copy_(g)

    def iteration(self, name, unscale=True) -> float:
        """Seconds for scale, unscale_, step and update."""
        _, opt, scaler = self.runs[name]
        self.restore(name)
        start = time.perf_counter()
        scaler.scale(self.loss)
        if unscale:
            scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
        return time.perf_counter() - start

    def step_only(self, name) -> float:
        """Seconds for scale, step and update: a fused optimizer then unscales by itself."""
        return self.iteration(name, unscale=False)

    def unscale_only(self, name) -> float:
        """Seconds for unscale_ alone: the part of the scaler that touches every gradient."""
        _, opt, scaler = self.runs[name]
        self.restore(name)
        scaler.scale(self.loss)
        start = time.perf_counter()
        scaler.unscale_(opt)
        elapsed = time.perf_counter() - start
        scaler.update()
        return elapsed


def compare(workload: Workload, measure: str, reps: int) -> dict[str, float]:
    """Median milliseconds per implementation, repetitions interleaved."""
    times = {"torch": [], "mplab": []}
    for rep in range(reps + 2):  # the first two warm up caches and allocators
        order = ("torch", "mplab") if rep % 2 else ("mplab", "torch")
        for name in order:
            elapsed = getattr(workload, measure)(name)
            if rep >= 2:
                times[name].append(elapsed)
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (0: default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:  # fused AdamW runs on CPU from torch 2.4
        p = torch.nn.Parameter(torch.ones(1))
        p.grad = torch.ones(1)
        torch.optim.AdamW([p], fused=True).step()
        has_fused = True
    except (RuntimeError, TypeError):
        has_fused = False

    big = transformer_shapes()
    tiny = [(64,)] * 200
    cases = [
        ("9M model, AdamW", big, False, "iteration"),
        ("9M model, unscale_ only", big, False, "unscale_only"),
        ("200 tiny tensors, AdamW", tiny, False, "iteration"),
        ("200 tiny tensors, unscale_ only", tiny, False, "unscale_only"),
    ]
    if has_fused:  # fused optimizers can unscale in their own kernel: the scaler only checks
        cases += [("9M model, fused AdamW", big, True, "iteration"),
                  ("9M model, fused AdamW, no unscale_", big, True, "step_only")]

    n_params = sum(torch.Size(s).numel() for s in big)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), {args.reps} reps")
    print(f"9M model: {n_params:,} parameters in {len(big)} tensors")
    print(f"{'':36}{'torch ms':>10}{'mplab ms':>10}{'ratio':>8}")
    ratios = {}
    for label, shapes, fused, measure in cases:
        ms = compare(Workload(shapes, fused), measure, args.reps)
        ratios[label] = ms["mplab"] / ms["torch"]
        print(f"{label:36}{ms['torch']:10.3f}{ms['mplab']:10.3f}{ratios[label]:7.2f}x")
    ratio = ratios["9M model, AdamW"]
    verdict = "within" if ratio <= TARGET_RATIO else "OVER"
    print(f"9M model iteration: {ratio:.2f}x torch, {verdict} the {TARGET_RATIO}x target")


if __name__ == "__main__":
    main()
