"""mplab.ranges against direct torch casts (and mplab.formats): underflow, overflow, swamping."""

import math
import warnings

import numpy as np
import pytest
import torch
from torch import nn

from mplab import formats as F
from mplab import plots
from mplab import ranges as R

LOW = ["fp16", "bf16", "fp8_e4m3", "fp8_e5m2"]
ALL = LOW + ["fp32"]
SCALES = [1.0, 2.0**-3, 8.0, 2.0**10, 2.0**24, 3.0, 0.1, 1000.5]
E4M3_OVERFLOW = 464.0  # 448 + half its ulp (32); the tie rounds to 448, whose mantissa is even


def spread(n: int, seed: int = 0, lo: float = -45, hi: float = 20) -> torch.Tensor:
    """Random signs and log-uniform magnitudes 2^lo..2^hi, 2 % exact zeros."""
    g = torch.Generator().manual_seed(seed)
    x = torch.exp2(torch.rand(n, generator=g) * (hi - lo) + lo)
    x = torch.where(torch.rand(n, generator=g) < 0.5, -x, x)
    x[: n // 50] = 0.0
    return x


def edge_values(fmt: str) -> torch.Tensor:
    """The rounding edges of fmt in fp32 and their fp32 neighbours on both sides."""
    f = F.get_format(fmt)
    edges = [float(f.min_subnormal) / 2, float(f.min_normal) - float(f.min_subnormal) / 2,
             float(f.max_finite), float(f.min_subnormal), float(f.min_normal)]
    top_ulp = 2.0 ** (f.emax - f.man_bits)
    edges.append(float(f.max_finite) + top_ulp / 2)
    t = torch.tensor([e for e in edges if 0 < e < 3e38], dtype=torch.float32)
    t = t[t > 0]
    up = torch.nextafter(t, torch.tensor(math.inf))
    down = torch.nextafter(t, torch.tensor(0.0))
    both = torch.cat([t, up, down])
    return torch.cat([both, -both])


def direct(x: torch.Tensor, fmt: str, scale: float) -> dict:
    """Classify each value by casting it with torch (the definition the library must meet)."""
    f = F.get_format(fmt)
    x = x.float()
    v = x * scale
    q = v.to(f.dtype()).float()
    nz = x.isfinite() & (x != 0)
    under = nz & (q == 0)
    over = nz & ((v.abs() > E4M3_OVERFLOW) if fmt == "fp8_e4m3" else q.isinf())
    kept = nz & ~under & ~over
    sub = kept & (q.abs() < float(f.min_normal))
    return {"count": x.numel(), "zero": int((x == 0).sum()), "underflow": int(under.sum()),
            "subnormal": int(sub.sum()), "normal": int((kept & ~sub).sum()),
            "overflow": int(over.sum()), "inf": int(x.isinf().sum()),
            "nan": int(x.isnan().sum())}


def counts(st: R.CastStats) -> dict:
    return {k: getattr(st, k) for k in ("count", "zero", "underflow", "subnormal", "normal",
                                        "overflow", "inf", "nan")}


# --- cast_stats and the fast path ---------------------------------------------------------------

@pytest.mark.parametrize("fmt", ALL)
def test_cast_stats_counts_equal_direct_torch_casts_at_every_scale(fmt):
    x = torch.cat([spread(20_000, seed=1), edge_values(fmt),
                   torch.tensor([math.inf, -math.inf, math.nan, 0.0, -0.0])])
    for scale in SCALES:
        st = R.cast_stats(x, fmt, scale)
        assert counts(st) == direct(x, fmt, scale), (fmt, scale)
        assert st.overflow_to == ("saturate" if fmt == "fp8_e4m3" else "inf")
        assert sum(counts(st).values()) - st.count == st.count  # every value in one class


@pytest.mark.parametrize("fmt", ALL)
def test_fast_stats_from_sorted_magnitudes_agree_exactly_with_real_casts(fmt):
    x = torch.cat([spread(30_000, seed=2, lo=-60, hi=30), edge_values(fmt),
                   torch.tensor([math.inf, math.nan, 0.0])])
    mags = R.Magnitudes(x)
    for scale in SCALES + [2.0**-20, 2.0**40]:
        slow, fast = R.cast_stats(x, fmt, scale), mags.stats(fmt, scale)
        assert counts(fast) == counts(slow), (fmt, scale)
        assert fast.max_rel_error == slow.max_rel_error
        assert fast.mean_rel_error == pytest.approx(slow.mean_rel_error, rel=1e-9, abs=1e-300)


@pytest.mark.parametrize("fmt", ALL)
@pytest.mark.parametrize("scale", [1.0, 2.0**5, 3.0])
def test_edges_hit_exactly_through_the_scale_agree_with_real_casts(fmt, scale):
    """x·scale lands exactly on each rounding edge (and one fp32 step either side)."""
    v = edge_values(fmt)
    x = v / scale
    mags = R.Magnitudes(x)
    assert counts(mags.stats(fmt, scale)) == counts(R.cast_stats(x, fmt, scale)) == direct(
        x, fmt, scale)


@pytest.mark.parametrize("fmt", LOW)
def test_fractions_equal_formats_round_to_value_by_value(fmt):
    """An independent reference: classify each fl32(x·s) with mplab.formats' exact rounding."""
    f = F.get_format(fmt)
    x = torch.cat([spread(400, seed=3), edge_values(fmt)])
    nan_fmt = F.E4M3_NAN_ON_OVERFLOW if fmt == "fp8_e4m3" else f  # overflow shows as NaN
    for scale in (1.0, 2.0**12, 0.1):
        want = dict.fromkeys(("zero", "underflow", "subnormal", "normal", "overflow"), 0)
        for v, x0 in zip((x * scale).tolist(), x.tolist()):
            r = F.round_to(v, nan_fmt)
            if x0 == 0:
                want["zero"] += 1
            elif r == 0:
                want["underflow"] += 1
            elif math.isinf(r) or math.isnan(r):
                want["overflow"] += 1
            elif abs(r) < f.min_normal:
                want["subnormal"] += 1
            else:
                want["normal"] += 1
        st = R.cast_stats(x, fmt, scale)
        assert {k: getattr(st, k) for k in want} == want, (fmt, scale)
        assert st.underflow_frac == want["underflow"] / x.numel()


@pytest.mark.parametrize("fmt", LOW)
def test_half_the_smallest_subnormal_ties_to_zero_and_just_above_rounds_up(fmt):
    f = F.get_format(fmt)
    half = torch.tensor([float(f.min_subnormal) / 2])
    above = torch.nextafter(half, torch.tensor(1.0))
    assert R.cast_stats(half, fmt).underflow == 1
    st = R.cast_stats(above, fmt)
    assert st.underflow == 0 and st.subnormal == 1
    assert above.to(f.dtype()).float().item() == float(f.min_subnormal)
    bands = R.format_bands(fmt)
    assert bands[0].hi == f.emin - f.man_bits - 1 == math.log2(half.item())


def test_overflow_edges_ieee_tie_overflows_e4m3_tie_saturates_to_448():
    fp16 = torch.tensor([65504.0, 65519.99, 65520.0])
    assert [R.cast_stats(v, "fp16").overflow for v in fp16] == [0, 0, 1]
    assert torch.tensor(65520.0).half().isinf()
    above = torch.nextafter(torch.tensor(E4M3_OVERFLOW), torch.tensor(1e9)).item()  # in fp32
    e4m3 = torch.tensor([448.0, E4M3_OVERFLOW, above, 1e30])
    assert [R.cast_stats(v, "fp8_e4m3").overflow for v in e4m3] == [0, 0, 1, 1]
    assert (e4m3.to(torch.float8_e4m3fn).float() == 448).all()  # torch saturates all of them
    assert R.format_bands("fp8_e4m3")[-1].lo_value == E4M3_OVERFLOW
    assert R.format_bands("fp16")[-1].lo_value == 65520.0


def test_relative_error_is_that_of_the_cast_of_the_kept_values():
    x = torch.tensor([1.0, 0.1, 1e-6, 1e-9, 0.0])  # 1e-9 underflows in fp16: not counted
    st = R.cast_stats(x, "fp16")
    v = x[:3]
    rel = ((v.half().double() - v.double()).abs() / v.double()).tolist()
    assert st.max_rel_error == pytest.approx(max(rel), rel=2**-23)  # divided in fp32
    assert st.mean_rel_error == pytest.approx(sum(rel) / 3, rel=2**-23)
    assert (st.zero, st.underflow, st.subnormal, st.normal) == (1, 1, 1, 2)


def test_empty_and_all_zero_tensors_give_zero_fractions_without_warnings():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for t in (torch.empty(0), torch.zeros(0, 3), torch.zeros(5)):
            for st in (R.cast_stats(t, "fp16"), R.Magnitudes(t).stats("fp16")):
                assert st.count == t.numel() and st.zero == t.numel()
                assert st.underflow_frac == st.overflow_frac == st.subnormal_frac == 0.0
                assert st.mean_rel_error == st.max_rel_error == st.max_abs == 0.0
                assert st.zero_frac == (1.0 if t.numel() else 0.0)
        assert R.exponent_histogram(torch.empty(0)).nonzero == 0


def test_nan_and_inf_inputs_are_counted_apart_not_as_overflow():
    x = torch.tensor([math.nan, math.inf, -math.inf, 1.0])
    for fmt in LOW:
        st = R.cast_stats(x, fmt)
        assert (st.nan, st.inf, st.overflow, st.normal) == (1, 2, 0, 1)
        assert st.max_abs == 1.0


def test_integer_tensors_are_converted_and_bool_complex_rejected():
    ints = torch.arange(-5, 70_000, 7)
    assert R.cast_stats(ints, "fp16") == R.cast_stats(ints.float(), "fp16")
    assert R.cast_stats(ints, "fp16").overflow == int((ints >= 65520).sum())
    assert R.cast_stats([1, 2.5, 1e-9], "fp16").underflow == 1  # lists of numbers work too
    with pytest.raises(TypeError, match="bool"):
        R.cast_stats(torch.ones(3, dtype=torch.bool), "fp16")
    with pytest.raises(TypeError, match="complex"):
        R.cast_stats(torch.ones(3, dtype=torch.complex64), "fp16")
    with pytest.raises(TypeError, match="tensor"):
        R.cast_stats("0.1", "fp16")


def test_unknown_formats_and_bad_scales_are_clear_errors():
    x = torch.ones(3)
    with pytest.raises(ValueError, match="'fp12'.*accepted.*fp16"):
        R.cast_stats(x, "fp12")
    with pytest.raises(ValueError, match="tf32.*accepted: fp32, fp16, bf16"):
        R.cast_stats(x, "tf32")
    for bad in (0, -1.0, math.inf, math.nan, 1e-60, 1e50, 2**2000):
        with pytest.raises(ValueError, match="scale"):
            R.cast_stats(x, "fp16", bad)
    for bad in ("8", None, True):
        with pytest.raises(TypeError, match="scale"):
            R.cast_stats(x, "fp16", bad)
    assert R.as_scale(0.1) == float(np.float32(0.1))  # torch multiplies by fp32(0.1)


# --- histograms and bands -----------------------------------------------------------------------

def test_exponent_histogram_counts_floor_log2_and_zeros_apart():
    x = torch.cat([spread(10_000, seed=4, lo=-70, hi=25), torch.tensor([math.nan, math.inf])])
    hist = R.exponent_histogram(x)
    counts, edges = hist  # unpacks as (counts, edges)
    nz = x[x.isfinite() & (x != 0)]
    exps = (torch.frexp(nz.abs()).exponent - 1).numpy()  # floor(log2|x|), exact
    assert list(edges) == list(range(-60, 20))
    want = np.array([(exps == e).sum() for e in range(-60, 19)])
    assert np.array_equal(counts, want)
    assert hist.zeros == int((x == 0).sum()) and (hist.inf, hist.nan) == (1, 1)
    assert hist.below == int((exps < -60).sum()) and hist.above == int((exps >= 19).sum())
    assert hist.total == x.numel()
    parts = R.exponent_histogram([x[:5000], x[5000:]], bins=range(-60, 20))
    assert np.array_equal(parts.counts, counts)
    assert R.exponent_histogram(torch.tensor([2.0**-149, 1.0]), bins=[-150, -148, 0, 1]).counts \
        .tolist() == [1, 0, 1]


def test_bad_bins_are_a_clear_error():
    for bad in ([3, 1], [0.5, 1.5], [1], "abc"):
        with pytest.raises(ValueError, match="bins"):
            R.exponent_histogram(torch.ones(3), bins=bad)


def test_format_bands_move_down_by_log2_of_the_scale():
    base, scaled = R.format_bands("fp16"), R.format_bands("fp16", 2.0**10)
    assert [b.name for b in base] == ["zero", "subnormal", "normal", "overflow"]
    assert base[0].hi == -25 and base[1].hi < -14 < base[1].hi + 0.001
    for a, b in zip(base, scaled):
        assert b.hi == a.hi - 10 or a.hi == math.inf
    assert R.format_bands("bf16")[0].hi == -134


# --- capture ------------------------------------------------------------------------------------

def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 16), nn.LayerNorm(16),
                         nn.Linear(16, 1))


