"""mplab.train's Accelerate and Trainer paths: the course's code, on the torch path's batches, so
that the three paths agree; what fp16 on a CPU really does in each; resume, processes, and the
Trainer behaviours a lesson has to show (the renamed argument, bf16 needs use_cpu)."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # these tests never reach for the hub

import json  # noqa: E402
import sys  # noqa: E402
import warnings  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from conftest import launch  # noqa: E402

from mplab import models  # noqa: E402
from mplab.train import TrainResult, TrainWarning, train  # noqa: E402
from mplab.train.trainer_path import (  # noqa: E402
    course_arguments_error,
    renamed,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = {"batch_size": 8, "eval_samples": 0, "progress": False, "device": "cpu"}
# A constant learning rate, no warm-up
SAME_LR = {"warmup_steps": 0, "schedule": "constant"}


def quiet_train(config=None, **settings) -> TrainResult:
    """train() with its TrainWarnings silenced; they stay in `result.warnings` for checking."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TrainWarning)
        return train(config, **settings)


def env() -> dict:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": ROOT}


# ---- the three paths agree ------------------------------------------------------------------

@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_torch_accelerate_and_trainer_train_the_same_40_steps(precision):
    """Same data, initial weights, seed and precision, and the default settings: 40 steps of
    the lesson model. Every path takes the Trainer's two choices (no weight decay for biases
    and norms, its warm-up from lr 0), so the final loss and the mean of the last 10 agree
    within 0.5 % (the Accelerate path's arithmetic is the torch path's, bit for bit, and the
    Trainer's within rounding)."""
    settings = {**TINY, "steps": 40, "precision": precision}
    runs = {path: quiet_train(path=path, **settings) for path in ("torch", "accelerate",
                                                                  "trainer")}
    torch_run = runs["torch"]
    for path, run in runs.items():
        assert run.path == path and len(run.losses) == 40
        assert run.compute_dtype == (torch.bfloat16 if precision == "bf16" else torch.float32)
        assert abs(run.versus(torch_run)["loss_change"]) < 0.005, path
        assert run.final_loss == pytest.approx(torch_run.final_loss, rel=0.005), path
    assert runs["accelerate"].losses == torch_run.losses  # the very same arithmetic
    # and the Trainer's, to rounding: decaying biases and norms too moves the last loss 1e-5
    assert runs["trainer"].losses == pytest.approx(torch_run.losses, rel=1e-6)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_with_accumulation_and_clipping_the_trainer_takes_the_torch_paths_steps(precision):
    """Accumulated micro-batches and clipped norms too: the Trainer's AdamW, schedule,
    batches, decay groups and loss (a mean over micro-batches) are the torch path's."""
    settings = {**TINY, "steps": 12, "precision": precision, "accumulation_steps": 2,
                "max_grad_norm": 0.5}
    ours, trainer = quiet_train(path="torch", **settings), quiet_train(path="trainer", **settings)
    assert trainer.losses == pytest.approx(ours.losses, rel=1e-4)
    assert trainer.grad_norms == pytest.approx(ours.grad_norms, rel=1e-3)


def test_every_path_decays_the_parameters_the_trainer_decays():
    from transformers import Trainer

    from mplab.train.run import decay_groups

    for model in (models.lesson_model(), models.load_pretrained(models.minilm_path())[0]):
        decayed = set(Trainer.get_decay_parameter_names(None, model))
        groups = decay_groups(model, 0.01)
        ours = {n for n, p in model.named_parameters()
                if any(p is q for q in groups[0]["params"])}
        assert ours == decayed and [g["weight_decay"] for g in groups] == [0.01, 0.0]
        assert sum(len(g["params"]) for g in groups) == len(list(model.parameters()))


def test_the_schedule_is_the_trainers_on_every_path():
    from transformers import get_constant_schedule_with_warmup, get_linear_schedule_with_warmup

    from mplab.train import TrainConfig
    from mplab.train.run import lr_schedule

    def factors(schedule):
        return [schedule.lr_lambdas[0](s) for s in range(30)]

    sgd = torch.optim.SGD([torch.zeros(1)], lr=1.0)
    assert [lr_schedule(TrainConfig(steps=30, warmup_steps=5))(s) for s in range(30)] == \
        factors(get_linear_schedule_with_warmup(sgd, 5, 30))
    assert [lr_schedule(TrainConfig(steps=30, warmup_steps=5, schedule="constant"))(s)
            for s in range(30)] == factors(get_constant_schedule_with_warmup(sgd, 5))


