"""mplab.diagnose, the Recorder and the failure lab: every failure the lab reproduces is named by
diagnose, and its fix makes diagnose stop naming it; the hooks see what torch really did."""

from __future__ import annotations

import functools
import inspect
import json
import math

import pytest
import torch

import mplab
from mplab.diagnosis import CAUSES, Diagnosis, diagnose, lab, lab_runs
from mplab.plots import learned_share
from mplab.train import NonFiniteLossError, Recorder, TrainResult, train
from mplab.train.watch import ScalerCalls, StepWatch

pytestmark = pytest.mark.filterwarnings("ignore")


#: The failures whose outcome depends on the CPU's units: run under each kind (`machine`).
ON_THE_HARDWARE = ("no_units", "fp16_ignored")


@functools.cache
def lab_run(name: str, fix: str | None = None) -> TrainResult:
    """A lab run on the CPU, whatever the machine (the CUDA runs are gpu_check.sh's)."""
    runner = lab.FAILURES[name].runner
    device = {"device": "cpu"} if "device" in inspect.signature(runner).parameters else {}
    return lab.run(name, fix=fix, **device)


# ---- the lab: reproduce, diagnose, fix --------------------------------------------------------

def test_every_cause_has_a_check_and_the_lab_reproduces_each_a_run_can_show():
    """One registry: each cause is declared by the check that names it; each one a training
    run can show is what a lab failure's broken run reproduces, or one of its fixes' notes."""
    from mplab.diagnosis import BENCH_CHECKS, CRASH_CHECKS, RUN_CHECKS

    from_runs = {c for check in RUN_CHECKS for c in check.causes}
    from_bench = {c for check in BENCH_CHECKS for c in check.causes}
    from_crashes = {c for check in CRASH_CHECKS for c in check.causes}  # tests/test_crashes.py
    assert from_runs | from_bench | from_crashes == set(CAUSES)
    reproduced = set(lab.FAILURES) | {c for f in lab.FAILURES.values() for _, c in f.fix_causes}
    assert reproduced == from_runs
    for name, failure in lab.FAILURES.items():
        assert failure.title == CAUSES[name] and failure.fixes
        assert {fix for fix, _ in failure.fix_causes} <= set(failure.fixes)


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in lab.FAILURES if n not in ON_THE_HARDWARE])
def test_diagnose_names_each_lab_failure_and_not_after_its_fix(name):
    failure = lab.FAILURES[name]
    broken = diagnose(lab_run(name))
    assert name in broken, broken
    found = next(f for f in broken.findings if f.name == name)
    if found.severity != "note":  # a note (a scaler kept with bf16) lets a warning lead
        assert broken.cause == name, broken
    notes = dict(failure.fix_causes)
    for fix in dict.fromkeys((failure.fixes[0], *notes)):  # the lesson's fix, and each note's
        run = lab_run(name, fix)
        if fix == failure.fixes[0]:  # the lab plots it beside the broken run: it learns
            assert learned_share(run.losses) >= 0.25, (fix, run.losses)
        fixed = diagnose(run)
        assert failure.fixed_in(fixed) and name not in fixed, (fix, fixed)
        assert not any(f.severity == "broken" for f in fixed.findings), (fix, fixed)
        if fix in notes:
            assert notes[fix] in fixed, (fix, fixed)


@pytest.mark.parametrize("fix", [None, "fp32"])
def test_low_precision_without_units_is_reproduced_where_the_cpu_lacks_them(machine, fix):
    if machine.cpu_bf16 and machine.cpu_fp16:
        with pytest.raises(lab.CannotReproduce, match="cannot be reproduced on this machine"):
            lab.run("no_units", fix=fix)
        return
    result = lab.run("no_units", fix=fix)
    missing = "fp16" if not machine.cpu_fp16 else "bf16"
    assert result.precision == ("fp32" if fix else missing)
    found = diagnose(result)
    assert ("no_units" in found) == (fix is None) and found.cause == (None if fix else "no_units")


def test_fp16_flags_are_ignored_on_a_cpu_and_the_fix_asks_for_what_it_supports(machine):
    broken = lab_run("fp16_ignored")
    assert broken.compute_dtype == torch.float32 and not broken.scales
    fp32 = lab_runs._train(lab.lab_model(), path="accelerate", precision="fp32",
                      steps=len(broken.losses), device="cpu")
    assert broken.losses == fp32.losses and diagnose(broken).cause == "fp16_ignored"
    fixed = lab.run("fp16_ignored", fix="supported")
    assert fixed.precision == ("bf16" if machine.cpu_bf16 else "fp32")
    assert "fp16_ignored" not in diagnose(fixed)