def mse(model, batch):
    x, y = batch
    return ((model(x) - y) ** 2).mean()


def batch_xy():
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 6, generator=g), torch.randn(8, 1, generator=g)


def all_hooks(model: nn.Module) -> int:
    return sum(len(d) for m in model.modules() for d in (
        m._forward_hooks, m._forward_pre_hooks, m._backward_hooks, m._backward_pre_hooks))


def test_capture_records_activations_and_their_gradients_as_autograd_computes_them():
    model, (x, y) = mlp(), batch_xy()
    cap = R.capture(model, (x, y), loss_fn=mse)
    assert list(cap.activations) == ["0", "2", "3", "4"]
    assert list(cap.activation_grads) == ["0", "2", "3", "4"]
    assert list(cap.weight_grads) == [n for n, _ in model.named_parameters()]
    # the reference: the same step written out by hand
    h0 = model[0](x)
    h2 = model[2](model[1](h0))
    h3 = model[3](h2)
    out = model[4](h3)
    for t in (h0, h2, h3, out):
        t.retain_grad()
    loss = ((out - y) ** 2).mean()
    loss.backward()
    for name, t in zip(["0", "2", "3", "4"], (h0, h2, h3, out)):
        assert torch.equal(cap.activations[name], t.detach())
        assert torch.equal(cap.activation_grads[name], t.grad)
    for name, p in model.named_parameters():
        assert torch.equal(cap.weight_grads[name], p.grad)
    assert cap.loss == loss.item()


