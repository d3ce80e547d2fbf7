"""mplab.diagnosis.Watch: a Hugging Face Trainer's run recorded in one line, diagnosed as
mplab's own Trainer path's run is (the reference: mplab.train(path="trainer")); and the same
run recorded four ways (a Recorder in a loop of your own, Watch, LightningWatch,
watch_accelerator), one record and one diagnosis."""

import warnings

import lightning.pytorch as L
import pytest
import pytorch_lightning
import torch
from accelerate import Accelerator
from lightning.pytorch.plugins import MixedPrecision
from torch.utils.data import DataLoader
from transformers import Trainer, TrainingArguments

import mplab
from mplab.diagnosis import lab
from mplab.hardware import has_units
from mplab.train import Recorder, fresh_accelerate, train

warnings.filterwarnings("ignore", category=UserWarning)
STEPS = 6


def rows(n: int) -> list[dict]:
    """The lab's shipped reviews as the Trainer takes them: one dict of tensors per review."""
    batch = next(lab.lab_batches(1, batch_size=n))
    return [{k: v[i] for k, v in batch.items()} for i in range(n)]


def trainer_run(tmp_path, precision: str):
    watch = mplab.diagnosis.Watch()
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=8,
                             gradient_accumulation_steps=2, max_steps=STEPS, learning_rate=1e-3,
                             fp16=precision == "fp16", bf16=precision == "bf16", use_cpu=True,
                             report_to=[], save_strategy="no", logging_steps=1000,
                             disable_tqdm=True)
    trainer = Trainer(model=lab.lab_model(), args=args, train_dataset=rows(8 * 2 * STEPS),
                      callbacks=[watch])
    assert watch.result is None
    with pytest.raises(RuntimeError, match="has not seen a run"):
        watch.diagnose()
    trainer.train()
    return watch, trainer


def test_a_watched_trainer_run_is_recorded_step_by_step_whatever_logging_steps(tmp_path):
    watch, trainer = trainer_run(tmp_path, "fp32")
    result = watch.result
    assert result.steps == len(result.losses) == trainer.state.global_step == STEPS
    assert all(torch.isfinite(torch.tensor(result.losses)))
    assert result.precision == "fp32" and result.config["label"] == "a Trainer run"
    assert result.audit.compute_dtype == torch.float32
    assert watch.diagnose().ok, watch.diagnose()


def test_fp16_ignored_on_a_cpu_is_named_as_for_mplabs_own_trainer_path(tmp_path):
    """TrainingArguments(fp16=True) on a CPU trains in fp32 without a word: the watched run and
    mplab's Trainer path, same request, same diagnosis."""
    watch, _ = trainer_run(tmp_path, "fp16")
    reference = mplab.diagnose(train(model=lab.lab_model(), path="trainer", precision="fp16",
                                     steps=STEPS, batch_size=8, eval_samples=0, progress=False,
                                     device="cpu"))
    found = watch.diagnose()
    assert found.cause == reference.cause == "fp16_ignored", (found, reference)
    assert watch.result.audit.has("fp16_ignored") and watch.result.scales == []


def test_a_bf16_trainer_run_matmuls_in_bf16_and_is_not_broken(tmp_path):
    watch, _ = trainer_run(tmp_path, "bf16")
    assert watch.result.audit.compute_dtype == torch.bfloat16
    found = watch.diagnose()
    assert all(f.severity != "broken" for f in found.findings), found
    # on a CPU without bf16 units the one warning is that it is slow there
    assert found.cause == (None if has_units("bf16") else "no_units"), found


def test_the_readmes_one_line_needs_only_import_mplab():
    import subprocess
    import sys

    code = "import mplab; print(mplab.diagnosis.Watch.__name__, mplab.amp.GradScaler.__name__)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.split() == ["Watch", "GradScaler"], done.stderr
    with pytest.raises(AttributeError, match="no attribute 'no_such_package'"):
        mplab.no_such_package  # noqa: B018


# ---- one failure, four attaches: own loop, Trainer, Lightning, Accelerate -------------------

