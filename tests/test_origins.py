"""Where the first inf/NaN began (mplab.train.layers), and the causes only that record tells
apart (mplab.diagnosis.origins), on small loops a user could have written."""

import json
import math

import pytest
import torch
import torch.nn.functional as F

import mplab
from mplab.diagnosis.origins import layer_series
from mplab.train import Recorder, TrainResult
from mplab.train.layers import LAYER_FIELDS


class HandNorm(torch.nn.Module):
    """An RMSNorm written by hand, computing in its input's dtype (as fp16 checkpoints' do),
    or, with `fp32`, in fp32 and cast back (as LlamaRMSNorm does)."""

    def __init__(self, width: int, eps: float, fp32: bool = False):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(width))
        self.eps, self.fp32 = eps, fp32

    def forward(self, x):
        h = x.float() if self.fp32 else x
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class Padded(torch.nn.Module):
    """Token vectors with the padded ones zeroed, a norm over each, mean-pooled, classified."""

    def __init__(self, norm: torch.nn.Module, width: int = 16, gain: float = 1.0):
        super().__init__()
        self.embed = torch.nn.Linear(width, width)
        self.norm = norm
        self.head = torch.nn.Linear(width, 2)
        self.gain = gain

    def forward(self, x, mask):
        h = self.embed(x) * self.gain * mask[..., None]
        return self.head(self.norm(h).mean(1))