def test_capture_keeps_detached_copies_and_leaves_the_model_as_it_was():
    model, batch = mlp(), batch_xy()
    marker = torch.full_like(model[0].weight, 7.0)
    model[0].weight.grad = marker
    cap = R.capture(model, batch, loss_fn=mse)
    assert model[0].weight.grad is marker and model[2].weight.grad is None
    assert all_hooks(model) == 0
    kept = {k: v.clone() for k, v in cap.weight_grads.items()}
    acts = {k: v.clone() for k, v in cap.activations.items()}
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(3.0)
    model(batch[0]).sum().backward()
    for d, ref in ((cap.weight_grads, kept), (cap.activations, acts)):
        for k, v in d.items():
            assert torch.equal(v, ref[k]) and not v.requires_grad
            assert v.dtype == torch.float32 and v.device.type == "cpu"
    cap.weight_grads["0.weight"].zero_()
    assert model[0].weight.grad.abs().sum() > 0


def test_an_activation_changed_in_place_later_is_kept_as_the_layer_produced_it():
    torch.manual_seed(0)
    inplace = nn.Sequential(nn.Linear(6, 16), nn.ReLU(inplace=True), nn.Linear(16, 1))
    plain = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 1))
    plain.load_state_dict(inplace.state_dict())
    batch = batch_xy()
    a, b = R.capture(inplace, batch, mse), R.capture(plain, batch, mse)
    assert (a.activations["0"] < 0).any()  # copied before the ReLU overwrote it
    for kind in R.KINDS:
        for name, t in b.tensors(kind).items():
            assert torch.equal(a.tensors(kind)[name], t), (kind, name)


