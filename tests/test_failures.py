"""mplab.numerics.failures against torch's arithmetic (and mplab.numerics.formats): swamped updates,
stalled sums, an fp16 overflow that turns NaN."""

import math

import numpy as np
import pytest
import torch

from mplab.numerics import failures as X
from mplab.numerics import formats

#: e4m3 overflows saturate at 448 on torch 2.13 and later, and become NaN before
SATURATES = formats.TORCH_E4M3_OVERFLOW == "saturate"


@pytest.mark.parametrize("precision,k", [("fp16", 11), ("bf16", 8)])
def test_swamp_threshold_is_where_torch_stops_adding_the_update(precision, k):
    dtype = formats.get_format(precision).dtype()
    for u in (2.0**-10, 2.0**-3, 1e-3, 0.3):
        w = X.swamp_threshold(u, precision)
        if math.log2(u) == int(math.log2(u)):
            assert w == 2.0**k * u
        assert 2.0**k * u <= w < 2.0 ** (k + 1) * u
        at = torch.tensor(w, dtype=dtype)
        assert (at.float() + u).to(dtype) == at  # lost at the threshold
        below = torch.tensor(formats.next_down(w, precision), dtype=dtype)
        assert (below.float() + u).to(dtype) != below  # not lost one step below
    assert X.swamp_threshold(2.0**-26, "fp16") == 0.0  # the update itself is 0 in fp16


def test_fp16_weights_stall_at_2_11_times_the_update_master_weights_do_not():
    u = 2.0**-10
    plain = X.swamping_run(0.0, u, 4000, "fp16")
    assert plain.final == 2.0**11 * u == 2.0
    assert plain.first_lost == 2049 and plain.lost_steps == 4000 - 2048
    master = X.swamping_run(0.0, u, 4000, "fp16", master=True)
    assert master.final == master.expected == 4000 * u and master.lost_steps == 0
    assert np.array_equal(master.master_weights, master.exact)  # sums of 2^-10 are exact in fp32
    assert np.all(np.abs(master.weights - master.exact) <= 2.0**-10)  # fp16 copy: within an ulp/2
    bf = X.swamping_run(1.0, 2.0**-9, 300, "bf16")
    assert bf.final == 1.0 and bf.first_lost == 1  # |w| = 2^9·|u| > 2^8·|u|: lost at once
    assert bf.applied == 0.0
    assert "updates lost" in str(plain.table())


def test_swamping_run_steps_equal_formats_round_to():
    run = X.swamping_run(1000.0, 0.3, 50, "fp16")
    w = formats.round_to(1000.0, "fp16")
    u = formats.round_to(0.3, "fp16")
    for k in range(1, 51):
        w = formats.round_to(float(np.float32(w + u)), "fp16")
        assert run.weights[k] == w, k


def test_bf16_running_sum_of_10000_uniform_values_sticks_at_256():
    values = torch.rand(10_000, generator=torch.Generator().manual_seed(0))
    rs = X.running_sum(values, "bf16")
    assert rs.low == 256.0
    assert rs.exact == pytest.approx(5000, rel=0.02) and rs.fp32 == pytest.approx(rs.exact,
                                                                                   rel=1e-5)
    assert rs.partial[rs.stalled_from - 1] == 256.0 and (rs.partial[rs.stalled_from:] == 256).all()
    acc = 0.0  # the same sums by mplab.numerics.formats
    for v in values[:600].tolist():
        acc = formats.round_to(float(np.float32(acc + v)), "bf16")
    assert acc == rs.partial[599]
    assert X.running_sum(torch.empty(0), "fp16").low == 0.0


def test_swamping_bad_inputs():
    with pytest.raises(ValueError, match="steps"):
        X.swamping_run(1.0, 0.1, -1)
    with pytest.raises(ValueError, match="update"):
        X.swamping_run(1.0, math.nan, 5)
    with pytest.raises(ValueError, match="accepted"):
        X.swamping_run(1.0, 0.1, 5, precision="fp9")


# --- overflow -----------------------------------------------------------------------------------

