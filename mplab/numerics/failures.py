"""What breaks in a narrow format: small updates swamped by big weights, sums that stall,
an activation that outgrows fp16 and turns the loss NaN, and where each NaN comes from.

    swamping_run(1.0, 1e-4, 1000, "fp16")                # every update lost
    swamping_run(1.0, 1e-4, 1000, "fp16", master=True)   # fp32 master weights keep them
    swamp_threshold(1e-4, "fp16")                        # the |w| from which on they vanish
    running_sum(torch.rand(10_000), "bf16").low          # stalls at 256
    overflow_demo("fp16").table()                        # inf at ff_out, NaN from layer_norm on
    attention_overflow_demo("fp16").story()              # an attention score: inf, then NaN
    inf_arithmetic("fp16")                               # inf - inf, 0 * inf, ...: torch's answers

Each demonstration is run with torch's own casts and arithmetic on the CPU, and says where
the failure begins, so a lesson can show it happen and its fix work.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass, field
from fractions import Fraction

import numpy as np
import torch

from mplab._display import Table
from mplab.numerics.casts import fp32_values, storage_format
from mplab.numerics.formats import floor_log2, get_format

__all__ = ["finite_number", "SwampRun", "swamping_run", "swamp_threshold", "RunningSum",
           "running_sum", "T5_ACTIVATION", "StageRecord", "OverflowDemo", "overflow_demo",
           "ATTENTION_SCORE", "attention_overflow_demo", "inf_arithmetic", "sum_across_ranks"]


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


def sum_across_ranks(ranks, precision="bf16", size: int = 4096, seed: int = 0) -> Table:
    """Gradients summed across ranks (lesson 8's reduce_dtype), modelled: for each number of
    ranks, `size` random gradients per rank summed one rank at a time into an accumulator of
    the format (each addition in fp32, then rounded, as a ring reduce adds at each hop), and
    into fp32; each sum's relative error against the exact one (float64)."""
    dtype = storage_format(precision).dtype()
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for n in ranks:
        grads = torch.randn(n, size, generator=generator, dtype=torch.float64) * 1e-3
        exact = grads.sum(0)
        low, high = torch.zeros(size, dtype=dtype), torch.zeros(size)
        for g in grads:
            low = (low.float() + g.to(dtype).float()).to(dtype)
            high = high + g.float()
        error = {name: (torch.linalg.vector_norm(s.double() - exact)
                        / torch.linalg.vector_norm(exact)).item()
                 for name, s in ((precision, low), ("fp32", high))}
        rows.append({"ranks": n, f"{precision} sum, rel. error": error[precision],
                     "fp32 sum, rel. error": error["fp32"]})
    return Table(rows, title=f"{size} gradients summed across ranks, one rank at a time")


# --- overflow: an activation outgrows fp16 -----------------------------------------------------

@dataclass(frozen=True)
class StageRecord:
    """One step of the forward pass: its largest |value| in fp32 and in the format, how
    many infs and NaNs the format's run had there, and how many of those NaNs the step made
    itself (its inputs held no NaN there) and from what: "inf − inf", "0 × inf", "inf / inf",
    "0 / 0" (for an elementwise + − × /), None for other ops."""

    stage: str
    reference_max: float
    max_finite: float
    inf: int
    nan: int
    made: int = 0
    cause: str | None = None


@dataclass
class OverflowDemo:
    """A feed-forward block run in fp32 and in a narrow format, stage by stage (see
    :func:`overflow_demo`)."""

    precision: str
    simulated: bool
    stages: list[StageRecord]
    loss: float
    reference_loss: float
    block: str = "Feed-forward block"
    #: The format's run: each stage's tensor (upcast to fp32), for a test or a closer look.
    outputs: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)

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
        return Table(rows, title=f"{self.block} in {self.precision}{how}, stage by "
                                 f"stage beside fp32 ({self.precision}'s largest finite value: "
                                 f"{float(top):g})")

    def story(self) -> str:
        """Where this run's infs and NaNs come from, in words read off its stages: the first
        inf and the value fp32 has there, the first NaN made and from what, the stages that
        carry it on; a sentence a line. (A lesson whose reader should find this in the table
        does not print it.)"""
        p, top = self.precision, float(get_format(self.precision).max_finite)
        if self.finite:
            big = max(self.stages, key=lambda s: s.reference_max)
            where = (f"is past {p}'s largest finite value, {top:g}, but {p} has no inf: its "
                     "cast saturates and" if big.reference_max > top else
                     f"is within {p}'s range (up to {top:g}), which")
            return (f"In {p} every stage stays finite: the largest value, "
                    f"{big.reference_max:,.6g} (at '{big.stage}'), {where} stores it as "
                    f"{big.max_finite:,.6g}.")
        out = []
        names = [s.stage for s in self.stages]
        first_nan = names.index(self.first_nan) if self.first_nan else len(names)
        if self.first_inf:
            i = names.index(self.first_inf)
            s = self.stages[i]
            upto = "" if s.inf == 1 else "up to "
            out.append(f"In {p} the first inf is at '{s.stage}': {_count(s.inf, 'value')}, "
                       f"{upto}{s.reference_max:,.6g} in fp32, past {p}'s largest finite "
                       f"value, {top:g}.")
            kept = [f"'{t.stage}'" for t in self.stages[i + 1:first_nan] if t.inf]
            if kept:
                out.append(f"It stays inf at {_and(kept)}: arithmetic on an inf that has an "
                           "answer gives inf.")
        if self.first_nan is None:
            out.append(f"No stage makes a NaN; the loss is {self.loss:g}.")
            return "\n".join(out)
        s = self.stages[first_nan]
        n = s.made or s.nan
        how = (f"{'an' if n == 1 else 'each an'} {s.cause}, which has no answer, so IEEE "
               "arithmetic gives NaN" if s.cause else "from inputs that hold no NaN")
        out.append(f"The first NaN is made at '{s.stage}': {_count(n, 'value')}, {how}.")
        carried = [f"{t.nan} at '{t.stage}'" for t in self.stages[first_nan + 1:] if t.nan]
        if carried:
            out.append(f"From there every op that reads a NaN gives NaN: {_and(carried)}.")
        return "\n".join(out)