def test_hooks_are_removed_and_grads_restored_when_the_step_raises():
    class Breaks(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x):
            self.b(self.a(x))
            raise RuntimeError("boom in forward")

    model = Breaks()
    marker = torch.ones_like(model.a.weight)
    model.a.weight.grad = marker
    with pytest.raises(RuntimeError, match="boom"):
        R.capture(model, torch.randn(2, 4))
    assert all_hooks(model) == 0
    assert model.a.weight.grad is marker and model.b.weight.grad is None

    def bad_loss(model, batch):
        return model[0](batch).sum() + "oops"

    seq = nn.Sequential(nn.Linear(4, 4))
    with pytest.raises(TypeError):
        R.capture(seq, torch.randn(2, 4), loss_fn=bad_loss)
    assert all_hooks(seq) == 0 and seq[0].weight.grad is None


def tiny_bert():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.BertConfig(vocab_size=100, hidden_size=16, num_hidden_layers=1,
                                  num_attention_heads=2, intermediate_size=32,
                                  max_position_embeddings=16, num_labels=2)
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(cfg).eval()
    g = torch.Generator().manual_seed(0)
    batch = {"input_ids": torch.randint(0, 100, (4, 8), generator=g),
             "attention_mask": torch.ones(4, 8, dtype=torch.long),
             "labels": torch.tensor([0, 1, 1, 0])}
    return model, batch