def test_the_accumulation_bug_is_what_torch_refuses_without_the_extra_updates():
    said = lab.accumulation_error()
    assert said.startswith("RuntimeError: unscale_() has already been called on this optimizer")


def test_the_t5_like_model_overflows_fp16_exactly_where_torch_casts_to_inf():
    model = lab.lab_model()
    batch = next(lab.lab_batches(1))
    before = lab.grow_feed_forward(model, batch, largest=1e5)
    assert before < 65504 / 1000  # the lab model's own outputs are far below fp16's max
    seen = []
    model.bert.encoder.layer[0].output.dense.register_forward_hook(
        lambda m, a, out: seen.append(out))
    with torch.no_grad():
        fp32_loss = model(**batch).loss
    assert math.isfinite(fp32_loss.item())  # the LayerNorm after it copes in fp32
    largest = seen[0].abs().max()
    assert largest.item() == pytest.approx(1e5, rel=1e-4)
    assert torch.isinf(largest.half())  # torch's own cast: past 65504 is inf


def test_the_overflow_run_stops_at_step_one_and_its_fixes_train():
    broken = lab_run("fp16_overflow")
    assert broken.stopped and not broken.losses
    assert diagnose(broken).run.endswith(", stopped at step 1")  # not "0 steps"
    for fix in ("bf16", "fp32_island"):
        fixed = lab_run("fp16_overflow", fix)
        assert len(fixed.losses) == 20 and all(map(math.isfinite, fixed.losses))


def test_without_a_scaler_most_fp16_gradients_are_zero_and_with_one_few():
    broken, fixed = lab_run("no_scaler"), lab_run("no_scaler", "scaler")
    assert min(broken.zero_grad_fractions) > 0.9
    assert max(fixed.zero_grad_fractions) < 0.5
    words = " ".join(next(f for f in diagnose(broken).findings if f.name == "no_scaler").evidence)
    assert f"{sorted(broken.zero_grad_fractions)[15]:.1%}" in words


def test_the_clipped_scaled_norms_are_the_scale_times_the_true_ones():
    broken, fixed = lab_run("clip_before_unscale"), lab_run("clip_before_unscale", "unscale_first")
    # the first step of both runs sees the same gradients: the norms differ by the scale
    assert broken.grad_norms[0] / fixed.grad_norms[0] == pytest.approx(broken.scales[0], rel=1e-2)


def test_the_scale_halves_every_step_when_the_gradients_are_nan_at_any_scale():
    result = lab_run("scale_collapse")
    assert result.skipped_steps == list(range(1, 41))
    assert result.scales == [2.0**16 * 0.5**k for k in range(1, 41)]
    assert all(map(math.isfinite, result.losses))
    evidence = " ".join(diagnose(result).findings[0].evidence)
    assert "#99640" in evidence and "126 more steps" in evidence  # 2**-24 to 2**-149 is 125+1


def test_the_scaler_calls_are_counted_per_iteration():
    def counted(*run):  # (scale, unscale_, step, update) per iteration
        return {tuple(c.values()) for c in lab_run(*run).scaler_calls}

    assert counted("extra_update") == {(1, 2, 2, 2)}
    assert counted("extra_update", "update_once") == {(1, 2, 2, 1)}
    assert counted("accumulation_scaler") == {(4, 4, 1, 4)}
    assert counted("scaler_bypassed") == {(1, 0, 0, 0)}
    assert counted("scaler_bypassed", "scaler_step") == {(1, 1, 1, 1)}


@pytest.mark.slow
def test_pure_bf16_and_its_fixes_side_by_side():
    table = lab.compare_bf16_fixes(steps=20)  # lesson 7 runs 40; 20 already part them
    rows = {r["fix"]: r for r in table.rows}
    assert rows["fp32_master"]["distance from fp32 master"] == 0
    assert rows["fp32_master"]["weights unchanged per step"] == 0
    assert rows[None]["weights unchanged per step"] > 0.5  # measured 0.76 at lr 1e-4
    # Kahan keeps what rounding took; stochastic rounding keeps it on average (noisier)
    distance = {fix: row["distance from fp32 master"] for fix, row in rows.items()}
    assert distance["kahan"] < 0.5 * distance[None]
    assert distance["stochastic"] < distance[None]
    assert [rows[f]["bytes per weight"] for f in (None, "fp32_master", "kahan", "stochastic")] == [
        2, 4, 4, 2]
    short = lab.compare_bf16_fixes(steps=4)
    assert lab.compare_bf16_fixes(steps=4).rows == short.rows  # seeded: the same numbers


