"""mplab.train, the plain PyTorch path: what it learns, what it records, and that each feature
(scalers, clipping, accumulation, resume, processes) does exactly what the lesson says."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # these tests never reach for the hub

import dataclasses  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import warnings  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from conftest import COURSE_STEPS  # noqa: E402
from torch.optim.optimizer import register_optimizer_step_pre_hook  # noqa: E402

from mplab import models  # noqa: E402
from mplab.amp.scaler import GradScaler as MplabGradScaler  # noqa: E402
from mplab.train import (  # noqa: E402
    NonFiniteLossError,
    TrainConfig,
    TrainResult,
    TrainWarning,
    errors,
    train,
)
from mplab.train.watch import StepCounter  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Tiny runs: a few steps of small batches, no evaluation (fp16 on this CPU is slow).
TINY = {"batch_size": 8, "eval_samples": 0, "progress": False, "device": "cpu"}


def quiet_train(**settings) -> TrainResult:
    """train() with its TrainWarnings silenced; they stay in `result.warnings` for checking."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TrainWarning)
        return train(**settings)


def env() -> dict:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": ROOT}


# ---- what it learns ---------------------------------------------------------------------------

@pytest.mark.slow
def test_the_course_call_without_attention_mask_learns_the_data_to_80_percent(course_run):
    """model(input_ids, labels=labels), no mask: length-grouped batches hold almost no padding,
    so the model barely sees [PAD] and learns as with the mask (0.86 at 400 steps measured)."""
    result, _ = course_run
    assert result.compute_dtype == torch.float32
    assert len(result.losses) == COURSE_STEPS
    assert result.scales == [] and result.skipped_steps == []
    first, last = result.losses[:50], result.losses[-50:]
    assert sum(last) / 50 < 0.5 * sum(first) / 50
    assert result.eval_accuracy >= 0.80
    assert result.eval_history[-1] == (COURSE_STEPS, result.eval_accuracy)


# ---- precisions and scalers -------------------------------------------------------------------

def test_fp16_with_torch_and_mplab_scalers_gives_identical_losses_and_scales():
    # A loss of 1e29 on the second step overflows fp16 gradients: both scalers must skip it.
    runs = [quiet_train(model=ScaledLoss(1e29, call=2, once=True), precision="fp16", scaler=s,
                        steps=4, **TINY) for s in ("torch", "mplab")]
    torch_run, mplab_run = runs
    assert torch_run.compute_dtype == mplab_run.compute_dtype == torch.float16
    assert torch_run.losses == mplab_run.losses  # bit for bit: the scaler is a twin
    assert torch_run.scales == mplab_run.scales and len(torch_run.scales) == 4
    assert torch_run.skipped_steps == mplab_run.skipped_steps == [2]
    assert torch_run.scales[:2] == [65536.0, 32768.0]  # the default init scale, one backoff
    # measured before the run: a warning, with the cost, exactly where fp16 was slow here
    said = [w for w in torch_run.warnings if "fp16 on this CPU is slow" in w]
    slow = torch_run.matmul_slowdown
    assert bool(said) == (slow is not None) and (slow is None or slow >= 1.5)
    assert all(f"({slow:.0f}x slower)" in w for w in said)


@pytest.mark.parametrize("ratio", [1.2, 20.0])
def test_the_slow_precision_warning_says_why_on_each_kind_of_cpu(machine, monkeypatch, ratio):
    """The matmul's cost decides whether to warn; the CPU's units decide why it is slow."""
    from mplab.hardware import MatmulTiming, no_units_reason

    seconds = {"fp32": 1e-3, "fp16": ratio * 1e-3}
    monkeypatch.setattr(errors, "time_matmul", lambda n, p, device, **kw: MatmulTiming(
        p, n, "cpu", seconds[p], 1, seconds[p]))
    cost = errors.low_precision_cost("fp16", torch.device("cpu"))
    if ratio < 1.5:
        assert cost is None
        return
    slowdown, said = cost
    assert slowdown == pytest.approx(ratio) and "(20x slower)" in said
    why = "torch has no fast kernel" if machine.cpu_fp16 else no_units_reason("fp16")
    assert why in said