BATCH = 8
#: each run as a user would set it in any of the four: what it asks for, its lr, its weights
CASES = {
    "healthy": {"precision": "fp32", "lr": 1e-3, "steps": 6, "bf16_weights": False},
    # bf16 asked for, and the weights cast to bf16 (no fp32 master weights)
    "pure_low_precision": {"precision": "bf16", "lr": 1e-4, "steps": 6, "bf16_weights": True},
    # AdamW at lr=1 (1000 times the lab's): the loss climbs to tens
    "diverged": {"precision": "fp32", "lr": 1.0, "steps": 12, "bf16_weights": False},
}
LIGHTNING = {"fp32": "32-true", "bf16": "bf16-mixed"}
ACCELERATE = {"fp32": "no", "bf16": "bf16"}


def loader(steps: int, accumulation: int = 1) -> DataLoader:
    """The same batches in the same order for the own loop, Lightning and Accelerate (the
    Trainer shuffles them)."""
    return DataLoader(rows(BATCH * steps * accumulation), batch_size=BATCH)


def lab_model(bf16_weights: bool) -> torch.nn.Module:
    model = lab.lab_model()
    return model.to(torch.bfloat16) if bf16_weights else model


def own_run(precision, lr, steps, bf16_weights):
    model = lab_model(bf16_weights)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16")
    with Recorder(model, optimizer, autocast=autocast, precision=precision) as rec:
        for batch in loader(steps):
            with autocast:
                loss = model(**batch).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            rec.step(loss)
        return rec.finish()


def trainer_watch_run(tmp_path, precision, lr, steps, bf16_weights):
    watch = mplab.diagnosis.Watch()
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=BATCH,
                             max_steps=steps, learning_rate=lr, lr_scheduler_type="constant",
                             bf16=precision == "bf16", use_cpu=True, report_to=[],
                             save_strategy="no", logging_steps=1000, disable_tqdm=True)
    Trainer(model=lab_model(bf16_weights), args=args, train_dataset=rows(BATCH * steps),
            callbacks=[watch]).train()
    return watch.result


def lab_module(model, lr, package=L, seen=None):
    """The lab model as a LightningModule of `package` (lightning.pytorch or
    pytorch_lightning); `seen` collects each micro-batch's loss."""
    class LabModule(package.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = model

        def training_step(self, batch, index):
            loss = self.model(**batch).loss
            if seen is not None:
                seen.append(loss.item())
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=lr)
    return LabModule()


def lightning_fit(module, steps, package=L, accumulation=1, **settings):
    watch = mplab.diagnosis.LightningWatch()
    trainer = package.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False,
                              enable_checkpointing=False, enable_progress_bar=False,
                              enable_model_summary=False, accumulate_grad_batches=accumulation,
                              callbacks=[watch], **settings)
    trainer.fit(module, loader(steps, accumulation))
    return watch, trainer


def lightning_run(precision, lr, steps, bf16_weights):
    module = lab_module(lab_model(bf16_weights), lr)
    return lightning_fit(module, steps, precision=LIGHTNING[precision])[0].result


def accelerate_run(precision, lr, steps, bf16_weights, accumulation=1, seen=None):
    with fresh_accelerate():
        accelerator = Accelerator(mixed_precision=ACCELERATE.get(precision, precision),
                                  gradient_accumulation_steps=accumulation, cpu=True)
        model = lab_model(bf16_weights)
        model, optimizer, batches = accelerator.prepare(
            model, torch.optim.AdamW(model.parameters(), lr=lr), loader(steps, accumulation))
        with mplab.diagnosis.watch_accelerator(accelerator) as watch:
            for batch in batches:
                with accelerator.accumulate(model):
                    loss = model(**batch).loss
                    if seen is not None:
                        seen.append(loss.item())
                    accelerator.backward(loss)
                    optimizer.step()
                    optimizer.zero_grad()
        return watch.result


def facts(result) -> dict:
    return {"precision": result.precision, "steps": result.steps,
            "skipped": result.skipped_steps, "scaler": result.config["scaler"],
            "scales": result.scales, "weights": result.param_dtype,
            "matmuls": result.audit.compute_dtype}