def test_a_compensated_bf16_run_is_a_note_not_a_failure(machine):
    found = diagnose(lab.pure_bf16("kahan", steps=10))
    slow = [] if machine.units("bf16") else ["no_units"]  # a warning about the CPU alone
    assert found.names == slow + ["compensated_weights"] and found.ok == machine.units("bf16")


def test_the_lab_rejects_unknown_failures_and_fixes():
    with pytest.raises(ValueError, match="unknown failure 'nan'; accepted: fp16_overflow"):
        lab.run("nan")
    with pytest.raises(ValueError, match="no_scaler has no fix 'kahan'; accepted: 'scaler'"):
        lab.run("no_scaler", fix="kahan")


def test_a_diagnosis_names_the_run_by_its_label_else_its_path():
    """diagnose's header says what a run was: the lab names its failure and fix (and the
    mplab.train path it went through, if any); a Recorder's run is "own loop" unless labelled,
    and its model is named by its class unless named."""
    assert diagnose(lab_run("no_scaler", "scaler")).run.startswith(
        "lab run no_scaler with fix scaler / fp16")
    trained = diagnose(lab_run("fp16_ignored")).run
    assert trained.startswith("lab run fp16_ignored (mplab.train, accelerate path) / fp16")
    model = lab.lab_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    plain = Recorder(model, opt).finish()
    assert diagnose(plain).run.startswith(f"own loop / fp32 on cpu, {type(model).__name__}")
    mine = Recorder(model, opt, name="tiny bert", label="my sweep, run 3").finish()
    assert diagnose(mine).run.startswith("my sweep, run 3 / fp32 on cpu, tiny bert")


def test_every_failure_is_a_named_cause_with_its_code():
    for name, failure in lab.FAILURES.items():
        assert name in CAUSES
        assert f"def {failure.runner.__name__}(" in failure.code


# ---- diagnose reads every form of the record -------------------------------------------------

def test_diagnose_reads_a_result_its_dict_its_json_and_the_error(tmp_path):
    result = lab_run("clip_before_unscale")
    file = tmp_path / "run.json"
    result.write_json(file)
    names = diagnose(result).names
    assert diagnose(str(file)).names == names
    assert diagnose(file).names == names
    assert diagnose(json.loads(file.read_text())).names == names
    assert mplab.diagnose is diagnose
    with pytest.raises(NonFiniteLossError) as err:
        model = lab.lab_model()
        lab.grow_feed_forward(model, next(lab.lab_batches(1)))
        train(model=model, precision="fp16", steps=3, batch_size=16, progress=False,
              eval_samples=0)
    assert diagnose(err.value).cause == "fp16_overflow"


def test_diagnose_says_what_it_was_given_and_what_it_reads(tmp_path):
    with pytest.raises(TypeError, match="got int"):
        diagnose(3)
    with pytest.raises(FileNotFoundError, match="no such file"):
        diagnose(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="is not JSON"):
        diagnose(tmp_path / "bad.json")
    with pytest.raises(ValueError, match="needs its 'crossover' list"):
        diagnose({"device": "cpu", "rows": []})
    with pytest.raises(ValueError, match="no 'losses'"):
        diagnose({"precision": "fp16"})


def test_a_healthy_run_is_reported_healthy_and_prints():
    result = train(model=lab.lab_model(), precision="fp32", steps=5, batch_size=16,
                   progress=False, eval_samples=0)
    found = diagnose(result)
    assert isinstance(found, Diagnosis) and found.ok and found.findings == []
    assert "nothing wrong found" in str(found)
    assert "Nothing wrong found" in found._repr_html_()
    assert found.as_dict() == {"run": found.run, "cause": None, "findings": []}