def test_overflow_demo_fp16_inf_turns_to_nan_bf16_stays_finite():
    fp16 = X.overflow_demo("fp16")
    assert fp16.first_inf == "ff_out: h·W2ᵀ + b2" and fp16.first_nan == "layer_norm"
    ff = next(s for s in fp16.stages if s.stage == fp16.first_inf)
    assert ff.reference_max == 66_246.0 > 65_504 and ff.inf == 1
    assert math.isnan(fp16.loss) and math.isfinite(fp16.reference_loss)
    bf16 = X.overflow_demo("bf16")
    assert bf16.finite and bf16.first_inf is None
    assert next(s for s in bf16.stages if s.stage.startswith("ff_out")).max_finite == 66_048.0
    assert bf16.loss == pytest.approx(bf16.reference_loss, rel=0.02)
    e4m3 = X.overflow_demo("fp8_e4m3")  # no inf: torch >= 2.13 saturates at 448, before NaN
    if SATURATES:
        assert e4m3.finite
    else:
        assert not e4m3.finite and e4m3.first_inf is None and math.isnan(e4m3.loss)
    assert X.overflow_demo("fp8_e5m2").first_nan == "layer_norm"
    assert len(fp16.table()) == len(fp16.stages)
    # the table shows the evidence (per stage, infs and NaNs beside fp32's values) and the
    # format's limit; where the failure begins is for the reader to find in the rows
    title = fp16.table().title
    assert "fp16" in title and "65504" in title
    assert fp16.first_inf not in title and "first" not in title and "NaN" not in title
    assert [r["inf"] > 0 for r in fp16.table()].index(True) == [
        s.stage for s in fp16.stages].index(fp16.first_inf)
    assert "3.38953e+38" in bf16.table().title and "finite value" in bf16.table().title


def test_attention_demo_softmax_steps_are_torchs_and_say_where_the_nan_is_made():
    fp16 = X.attention_overflow_demo("fp16")
    scores = next(s for s in fp16.stages if s.stage == fp16.first_inf)
    assert scores.reference_max == X.ATTENTION_SCORE > 65_504 and scores.inf == 1
    # the softmax spelled out is torch's own: the same NaNs, the same finite values
    out = fp16.outputs
    want = torch.softmax(out["scaled: scores / √d"].half(), dim=-1).float()
    got = out["softmax: exp / row sum"]
    assert torch.equal(got.isnan(), want.isnan()) and bool(got.isnan().any())
    assert torch.allclose(got[~got.isnan()], want[~want.isnan()], atol=1e-3)
    made = [s for s in fp16.stages if s.made]  # only one stage makes NaN; the rest carry it
    assert [(s.stage, s.made, s.cause) for s in made] == [("scores − row max", 1, "inf − inf")]
    assert fp16.first_nan == "scores − row max" and math.isnan(fp16.loss)
    story = fp16.story()
    assert "'scores: q·kᵀ'" in story and "72,000" in story and "inf − inf" in story
    assert "8 at 'output: softmax·v'" in story  # the NaN row times v: every output channel
    bf16 = X.attention_overflow_demo("bf16")
    stored = next(s for s in bf16.stages if s.stage == "scores: q·kᵀ").max_finite
    assert bf16.finite and stored == torch.tensor(X.ATTENTION_SCORE).bfloat16().item()
    assert f"stores it as {stored:,.6g}" in bf16.story()
    e4m3 = X.attention_overflow_demo("fp8_e4m3").story()
    assert ("saturates" in e4m3) if SATURATES else ("first NaN is made at 'scores: q·kᵀ'" in e4m3)
    with pytest.raises(ValueError, match="accepted"):
        X.attention_overflow_demo("fp9")


def test_nan_causes_are_read_off_the_operands():
    ff = X.overflow_demo("fp16")  # layer_norm is no elementwise op: NaNs counted, no cause
    ln = next(s for s in ff.stages if s.stage == "layer_norm")
    assert (ln.made, ln.cause) == (ln.nan, None) and ln.nan > 0
    assert all(s.made == 0 for s in ff.stages if s.stage != "layer_norm")


@pytest.mark.parametrize("precision", ["fp16", "bf16", "fp32"])
def test_inf_arithmetic_is_torchs_in_the_format(precision):
    rows = {r["operation"]: r[f"{precision} result"] for r in X.inf_arithmetic(precision)}
    top = float(formats.get_format(precision).max_finite)
    assert rows[f"{top:g} × 2"] == math.inf and rows["inf + 1"] == math.inf
    assert rows["1 / inf"] == 0 and rows["exp(−inf)"] == 0
    for op in ("inf − inf", "0 × inf", "inf / inf", "NaN + 1", "NaN × 0", "max(NaN, 1)"):
        assert math.isnan(rows[op]), op
    with pytest.raises(ValueError, match="accepted: 'fp16'"):
        X.inf_arithmetic("fp8_e4m3")


def test_a_sum_across_ranks_in_bf16_loses_more_as_the_ranks_grow():
    rows = X.sum_across_ranks([1, 2, 16, 256], "bf16", size=1024).rows
    bf16 = [r["bf16 sum, rel. error"] for r in rows]
    assert bf16 == sorted(bf16) and bf16[-1] > 4 * bf16[1]
    # one rank is torch's cast of its gradients to bf16, and nothing else
    g = torch.randn(1, 1024, generator=torch.Generator().manual_seed(0),
                    dtype=torch.float64) * 1e-3
    cast = (torch.linalg.vector_norm(g[0].to(torch.bfloat16).double() - g[0])
            / torch.linalg.vector_norm(g[0])).item()
    assert bf16[0] == pytest.approx(cast, rel=1e-6)
    assert all(r["fp32 sum, rel. error"] < 1e-6 for r in rows)