def test_bf16_runs_without_a_scaler_and_its_matmuls_really_run_in_bf16():
    result = quiet_train(precision="bf16", steps=3, **TINY)
    assert result.compute_dtype == torch.bfloat16
    assert result.scales == [] and result.skipped_steps == []
    assert len(result.losses) == 3 and all(math.isfinite(x) for x in result.losses)
    fp32 = train(steps=3, **TINY)
    assert fp32.compute_dtype == torch.float32
    # Same seed, same data: bf16 differs from fp32 only by rounding.
    assert result.losses == pytest.approx(fp32.losses, rel=0.03)


def test_clipping_happens_after_unscale_so_the_optimizer_sees_the_true_clipped_gradients():
    """Like clip_grad_norm_ on the fp32 gradients: the optimizer sees norm min(norm, max)."""
    seen = []

    def measure(optimizer, args, kwargs):
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        seen.append(torch.linalg.vector_norm(torch.stack(
            [torch.linalg.vector_norm(g) for g in grads])).item())

    handle = register_optimizer_step_pre_hook(measure)
    try:
        result = quiet_train(precision="fp16", steps=4, max_grad_norm=0.3, **TINY)
    finally:
        handle.remove()
    stepped = [n for i, n in enumerate(result.grad_norms, 1) if i not in result.skipped_steps]
    assert len(seen) == len(stepped) >= 3
    assert all(math.isfinite(n) for n in stepped)
    assert any(n > 0.3 for n in stepped)  # clipping had something to do
    # Clipping scaled grads would leave norms ~65536x too small once unscaled.
    assert seen == pytest.approx([min(n, 0.3) for n in stepped], rel=1e-4)


def test_two_accumulated_micro_batches_of_b_equal_one_step_of_2b_in_fp32():
    accumulated, whole = models.lesson_model(seed=0), models.lesson_model(seed=0)
    a = train(model=accumulated, steps=4, accumulation_steps=2,
              **{**TINY, "batch_size": 8})
    b = train(model=whole, steps=4, **{**TINY, "batch_size": 16})
    assert a.global_batch_size == b.global_batch_size == 16
    assert a.losses == pytest.approx(b.losses, rel=1e-5)
    for p, q in zip(accumulated.parameters(), whole.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-6)


# ---- resume, the guard, the record ------------------------------------------------------------

@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_a_run_interrupted_and_resumed_gives_bit_identical_losses(tmp_path, precision):
    settings = {"precision": precision, "steps": 7, **TINY, "eval_samples": 40}
    whole = quiet_train(**settings)

    def interrupt(step, result):
        if step == 5:
            raise KeyboardInterrupt  # after the checkpoint at step 4, before the next

    folder = str(tmp_path / "ckpt")
    with pytest.raises(KeyboardInterrupt):
        quiet_train(**settings, checkpoint_dir=folder, save_every=2, on_step=interrupt)
    resumed = quiet_train(**settings, checkpoint_dir=folder, resume=True)
    assert resumed.resumed_from == 4
    assert resumed.losses == whole.losses  # exact: model, optimizer, scaler, data order, step
    assert resumed.scales == whole.scales and resumed.eval_accuracy == whole.eval_accuracy
    with pytest.raises(ValueError, match=r"settings changed \(lr: 0.001 -> 0.002\)"):
        quiet_train(**{**settings, "lr": 2e-3}, checkpoint_dir=folder, resume=True)


