"""mplab.fixtures: each fixture is what the library makes when called the way a learner would."""

import pytest
import torch

from mplab import fixtures
from mplab.amp.capture import capture
from mplab.amp.scaler import GradScaler
from mplab.amp.trace import trace
from mplab.data import batches, encode, load_dataset
from mplab.models import lesson_model, lesson_tokenizer
from mplab.train import train


def test_the_lesson_batch_is_the_first_training_reviews_encoded():
    reviews = load_dataset("sentiment", "train")
    batch = fixtures.lesson_batch(6)
    want = encode(lesson_tokenizer(), reviews.texts[:6], reviews.labels[:6])
    assert set(batch) == {"input_ids", "attention_mask", "labels"}
    assert all(torch.equal(batch[k], want[k]) for k in want)
    everything = encode(lesson_tokenizer(), reviews.texts, reviews.labels)
    first = next(batches(everything, 6, shuffle=False, device="cpu"))  # no padding-only columns
    assert all(torch.equal(batch[k], first[k]) for k in first)
    with pytest.raises(ValueError, match="size"):
        fixtures.lesson_batch(0)


def test_the_lesson_capture_is_a_capture_after_training_with_mplab_train():
    model = lesson_model(seed=1)
    train(model=model, steps=3, batch_size=8, lr=1e-3, schedule="constant", warmup_steps=0,
          eval_samples=0, seed=1, device="cpu", progress=False)
    want = capture(model, fixtures.lesson_batch(8))
    got = fixtures.lesson_capture(steps=3, batch_size=8, seed=1)
    assert got.loss == want.loss
    assert list(got.weight_grads) == list(want.weight_grads)
    for kind in ("weight_grads", "activation_grads"):
        for name, t in want.tensors(kind).items():
            assert torch.equal(got.tensors(kind)[name], t), (kind, name)
    assert fixtures.lesson_capture(steps=3, batch_size=8, seed=1) is got  # cached


def test_steps_0_captures_the_model_as_initialised():
    got = fixtures.lesson_capture(steps=0, batch_size=4)
    want = capture(lesson_model(seed=0), fixtures.lesson_batch(4))
    assert got.loss == want.loss
    assert all(torch.equal(got.weight_grads[n], t) for n, t in want.weight_grads.items())


@pytest.mark.parametrize("bad", [{"steps": -1}, {"batch_size": 0}, {"seed": "0"},
                                 {"steps": True}])
def test_lesson_capture_rejects_bad_settings(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        fixtures.lesson_capture(**bad)


def test_the_lesson_trace_is_bf16_autocast_on_four_reviews_and_shared():
    t = fixtures.lesson_trace()
    want = trace(lesson_model(), fixtures.lesson_batch(4), precision="bf16", device="cpu")
    assert [(r.op, r.kind) for r in t.records] == [(r.op, r.kind) for r in want.records]
    assert t.fp32_ops == want.fp32_ops and fixtures.lesson_trace() is t


def test_the_layer_weight_is_an_initialised_linear_layers_weight():
    torch.manual_seed(0)
    assert fixtures.layer_weight() == torch.nn.Linear(768, 768).weight[0, 0].item()
    torch.manual_seed(3)
    assert fixtures.layer_weight(3, 1, 2) == torch.nn.Linear(768, 768).weight[1, 2].item()


def test_layer_weight_leaves_the_callers_random_state_alone():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    fixtures.layer_weight.cache_clear()
    fixtures.layer_weight()
    assert torch.equal(torch.rand(3), expected)


def test_a_scaler_run_steps_mplabs_scaler_as_torch_steps_its_own():
    settings = {"init_scale": 2.0**10, "growth_interval": 2}
    ours = fixtures.ScalerRun(GradScaler("cpu", **settings))
    theirs = fixtures.ScalerRun(torch.amp.GradScaler("cpu", **settings))
    clicks = [False, False, True, False, False, False, True, True]
    for inject in clicks:
        ours.iteration(inject)
        theirs.iteration(inject)
        assert ours.agrees_with(theirs)
    rows = ours.history_rows()
    assert [r["inf/NaN found"] for r in rows] == clicks
    assert [r["step"] for r in rows] == ["skipped" if c else "taken" for c in clicks]
    assert rows[-1]["new scale"] == theirs.scaler.get_scale()
    assert rows[0] == {"iteration": 1, "scale used": 1024.0, "inf/NaN found": False,
                       "step": "taken", "new scale": 1024.0, "tracker": 1}
    theirs.iteration(True)  # one more on one side only: they part
    assert not ours.agrees_with(theirs)
