"""What breaks in a narrow format: small updates swamped by big weights, sums that stall,
an activation that outgrows fp16 and turns the loss NaN.

    swamping_run(1.0, 1e-4, 1000, "fp16")                # every update lost
    swamping_run(1.0, 1e-4, 1000, "fp16", master=True)   # fp32 master weights keep them
    swamp_threshold(1e-4, "fp16")                        # the |w| from which on they vanish
    running_sum(torch.rand(10_000), "bf16").low          # stalls at 256
    overflow_demo("fp16").table()                        # inf at ff_out, NaN from layer_norm on

Each demonstration is run with torch's own casts and arithmetic on the CPU, and says where
the failure begins, so a lesson can show it happen and its fix work.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction

import numpy as np
import torch

from mplab._display import Table
from mplab.casts import fp32_values, storage_format
from mplab.formats import floor_log2, get_format

__all__ = ["finite_number", "SwampRun", "swamping_run", "swamp_threshold", "RunningSum",
           "running_sum", "T5_ACTIVATION", "StageRecord", "OverflowDemo", "overflow_demo"]


# --- swamping and master weights ---------------------------------------------------------------

def finite_number(x, what: str) -> float:
    """x as one finite float (a number or a one-element tensor); a ValueError naming `what`
    otherwise."""
    if isinstance(x, torch.Tensor) and x.numel() == 1:
        x = x.item()
    if isinstance(x, bool) or not isinstance(x, numbers.Real) or not math.isfinite(float(x)):
        raise ValueError(f"{what} must be one finite number, got {x!r}")
    return float(x)


@dataclass(eq=False)  # holds arrays: compare fields, not records
class SwampRun:
    """``w ← w + update`` repeated, kept in a narrow format (or through an fp32 master copy).

    weights: the weight the model computes with after each step (steps + 1 values, as the
             format holds them); master_weights: the fp32 master copy (None without one);
    exact:   w0 + k·update in float64, what the steps should add up to;
    lost_steps / first_lost: updates that changed nothing in the stored weight (the format's
             copy without a master, the fp32 master with one), and the first such step.
    """

    precision: str
    master: bool
    w0: float
    update: float
    weights: np.ndarray
    master_weights: np.ndarray | None
    exact: np.ndarray
    lost_steps: int
    first_lost: int | None

    @property
    def steps(self) -> int:
        return len(self.weights) - 1

    @property
    def final(self) -> float:
        return float(self.weights[-1])

    @property
    def expected(self) -> float:
        return float(self.exact[-1])

    @property
    def applied(self) -> float:
        """The fraction of the intended total change that reached the weight."""
        want = self.expected - self.w0
        return (self.final - self.w0) / want if want else 1.0

    def table(self, rows: int = 11) -> Table:
        idx = sorted({round(i * self.steps / max(rows - 1, 1)) for i in range(rows)})
        out = []
        for k in idx:
            r = {"step": k, "exact": float(self.exact[k]), f"weight ({self.precision})":
                 float(self.weights[k])}
            if self.master_weights is not None:
                r["fp32 master"] = float(self.master_weights[k])
            r["error"] = float(self.weights[k] - self.exact[k])
            out.append(r)
        how = (f"fp32 master weights, cast to {self.precision} for use" if self.master
               else f"weights kept in {self.precision}")
        return Table(out, title=f"w ← w + {self.update:g} from w0 = {self.w0:g}, {how}: "
                                f"{self.lost_steps} of {self.steps} updates lost")


def swamping_run(w0, update, steps: int, precision="fp16", master: bool = False) -> SwampRun:
    """Apply ``w ← w + update`` `steps` times and watch small updates vanish.

    master=False: the weight lives in the format and so does the update; each step adds them in
    fp32 and rounds the sum to the format (what torch does for fp16/bf16 tensors on the CPU). Once
    |w| reaches :func:`swamp_threshold` (about 2^11·|update| in fp16, 2^8 in bf16) the sum
    rounds back to w: every later update is lost.
    master=True: an fp32 master copy takes the fp32 update; the model uses it cast to the
    format.
    Nothing is lost (until fp32 itself swamps, 2^24 times further out).
    """
    f = storage_format(precision)
    w0f, u = finite_number(w0, "w0"), finite_number(update, "update")
    if isinstance(steps, bool) or not isinstance(steps, numbers.Integral) or not (
            0 <= steps <= 10**6):
        raise ValueError(f"steps must be a whole number from 0 to 1,000,000, got {steps!r}")
    steps = int(steps)
    dtype = f.dtype()
    exact = w0f + np.arange(steps + 1, dtype=np.float64) * u
    if master:
        m = np.full(steps + 1, np.float32(u), dtype=np.float32)
        m[0] = np.float32(w0f)
        np.add.accumulate(m, out=m)  # sequential fp32 sums, as an optimizer step makes them
        used = torch.from_numpy(m).to(dtype).double().numpy()
        stored, master_w = m.astype(np.float64), m.astype(np.float64)
    else:
        w = torch.tensor(w0f, dtype=torch.float32).to(dtype)
        du = torch.tensor(u, dtype=torch.float32).to(dtype).float()
        used = np.empty(steps + 1)
        used[0] = w.item()
        for k in range(1, steps + 1):
            nw = (w.float() + du).to(dtype)
            if torch.equal(nw, w):  # the same sum every step from here on: lost for good
                used[k:] = used[k - 1]
                break
            w = nw
            used[k] = w.item()
        stored, master_w = used, None
    lost = np.flatnonzero(np.diff(stored) == 0) if u != 0 else np.array([], dtype=np.int64)
    return SwampRun(f.name, master, w0f, u, used, master_w, exact, int(lost.size),
                    int(lost[0]) + 1 if lost.size else None)


def swamp_threshold(update, precision="fp16") -> float:
    """The smallest weight magnitude at which adding `update` (same sign) changes nothing:
    the first w whose half-ulp is at least |update| (a tie rounds to w, whose last bit is 0).

    For update = 2^k it is 2^(mantissa bits + 1)·|update|: 2^11 in fp16, 2^8 in bf16; for
    other updates up to twice that. 0.0 when the update itself rounds to 0 in the format; inf
    when no finite weight of the format is that large.
    """
    f = get_format(precision)
    u = Fraction(abs(finite_number(update, "update")))
    if u <= f.min_subnormal / 2:
        return 0.0
    ceil_log2 = -floor_log2(1 / u)  # smallest k with 2^k >= u
    e = ceil_log2 + f.man_bits + 1
    return math.ldexp(1.0, e) if e <= f.emax else math.inf


@dataclass(eq=False)  # holds arrays: compare fields, not records
class RunningSum:
    """Values added one at a time into an accumulator of a narrow format, against fp32.

    partial: the narrow accumulator after each value; low: its final value; fp32: the same
    sequential sum in fp32; exact: the correctly rounded sum (math.fsum); stalled_from: the
    first value from which on the narrow sum never changed again (None if it moved at the end).
    """

    precision: str
    n: int
    low: float
    fp32: float
    exact: float
    partial: np.ndarray
    stalled_from: int | None

    def table(self) -> Table:
        rows = [{"accumulator": name, "sum": v,
                 "rel. error": abs(v - self.exact) / abs(self.exact) if self.exact else 0.0}
                for name, v in ((self.precision, self.low), ("fp32", self.fp32),
                                ("exact (fsum)", self.exact))]
        return Table(rows, title=f"Sum of {self.n} values, one at a time")


def running_sum(values, precision="bf16") -> RunningSum:
    """Add the values one by one into an accumulator of the format (each sum computed in fp32
    and rounded to the format, with torch), and compare with fp32 and the exact sum.

    10,000 uniform(0, 1) values in bf16 stop at 256: there the spacing of bf16 numbers is 2,
    so adding anything below 1 rounds back to 256.
    """
    f = storage_format(precision)
    v = fp32_values(values, "values")
    dtype = f.dtype()
    acc = torch.zeros((), dtype=dtype)
    sums = []
    for x in v:
        acc = (acc.float() + x).to(dtype)
        sums.append(acc)
    partial = torch.stack(sums).double().numpy() if sums else np.empty(0)
    fp32 = float(np.add.accumulate(v.numpy())[-1]) if v.numel() else 0.0
    moved = np.flatnonzero(np.diff(np.concatenate([[0.0], partial])) != 0)
    last = int(moved[-1]) if moved.size else -1
    stalled = last + 1 if last + 1 < v.numel() else None
    return RunningSum(f.name, v.numel(), float(partial[-1]) if v.numel() else 0.0, fp32,
                      math.fsum(v.double().tolist()), partial, stalled)


# --- overflow: an activation outgrows fp16 -----------------------------------------------------

@dataclass(frozen=True)
class StageRecord:
    """One step of the forward pass: its largest |value| in fp32 and in the format, and how
    many infs and NaNs the format's run had there."""

    stage: str
    reference_max: float
    max_finite: float
    inf: int
    nan: int


