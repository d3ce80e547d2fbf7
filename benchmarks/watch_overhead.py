"""The always-on watch's cost: a training step bare against the same step with a `Recorder`.

    python benchmarks/watch_overhead.py             # both models, 1 thread: about 1 minute
    python benchmarks/watch_overhead.py --model lesson --steps 200 --budget 40
    python benchmarks/watch_overhead.py --pieces    # the watch's parts, each timed alone
    python benchmarks/watch_overhead.py --model lesson --profile fp32   # where the cost goes

The figures in benchmarks/RECORDS.md ("watch overhead", "lab watch", "watch pieces") come
from the first and the third command.

Issue 34's target: the watch costs at most 10 % of a step of the lesson model.

On the lesson model (`mplab.models.lesson_model()`, 324 k parameters, batch 32: what the
lessons and `python -m mplab.train` train by default) and the failure lab's
(`mplab.diagnosis.lab.lab_model()`, batch `lab.BATCH`), the same training step (fp32; bf16
autocast; fp16 autocast + GradScaler) on the shipped reviews (`lab.lab_batches`, as the lab
draws them), by three copies of the model from the same weights, each with its AdamW:

- bare: the textbook loop, nothing attached;
- watched: with `Recorder(model, optimizer, scaler=..., autocast=...)` attached and
  `rec.step(loss)` called each step, everything on, as a user gets it;
- no layers: the same Recorder with its `LayerWatch` switched off (patched out here, in the
  benchmark only), so that the layer watch's own share is the difference.

The three take turns on each batch (the order rotating: ABC, BCA, CAB, ...), so a shared
machine's drift falls on all three alike; the first `--warmup` steps are left out; figures
are medians over the steps and the overhead is the median of the steps' ratios (watched /
bare of the same batch). `LayerWatch` measures the leaf modules against the formats at
step 1 and every `every` (10) steps: those steps ("sampled") are given apart, and the
"amortized" column weighs them in as 1 in `every`.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import math
import pstats
import statistics
import time
import warnings

import torch

import mplab.train.watch as watch_module
from mplab import models
from mplab._display import Table
from mplab.diagnosis import lab
from mplab.hardware import cpu_features, describe
from mplab.train import Recorder

TARGET = 0.10
PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
MODELS = {  # name: (how to build it, batch size)
    "lesson": (lambda: models.lesson_model(seed=0), 32),
    "lab": (lambda: lab.lab_model(seed=0), lab.BATCH),
    # issue 37's model: the bf16 share's (mplab.bench.training_share)
    "share": (lambda: models.lesson_model(seed=0, hidden_size=512, num_hidden_layers=4,
                                          num_attention_heads=8, intermediate_size=1024), 32),
}
ARMS = ("bare", "no layers", "watched")
MIN_STEPS = 10  # timed steps a setting runs whatever its budget


@contextlib.contextmanager
def layer_watch_off():
    """`StepLog` built inside builds no `LayerWatch` (the rest of the watch stays on)."""
    saved = watch_module.LayerWatch
    watch_module.LayerWatch = lambda model, *args, **kwargs: None
    try:
        yield
    finally:
        watch_module.LayerWatch = saved


class Arm:
    """One copy of the model, its optimizer and, unless bare, its Recorder."""

    def __init__(self, kind: str, make_model, precision: str):
        self.kind = kind
        self.model = make_model().train()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lab.LR)
        dtype = PRECISIONS[precision]
        self.autocast = torch.autocast("cpu", dtype=dtype or torch.bfloat16,
                                       enabled=dtype is not None)
        self.scaler = torch.amp.GradScaler("cpu", enabled=precision == "fp16")
        self.rec = None
        if kind != "bare":
            with layer_watch_off() if kind == "no layers" else contextlib.nullcontext():
                self.rec = Recorder(self.model, self.optimizer,
                                    scaler=self.scaler if self.scaler.is_enabled() else None,
                                    autocast=self.autocast)

    def step(self, batch: dict) -> float:
        """Seconds of one step (on the CPU every op has finished when it returns)."""
        start = time.perf_counter()
        with self.autocast:
            loss = self.model(**batch).loss
        self.scaler.scale(loss).backward()
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad()
        if self.rec is not None:
            self.rec.step(loss)
        return time.perf_counter() - start

    def finish(self) -> float:
        """Seconds of `Recorder.finish()` (the audit, once per run); 0 when bare."""
        if self.rec is None:
            return 0.0
        start = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.rec.finish()
        return time.perf_counter() - start


def measure(model_name: str, precision: str, steps: int, warmup: int,
            budget: float = float("inf")) -> dict:
    """Per arm, the seconds of each timed step (the same batches for all), and which of the
    timed steps the layer watch sampled. Stops early, after at least `MIN_STEPS` timed
    steps, once the setting has taken `budget` seconds (fp16 on a CPU without fp16 units)."""
    make_model, batch_size = MODELS[model_name]
    arms = [Arm(kind, make_model, precision) for kind in ARMS]
    every = next(a.rec.log.layers.every for a in arms if a.kind == "watched")
    seconds: dict[str, list[float]] = {kind: [] for kind in ARMS}
    sampled = []
    start = time.perf_counter()
    for i, batch in enumerate(lab.lab_batches(warmup + steps, batch_size=batch_size)):
        if len(sampled) >= MIN_STEPS and time.perf_counter() - start > budget:
            break
        turn = i % len(arms)
        for arm in arms[turn:] + arms[:turn]:
            took = arm.step(batch)
            if i >= warmup:
                seconds[arm.kind].append(took)
        n = i + 1  # the step's number, as the Recorder counts
        if i >= warmup:
            sampled.append(n == 1 or n % every == 0)
    finish = {arm.kind: arm.finish() for arm in arms}
    return {"seconds": seconds, "sampled": sampled, "every": every, "finish": finish}


def summary(found: dict) -> dict:
    """Medians (ms), and the overheads as medians of the steps' ratios to bare."""
    seconds, sampled, every = found["seconds"], found["sampled"], found["every"]
    plain = [i for i, s in enumerate(sampled) if not s]
    marked = [i for i, s in enumerate(sampled) if s]

    def ratio(kind: str, steps: list[int]) -> float:
        if not steps:
            return float("nan")
        return statistics.median(seconds[kind][i] / seconds["bare"][i] for i in steps)

    def ms(kind: str, steps: list[int]) -> float:
        return statistics.median(seconds[kind][i] for i in steps) * 1e3 if steps else float("nan")

    watched, layerless = ratio("watched", plain), ratio("no layers", plain)
    at_sample = ratio("watched", marked)
    amortized = watched if not marked else ((every - 1) * watched + at_sample) / every
    return {"bare ms": ms("bare", plain), "watched ms": ms("watched", plain),
            "overhead": watched - 1, "ratio": watched,
            "no layers ms": ms("no layers", plain), "no layers overhead": layerless - 1,
            "layer watch alone": watched - layerless,
            "sampled ms": ms("watched", marked), "sampled ratio": at_sample,
            "amortized": amortized - 1, "steps": len(plain), "sampled steps": len(marked),
            "finish ms": found["finish"]["watched"] * 1e3}