def test_accelerate_trains_on_the_torch_paths_batches_bit_for_bit():
    """Accumulation, clipping and the schedule's warm-up included: same losses, same norms,
    same final weights (the DataLoader is the torch path's batches, in order)."""
    a, b = models.lesson_model(seed=0), models.lesson_model(seed=0)
    settings = {**TINY, "steps": 6, "accumulation_steps": 2, "max_grad_norm": 0.3,
                "precision": "bf16", "warmup_steps": 3}
    ours = quiet_train(model=a, path="torch", **settings)
    theirs = quiet_train(model=b, path="accelerate", **settings)
    assert theirs.losses == ours.losses and theirs.grad_norms == ours.grad_norms
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)


def test_the_trainers_own_loss_is_multiplied_by_the_accumulation_steps_for_a_classifier(
        tmp_path):
    """Upstream behaviour mplab works around (transformers 5.23): the Trainer sees `**kwargs` in
    BertForSequenceClassification.forward, assumes its loss divides by num_items_in_batch,
    and so does not divide a plain mean by the accumulation steps. If this test fails, the
    Trainer has fixed it and trainer_path's `accepts_loss_kwargs = False` can go."""
    from transformers import Trainer, TrainingArguments

    from mplab.train import TrainConfig
    from mplab.train.accelerate_path import fresh_accelerate
    from mplab.train.order import RunOrder
    from mplab.train.run import Run
    from mplab.train.trainer_path import trainer_settings

    config = TrainConfig(path="trainer", steps=2, accumulation_steps=2, **TINY, **SAME_LR)
    ours = quiet_train(config)
    with Run.start(config, "trainer") as run, fresh_accelerate():
        args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True,
                                 **trainer_settings(config))
        trainer = Trainer(model=run.model, args=args, train_dataset=RunOrder(run))
        trainer.train()  # the course's Trainer, left to its own loss counting
    logged = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert trainer.model_accepts_loss_kwargs
    assert logged == pytest.approx([2 * loss for loss in ours.losses], rel=1e-4)


# ---- what fp16 on a CPU really does ---------------------------------------------------------

def test_fp16_on_a_cpu_accelerate_trains_in_fp32_without_a_word_and_mplab_says_so():
    from accelerate import Accelerator

    from mplab.train.accelerate_path import fresh_accelerate

    with fresh_accelerate():  # the real Accelerate: fp16 asked, nothing built for it
        accelerator = Accelerator(mixed_precision="fp16", cpu=True)
        assert accelerator.mixed_precision == "fp16"
        assert accelerator.scaler is None and not accelerator.native_amp
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with fresh_accelerate():
            Accelerator(mixed_precision="fp16", cpu=True)
    assert not [w for w in caught if "fp16" in str(w.message)]  # and says nothing
    fp16 = quiet_train(path="accelerate", precision="fp16", steps=3, **TINY)
    fp32 = quiet_train(path="accelerate", precision="fp32", steps=3, **TINY)
    assert fp16.losses == fp32.losses  # an fp32 run, bit for bit
    assert fp16.compute_dtype == torch.float32 and fp16.scales == []
    said = [w for w in fp16.warnings if "Accelerate ignores fp16 on a CPU" in w]
    assert len(said) == 1 and [f.text for f in fp16.audit.fallbacks] == said
    assert [f.code for f in fp16.audit.fallbacks] == ["fp16_ignored"]
    assert not any("fp16 on this CPU is slow" in w for w in fp16.warnings)  # it was not fp16


def test_fp16_true_on_a_cpu_the_trainer_raises_nothing_and_trains_in_fp32():
    from transformers import TrainingArguments

    assert course_arguments_error(fp16=True, use_cpu=True) is None  # no error on 5.23
    args = TrainingArguments(output_dir="unused", fp16=True, use_cpu=True, report_to="none")
    assert args.device.type == "cpu"
    fp16 = quiet_train(path="trainer", precision="fp16", steps=3, **TINY)
    fp32 = quiet_train(path="trainer", precision="fp32", steps=3, **TINY)
    assert fp16.losses == fp32.losses and fp16.compute_dtype == torch.float32
    assert fp16.scales == [] and fp16.skipped_steps == []
    assert any("the Trainer (through Accelerate) ignores fp16 on a CPU" in w
               for w in fp16.warnings)