def _count(n: int, what: str) -> str:
    return f"{n:,} {what}" + ("" if n == 1 else "s")


def _and(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


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


class _Stages:
    """Keeps each stage's result (rounded by `rnd`) and the NaNs the stage made itself."""

    def __init__(self, rnd: Callable):
        self.rnd, self.out, self.made = rnd, {}, {}
        self._last = None

    def __call__(self, name: str, t: torch.Tensor, *inputs: torch.Tensor, op=None):
        t = self.rnd(t)
        ins = inputs or (() if self._last is None else (self._last,))
        self.out[name] = self._last = t
        self.made[name] = _made_nan(t, ins, op)
        return t


def _made_nan(out: torch.Tensor, inputs, op) -> tuple[int, str | None]:
    """How many of out's NaNs its inputs did not already hold, and (for an elementwise
    + − × /) the no-answer arithmetic that made them."""
    if not out.is_floating_point():
        return 0, None
    if op is None or len(inputs) != 2:  # any other op: all its NaNs, if its inputs held none
        held = any(bool(x.isnan().any()) for x in inputs if x.is_floating_point())
        return (0 if held else int(out.isnan().sum())), None
    a, b = (x.float().expand_as(out) for x in inputs)
    made = out.isnan() & ~a.isnan() & ~b.isnan()
    inf = a.isinf() & b.isinf()
    checks = {"−": [(inf & (a == b), "inf − inf")], "+": [(inf & (a != b), "inf − inf")],
              "×": [(((a == 0) & b.isinf()) | (a.isinf() & (b == 0)), "0 × inf")],
              "/": [(inf, "inf / inf"), ((a == 0) & (b == 0), "0 / 0")]}[op]
    return int(made.sum()), next((c for mask, c in checks if (made & mask).any()), None)


def _demo_stages(p: dict[str, torch.Tensor], keep: _Stages) -> None:
    F = torch.nn.functional
    x = keep("input", p["x"])
    h = keep("ff_in: x·W1ᵀ", F.linear(x, p["w_in"], p["b_in"]))
    h = keep("relu", F.relu(h))
    y = keep("ff_out: h·W2ᵀ + b2", F.linear(h, p["w_out"], p["b_out"]))
    y = keep("residual: x + ff_out", x + y, x, y, op="+")
    y = keep("layer_norm", F.layer_norm(y, (y.shape[-1],), p["ln_w"], p["ln_b"]))
    logits = keep("logits", F.linear(y, p["w_cls"], p["b_cls"]))
    keep("softmax", torch.softmax(logits, dim=-1))
    keep("loss", F.cross_entropy(logits, p["labels"]), logits)


def overflow_demo(precision="fp16") -> OverflowDemo:
    """Run a tiny feed-forward block (Linear → ReLU → Linear, residual, LayerNorm, classifier,
    softmax, loss) whose weights make one output reach 66,246, past fp16's 65,504 (T5's
    figure), in fp32 and in the format, and record each stage's largest value, infs and NaNs.

    In fp16 the ff_out activation becomes inf; LayerNorm subtracts the mean (inf − inf) and
    the whole token turns NaN, then the loss of the batch. In bf16 (8 exponent bits) it stays
    finite, rounded to 66,048. fp16, bf16 and fp32 run natively in that dtype (fp16 matmuls are
    slow on a CPU; these are tiny). fp8 has no CPU arithmetic: it is simulated, fp32 arithmetic
    with every weight, input and result rounded to fp8 as the installed torch casts it (e4m3
    has no inf: torch 2.13 and later saturate at 448, earlier releases make the overflow NaN).
    """
    return _run_demo(precision, _demo_block(), _demo_stages, "Feed-forward block")


def _run_demo(precision, params: dict[str, torch.Tensor], stages: Callable,
              block: str) -> OverflowDemo:
    """Run `stages` on `params` in fp32 and in the format; record every stage."""
    f = storage_format(precision)
    ref = _Stages(lambda t: t)
    stages(params, ref)
    dtype = f.dtype()
    simulated = f.bits == 8
    if simulated:
        def rnd(t):
            return t if t.dtype == torch.int64 else t.to(dtype).float()
        run = _Stages(rnd)
        stages({k: rnd(v) for k, v in params.items()}, run)
    else:
        run = _Stages(lambda t: t)
        stages({k: v if v.dtype == torch.int64 else v.to(dtype) for k, v in params.items()}, run)
    records = []
    for name, t in run.out.items():
        t = t.float()
        fin = t[t.isfinite()].abs()
        records.append(StageRecord(name, ref.out[name].abs().max().item(),
                                   fin.max().item() if fin.numel() else math.nan,
                                   int(t.isinf().sum()), int(t.isnan().sum()), *run.made[name]))
    return OverflowDemo(f.name, simulated, records, run.out["loss"].float().item(),
                        ref.out["loss"].item(), block,
                        {k: v.float() for k, v in run.out.items()})


#: The attention score the demo builds: 8 channels · 100 · 90, past fp16's 65,504.
ATTENTION_SCORE = 72_000.0


def _attention_block() -> dict[str, torch.Tensor]:
    """One attention head (4 tokens, head size 8). Token 2's query is 100 and its key 90 in
    every channel, so its score with itself is 8 · 100 · 90 = 72,000. Every other query and
    key is a small multiple of 1/16 (at most 1), so every other score is at most 800 in size.
    All are exact in fp16 and bf16 (100 and 90 have 7 significant bits): only the range
    differs between the runs."""
    g = torch.Generator().manual_seed(1)

    def small(*shape):
        return torch.randint(-16, 17, shape, generator=g).float() / 16

    q, k, v = small(4, 8), small(4, 8), small(4, 8)
    q[2], k[2] = 100.0, ATTENTION_SCORE / 8 / 100
    return {"q": q, "k": k, "v": v, "labels": torch.tensor([0, 1, 2, 3])}


def _attention_stages(p: dict[str, torch.Tensor], keep: _Stages) -> None:
    q, k, v = keep("queries q", p["q"]), keep("keys k", p["k"]), keep("values v", p["v"])
    s = keep("scores: q·kᵀ", q @ k.T, q, k)
    s = keep("scaled: scores / √d", s / math.sqrt(q.shape[-1]), s)  # a float keeps the dtype
    # softmax spelled out as torch computes it: subtract the row's max, exp, normalise
    m = keep("row max", s.amax(-1, keepdim=True), s)
    z = keep("scores − row max", s - m, s, m, op="−")
    e = keep("exp", z.exp(), z)
    n = keep("row sum", e.sum(-1, keepdim=True), e)
    w = keep("softmax: exp / row sum", e / n, e, n, op="/")
    o = keep("output: softmax·v", w @ v, w, v)
    keep("loss", torch.nn.functional.cross_entropy(o, p["labels"]), o)


def attention_overflow_demo(precision="fp16") -> OverflowDemo:
    """Run one attention head whose query and key for one token make its score 72,000, past
    fp16's 65,504, in fp32 and in the format, stage by stage with the softmax spelled out
    (the same steps as torch.softmax), and record each stage's largest value, infs and NaNs,
    and the NaNs each stage made. In fp16 the score is inf; the softmax subtracts the row's
    max, inf − inf, and that token's row turns NaN, then its output and the loss. In bf16 it
    stays finite, rounded to 72,192. Formats as :func:`overflow_demo`."""
    return _run_demo(precision, _attention_block(), _attention_stages, "Attention head")


#: The operations :func:`inf_arithmetic` shows: (what it reads, the tensor op).
_INF_OPS = (
    ("largest finite × 2", lambda top, inf, nan: top * 2),
    ("inf + 1", lambda top, inf, nan: inf + 1),
    ("inf × 0.001", lambda top, inf, nan: inf * 0.001),
    ("1 / inf", lambda top, inf, nan: 1 / inf),
    ("exp(−inf)", lambda top, inf, nan: (-inf).exp()),
    ("inf − inf", lambda top, inf, nan: inf - inf),
    ("0 × inf", lambda top, inf, nan: inf * 0),
    ("inf / inf", lambda top, inf, nan: inf / inf),
    ("NaN + 1", lambda top, inf, nan: nan + 1),
    ("NaN × 0", lambda top, inf, nan: nan * 0),
    ("max(NaN, 1)", lambda top, inf, nan: torch.maximum(nan, torch.ones_like(nan))),
)
_ARITHMETIC = ("fp16", "bf16", "fp32")


def inf_arithmetic(precision="fp16") -> Table:
    """What torch gives for arithmetic on the format's largest value, on inf and on NaN, each
    computed in that dtype: where an inf comes from, which operations keep it, which have no
    answer and give NaN, and that NaN spreads through everything after. fp16, bf16, fp32
    (the fp8 formats have no arithmetic of their own)."""
    f = get_format(precision)
    if f.name not in _ARITHMETIC:
        raise ValueError(f"inf_arithmetic computes in a dtype with arithmetic; got {f.name!r}, "
                         f"accepted: " + ", ".join(map(repr, _ARITHMETIC)))
    dtype = f.dtype()
    top, inf, nan = (torch.tensor(x, dtype=dtype) for x in
                     (float(f.max_finite), math.inf, math.nan))
    rows = []
    for what, fn in _INF_OPS:
        r = fn(top, inf, nan)
        assert r.dtype == dtype, what  # each op stays in the format
        rows.append({"operation": what.replace("largest finite", f"{float(f.max_finite):g}"),
                     f"{f.name} result": r.item()})
    return Table(rows, title=f"Arithmetic on inf and NaN in {f.name} (torch)")