def test_capture_a_hugging_face_model_with_a_dict_batch():
    model, batch = tiny_bert()
    cap = R.capture(model, batch)
    out = model(**batch)
    out.loss.backward()
    assert cap.loss == pytest.approx(out.loss.item(), rel=1e-6)
    for name, p in model.named_parameters():
        assert torch.allclose(cap.weight_grads[name], p.grad, rtol=1e-5, atol=1e-9), name
    assert "bert.embeddings.word_embeddings" in cap.activations
    assert cap.layer_types["classifier"] == "Linear"
    assert cap.activations["classifier"].shape == (4, 2)
    assert set(cap.activation_grads) <= set(cap.activations)
    table = cap.table("fp16", 2.0**8, "activation_grads")
    assert len(table) == len(cap.activation_grads) + 1 and table[-1]["name"] == "(all)"
    assert table[-1]["values"] == cap.all("activation_grads").numel()
    whole = R.cast_stats(cap.all("activation_grads"), "fp16", 2.0**8)
    assert table[-1]["underflow"] == whole.underflow_frac
    assert table[-1]["mean rel. error"] == pytest.approx(whole.mean_rel_error, rel=1e-9)
    assert all_hooks(model) == 0
    with pytest.raises(ValueError, match="no loss"):
        R.capture(model, {k: v for k, v in batch.items() if k != "labels"})