def profile(model_name: str, precision: str, steps: int, warmup: int, top: int = 25) -> None:
    """cProfile of the watched arm's steps (after warm-up): the functions by own time."""
    make_model, batch_size = MODELS[model_name]
    arm = Arm("watched", make_model, precision)
    batch_list = list(lab.lab_batches(warmup + steps, batch_size=batch_size))
    for batch in batch_list[:warmup]:
        arm.step(batch)
    prof = cProfile.Profile()
    prof.enable()
    for batch in batch_list[warmup:]:
        arm.step(batch)
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
    print(out.getvalue())


def timed(work, repeats: int = 200) -> float:
    """Median microseconds of `work()` (after a few calls left out)."""
    for _ in range(10):
        work()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        work()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def sample_before(x: torch.Tensor) -> torch.Tensor:
    """A sampled row's figures as `mplab.train.layers` counted them before 2026-12-05 (float
    |x|, bool masks, every value), to time the present way against."""
    a = x.detach().abs().float()
    n = a.numel()
    nonzero = a > 0
    smallest = torch.where(nonzero, a, math.inf).amin()
    return torch.stack([
        a.amax(), torch.where(torch.isinf(smallest), 0.0, smallest),
        (~nonzero).sum() / n,
        (nonzero & (a < 2.0 ** -14)).sum() / n,
        (nonzero & (a < 2.0 ** -126)).sum() / n,
        ((a > 65504.0) | torch.isnan(a)).sum() / n])