class ScaledLoss(torch.nn.Module):
    """The lesson model, but its loss is multiplied by `factor` from the `call`-th forward pass
    on (`once`: on that pass only)."""

    def __init__(self, factor: float, call: int, once: bool = False):
        super().__init__()
        self.model, self.factor, self.call, self.once = models.lesson_model(), factor, call, once
        self.calls = 0

    def forward(self, input_ids, labels=None, **kwargs):
        outputs = self.model(input_ids, labels=labels, **kwargs)
        if labels is not None:
            self.calls += 1
            if self.calls == self.call or (self.calls > self.call and not self.once):
                outputs.loss = outputs.loss * self.factor
        return outputs


def test_a_non_finite_loss_stops_the_run_naming_the_step_and_the_likely_cause():
    with pytest.raises(NonFiniteLossError, match="step 3: the loss is inf") as caught:
        train(model=ScaledLoss(math.inf, call=3), steps=10, **TINY)
    assert len(caught.value.result.losses) == 2 and "Likely cause" in str(caught.value)
    assert caught.value.result.stopped == str(caught.value)
    with pytest.raises(NonFiniteLossError, match=r"learning rate \(lr=1e\+06\) is too high"):
        train(steps=30, lr=1e6, warmup_steps=0, **TINY)


def test_a_far_too_high_init_scale_records_the_first_steps_as_skipped_until_it_backs_off():
    """2^40 overflows fp16 gradients: each step is skipped and halves the scale, and the run
    records it from the optimizer not stepping, with the schedule held back until it does."""
    result = quiet_train(precision="fp16", init_scale=2.0**40, steps=6, **TINY)
    assert result.config["init_scale"] == 2.0**40
    assert result.skipped_steps == [1, 2, 3, 4, 5, 6][:len(result.skipped_steps)]
    assert len(result.skipped_steps) >= 3
    assert result.scales[:3] == [2.0**39, 2.0**38, 2.0**37]


@pytest.mark.parametrize("scaler_cls", [torch.amp.GradScaler, MplabGradScaler])
def test_a_skip_is_seen_from_the_optimizer_not_inferred_from_a_falling_scale(scaler_cls):
    """Two skips whose scale does not fall: a scale of 0 (0 x 0.5 = 0) and update(new_scale)."""
    weight = torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([weight], lr=0.1)
    counter = StepCounter(optimizer)
    for init_scale, new_scale in ((0.0, None), (1024.0, 4096.0)):
        scaler = scaler_cls("cpu", init_scale=init_scale)
        scaler.scale(weight.sum())  # the scaler starts at its first scale()
        weight.grad = torch.tensor([math.inf, 1.0])  # an inf gradient: the step is skipped
        scaler.step(optimizer)
        scaler.update(new_scale)
        assert scaler.get_scale() >= init_scale  # did not fall
        assert not counter.stepped() and torch.equal(weight.detach(), torch.ones(2))
        optimizer.zero_grad()
    scaler = scaler_cls("cpu")
    scaler.scale(weight.sum()).backward()
    scaler.step(optimizer)
    assert counter.stepped() and not counter.stepped()  # once per real step


def test_an_inf_gradient_in_fp16_is_a_skipped_step_not_a_stop():
    """The guard looks at the loss: GradScaler's skipped steps are normal and the run goes on.
    A loss of 1e29 is finite in fp32, but its gradients overflow fp16 on the way back."""
    result = quiet_train(model=ScaledLoss(1e29, call=2, once=True), precision="fp16", steps=3,
                         **TINY)
    assert result.stopped is None and len(result.losses) == 3
    assert result.losses[1] > 1e28 and result.skipped_steps == [2]
    assert result.scales[1] == result.scales[0] / 2