@pytest.mark.parametrize("case", CASES)
def test_one_run_through_four_attaches_is_one_record_and_one_diagnosis(tmp_path, case):
    """The same run (the same request, lr and weights) in a loop of your own with a Recorder,
    the Trainer with Watch, Lightning with LightningWatch and Accelerate with
    watch_accelerator: the same facts recorded, the same diagnosis."""
    setting = CASES[case]
    runs = {"own loop": own_run(**setting),
            "Trainer": trainer_watch_run(tmp_path, **setting),
            "Lightning": lightning_run(**setting),
            "Accelerate": accelerate_run(**setting)}
    found = {name: mplab.diagnose(result) for name, result in runs.items()}
    expected = {"precision": setting["precision"], "steps": setting["steps"], "skipped": [],
                "scaler": None, "scales": [],
                "weights": torch.bfloat16 if setting["bf16_weights"] else torch.float32,
                "matmuls": torch.bfloat16 if setting["precision"] == "bf16" else torch.float32}
    for name, result in runs.items():
        assert facts(result) == expected, (name, facts(result))
    assert {d.cause for d in found.values()} == {None if case == "healthy" else case}, found
    assert len({tuple(d.names) for d in found.values()}) == 1, found
    # the same batches in the same order (the Trainer shuffles): the same losses
    own = torch.tensor(runs["own loop"].losses)
    for name in ("Lightning", "Accelerate"):
        assert torch.allclose(torch.tensor(runs[name].losses), own, rtol=1e-4), name


@pytest.mark.parametrize("asked", ["bf16-mixed", "16-mixed"])
def test_a_lightning_mixed_run_on_a_cpu_is_recorded_as_the_bf16_it_ran(asked):
    """Lightning runs "16-mixed" on a CPU as "bf16-mixed" (it warns): the record says what
    the Trainer ran, bf16 autocast with fp32 weights and no scaler."""
    watch, trainer = lightning_fit(lab_module(lab.lab_model(), 1e-3), 6, precision=asked)
    result = watch.result
    assert trainer.precision == "bf16-mixed" and result.precision == "bf16"
    assert result.steps == 6 and result.scales == [] and result.config["scaler"] is None
    assert result.audit.autocast["dtype"] == result.compute_dtype == torch.bfloat16
    assert result.param_dtype == torch.float32
    found = watch.diagnose()
    assert found.cause == (None if has_units("bf16") else "no_units"), found


def test_lightning_bf16_true_casts_the_weights_and_is_named_pure_low_precision():
    watch, _ = lightning_fit(lab_module(lab.lab_model(), 1e-4), 6, precision="bf16-true")
    assert watch.result.precision == "bf16" and watch.result.param_dtype == torch.bfloat16
    assert watch.diagnose().cause == "pure_low_precision"


def test_lightnings_gradscaler_is_found_in_its_precision_plugin():
    """fp16 autocast on a CPU, as Lightning's own MixedPrecision plugin runs it when given
    (Trainer(precision="16-mixed") would switch to bf16), with a scaler that starts too high:
    the steps it skipped, its scale and each of its calls once per step are recorded."""
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**24)
    watch, trainer = lightning_fit(lab_module(lab.lab_model(), 1e-3), 10,
                                   plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)])
    result = watch.result
    assert result.precision == "fp16" and result.compute_dtype == torch.float16
    assert result.steps == trainer.global_step == 10
    assert result.config["scaler"] == "torch" and result.config["init_scale"] == 2.0**24
    skipped = result.skipped_steps
    assert 0 < len(skipped) < 10 and skipped == list(range(1, len(skipped) + 1)), skipped
    assert result.scales[0] == 2.0**23 and result.scales[-1] == trainer.scaler.get_scale()
    assert result.scaler_calls == [{"scale": 1, "unscale_": 1, "step": 1, "update": 1}] * 10
    found = watch.diagnose()
    assert "scale_calibrating" in found and all(f.severity != "broken" for f in found.findings)


