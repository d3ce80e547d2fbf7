"""mplab.diagnosis.Watch: a Hugging Face Trainer's run recorded in one line, diagnosed as
mplab's own Trainer path's run is (the reference: mplab.train(path="trainer"))."""

import warnings

import pytest
import torch
from transformers import Trainer, TrainingArguments

import mplab
from mplab.diagnosis import lab
from mplab.hardware import has_units
from mplab.train import train

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