def _batches(steps: int, dtype=torch.float32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(8, 6, 16, generator=g).to(dtype)
        mask = torch.ones(8, 6, dtype=dtype)
        mask[:, 4:] = 0  # two padded positions per sequence
        yield x, mask, torch.randint(0, 2, (8,), generator=g)


def _train(model, steps=6, dtype=torch.float32, lr=1e-2, **recorded) -> TrainResult:
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    with Recorder(model, optimizer, **recorded) as rec:
        for x, mask, y in _batches(steps, dtype):
            loss = F.cross_entropy(model(x, mask).float(), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            rec.step(loss)
        return rec.finish()


def test_a_norm_whose_eps_rounds_to_zero_in_fp16_is_named_and_the_fp32_norm_is_healthy():
    broken = _train(Padded(HandNorm(16, eps=1e-12)).half(), dtype=torch.float16)
    first = broken.numerics["first"]["forward"]
    assert (first["step"], first["module"], first["kind"]) == (1, "norm", "HandNorm")
    assert first["input_finite"] is True and first["eps"] == 1e-12
    # what torch itself does with that eps in fp16, the reason the check gives
    assert torch.tensor(1e-12, dtype=torch.float16).item() == 0.0
    assert mplab.diagnose(broken).cause == "eps_underflow"
    healthy = _train(Padded(HandNorm(16, eps=1e-12, fp32=True)).half(), dtype=torch.float16)
    assert healthy.numerics["first"] == {}
    assert all(map(math.isfinite, healthy.losses))


def test_a_norm_fed_an_inf_from_the_op_before_it_is_an_overflow_not_its_eps():
    # the embedding's output times 1e5 passes 65504 in the functional op between two
    # modules: the norm is the first module whose output is non-finite, its input already is
    model = Padded(torch.nn.LayerNorm(16, eps=1e-12), gain=1e5).half()
    result = _train(model, steps=3, dtype=torch.float16)
    first = result.numerics["first"]["forward"]
    assert first["module"] == "norm" and first["input_finite"] is False
    diagnosis = mplab.diagnose(result)
    assert diagnosis.cause == "fp16_overflow"
    assert any("input was already inf/NaN" in e for e in diagnosis.findings[0].evidence)


def test_a_fill_is_told_from_a_value_that_grew(monkeypatch):
    # one-sided -inf beside small values: a constant, not growth...
    result = TrainResult(path="own loop", precision="fp16", device="cpu", model="m",
                         losses=[0.7, math.nan])
    result.numerics = {"first": {"forward": {
        "step": 2, "module": "head", "kind": "Linear", "dtype": "float16", "min": -math.inf,
        "max": 3.0, "peak_before": 4.0, "eps": None}}}
    assert mplab.diagnose(result).cause == "fill_out_of_range"
    # ...while a layer whose values were near the limit before grew into it
    result.numerics["first"]["forward"]["peak_before"] = 60000.0
    assert mplab.diagnose(result).cause == "fp16_overflow"
    result.numerics["first"]["forward"] |= {"peak_before": 4.0, "max": 30000.0}
    assert mplab.diagnose(result).cause == "fp16_overflow"


def test_gradients_zeroed_after_each_accumulated_step_are_not_stale():
    model = Padded(torch.nn.LayerNorm(16))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    with Recorder(model, optimizer) as rec:
        batches = list(_batches(12))
        for i in range(0, 12, 4):  # four micro-batches per optimizer step
            losses = []
            for x, mask, y in batches[i:i + 4]:
                loss = F.cross_entropy(model(x, mask), y) / 4
                loss.backward()
                losses.append(loss.detach() * 4)
            optimizer.step()
            optimizer.zero_grad()
            rec.step(torch.stack(losses).mean())
        result = rec.finish()
    assert result.numerics["stale_grads"] == []
    assert "stale_grads" not in mplab.diagnose(result)


class Grows(torch.optim.Optimizer):
    """Multiplies each weight by 300 a step, whatever its gradient: in fp16 a weight of 0.5
    is 150, then 45,000 (44,992), then inf, at the third step."""

    def __init__(self, params):
        super().__init__(params, {})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                p.mul_(300)


@pytest.mark.parametrize("set_to_none", [True, False])
def test_a_step_that_overflows_a_weight_is_found_however_the_loop_zeroes(set_to_none):
    # zero_grad() lets the watch keep the gradients unread until a weight turns inf/NaN;
    # zero_grad(set_to_none=False) overwrites them, so they are measured at each step
    model = Padded(torch.nn.LayerNorm(16)).half()
    with torch.no_grad():
        model.head.weight.fill_(0.5)
    optimizer = Grows([model.head.weight])
    with Recorder(model, optimizer) as rec:
        for x, mask, y in _batches(3, torch.float16):
            loss = F.cross_entropy(model(x, mask).float(), y)
            loss.backward()
            grad = model.head.weight.grad.abs().max().item()
            optimizer.step()
            optimizer.zero_grad(set_to_none=set_to_none)
            rec.step(loss)
        assert rec.log.layers._lazy is set_to_none
        result = rec.finish()
    assert result.numerics["first"]["step"] == {
        "step": 3, "parameter": "head.weight", "grad_amax": grad,
        "weight_amax_before": 44992.0}  # 45,000 in fp16


def test_the_sampled_rows_match_what_torch_computes_on_the_same_outputs():
    model = Padded(torch.nn.LayerNorm(16))
    seen = {}

    def keep(module, args, out):  # returns None: the output stays the model's
        seen[len(seen) + 1] = out.detach().clone()
    model.head.register_forward_hook(keep)
    result = _train(model, steps=11)
    rows = {(r["step"], r["module"], r["phase"]): r for r in result.numerics["layers"]}
    assert {s for s, *_ in rows} == {1, 10}  # step 1, then every 10
    assert set(LAYER_FIELDS) <= set(rows[1, "head", "forward"])
    for step in (1, 10):
        out, row = seen[step], rows[step, "head", "forward"]
        assert row["amax"] == pytest.approx(out.abs().max().item())
        assert row["amin"] == pytest.approx(out.abs()[out != 0].min().item())
        assert row["zeros"] == pytest.approx((out == 0).float().mean().item())
        assert row["fp16_overflow"] == 0.0
    assert layer_series(result, "head") == [(1, rows[1, "head", "forward"]["amax"]),
                                             (10, rows[10, "head", "forward"]["amax"])]
    assert ("embed" in {m for _, m, _ in rows}) and ("" not in {m for _, m, _ in rows})


def test_a_big_tensors_row_counts_values_spread_over_every_column():
    from mplab.train.layers import _SAMPLE_VALUES, _row, _Samples, _spread

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(32, 96, 768, generator=gen) * 1e-3  # 2.4 M values; 768 = 2^8 * 3
    x[..., 7] = 1e5  # one outlier channel, past fp16's largest: 1 value in 768
    x[:4] = 0.0
    index = _spread(torch.arange(x.numel(), dtype=torch.float64).view(x.shape)).reshape(-1)
    index = index.long()
    assert len(index) <= _SAMPLE_VALUES and len(index.unique()) == len(index)
    assert len((index % 768).unique()) == 768  # every column is among those counted
    small = torch.randn(3, 5, 7, generator=gen).half()  # under 8,192 values: every one
    assert torch.equal(_spread(small), small.reshape(-1))
    samples = _Samples()
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float16)  # as Lightning's "16-true" sets it in a forward
    try:
        (_, n_big), (_, n_small) = samples.add(x), samples.add(small)
    finally:
        torch.set_default_dtype(default)
    assert n_big == len(index) and n_small == small.numel()
    big, little = [_row([*map(float, torch.aminmax(t)), *figures], n)
                   for t, n, figures in zip((x, small), (n_big, n_small), samples.count())]
    a = x.abs()
    assert big["amax"] == 1e5  # the whole tensor's, exactly
    assert big["zeros"] == pytest.approx((a == 0).double().mean().item(), abs=0.01)
    assert big["fp16_subnormal"] == pytest.approx(
        ((a < 2.0 ** -14) & (a > 0)).double().mean().item(), abs=0.01)
    assert big["fp16_overflow"] == pytest.approx((a > 65504).double().mean().item(), rel=0.05)
    assert big["bf16_subnormal"] == 0.0
    # a shorter tensor counted in the same batch: exact, its padding counted nowhere
    s = small.float().abs()
    assert little == {"amax": s.max().item(), "amin": s.min().item(), "zeros": 0.0,
                      "fp16_subnormal": ((s < 2.0 ** -14) & (s > 0)).double().mean().item(),
                      "bf16_subnormal": 0.0, "fp16_overflow": 0.0}


def test_the_layers_record_survives_json_and_diagnoses_the_same():
    broken = _train(Padded(HandNorm(16, eps=1e-12)).half(), dtype=torch.float16)
    again = TrainResult.from_dict(json.loads(json.dumps(broken.as_dict(), allow_nan=False)))
    assert again.numerics["first"]["forward"]["module"] == "norm"
    assert mplab.diagnose(again).names == mplab.diagnose(broken).names


def test_layers_plot_draws_the_sampled_rows_and_refuses_a_run_without_them():
    from mplab.plots import layers_plot

    result = _train(Padded(torch.nn.LayerNorm(16)), steps=20)
    fig = layers_plot(result, pyplot=False)
    ax = fig.axes[0]
    drawn = {line.get_label(): line for line in ax.get_lines()}
    assert "fp16's largest, 65504" in drawn
    head = [r["amax"] for r in result.numerics["layers"]
            if r["module"] == "head" and r["phase"] == "forward"]
    assert list(drawn["head"].get_ydata()) == pytest.approx(head)
    with pytest.raises(ValueError, match="fields are"):
        layers_plot(result, field="largest", pyplot=False)
    bare = TrainResult(path="own loop", precision="fp32", device="cpu", model="m")
    with pytest.raises(ValueError, match="has none"):
        layers_plot(bare, pyplot=False)


def test_a_record_mplab_cannot_read_says_which_field_and_who_wrote_it(tmp_path):
    record = _train(Padded(torch.nn.LayerNorm(16)), steps=2).as_dict()
    assert record["mplab_version"] == mplab.train.result.MPLAB_VERSION
    older = record | {"losses": [0.7, "0.6"], "mplab_version": "0.1.0"}
    with pytest.raises(ValueError, match=r"'losses' must be a list of numbers; it was written by "
                                         r"mplab 0\.1\.0"):
        mplab.diagnose(older)
    cut = record | {"numerics": {"first": {"forward": {"step": 1}}}}
    with pytest.raises(ValueError, match=r"numerics\['first'\]\['forward'\].*is it whole"):
        mplab.diagnose(cut)
    path = tmp_path / "run.json"
    path.write_text(json.dumps(record)[:200])  # a file whose writer was stopped
    with pytest.raises(ValueError, match="not JSON .*cut short"):
        mplab.diagnose(path)
    assert mplab.diagnose(record).names == mplab.diagnose(TrainResult.from_dict(record)).names