@dataclass
class OverflowDemo:
    """A feed-forward block run in fp32 and in a narrow format, stage by stage (see
    :func:`overflow_demo`)."""

    precision: str
    simulated: bool
    stages: list[StageRecord]
    loss: float
    reference_loss: float

    @property
    def first_inf(self) -> str | None:
        return next((s.stage for s in self.stages if s.inf), None)

    @property
    def first_nan(self) -> str | None:
        return next((s.stage for s in self.stages if s.nan), None)

    @property
    def finite(self) -> bool:
        return not any(s.inf or s.nan for s in self.stages)

    def table(self) -> Table:
        rows = [{"stage": s.stage, "fp32 max |x|": s.reference_max,
                 f"{self.precision} max finite |x|": s.max_finite, "inf": s.inf, "NaN": s.nan}
                for s in self.stages]
        how = " (simulated: fp32 arithmetic, rounded after each op)" if self.simulated else ""
        # The evidence only (values, infs and NaNs per stage): where the failure begins and
        # why is the reader's to say, so the title names neither.
        top = get_format(self.precision).max_finite
        return Table(rows, title=f"Feed-forward block in {self.precision}{how}, stage by "
                                 f"stage beside fp32 ({self.precision}'s largest finite value: "
                                 f"{float(top):g})")