def test_update_twice_is_inferred_from_the_scale_when_calls_were_not_counted():
    """Two optimizers whose gradients are both inf, each followed by update(): torch backs the
    scale off twice in one iteration, x0.25, which no single update() can do."""
    w1, w2 = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
    o1, o2 = torch.optim.SGD([w1], lr=0.1), torch.optim.SGD([w2], lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    result = TrainResult(path="own loop", precision="fp16", device="cpu", model="two")
    for _ in range(3):
        scaler.scale((w1 * w2).sum() * float("inf")).backward()
        for opt in (o1, o2):
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        result.losses.append(1.0)
        result.scales.append(scaler.get_scale())
    assert result.scales == [2.0**14, 2.0**12, 2.0**10]  # torch's own arithmetic
    found = diagnose(result)
    assert found.cause == "extra_update"
    assert "from 16384 to 4096 (×0.25)" in found.findings[0].evidence[0]


# ---- the hooks see what torch did, and change nothing ----------------------------------------

def _fp16_steps(record: bool, init_scale=2.0**16, steps=4):
    model = lab.lab_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
    autocast = torch.autocast("cpu", dtype=torch.float16)
    rec = Recorder(model, opt, scaler=scaler, autocast=autocast) if record else None
    torch_scales, torch_skips = [], []
    for step, batch in enumerate(lab.lab_batches(steps), 1):
        with autocast:
            loss = model(**batch).loss
        scaler.scale(loss).backward()
        before = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        if scaler.get_scale() < before:  # torch backs off exactly when it skipped
            torch_skips.append(step)
        torch_scales.append(scaler.get_scale())
        if rec:
            rec.step(loss)
    return (rec.finish() if rec else None), model, torch_scales, torch_skips


def test_the_recorder_changes_nothing_and_sees_torchs_skips():
    result, model, scales, skips = _fp16_steps(True, init_scale=2.0**40)
    _, plain, _, _ = _fp16_steps(False, init_scale=2.0**40)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), plain.parameters()))
    assert result.scales == scales and result.skipped_steps == skips and skips
    assert result.compute_dtype == torch.float16 and result.param_dtype == torch.float32
    assert result.config["init_scale"] == 2.0**40 and result.config["scaler"] == "torch"


def test_the_step_watch_counts_zeros_and_unchanged_weights_as_torch_computes_them():
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 3))
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)
    watch = StepWatch(model, opt)
    out = model(torch.tensor([1, 2])).sum()
    out.backward()
    linear = model[1]
    linear.weight.grad[0] = 0  # one row of zeros, by hand
    expected = ((linear.weight.grad == 0).sum() + (linear.bias.grad == 0).sum()).item() / 15
    opt.step()
    zeros, unchanged = watch.measure()
    assert zeros == pytest.approx(expected) and unchanged is None  # fp32: nothing to swamp
    watch.remove()
    model.to(torch.bfloat16)
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)  # 1e-6 is far below half a bf16 ulp
    watch = StepWatch(model, opt)
    model(torch.tensor([1, 2])).float().sum().backward()
    opt.step()
    assert watch.measure()[1] == 1.0


def test_an_fp32_run_has_almost_no_zero_gradients_as_diagnose_says():
    """diagnose's no_scaler evidence compares with fp32: measured here, at most 0.01 %."""
    model = lab.lab_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    watch = StepWatch(model, opt)
    zeros = []
    for batch in lab.lab_batches(10):
        model(**batch).loss.backward()
        opt.step()
        opt.zero_grad()
        zeros.append(watch.measure()[0])
    assert max(zeros) < 1e-3
    assert "an fp32 run has almost none" in " ".join(
        diagnose(lab_run("no_scaler")).findings[0].evidence)


def test_scaler_calls_wrap_and_unwrap_the_instance():
    scaler = torch.amp.GradScaler("cpu")
    calls = ScalerCalls(scaler)
    scaler.get_scale()
    assert calls.counts() == {"scale": 0, "unscale_": 0, "step": 0, "update": 0}
    calls.remove()
    assert "update" not in scaler.__dict__


def test_mplab_train_records_the_watch_for_fp16_only():
    fp16 = train(model=lab.lab_model(), precision="fp16", steps=3, batch_size=16,
                 progress=False, eval_samples=0, device="cpu")
    fp32 = train(model=lab.lab_model(), precision="fp32", steps=3, batch_size=16,
                 progress=False, eval_samples=0, device="cpu")
    assert len(fp16.zero_grad_fractions) == 3 and fp32.zero_grad_fractions == []
    assert fp32.unchanged_weight_fractions == [] and fp16.has_units in (True, False)
    again = TrainResult.from_dict(fp16.as_dict())
    assert again.zero_grad_fractions == fp16.zero_grad_fractions