def test_the_json_record_has_every_field_and_reads_back(tmp_path):
    result = train(steps=2, **TINY)
    file = tmp_path / "run.json"
    result.write_json(file)
    data = json.loads(file.read_text())
    assert set(data) == {f.name for f in dataclasses.fields(TrainResult)}
    for key in ("path", "precision", "device", "compute_dtype", "losses", "samples_per_s",
                "tokens_per_s", "peak_memory_bytes", "skipped_steps", "scales",
                "eval_accuracy", "warnings", "steps", "seconds", "model", "torch_version",
                "world_size"):
        assert key in data
    assert data["path"] == "torch" and data["compute_dtype"] == "float32"
    assert data["samples_per_s"] > 0 and data["tokens_per_s"] > data["samples_per_s"]
    assert data["peak_memory_bytes"] > 2**20 and data["peak_memory_kind"] == "process peak RSS"
    back = TrainResult.from_dict(data)
    assert back.compute_dtype == torch.float32 and back.losses == result.losses


# ---- the CLI, a saved model, two processes ----------------------------------------------------

def test_cli_trains_a_saved_model_from_a_local_folder_and_writes_json(tmp_path, capsys):
    from mplab.train.__main__ import main

    folder = tmp_path / "tiny"
    models.lesson_model(seed=1).save_pretrained(folder)
    models.lesson_tokenizer().save_pretrained(folder)
    out = tmp_path / "run.json"
    code = main(["--path", "torch", "--precision", "fp32", "--device", "cpu", "--steps", "3",
                 "--batch-size", "8", "--eval-samples", "50", "--model", str(folder),
                 "--json", str(out), "--no-progress"])
    printed = capsys.readouterr().out
    assert code == 0 and "matmuls ran in" in printed and "float32" in printed
    data = json.loads(out.read_text())
    assert data["model"] == str(folder) and len(data["losses"]) == 3
    assert 0 <= data["eval_accuracy"] <= 1


@pytest.mark.parametrize("args, expected", [
    (["--path", "keras"], "unknown path 'keras'; accepted: 'torch', 'accelerate', 'trainer'"),
    (["--precision", "fp8"], "unknown precision 'fp8'; accepted: 'fp32', 'fp16', 'bf16'"),
    (["--steps", "0"], "steps must be a positive integer, got 0"),
    (["--device", "tpu"], "unknown device 'tpu'; accepted: 'auto', 'cpu', 'cuda'"),
])
def test_cli_bad_input_says_what_was_given_and_what_is_accepted(args, expected, capsys):
    from mplab.train.__main__ import main

    try:
        code = main(["--no-progress", "--eval-samples", "0", *args])
    except SystemExit as exit:  # argparse's error(): usage, message, status 2
        code = exit.code
    assert code == 2 and expected in capsys.readouterr().err


# ---- bad input ----------------------------------------------------------------------------------