#: The outlier the demo builds: T5's feed-forward output in fp16 (transformers #5651).
T5_ACTIVATION = 66_246.0


def _demo_block() -> dict[str, torch.Tensor]:
    """Weights of a tiny T5-like feed-forward block (d_model 8, d_ff 64) and its input.

    Token 0 is ordinary. Token 1 switches on all 64 hidden units at 32, and the output
    weights of channel 0 are 32 with a bias of 710: 64 · 32 · 32 + 710 = 66,246. Every
    weight and input is a small multiple of 1/16, exact in fp16 and bf16, so only the range
    differs between the runs.
    """
    g = torch.Generator().manual_seed(0)

    def small(*shape):
        return torch.randint(-16, 17, shape, generator=g).float() / 16

    w_in = torch.full((64, 8), 4.0)
    x = torch.stack([torch.tensor([1.0, -1.0] * 4), torch.ones(8)])  # token 0: hidden units 0
    w_out = small(8, 64)
    w_out[0] = 32.0
    b_out = torch.zeros(8)
    b_out[0] = T5_ACTIVATION - 64 * 32 * 32
    return {"x": x, "w_in": w_in, "b_in": torch.zeros(64), "w_out": w_out, "b_out": b_out,
            "ln_w": torch.ones(8), "ln_b": torch.zeros(8), "w_cls": small(3, 8),
            "b_cls": torch.zeros(3), "labels": torch.tensor([0, 2])}


def _demo_stages(p: dict[str, torch.Tensor], rnd: Callable) -> dict[str, torch.Tensor]:
    F = torch.nn.functional
    out = {}

    def keep(name, t):
        out[name] = t = rnd(t)
        return t

    x = keep("input", p["x"])
    h = keep("ff_in: x·W1ᵀ", F.linear(x, p["w_in"], p["b_in"]))
    h = keep("relu", F.relu(h))
    y = keep("ff_out: h·W2ᵀ + b2", F.linear(h, p["w_out"], p["b_out"]))
    y = keep("residual: x + ff_out", x + y)
    y = keep("layer_norm", F.layer_norm(y, (y.shape[-1],), p["ln_w"], p["ln_b"]))
    logits = keep("logits", F.linear(y, p["w_cls"], p["b_cls"]))
    keep("softmax", torch.softmax(logits, dim=-1))
    keep("loss", F.cross_entropy(logits, p["labels"]))
    return out


def overflow_demo(precision="fp16") -> OverflowDemo:
    """Run a tiny feed-forward block (Linear → ReLU → Linear, residual, LayerNorm, classifier,
    softmax, loss) whose weights make one output reach 66,246, past fp16's 65,504 (T5's
    figure), in fp32 and in the format, and record each stage's largest value, infs and NaNs.

    In fp16 the ff_out activation becomes inf; LayerNorm subtracts the mean (inf − inf) and
    the whole token turns NaN, then the loss of the batch. In bf16 (8 exponent bits) it stays
    finite, rounded to 66,048. fp16, bf16 and fp32 run natively in that dtype (fp16 matmuls are
    slow on a CPU; these are tiny). fp8 has no CPU arithmetic: it is simulated, fp32 arithmetic
    with every weight, input and result rounded to fp8 (e4m3 saturates at 448 instead).
    """
    f = storage_format(precision)
    params = _demo_block()
    ref = _demo_stages(params, lambda t: t)
    dtype = f.dtype()
    simulated = f.bits == 8
    if simulated:
        def rnd(t):
            return t if t.dtype == torch.int64 else t.to(dtype).float()
        run = _demo_stages({k: rnd(v) for k, v in params.items()}, rnd)
    else:
        cast = {k: v if v.dtype == torch.int64 else v.to(dtype) for k, v in params.items()}
        run = _demo_stages(cast, lambda t: t)
    stages = []
    for name, t in run.items():
        t = t.float()
        fin = t[t.isfinite()].abs()
        stages.append(StageRecord(name, ref[name].abs().max().item(),
                                  fin.max().item() if fin.numel() else math.nan,
                                  int(t.isinf().sum()), int(t.isnan().sum())))
    return OverflowDemo(f.name, simulated, stages, run["loss"].float().item(),
                        ref["loss"].item())
