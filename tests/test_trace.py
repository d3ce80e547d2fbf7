"""mplab.amp.trace against what torch really does under CPU autocast (references computed here)."""

import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import _get_current_function_mode
from torch.utils._python_dispatch import _get_current_dispatch_mode

from mplab.amp.trace import (
    CAST,
    EXPLICIT_CAST,
    FP32,
    FP32_AUTOCAST,
    KINDS,
    LOW,
    POLICY_CALLS,
    PROMOTE,
    LayerView,
    autocast_policy,
    trace,
)


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def linear_output_dtypes(model, x, autocast: bool) -> set[torch.dtype]:
    """The reference: dtypes the Linear layers really returned, seen by a hook of our own."""
    seen, hooks = set(), []
    for m in model.modules():
        if isinstance(m, nn.Linear):
            hooks.append(m.register_forward_hook(lambda m, i, o: seen.add(o.dtype)))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        model(x)
    for h in hooks:
        h.remove()
    return seen


def under_cpu_autocast(fn, x):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return fn(x).dtype


class Head(nn.Module):
    """Linear -> LayerNorm -> softmax, then cross-entropy, cat and a residual add."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)

    def forward(self, x, target):
        h = self.proj(x)
        probs = F.softmax(self.norm(h), dim=-1)
        both = torch.cat([h, x])                      # bf16 with fp32
        residual = h + x                              # bf16 + fp32
        return F.cross_entropy(h, target) + probs.sum() + both.sum() + residual.sum()


@pytest.fixture(scope="module")
def head_trace():
    torch.manual_seed(0)
    return trace(Head(), (torch.randn(4, 8), torch.tensor([0, 1, 2, 3])), device="cpu",
                 loss_fn=lambda loss: loss)


def test_linear_runs_in_bf16_after_autocast_casts_its_weight():
    model, x = mlp(), torch.randn(5, 8)
    t = trace(model, x, precision="bf16", device="cpu")
    fwd = t.select("forward")
    first = next(i for i, r in enumerate(fwd) if r.op == "aten::addmm")
    assert fwd[first].inputs == (torch.bfloat16,) * 3
    assert fwd[first].outputs == (torch.bfloat16,)
    assert fwd[first].kind == LOW and fwd[first].module == "0"
    casts = [r for r in fwd[:first] if r.kind == CAST]
    assert [(r.inputs, r.outputs) for r in casts] == [((torch.float32,), (torch.bfloat16,))] * 3
    assert t.matmul_dtype == torch.bfloat16
    assert linear_output_dtypes(model, x, autocast=True) == {t.matmul_dtype}


def test_without_autocast_everything_runs_in_fp32():
    model, x = mlp(), torch.randn(5, 8)
    t = trace(model, x, precision="fp32", device="cpu")
    assert t.matmul_dtype == torch.float32
    assert linear_output_dtypes(model, x, autocast=False) == {t.matmul_dtype}
    assert not t.casts and not t.low_precision_ops and not t.fp32_ops
    assert "no autocast" in repr(t)


def test_fp16_autocast_on_cpu():
    t = trace(nn.Linear(4, 4), torch.randn(2, 4), precision=torch.float16, device="cpu")
    assert t.matmul_dtype == torch.float16 and t.dtype == torch.float16


def test_cpu_fp32_list_follows_what_torch_does(head_trace):
    bf16 = torch.randn(4, 8, dtype=torch.bfloat16)
    target = torch.tensor([0, 1, 2, 3])
    # The reference: on CPU, torch upcasts cross-entropy but leaves layer_norm and softmax alone.
    assert under_cpu_autocast(lambda x: F.cross_entropy(x, target), bf16) == torch.float32
    assert under_cpu_autocast(lambda x: F.layer_norm(x, (8,)), bf16) == torch.bfloat16
    assert under_cpu_autocast(lambda x: F.softmax(x, -1), bf16) == torch.bfloat16

    t = head_trace
    assert {"aten::_log_softmax", "aten::nll_loss_forward"} <= t.fp32_ops
    assert {"aten::native_layer_norm", "aten::_softmax", "aten::addmm"} <= t.low_precision_ops
    assert "aten::native_layer_norm" not in t.fp32_ops
    ce = [r for r in t.select("forward") if r.op == "aten::_log_softmax"]
    assert ce and all(r.inputs == (torch.float32,) for r in ce)
    # the upcast that feeds it is autocast's, not the code's
    upcasts = [r for r in t.casts if r.inputs == (torch.bfloat16,) and r.phase == "forward"]
    assert upcasts and all(r.module == "" for r in upcasts)


def test_cat_is_promoted_by_autocast_and_add_by_type_promotion(head_trace):
    fwd = head_trace.select("forward")
    cat = next(r for r in fwd if r.op == "aten::cat")
    assert cat.kind == PROMOTE and cat.inputs == (torch.float32, torch.float32)
    add = next(r for r in fwd if r.op == "aten::add" and r.inputs == (torch.bfloat16,
                                                                       torch.float32))
    assert add.kind == PROMOTE and add.outputs == (torch.float32,)


def test_each_op_says_whether_autocast_cast_its_inputs_first():
    """What tells an op on autocast's fp32 list from one that was simply given fp32."""
    class TwoLosses(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj, self.norm = nn.Linear(8, 4), nn.LayerNorm(8)

        def forward(self, x, target):
            low, high = self.proj(x), self.norm(x)[:, :4]  # bf16, and fp32 (x is fp32)
            return F.cross_entropy(low, target) + F.cross_entropy(high, target)

    torch.manual_seed(0)
    t = trace(TwoLosses(), (torch.randn(4, 8), torch.tensor([0, 1, 2, 3])), device="cpu",
              loss_fn=lambda loss: loss)
    fwd = t.select("forward")
    # both losses run in fp32, but only the bf16 one was cast up by autocast first
    softmaxes = [r for r in fwd if r.op == "aten::_log_softmax"]
    assert [(r.inputs, r.kind, r.autocast_cast) for r in softmaxes] == [
        ((torch.float32,), FP32_AUTOCAST, True), ((torch.float32,), FP32, False)]
    (norm,) = [r for r in fwd if r.op == "aten::native_layer_norm"]
    assert norm.inputs[0] == torch.float32 and norm.autocast_cast is False
    assert all(r.autocast_cast for r in fwd if r.op == "aten::addmm")
    assert all(r.autocast_cast is None for r in t.casts + t.select("backward"))
    assert t.table(phase="forward")[norm.index]["autocast cast inputs"] == "no"
    ops = t.summary().column("op")
    assert t.summary()[ops.index("aten::_log_softmax")]["autocast cast inputs"] == "no x1, yes x1"


def test_casts_the_code_asks_for_are_explicit():
    t = trace(mlp(), torch.randn(5, 8), device="cpu")   # default loss: output.float().sum()
    loss_ops = [r for r in t.select("forward") if r.module == "(loss)"]
    assert [(r.op, r.kind) for r in loss_ops] == [("aten::_to_copy", EXPLICIT_CAST),
                                                   ("aten::sum", FP32)]
    assert all(r.module != "(loss)" for r in t.casts)


def test_backward_is_recorded_and_attributed_to_the_modules_that_made_it():
    t = trace(mlp(), torch.randn(5, 8), device="cpu")
    bwd = t.select("backward")
    assert bwd and all(r.phase == "backward" for r in bwd)
    mms = [r for r in bwd if r.op == "aten::mm"]
    assert {r.module for r in mms} == {"0", "2"}
    assert all(r.inputs == (torch.bfloat16,) * 2 and r.kind == LOW for r in mms)
    # the gradients of autocast's weight casts: bf16 back to the fp32 weights
    back_casts = [r for r in bwd if r.kind == CAST]
    assert len(back_casts) == 4
    assert all(r.outputs == (torch.float32,) for r in back_casts)
    assert any(r.op == "aten::threshold_backward" and r.module == "1" for r in bwd)
    assert not trace(mlp(), torch.randn(5, 8), device="cpu", backward=False).select("backward")


def test_lesson_model_dict_batch():
    from mplab.data import encode, load_dataset
    from mplab.models import lesson_model, lesson_tokenizer

    ds = load_dataset("sentiment", "train")
    batch = encode(lesson_tokenizer(), ds.texts[:8], ds.labels[:8])
    model = lesson_model()
    start = time.perf_counter()
    t = trace(model, batch, precision="bf16", device="cpu")
    assert time.perf_counter() - start < 10
    assert t.matmul_dtype == torch.bfloat16
    assert "aten::nll_loss_forward" in t.fp32_ops
    query = [r for r in t.select("forward") if r.module.endswith("layer.0.attention.self.query")]
    assert [r.kind for r in query if r.op == "aten::addmm"] == [LOW]
    assert {r.phase for r in t.records} == {"forward", "backward"}
    assert all(p.grad is None for p in model.parameters())  # the model is left as it was


def test_tuple_inputs_loss_fn_and_grads_left_alone():
    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(4, 4)

        def forward(self, x, y):
            return self.a(x) * self.a(y)

    model = Two()
    before = torch.ones(4, 4)
    model.a.weight.grad = before
    t = trace(model, (torch.randn(2, 4), torch.randn(2, 4)), device="cpu",
              loss_fn=lambda out: F.mse_loss(out, torch.zeros(2, 4)))
    assert model.a.weight.grad is before and model.a.bias.grad is None
    assert next(r for r in t.records if r.op == "aten::mul").kind == LOW
    mse = next(r for r in t.records if r.op == "aten::mse_loss")   # on CPU's fp32 list
    assert mse.kind == FP32_AUTOCAST and mse.module == "(loss)"


class Boom(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        raise RuntimeError("boom")


@pytest.mark.parametrize("where", ["forward", "loss"])
def test_hooks_and_modes_are_removed_when_the_step_raises(where):
    model = Boom() if where == "forward" else mlp()

    def bad_loss(out):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        trace(model, torch.randn(2, 4 if where == "forward" else 8), device="cpu",
              loss_fn=bad_loss)
    assert _get_current_dispatch_mode() is None and _get_current_function_mode() is None
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    assert not torch.is_autocast_enabled("cpu")


def test_no_kind_reads_as_another_and_each_trace_defines_the_kinds_it_uses(head_trace):
    # labels that share a first word ("fp32 ...", "cast ...") each say whose decision it was
    for a in KINDS:
        for b in KINDS:
            if a != b and a.split()[0] == b.split()[0]:
                assert "(" in a and "(" in b, (a, b)
    kinds = head_trace.kinds()
    used = {r.kind for r in head_trace.records}
    assert [row["kind"] for row in kinds] == [k for k in KINDS if k in used]
    for row in kinds:
        assert row["ops"] == sum(r.kind == row["kind"] for r in head_trace.records)
        assert row["what it means"] == KINDS[row["kind"]]


def test_autocast_policy_agrees_with_torch_autocast_call_by_call():
    policy = autocast_policy("bf16", device="cpu")
    assert policy.column("call") == list(POLICY_CALLS)
    for row, fn in zip(policy, POLICY_CALLS.values()):
        want = under_cpu_autocast(fn, torch.randn(4, 8, dtype=torch.bfloat16))
        assert row["computed in"] == {torch.bfloat16: "bf16", torch.float32: "fp32"}[want], row
        assert row["kind"] == (FP32_AUTOCAST if want == torch.float32 else LOW), row
    ce = policy[policy.column("call").index("F.cross_entropy(x, labels)")]
    assert ce["ran as"] == "aten::_log_softmax, aten::nll_loss_forward"
    assert autocast_policy("fp16", device="cpu", calls={"x.sum()": lambda x: x.sum()}).column(
        "computed in") == ["fp16"]
    with pytest.raises(ValueError, match="'bf16' or 'fp16', got 'fp32'"):
        autocast_policy("fp32", device="cpu")


def test_table_summary_and_by_layer_render(head_trace):
    t = head_trace
    table = t.table()
    assert len(table) == len(t.records) and "aten::addmm" in table._repr_html_()
    assert len(t.table(phase="backward", kinds=LOW, limit=2)) == 2
    assert {r["kind"] for r in t.table(kinds=[CAST])} == {CAST}

    summary = t.summary()
    ops = summary.column("op")
    assert len(ops) == len(set(ops)) and "aten::nll_loss_forward" in ops
    row = summary[ops.index("aten::addmm")]
    assert row["kind"] == LOW and row["outputs"] == "bf16"
    assert "aten::_log_softmax" in str(summary)

    layers = t.by_layer()
    assert isinstance(layers, LayerView) and set(layers.rows) >= {"proj", "norm", ""}
    html = layers._repr_html_()
    assert "addmm" in html and "low-precision" in html and "fp32-autocast" in html
    assert "proj" in str(layers) and "addmm:bf16" in str(layers)


@pytest.mark.parametrize("kwargs, message", [
    ({"precision": "fp8"}, "'bf16'"),
    ({"precision": torch.int8}, "torch.float16"),
    ({"device": "tpu"}, "'cpu'"),
    ({"device": 3}, "'auto'"),
])
def test_bad_settings_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        trace(mlp(), torch.randn(2, 8), **kwargs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_without_a_gpu_is_a_clear_error():
    with pytest.raises(ValueError, match="no CUDA GPU"):
        trace(mlp(), torch.randn(2, 8), device="cuda")


@pytest.mark.parametrize("batch, message", [
    (42, "got int"), ((), r"\(empty\)"), ({1: torch.ones(2)}, "keys must be strings")])
def test_bad_batches_are_named(batch, message):
    with pytest.raises(ValueError, match=message):
        trace(mlp(), batch, device="cpu")


def test_bad_model_and_missing_loss_are_named():
    with pytest.raises(ValueError, match="torch.nn.Module, got str"):
        trace("bert", torch.randn(2, 8))
    with pytest.raises(ValueError, match="loss_fn"):
        trace(mlp(), torch.randn(2, 8), device="cpu", loss_fn=lambda out: out)
    frozen = mlp().requires_grad_(False)
    with pytest.raises(ValueError, match="backward=False"):
        trace(frozen, torch.randn(2, 8), device="cpu")


def test_bad_view_arguments_are_named(head_trace):
    with pytest.raises(ValueError, match="accepted: cast"):
        head_trace.table(kinds="fast")
    with pytest.raises(ValueError, match="phase"):
        head_trace.summary(phase="sideways")
    with pytest.raises(ValueError, match="limit"):
        head_trace.table(limit=-1)


def test_a_dict_batch_without_labels_needs_a_loss():
    from mplab.models import lesson_model

    batch = {"input_ids": torch.tensor([[2, 5, 6, 3]])}
    with pytest.raises(ValueError, match=r"keys \['input_ids'\]; include 'labels'"):
        trace(lesson_model(), batch, device="cpu")
    t = trace(lesson_model(), batch, device="cpu", backward=False)
    assert t.matmul_dtype == torch.bfloat16 and not t.select("backward")
