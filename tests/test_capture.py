"""mplab.amp.capture against the same step written out by hand: every activation, its gradient and
every weight gradient, and the model left as it was."""

import pytest
import torch
from torch import nn

from mplab.amp import capture as K
from mplab.numerics import casts as C


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
    cap = K.capture(model, (x, y), loss_fn=mse)
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
    cap = K.capture(model, batch, loss_fn=mse)
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
    a, b = K.capture(inplace, batch, mse), K.capture(plain, batch, mse)
    assert (a.activations["0"] < 0).any()  # copied before the ReLU overwrote it
    for kind in K.KINDS:
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
        K.capture(model, torch.randn(2, 4))
    assert all_hooks(model) == 0
    assert model.a.weight.grad is marker and model.b.weight.grad is None

    def bad_loss(model, batch):
        return model[0](batch).sum() + "oops"

    seq = nn.Sequential(nn.Linear(4, 4))
    with pytest.raises(TypeError):
        K.capture(seq, torch.randn(2, 4), loss_fn=bad_loss)
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
    cap = K.capture(model, batch)
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
    whole = C.cast_stats(cap.all("activation_grads"), "fp16", 2.0**8)
    assert table[-1]["lost (of nonzero)"] == whole.lost_frac
    assert table[-1]["zero (of all)"] == whole.zero_frac
    assert table[-1]["nonzero"] == int((cap.all("activation_grads") != 0).sum())
    assert table[-1]["mean rel. error"] == pytest.approx(whole.mean_rel_error, rel=1e-9)
    assert all_hooks(model) == 0
    with pytest.raises(ValueError, match="no loss"):
        K.capture(model, {k: v for k, v in batch.items() if k != "labels"})


def test_repeats_finds_the_embeddings_that_share_a_sum_s_gradient():
    model, batch = tiny_bert()
    cap = K.capture(model, batch)
    word, kind, pos = (cap.activation_grads[f"bert.embeddings.{n}_embeddings"]
                       for n in ("word", "token_type", "position"))
    assert torch.equal(word, kind)  # both terms of one sum: the same gradient
    assert pos.shape == (1, 8, 16) and torch.allclose(word.sum(0, keepdim=True), pos)
    rows = {r["name"]: r for r in cap.repeats("activation_grads")}
    assert set(rows) == {"bert.embeddings.token_type_embeddings",
                         "bert.embeddings.position_embeddings"}
    assert rows["bert.embeddings.token_type_embeddings"]["same as"] == \
        "bert.embeddings.word_embeddings"
    assert rows["bert.embeddings.token_type_embeddings"]["how"] == "identical"
    position = rows["bert.embeddings.position_embeddings"]
    assert position["how"] == "summed over dim 0 (4 → 1)"
    assert (position["shape"], position["values"]) == ((1, 8, 16), 128)
    # nothing repeats in an MLP, and a look-alike that is not the sum is no repeat
    assert len(K.capture(mlp(), batch_xy(), mse).repeats("activation_grads")) == 0
    assert K._repeat_of(word, word.sum(0, keepdim=True) * 1.01) == ""


def test_histograms_of_a_kind_share_bins_that_hold_every_value():
    model, batch = tiny_bert()
    cap = K.capture(model, batch)
    hists = cap.histograms("activation_grads")
    assert len({tuple(h.edges) for h in hists.values()}) == 1
    assert all(h.below == h.above == 0 for h in hists.values())
    smallest = min(m.min_abs for m in cap.magnitudes("activation_grads").values() if m.min_abs)
    assert next(iter(hists.values())).edges[0] <= torch.tensor(smallest).log2().item()


def test_capture_layer_selection_and_bad_inputs():
    model, batch = mlp(), batch_xy()
    assert list(K.capture(model, batch, mse, layers=["2", "4"]).activations) == ["2", "4"]
    assert list(K.capture(model, batch, mse, layers=nn.LayerNorm).weight_grads) == [
        "3.weight", "3.bias"]
    picked = K.capture(model, batch, mse, layers=lambda n, m: isinstance(m, nn.Linear))
    assert list(picked.activations) == ["0", "2", "4"]
    with pytest.raises(ValueError, match="no module named 'nope'"):
        K.capture(model, batch, mse, layers=["nope"])
    with pytest.raises(ValueError, match="scalar"):
        K.capture(model, batch[0])  # model(x) is (8, 1), not a loss
    with pytest.raises(ValueError, match="model.float"):
        K.capture(mlp().to(torch.bfloat16), batch, mse)
    with pytest.raises(TypeError, match="nn.Module"):
        K.capture(lambda x: x, batch, mse)
    with pytest.raises(ValueError, match="unknown kind"):
        K.capture(model, batch, mse).table(kind="gradients")
    assert all_hooks(model) == 0