def test_capture_layer_selection_and_bad_inputs():
    model, batch = mlp(), batch_xy()
    assert list(R.capture(model, batch, mse, layers=["2", "4"]).activations) == ["2", "4"]
    assert list(R.capture(model, batch, mse, layers=nn.LayerNorm).weight_grads) == [
        "3.weight", "3.bias"]
    picked = R.capture(model, batch, mse, layers=lambda n, m: isinstance(m, nn.Linear))
    assert list(picked.activations) == ["0", "2", "4"]
    with pytest.raises(ValueError, match="no module named 'nope'"):
        R.capture(model, batch, mse, layers=["nope"])
    with pytest.raises(ValueError, match="scalar"):
        R.capture(model, batch[0])  # model(x) is (8, 1), not a loss
    with pytest.raises(ValueError, match="model.float"):
        R.capture(mlp().to(torch.bfloat16), batch, mse)
    with pytest.raises(TypeError, match="nn.Module"):
        R.capture(lambda x: x, batch, mse)
    with pytest.raises(ValueError, match="unknown kind"):
        R.capture(model, batch, mse).table(kind="gradients")
    assert all_hooks(model) == 0


# --- choosing a scale ---------------------------------------------------------------------------

def grads_like() -> torch.Tensor:
    """Gradient-like magnitudes 2^-34..2^-2, a few large outliers, 30 % exact zeros."""
    x = spread(50_000, seed=5, lo=-34, hi=-2)
    x[:15_000] = 0.0
    x[-3:] = torch.tensor([0.5, -2.0, 30.0])
    return x


def test_scale_sweep_is_monotone_and_matches_cast_stats():
    x = grads_like()
    sweep = R.scale_sweep([x[:20_000], x[20_000:]], "fp16")
    assert [r["scale"] for r in sweep] == [2.0**k for k in range(25)]
    under, over = sweep.column("underflow"), sweep.column("overflow")
    assert all(a >= b for a, b in zip(under, under[1:]))
    assert all(a <= b for a, b in zip(over, over[1:]))
    assert under[0] > 0.1 and over[-1] > 0 and over[0] == 0
    for row in sweep.rows[::6]:
        st = R.cast_stats(x, "fp16", row["scale"])
        assert (row["underflow"], row["overflow"]) == (st.underflow_frac, st.overflow_frac)


def test_good_scale_window_and_largest_safe_scale():
    x = grads_like()
    sweep = R.scale_sweep(x, "fp16")
    lo, hi = R.good_scale_window(sweep, underflow_tol=1e-3)
    by = {r["scale"]: r for r in sweep}
    assert by[lo]["underflow"] <= 1e-3 < by[lo / 2]["underflow"]
    assert by[hi]["overflow"] == 0 < by[hi * 2]["overflow"]
    assert R.good_scale_window(sweep, underflow_tol=0.0) is not None
    too_wide = R.scale_sweep(torch.tensor([2.0**-40, 1e4]), "fp16")  # 2^-40 needs 2^15: 1e4 can't
    assert R.good_scale_window(too_wide, underflow_tol=0.0) is None
    safe = R.largest_safe_scale(x, "fp16")
    assert safe == hi == 2.0**11  # 30 · 2^11 = 61,440 ≤ 65,504 < 122,880
    assert not (x * safe).half().isinf().any() and (x * safe * 2).half().isinf().any()
    assert R.largest_safe_scale(torch.zeros(3), "fp16") == math.inf
    assert R.largest_safe_scale(torch.tensor([1e6]), "fp16") == 2.0**-4
    with pytest.raises(ValueError, match="scale_sweep"):
        R.good_scale_window([{"scale": 1.0}])