def test_a_loop_that_autocasts_inline_is_diagnosed_as_if_the_recorder_had_been_told():
    """The same fp16 overflow (the lab's grown feed-forward), recorded with and without
    `autocast=`: the Recorder learns fp16 from the matmuls it saw, and the diagnosis is the
    same (it used to read an untold fp16 overflow as an fp32 run that diverged)."""
    def loop(told: bool) -> TrainResult:
        model = lab.lab_model()
        lab.grow_feed_forward(model, next(lab.lab_batches(1)), largest=1e5)
        optimizer = torch.optim.AdamW(model.parameters(), lr=lab.LR)
        autocast = torch.autocast("cpu", dtype=torch.float16)
        scaler = torch.amp.GradScaler("cpu")
        with Recorder(model, optimizer, scaler=scaler,
                      **({"autocast": autocast} if told else {})) as rec:
            for batch in lab.lab_batches(3):
                with autocast:
                    loss = model(**batch).loss
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad()
                rec.step(loss)
            return rec.finish()

    told, untold = loop(True), loop(False)
    assert untold.precision == told.precision == "fp16"
    assert diagnose(untold).names == diagnose(told).names
    assert diagnose(untold).cause == "fp16_overflow"


def test_the_recorder_rejects_what_it_cannot_watch():
    model = lab.lab_model()
    with pytest.raises(TypeError, match="torch.nn.Module, got str"):
        Recorder("model", None)
    with pytest.raises(TypeError, match="torch optimizer"):
        Recorder(model, object())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="precision 'fp8'"):
        Recorder(model, opt, precision="fp8")


def test_the_gpu_check_runs_the_lab_within_its_five_minutes():
    import re
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    script = (root / "benchmarks" / "gpu_check.sh").read_text()
    limits = [int(s) for s in re.findall(r"^step \S+ (\d+) ", script, flags=re.M)]
    assert len(limits) >= 6 and sum(limits) <= 300
    assert "benchmarks/lab_check.py --device cuda" in script
    said = subprocess.run([sys.executable, str(root / "benchmarks" / "lab_check.py"), "--help"],
                          capture_output=True, text=True, check=True).stdout
    assert "--device" in said


def test_a_bench_record_is_diagnosed_from_its_own_rows(tmp_path, machine):
    from mplab import bench

    record = bench.lesson_bench(tiny=True)
    file = tmp_path / "bench.json"
    file.write_text(json.dumps(record))
    found = diagnose(str(file))
    assert found.run.startswith(f"mplab.bench record on {machine.device}")
    for p in ("bf16", "fp16"):  # read off the rows' has_units, not off their words
        named = [f for f in found.findings if f.cause.startswith(f"this device has no {p} ")]
        assert bool(named) == (not machine.units(p)) and all(f.name == "no_units" for f in named)
    for f in found.findings:  # each speaks of the record's own figures
        assert any("× fp32" in e for e in f.evidence)
    assert diagnose(record).names == found.names


def test_the_json_the_train_cli_writes_is_diagnosed(tmp_path, capsys):
    from mplab.train.__main__ import main

    file = tmp_path / "run.json"
    assert main(["--path", "accelerate", "--precision", "fp16", "--device", "cpu", "--steps",
                 "3", "--batch-size", "8", "--no-progress", "--json", str(file)]) == 0
    assert diagnose(file).cause == "fp16_ignored"


@pytest.mark.slow
def test_the_trainer_ignores_fp16_on_a_cpu_and_diagnose_says_so():
    broken = lab.fp16_ignored(steps=3, path="trainer")
    assert broken.compute_dtype == torch.float32
    assert diagnose(broken).cause == "fp16_ignored"
    assert "fp16_ignored" not in diagnose(lab.fp16_ignored("supported", steps=3, path="trainer"))


def test_a_loop_that_steps_past_the_scaler_is_named_not_an_overflow():
    """`optimizer.step()` after `scaler.scale(loss).backward()`: the record shows the loss
    scaled every iteration and scaler.step() never, which no fp16 overflow explains."""
    found = diagnose(lab_run("scaler_bypassed"))
    assert found.cause == "scaler_bypassed" and "fp16_overflow" not in found
    evidence = " ".join(found.findings[0].evidence)
    assert "scaler.step() never ran" in evidence and "65536× (the scale)" in evidence


def test_a_loss_that_climbs_is_diverged_whatever_the_precision():
    result = lab_run("diverged")
    assert all(map(math.isfinite, result.losses)) and result.losses[-1] > 2 * result.losses[0]
    found = diagnose(result)
    assert found.cause == "diverged" and "(lr=1)" in found.findings[0].fix