@pytest.mark.parametrize("settings, expected", [
    ({"precision": "float8"}, "unknown precision 'float8'; accepted: 'fp32', 'fp16', 'bf16'"),
    ({"path": "deepspeed"}, "unknown path 'deepspeed'; accepted: 'torch', 'accelerate', "),
    ({"path": "trainer", "scaler": "mplab"}, "scaler='mplab' is the torch and fsdp paths' choice"),
    ({"path": "trainer", "init_scale": 1024.0}, "init_scale=1024.0: the Trainer builds its"),
    ({"device": "npu"}, "unknown device 'npu'; accepted: 'auto', 'cpu', 'cuda'"),
    ({"steps": -1}, "steps must be a positive integer, got -1"),
    ({"scaler": "apex"}, "unknown scaler 'apex'; accepted: 'torch', 'mplab'"),
    ({"save_every": 5}, "save_every=5 needs checkpoint_dir"),
    ({"lr": float("nan")}, "lr must be a positive finite number, got nan"),
    ({"batch_size": 5000}, "one optimizer step takes 5000 reviews"),
    ({"warmup": 10}, "unknown setting(s) 'warmup'; accepted:"),
])
def test_bad_settings_name_what_was_given_and_what_is_accepted(settings, expected):
    with pytest.raises(ValueError) as caught:
        train(**{"progress": False, "eval_samples": 0, **settings})
    assert expected in str(caught.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_cuda_without_a_gpu_is_a_clear_error():
    with pytest.raises(ValueError, match="'cuda' was asked for, but this machine has no CUDA"):
        train(device="cuda", steps=1, progress=False)


def test_bf16_on_a_gpu_without_bf16_units_names_the_gpu_and_the_alternatives(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla V100")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 0))
    with pytest.raises(ValueError, match=r"Tesla V100 has no bf16 units .*'fp16'"):
        errors.check_precision("bf16", torch.device("cuda", 0))
    errors.check_precision("fp16", torch.device("cuda", 0))  # fine
    errors.check_precision("fp16", torch.device("cpu"))  # fine too: CPU GradScaler, torch 2.3


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_bf16_on_a_cpu_trains_with_the_math_attention_backend_and_says_so(precision):
    """torch's CPU flash attention runs a bf16 backward several times slower than its math
    backend (benchmarks/RECORDS.md "attention backend"): a bf16 run on the CPU uses the math
    one, every step, and its record says so; fp32 keeps torch's choice; after the run, torch's
    setting is as it was."""
    flash = []
    result = train(precision=precision, device="cpu", steps=2, batch_size=8, eval_samples=0,
                   progress=False, on_step=lambda *a, **k: flash.append(
                       torch.backends.cuda.flash_sdp_enabled()))
    assert flash == [precision != "bf16"] * 2
    assert result.attention.startswith("math" if precision == "bf16" else "torch's choice")
    assert torch.backends.cuda.flash_sdp_enabled()


def test_the_config_is_one_record_with_the_clis_names():
    from mplab.train.__main__ import parser

    flags = {a.dest for a in parser()._actions} - {"help", "json"}
    assert flags == {f.name for f in dataclasses.fields(TrainConfig)}


def test_versus_compares_a_run_with_its_fp32_twin_over_the_steps_both_trained():
    def run(losses, samples_per_s, memory):
        return TrainResult("torch", "bf16", "cpu", "lesson", losses=losses,
                           samples_per_s=samples_per_s, peak_memory_bytes=memory)

    fp32 = run([4.0, 2.0, 1.0, 1.0], 100.0, 1000)
    short_bf16 = run([4.0, 2.2, 1.1], 150.0, 800)  # 3 steps: compared over steps 2-3 at last=2
    out = short_bf16.versus(fp32, last=2)
    assert out["speedup"] == 1.5 and out["memory_ratio"] == 0.8
    assert out["steps_compared"] == (2, 3)
    assert out["loss_change"] == pytest.approx((3.3 / 2 - 3.0 / 2) / (3.0 / 2))
    assert out["largest_gap"] == pytest.approx(0.2) and out["gap_step"] == 2  # over all 3 steps
    assert fp32.versus(fp32)["largest_gap"] == 0.0
    with pytest.raises(TypeError, match="another TrainResult"):
        fp32.versus({"losses": []})


def test_each_step_is_timed_and_the_steady_time_leaves_out_the_warm_up_step():
    result = train(steps=4, **TINY)
    assert len(result.step_seconds) == 4 and all(t > 0 for t in result.step_seconds)
    assert result.train_seconds == pytest.approx(sum(result.step_seconds))
    rest = sorted(result.step_seconds[1:])
    assert result.steady_step_seconds == rest[1]


def test_the_bench_trains_without_the_watch_so_each_precision_pays_only_its_own_cost():
    from mplab.bench.sweep import Plan, _train

    on = quiet_train(precision="fp16", steps=2, **TINY)
    off = quiet_train(precision="fp16", steps=2, watch=False, **TINY)
    assert len(on.zero_grad_fractions) == 2 and off.zero_grad_fractions == []
    assert off.losses == on.losses  # the watch only looks
    bench_run = _train(Plan.preset("cpu", tiny=True), models.lesson_model(hidden_size=64,
                       num_hidden_layers=1, num_attention_heads=2, intermediate_size=128),
                       "fp16", 2, 4)
    assert bench_run.config["watch"] is False and bench_run.zero_grad_fractions == []