def test_lost_frac_is_the_share_of_nonzero_values_torch_flushes_and_windows_can_use_it():
    x = grads_like()
    x[::3] = 0.0  # exact zeros lose nothing
    for fmt in ("fp16", "bf16", "fp8_e5m2"):
        for scale in (1.0, 2.0**9):
            d = direct(x, fmt, scale)
            nonzero = d["underflow"] + d["subnormal"] + d["normal"] + d["overflow"]
            st = R.cast_stats(x, fmt, scale)
            assert st.lost_frac == d["underflow"] / nonzero
            assert st.row()["lost (of nonzero)"] == st.lost_frac
    assert R.cast_stats(torch.zeros(4), "fp16").lost_frac == 0.0
    sweep = R.scale_sweep(x, "fp16")
    lost = sweep.column("lost (of nonzero)")
    assert lost[0] > sweep[0]["underflow"]  # a share of fewer values
    lo, hi = R.good_scale_window(sweep, underflow_tol=0.01, of_nonzero=True)
    by = {r["scale"]: r for r in sweep}
    assert by[lo]["lost (of nonzero)"] <= 0.01 < by[lo / 2]["lost (of nonzero)"]
    m = R.Magnitudes(x)
    assert m.min_abs == x[x != 0].abs().min().item() and R.Magnitudes(torch.zeros(2)).min_abs == 0


@pytest.mark.parametrize("bad", [{"steps": -1}, {"batch_size": 0}, {"seed": "0"},
                                 {"steps": True}])