def pieces() -> None:
    """The choices in mplab/train/layers.py, each timed alone on a lesson-sized activation
    (batch 32, 50 tokens, hidden 128: 204,800 values) in the autograd graph, as a module's
    output is: how the watch counts the values below a bound, a sampled row's figures, a
    sampled step's fifty rows counted one by one or together, and the per-step figure of
    each output."""
    from mplab.train.layers import _Samples

    x = torch.randn(32, 50, 128, requires_grad=True) * 1.0
    plain = x.detach()
    bits = plain.view(torch.int32) & 0x7FFFFFFF
    work = torch.empty_like(bits)
    outputs = [torch.randn(32, 50, 128) for _ in range(50)]
    samples = _Samples()

    def count(tensors: list[torch.Tensor]) -> list[list[float]]:
        for t in tensors:
            samples.add(t)
        return samples.count()

    cases = [
        ("the values with |x| < 2^-14, counted",
         "float compare into a bool tensor", lambda: (plain.abs() < 2.0 ** -14).sum(),
         "|x|'s bits compared into int32",
         lambda: torch.lt(bits, 0x38800000, out=work).sum(dtype=torch.int32)),
        ("a sampled row's figures",
         "before 2026-12-05 (bool masks)", lambda: sample_before(x),
         "now (int32 bits, 8,192 spread)", lambda: count([x])),
        ("a sampled step's 50 rows",
         "counted one by one", lambda: [count([t]) for t in outputs],
         "all together", lambda: count(outputs)),
        ("the per-step figure of each output, for scale",
         "torch.aminmax", lambda: torch.aminmax(plain), "x.amax()", lambda: plain.amax()),
    ]
    rows = []
    for what, name_a, a, name_b, b in cases:
        us_a, us_b = timed(a), timed(b)
        rows.append({"what": what, "one way": name_a, "us": round(us_a, 1),
                     "the other": name_b, "us ": round(us_b, 1),
                     "ratio": f"{us_a / us_b:.1f}x"})
    print()
    print(Table(rows, title=f"the watch's parts, medians of 200 calls, "
                            f"{torch.get_num_threads()} thread(s)"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="both", choices=["both", *MODELS],
                   help="lesson (mplab.models.lesson_model), lab (lab.lab_model) or both")
    p.add_argument("--steps", type=int, default=120,
                   help="timed steps per setting (each arm runs each of them)")
    p.add_argument("--warmup", type=int, default=5, help="steps run first and left out")
    p.add_argument("--budget", type=float, default=20.0,
                   help=f"seconds per setting, after which it stops (at least {MIN_STEPS} "
                        "steps): fp16 on a CPU without fp16 units takes ~0.4 s a step")
    p.add_argument("--precisions", default="fp32,bf16,fp16",
                   help="comma-separated, of: fp32, bf16, fp16")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (0: torch's default); one by default, as on a shared "
                        "2-core machine two threads' steps stretch many times over "
                        "(benchmarks/RECORDS.md)")
    p.add_argument("--pieces", action="store_true",
                   help="instead: the watch's parts, each timed alone (RECORDS.md)")
    p.add_argument("--profile", metavar="PRECISION", default=None,
                   help="instead: cProfile of the watched steps in this precision")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    names = list(MODELS) if args.model == "both" else [args.model]
    precisions = [s.strip() for s in args.precisions.split(",") if s.strip()]
    for precision in precisions + ([args.profile] if args.profile else []):
        if precision not in PRECISIONS:
            p.error(f"precision {precision!r}: accepted: {', '.join(PRECISIONS)}")
    feats = cpu_features()
    print(f"{describe('cpu')}; torch {torch.__version__}, {torch.get_num_threads()} threads; "
          "CPU features: " + ", ".join(f"{k}={'yes' if v else 'no'}" for k, v in feats.items()))
    if args.pieces:
        pieces()
        return
    if args.profile:
        for name in names:
            print(f"\n{name} model, {args.profile}, {args.steps} watched steps:")
            profile(name, args.profile, args.steps, args.warmup)
        return
    started = time.perf_counter()
    rows, parts = [], []
    for name in names:
        for precision in precisions:
            s = summary(measure(name, precision, args.steps, args.warmup, args.budget))
            setting = {"model": name,
                       "setting": precision + (" + scaler" if precision == "fp16" else "")}
            rows.append(setting | {
                "steps": f"{s['steps']} + {s['sampled steps']}",
                "bare ms": round(s["bare ms"], 2), "watched ms": round(s["watched ms"], 2),
                "overhead": f"{s['overhead']:+.1%}", "ratio": f"{s['ratio']:.3f}x",
                "amortized": f"{s['amortized']:+.1%}",
                f"within {TARGET:.0%}": "yes" if s["amortized"] <= TARGET else "NO"})
            parts.append(setting | {
                "no layers ms": round(s["no layers ms"], 2),
                "Recorder without LayerWatch": f"{s['no layers overhead']:+.1%}",
                "LayerWatch alone": f"{s['layer watch alone']:+.1%}",
                "sampled step ms": round(s["sampled ms"], 2),
                "sampled / bare": f"{s['sampled ratio']:.2f}x",
                "finish ms": round(s["finish ms"], 1)})
    print()
    print(Table(rows, title=f"a step bare and watched by a Recorder: medians per step, "
                            f"{torch.get_num_threads()} thread(s), warm-up {args.warmup} left "
                            f"out, the arms taking turns on each batch"))
    print("\nsteps: ordinary + sampled timed steps. overhead, ratio: the median of watched / "
          "bare over the ordinary steps. amortized: with 1 step in 10 sampled (LayerWatch "
          "measures the leaf modules against the formats at step 1 and every 10th step).")
    print()
    print(Table(parts, title="where it goes (of a bare step)"))
    print("\nRecorder without LayerWatch: the Observer, StepWatch and ScalerCalls (median ratio "
          "- 1); LayerWatch alone: watched minus that. sampled: the steps LayerWatch samples. "
          "finish: Recorder.finish() (the audit), once per run.")
    print(f"\n{time.perf_counter() - started:.0f} s in all.")

if __name__ == "__main__":
    main()