def test_bf16_in_the_trainer_autocasts_the_matmuls_and_accelerate_makes_the_output_fp32():
    result = quiet_train(path="trainer", precision="bf16", steps=2, **TINY)
    assert result.compute_dtype == torch.bfloat16 and result.output_dtype == torch.float32
    assert result.param_dtype == result.grad_dtype == torch.float32
    assert result.optimizer_state_dtype == torch.float32
    assert result.audit.mixed and result.audit.fallbacks == []
    assert any("convert_outputs_to_fp32" in n for n in result.audit.notes)


# ---- the course's TrainingArguments lines ---------------------------------------------------

def test_the_courses_evaluation_strategy_is_a_type_error_and_eval_strategy_is_its_new_name():
    from transformers import TrainingArguments

    error = course_arguments_error()  # TrainingArguments(..., evaluation_strategy="epoch")
    assert error.startswith("TypeError: ")
    assert "unexpected keyword argument 'evaluation_strategy'" in error
    arguments, notes = renamed({"evaluation_strategy": "epoch", "fp16": False})
    assert arguments == {"eval_strategy": "epoch", "fp16": False}
    assert notes == ["evaluation_strategy='epoch' is now eval_strategy='epoch' (renamed in "
                     "transformers 4.41, the old name removed in 4.51)"]
    args = TrainingArguments(output_dir="unused", report_to="none", **arguments)
    assert args.eval_strategy == "epoch"


def test_bf16_on_a_cpu_needs_use_cpu_in_training_arguments():
    error = course_arguments_error(eval_strategy="epoch", bf16=True)
    assert error.startswith("ValueError: ") and "You need to assign use_cpu" in error
    assert course_arguments_error(eval_strategy="epoch", bf16=True, use_cpu=True) is None


# ---- data, evaluation and resume ------------------------------------------------------------

def test_the_trainer_loads_a_local_folder_through_datasets_and_evaluates_every_epoch(tmp_path):
    """200 reviews at batch 16: 12 steps an epoch, so eval_strategy="epoch" evaluates at steps
    12 and 24, and at the end (step 26) on the last, partial epoch."""
    from mplab import data

    train_set, test_set = data.load_dataset("sentiment", "train"), data.load_dataset(
        "sentiment", "test")
    for split, ds, n in (("train", train_set, 200), ("test", test_set, 60)):
        lines = [json.dumps({"text": t, "label": y}) for t, y in zip(ds.texts[:n], ds.labels)]
        (tmp_path / f"{split}.jsonl").write_text("\n".join(lines) + "\n")
    hf = data.hf_dataset(str(tmp_path), "train")
    assert hf.num_rows == 200 and hf["text"][:3] == train_set.texts[:3]
    settings = {**TINY, "batch_size": 16, "steps": 26, "dataset": str(tmp_path),
                "eval_samples": None}
    trainer, ours = quiet_train(path="trainer", **settings), quiet_train(path="torch", **settings)
    assert [step for step, _ in trainer.eval_history] == [12, 24, 26]
    assert trainer.eval_accuracy == trainer.eval_history[-1][1]
    assert abs(trainer.eval_accuracy - ours.eval_accuracy) <= 2 / 60  # the same 60 reviews


def test_without_datasets_the_trainer_trains_and_evaluates_on_the_same_rows(monkeypatch):
    """A GPU image without the `datasets` library: the Trainer path reads the rows through
    mplab's loader and tokenizes them as `datasets.map` does, so the run is the same."""
    pytest.importorskip("datasets")  # the run through it, to compare with
    settings = {**TINY, "steps": 6, "eval_samples": 40}
    with_datasets = quiet_train(path="trainer", **settings)
    monkeypatch.setitem(sys.modules, "datasets", None)  # `import datasets` now fails
    without = quiet_train(path="trainer", **settings)
    assert without.losses == with_datasets.losses
    assert without.eval_accuracy == with_datasets.eval_accuracy


def test_the_trainers_data_loader_names_a_dataset_it_cannot_find():
    from mplab import data

    with pytest.raises(ValueError, match="dataset 'no/such.jsonl' is not a folder of .jsonl"):
        data.hf_dataset("no/such.jsonl")
    with pytest.raises(ValueError, match="dataset 'sentiment' has no split 'validation'; "
                                         "accepted: 'test', 'train'"):
        data.hf_dataset("sentiment", "validation")