def test_lesson_capture_rejects_bad_settings(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        R.lesson_capture(**bad)


def test_swamping_plot_draws_the_run_and_marks_the_first_lost_update():
    run = R.swamping_run(1.0, 1e-4, 50, "fp16")
    fig = plots.swamping_plot(run, pyplot=False)
    lines = fig.axes[0].get_lines()
    assert any((line.get_ydata() == run.weights).all() for line in lines)
    assert "50 of 50 updates lost" in fig.axes[0].get_title()
    master = plots.swamping_plot(R.swamping_run(1.0, 1e-4, 50, "fp16", master=True),
                                 pyplot=False)
    assert len(master.axes[0].get_lines()) == 3  # exact, master, the weight used
    with pytest.raises(TypeError, match="swamping_run"):
        plots.swamping_plot([1.0, 2.0])


# --- swamping -----------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt,k", [("fp16", 11), ("bf16", 8)])
def test_swamp_threshold_is_where_torch_stops_adding_the_update(fmt, k):
    dtype = F.get_format(fmt).dtype()
    for u in (2.0**-10, 2.0**-3, 1e-3, 0.3):
        w = R.swamp_threshold(u, fmt)
        if math.log2(u) == int(math.log2(u)):
            assert w == 2.0**k * u
        assert 2.0**k * u <= w < 2.0 ** (k + 1) * u
        at = torch.tensor(w, dtype=dtype)
        assert (at.float() + u).to(dtype) == at  # lost at the threshold
        below = torch.tensor(F.next_down(w, fmt), dtype=dtype)
        assert (below.float() + u).to(dtype) != below  # not lost one step below
    assert R.swamp_threshold(2.0**-26, "fp16") == 0.0  # the update itself is 0 in fp16


def test_fp16_weights_stall_at_2_11_times_the_update_master_weights_do_not():
    u = 2.0**-10
    plain = R.swamping_run(0.0, u, 4000, "fp16")
    assert plain.final == 2.0**11 * u == 2.0
    assert plain.first_lost == 2049 and plain.lost_steps == 4000 - 2048
    master = R.swamping_run(0.0, u, 4000, "fp16", master=True)
    assert master.final == master.expected == 4000 * u and master.lost_steps == 0
    assert np.array_equal(master.master_weights, master.exact)  # sums of 2^-10 are exact in fp32
    assert np.all(np.abs(master.weights - master.exact) <= 2.0**-10)  # fp16 copy: within an ulp/2
    bf = R.swamping_run(1.0, 2.0**-9, 300, "bf16")
    assert bf.final == 1.0 and bf.first_lost == 1  # |w| = 2^9·|u| > 2^8·|u|: lost at once
    assert bf.applied == 0.0
    assert "updates lost" in str(plain.table())


def test_swamping_run_steps_equal_formats_round_to():
    run = R.swamping_run(1000.0, 0.3, 50, "fp16")
    w = F.round_to(1000.0, "fp16")
    u = F.round_to(0.3, "fp16")
    for k in range(1, 51):
        w = F.round_to(float(np.float32(w + u)), "fp16")
        assert run.weights[k] == w, k


def test_bf16_running_sum_of_10000_uniform_values_sticks_at_256():
    values = torch.rand(10_000, generator=torch.Generator().manual_seed(0))
    rs = R.running_sum(values, "bf16")
    assert rs.low == 256.0
    assert rs.exact == pytest.approx(5000, rel=0.02) and rs.fp32 == pytest.approx(rs.exact,
                                                                                   rel=1e-5)
    assert rs.partial[rs.stalled_from - 1] == 256.0 and (rs.partial[rs.stalled_from:] == 256).all()
    acc = 0.0  # the same sums by mplab.formats
    for v in values[:600].tolist():
        acc = F.round_to(float(np.float32(acc + v)), "bf16")
    assert acc == rs.partial[599]
    assert R.running_sum(torch.empty(0), "fp16").low == 0.0


def test_swamping_bad_inputs():
    with pytest.raises(ValueError, match="steps"):
        R.swamping_run(1.0, 0.1, -1)
    with pytest.raises(ValueError, match="update"):
        R.swamping_run(1.0, math.nan, 5)
    with pytest.raises(ValueError, match="accepted"):
        R.swamping_run(1.0, 0.1, 5, fmt="fp9")


# --- overflow -----------------------------------------------------------------------------------

def test_overflow_demo_fp16_inf_turns_to_nan_bf16_stays_finite():
    fp16 = R.overflow_demo("fp16")
    assert fp16.first_inf == "ff_out: h·W2ᵀ + b2" and fp16.first_nan == "layer_norm"
    ff = next(s for s in fp16.stages if s.stage == fp16.first_inf)
    assert ff.reference_max == 66_246.0 > 65_504 and ff.inf == 1
    assert math.isnan(fp16.loss) and math.isfinite(fp16.reference_loss)
    bf16 = R.overflow_demo("bf16")
    assert bf16.finite and bf16.first_inf is None
    assert next(s for s in bf16.stages if s.stage.startswith("ff_out")).max_finite == 66_048.0
    assert bf16.loss == pytest.approx(bf16.reference_loss, rel=0.02)
    assert R.overflow_demo("fp8_e4m3").finite  # saturates at 448 instead
    assert R.overflow_demo("fp8_e5m2").first_nan == "layer_norm"
    assert len(fp16.table()) == len(fp16.stages)


# --- plots --------------------------------------------------------------------------------------

def test_exponent_histogram_plot_shades_bands_and_shifts_the_data_by_the_scale():
    x = grads_like()
    mags = {"a": R.Magnitudes(x[:25_000]), "b": R.Magnitudes(x[25_000:])}
    fig = plots.exponent_histogram_plot(mags, "fp16", 2.0**8, pyplot=False)
    ax = fig.axes[0]
    gids = {a.get_gid(): a for a in ax.get_children()}
    assert {"band-zero", "band-subnormal", "band-normal", "band-overflow"} <= set(gids)
    unscaled = gids["hist-unscaled"].get_data().edges
    shifted = gids["hist-all"].get_data().edges
    assert np.array_equal(shifted - unscaled, np.full_like(unscaled, 8.0))
    summary = gids["cast-summary"].get_text()
    st = R.cast_stats(x, "fp16", 2.0**8)
    assert f"{100 * st.underflow / st.nonzero:.3g} %" in summary
    one = plots.exponent_histogram_plot(x, "bf16", pyplot=False)
    assert "hist-unscaled" not in {a.get_gid() for a in one.axes[0].get_children()}
    hist_only = plots.exponent_histogram_plot(R.exponent_histogram(x), "fp8_e5m2", 4.0,
                                              pyplot=False)
    assert hist_only.axes
    sweep_fig = plots.scale_sweep_plot(R.scale_sweep(mags), pyplot=False)
    assert sweep_fig.axes[0].get_xlabel() == "log2 scale"