def test_one_lightningwatch_serves_pytorch_lightning_too():
    watch, trainer = lightning_fit(lab_module(lab.lab_model(), 1e-3, package=pytorch_lightning),
                                   6, package=pytorch_lightning)
    assert isinstance(watch, pytorch_lightning.Callback) and isinstance(watch, L.Callback)
    assert watch.result.steps == trainer.global_step == 6 and watch.diagnose().ok


@pytest.mark.parametrize("library", ["Accelerate", "Lightning"])
def test_accumulated_micro_batches_are_one_step_with_their_mean_loss(library):
    """Gradient accumulation over 2 micro-batches: one recorded step per optimizer step, its
    loss the mean of its micro-batches' losses (Lightning hands back each loss divided by 2;
    Accelerate divides inside backward)."""
    seen: list[float] = []
    if library == "Accelerate":
        result = accelerate_run("fp32", 1e-3, 5, False, accumulation=2, seen=seen)
    else:
        module = lab_module(lab.lab_model(), 1e-3, seen=seen)
        watch, trainer = lightning_fit(module, 5, accumulation=2)
        result = watch.result
        assert trainer.global_step == 5
    assert len(seen) == 10 and result.steps == len(result.losses) == 5
    means = torch.tensor(seen).reshape(5, 2).mean(dim=1)
    assert torch.allclose(torch.tensor(result.losses), means, rtol=1e-5), (result.losses, means)
    assert result.skipped_steps == [] and mplab.diagnose(result).ok


def test_fp16_on_a_cpu_through_watch_accelerator_is_named_fp16_ignored():
    """Accelerate ignores fp16 on a CPU: no autocast, no scaler; named as the Trainer's is."""
    result = accelerate_run("fp16", 1e-3, 6, False)
    assert result.precision == "fp16" and result.compute_dtype == torch.float32
    assert result.scales == [] and mplab.diagnose(result).cause == "fp16_ignored"


# ---- wrong use: what was given, what is expected ---------------------------------------------

def test_watch_accelerator_refuses_what_it_cannot_watch():
    with pytest.raises(TypeError, match="takes the accelerate.Accelerator.*got Linear"):
        mplab.diagnosis.watch_accelerator(torch.nn.Linear(2, 2))
    with fresh_accelerate():
        accelerator = Accelerator(cpu=True)
        with pytest.raises(RuntimeError, match="prepared no model yet: call .* after model, "
                                               "optimizer, ... = accelerator.prepare"):
            mplab.diagnosis.watch_accelerator(accelerator)
        model = lab.lab_model()
        model, optimizer = accelerator.prepare(
            model, torch.optim.AdamW(model.parameters(), lr=1e-3))
        watch = mplab.diagnosis.watch_accelerator(accelerator)
        with pytest.raises(RuntimeError, match="already watched"):
            mplab.diagnosis.watch_accelerator(accelerator)
        batch = next(lab.lab_batches(1, batch_size=4))
        model(**batch).loss.backward()  # not accelerator.backward: no loss seen
        with pytest.raises(RuntimeError, match=r"no loss: call accelerator.backward\(loss\)"):
            optimizer.step()
        with pytest.raises(RuntimeError, match="recorded no optimizer step"):
            watch.finish()
        assert "backward" not in vars(accelerator) and "step" not in vars(optimizer)


def test_lightningwatch_says_how_to_use_it():
    with pytest.raises(TypeError, match="takes the run's name, a str; got Trainer"):
        mplab.diagnosis.LightningWatch(L.Trainer(logger=False))
    with pytest.raises(RuntimeError, match="has not seen a run: pass it to"):
        mplab.diagnosis.LightningWatch().diagnose()
    with pytest.raises(ValueError, match="cannot record precision='64-true'; accepted: "):
        lightning_fit(lab_module(lab.lab_model(), 1e-3), 1, precision="64-true")


def test_importing_mplab_diagnosis_imports_no_training_library():
    import subprocess
    import sys

    code = ("import sys, mplab.diagnosis; print(sorted(m for m in ('lightning', "
            "'pytorch_lightning', 'accelerate', 'transformers') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.split() == ["[]"], done.stderr