@pytest.mark.parametrize("path", ["accelerate", "trainer"])
def test_a_run_interrupted_and_resumed_gives_bit_identical_losses(tmp_path, path):
    """Accelerate's save_state/load_state, or the Trainer's own checkpoints, continue the run
    as if it had not stopped, as the torch path's checkpoint does."""
    settings = {"path": path, "precision": "bf16", "steps": 7, "accumulation_steps": 2,
                "max_grad_norm": 0.5, **TINY, "eval_samples": 40}
    whole = quiet_train(**settings)

    def interrupt(step, result):
        if step == 5:
            raise KeyboardInterrupt  # after the checkpoint at step 4, before the next

    folder = str(tmp_path / "ckpt")
    with pytest.raises(KeyboardInterrupt):
        quiet_train(**settings, checkpoint_dir=folder, save_every=2, on_step=interrupt)
    saved = sorted(os.listdir(folder))
    if path == "accelerate":  # Accelerate's own files, in the folder checkpoint.pt names
        assert saved == ["checkpoint.pt", "state-4"]
        assert {"model.safetensors", "optimizer.bin", "scheduler.bin",
                "random_states_0.pkl"} <= set(os.listdir(os.path.join(folder, "state-4")))
    else:
        assert {"checkpoint-2", "checkpoint-4", "mplab_config.json"} <= set(saved)
    resumed = quiet_train(**settings, checkpoint_dir=folder, resume=True)
    assert resumed.resumed_from == 4
    assert resumed.losses == whole.losses and resumed.grad_norms == whole.grad_norms
    assert resumed.eval_accuracy == whole.eval_accuracy
    with pytest.raises(ValueError, match=r"settings changed \(lr: 0.001 -> 0.002\)"):
        quiet_train(**{**settings, "lr": 2e-3}, checkpoint_dir=folder, resume=True)


def test_runs_of_different_precisions_follow_each_other_in_one_process():
    """Accelerate refuses a second Accelerator with another mixed_precision in one process
    ("restart your runtime"); a lesson compares precisions in one kernel, so each run starts
    from a fresh state."""
    for precision in ("fp32", "bf16", "fp32"):
        for path in ("accelerate", "trainer"):
            result = quiet_train(path=path, precision=precision, steps=1, **TINY)
            assert result.precision == precision


# ---- several processes ----------------------------------------------------------------------

@pytest.mark.slow  # accelerate's launcher and a module printing one line (benchmarks/RECORDS.md)
def test_accelerate_launch_cpu_with_two_processes_starts_one():
    """accelerate 1.15 on a CPU: --cpu --num_processes 2 starts a single process (multi-CPU
    there goes through mpirun), as the README says; --multi_gpu starts two (the README's
    line, run in test_readme)."""
    launcher = [sys.executable, "-m", "accelerate.commands.launch", "--num_machines", "1",
              "--mixed_precision", "no", "--dynamo_backend", "no"]
    done = launch(launcher + ["--cpu", "--num_processes", "2", "-m", "platform"],
                  env=env(), cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert len(done.stdout.strip().splitlines()) == 1  # one process printed its platform




@pytest.mark.parametrize("path,precision,fused", [
    ("torch", "fp32", True), ("torch", "bf16", True), ("torch", "fp16", False),
    ("accelerate", "bf16", True), ("accelerate", "fp16", True),  # fp16 ignored: trains as fp32
    ("trainer", "bf16", True), ("trainer", "fp16", True)])
def test_adamw_is_fused_on_every_path_unless_a_grad_scaler_steps_it(monkeypatch, path,
                                                                     precision, fused):
    """A fused AdamW step skips inside its kernel on inf/NaN, unseen by the hooks that count
    skipped steps, so a run with a GradScaler keeps the plain one; every other run fuses (a
    third of the optimizer's time on a CPU), the same on every path so that they stay equal."""
    made = []
    real = torch.optim.AdamW.__init__

    def record(self, params, *args, **kwargs):
        made.append(bool(kwargs.get("fused")))
        real(self, params, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "__init__", record)
    result = quiet_train(path=path, precision=precision, steps=1, **TINY)
    assert made == [fused] and result.losses
