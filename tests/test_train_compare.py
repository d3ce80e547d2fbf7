"""mplab.train.compare: the three ways to train measured from the code that really runs; and
what runs say side by side: loss_overlaps (where two runs' loss curves lie on top of each
other), step_time_noise (when a gap in step time is the machine's noise) and accuracy_rise
(whether an accuracy rose beyond chance)."""

import math

import pytest
import torch

from mplab.train import TrainResult, accuracy_rise, compare, loss_overlaps, step_time_noise


def test_the_torch_path_writes_every_step_of_the_amp_loop_itself():
    torch_path = compare.profile("torch")
    assert torch_path.steps_written == tuple(compare.STEPS)
    assert torch_path.steps_hidden == ()
    # the counted code is the method: no docstring, no comments, none of Run's bookkeeping
    lines = compare.method_lines("torch")
    assert "scaler.update()" in lines and "scaler.step(optimizer)" in lines
    assert not any(line.startswith(('"""', "#")) or "run.record" in line for line in lines)
    assert torch_path.lines_of_code == len(lines) >= 20
    # torch.autocast and torch.amp.GradScaler's own keyword arguments, read from torch
    assert torch_path.settings_exposed >= 8


def test_a_diff_of_two_paths_is_their_real_source_line_by_line():
    text = compare.diff("torch", "torch")
    assert text == ""  # the same function: nothing to change
    assert "scaler.scale(micro_loss).backward()" in compare.source("torch")


def test_each_path_hides_more_of_the_loop_and_needs_fewer_lines():
    torch_path, accelerate, trainer = (compare.profile(p) for p in ("torch", "accelerate",
                                                                    "trainer"))
    assert len(torch_path.steps_written) > len(accelerate.steps_written) > len(
        trainer.steps_written)
    assert torch_path.lines_of_code > accelerate.lines_of_code > trainer.lines_of_code
    assert "loss scaling" in accelerate.steps_hidden  # Accelerate's backward scales
    text = compare.diff("torch", "accelerate")
    assert any(line.startswith("-") and "scaler.scale(" in line for line in text.splitlines())
    assert any(line.startswith("+") and "accelerator.backward(" in line
               for line in text.splitlines())


def test_an_unknown_path_is_named_with_the_accepted_ones():
    with pytest.raises(ValueError, match="unknown path 'keras'; accepted: 'torch'"):
        compare.profile("keras")


def test_the_chart_places_each_path_at_its_measured_lines_and_steps():
    from mplab import plots

    table = compare.profiles()
    ax = plots.paths_chart(table, pyplot=False).axes[0]
    points = [tuple(c.get_offsets()[0]) for c in ax.collections]
    assert points == [(r["lines of code"], int(r["steps you write"].split(" of ")[0]))
                      for r in table]
    assert ax.get_xlim()[0] > ax.get_xlim()[1]  # fewer lines (easier) to the right
    with pytest.raises(TypeError, match="compare.profiles"):
        plots.paths_chart([{"path": "torch"}])


def test_the_counts_lessons_5_and_6_print_are_the_tagged_lines():
    """The chart's figures, pinned: a change to a path's code moves them only through its
    lines and tags, never through a variable's name."""
    counts = {r["path"]: (r["lines of code"], r["steps you write"]) for r in compare.profiles()}
    assert counts == {"torch": (27, "9 of 9"), "accelerate": (24, "6 of 9"),
                      "trainer": (19, "0 of 9")}
    assert compare.steps_written("accelerate") == ("backward", "unscale + clip",
                                                   "optimizer step", "zero_grad",
                                                   "lr schedule", "accumulation")
    trainer = compare.method_lines("trainer")
    assert "training_args = TrainingArguments(" in trainer and "trainer.train(" in " ".join(
        trainer)
    assert not any("Run.start" in line or "run.finish" in line for line in trainer)


def test_what_a_user_writes_counts_and_mplabs_record_of_the_run_does_not():
    accelerate = compare.method_lines("accelerate")
    # the objects a user builds count, every line of them
    assert "accelerator = Accelerator(" in accelerate
    assert "mixed_precision=MIXED_PRECISION[config.precision]," in accelerate
    assert "model, optimizer, train_dataloader, lr_scheduler = accelerator.prepare(" in accelerate
    assert "norm = accelerator.clip_grad_norm_(model.parameters()," in accelerate  # it clips
    # imports are not counted (the torch path's sit at the top of its module)
    assert not any(line.startswith(("from ", "import ")) for path in compare.FUNCTIONS
                   for line in compare.method_lines(path))
    # the running loss, the norm and the scale kept for the record are mplab's, and so is
    # the `if` that holds only them
    assert "step_loss, norm = 0.0, None" in compare.source("accelerate")
    assert not any("step_loss" in line or "accelerator.scaler" in line for line in accelerate)
    assert accelerate.count("if accelerator.sync_gradients:") == 1
    torch_path = compare.method_lines("torch")
    assert "loss = 0.0" not in torch_path and "norm = None" not in torch_path
    assert "norm = torch.nn.utils.clip_grad_norm_(model.parameters(), config.max_grad_norm)" \
        in torch_path


def test_a_diff_without_bookkeeping_holds_only_the_counted_lines_with_their_step_tags():
    text = compare.diff("accelerate", "trainer", bookkeeping=False)
    changed = [line[1:] for line in text.splitlines()[2:] if line[:1] in "+- "
               and not line.startswith("@@")]
    assert sorted(line.split("  #")[0].strip() for line in changed) == sorted(
        compare.method_lines("accelerate") + compare.method_lines("trainer"))
    assert "-        accelerator.backward(loss)  # [backward]" in text.splitlines()
    assert "run.record" not in text and "[mplab]" not in text
    assert compare.user_code("torch").splitlines()[0] == "model, device = run.model, run.device"


def test_versus_says_what_the_counts_say():
    for old, new in [("torch", "accelerate"), ("accelerate", "trainer"), ("trainer", "torch"),
                     ("torch", "torch")]:
        a, b = compare.profile(old), compare.profile(new)
        text = compare.versus(old, new)
        gap = b.lines_of_code - a.lines_of_code
        word = "fewer" if gap < 0 else "more" if gap > 0 else "as many"
        assert text.startswith(f"{new}: {b.lines_of_code} lines of code to {old}'s "
                               f"{a.lines_of_code} ({abs(gap)} {word})" if gap else
                               f"{new}: {b.lines_of_code} lines of code to {old}'s "
                               f"{a.lines_of_code} (as many)")
        assert f"writes {len(b.steps_written)} of the 9 steps" in text
        assert f"exposes {b.settings_exposed} settings to {old}'s {a.settings_exposed}" in text
        for step in a.steps_hidden:
            assert (step in text) == (step in b.steps_written)
    assert "handing autocast, loss scaling and scaler update to the library" in compare.versus(
        "torch", "accelerate")


def test_a_tag_counts_its_statement_and_a_typo_is_an_error(monkeypatch):
    def toy(run, scaler, loss):
        with run.start() as r:  # [mplab]
            # [loss scaling] [backward]
            scaler.scale(loss).backward()
            r.record(loss,  # the tag may sit on any line of the statement
                     scaled=True)  # [mplab]

    monkeypatch.setitem(compare.FUNCTIONS, "torch", f"{__name__}:toy")
    globals()["toy"] = toy
    assert compare.method_lines("torch") == ["scaler.scale(loss).backward()"]
    assert compare.steps_written("torch") == ("loss scaling", "backward")

    def typo(scaler, loss):
        scaler.scale(loss).backward()  # [loss-scaling]

    globals()["typo"] = typo
    monkeypatch.setitem(compare.FUNCTIONS, "torch", f"{__name__}:typo")
    with pytest.raises(ValueError, match=r"unknown tag \[loss-scaling\]; accepted: \[autocast\]"):
        compare.method_lines("torch")


def test_record_only_statements_are_found_by_what_reads_them(monkeypatch):
    def toy(run, model, optimizer, batches, clip):
        total, norm = 0.0, None  # only the record reads these
        kept = 0  # read by a counted statement: counted
        for batch in batches:
            loss = model(batch)
            loss.backward()  # [backward]
            total += loss.detach()
            norm = clip(model)  # a call does work: counted, though only the record reads norm
            kept += 1
            if kept:  # holds only bookkeeping
                size = total
                run.record(size, norm)  # [mplab]
        optimizer.step(kept)

    monkeypatch.setitem(compare.FUNCTIONS, "torch", f"{__name__}:toy")
    globals()["toy"] = toy
    assert compare.method_lines("torch") == [
        "kept = 0", "for batch in batches:", "loss = model(batch)", "loss.backward()",
        "norm = clip(model)", "kept += 1", "optimizer.step(kept)"]


# ---- loss curves that lie on top of each other ----------------------------------------------

def _run(precision, losses):
    return TrainResult(path="torch", precision=precision, device="cpu", model="lesson",
                       losses=list(losses))


def test_loss_overlaps_says_which_curves_lie_on_top_of_each_other_from_versus():
    runs = {"fp32": _run("fp32", [0.7, 0.5, 0.3, 0.2]), "bf16": _run("bf16", [0.7, 0.5002, 0.3]),
            "fp16": _run("fp16", [0.7, 0.5002, 0.3]), "far": _run("fp16", [0.7, 0.6, 0.5])}
    lines = loss_overlaps(runs).splitlines()
    assert len(lines) == 6  # every pair
    v = runs["bf16"].versus(runs["fp32"])
    assert lines[0] == (f"fp32 and bf16: largest gap {v['largest_gap']:.4f}, at step "
                        f"{v['gap_step']} of the 3 both trained, under 1% of the 0.500 the "
                        "losses span: the curves lie on top of each other")
    assert lines[3] == ("bf16 and fp16: the same losses bit for bit over the 3 steps both "
                        "trained, drawn as one line")
    far = runs["far"].versus(runs["fp32"])
    assert lines[2].startswith(f"fp32 and far: largest gap {far['largest_gap']:.4f}, at step 3")
    assert lines[2].endswith(f"{far['largest_gap'] / 0.5:.0%} of the 0.500 the losses span: "
                             "the curves part there")
    with pytest.raises(ValueError, match="label -> TrainResult, got list"):
        loss_overlaps([runs["fp32"]])


def test_step_time_noise_calls_a_gap_noise_only_between_runs_with_the_same_losses():
    fp32 = TrainResult("accelerate", "fp32", "cpu", "lesson", losses=[0.7, 0.5, 0.3],
                       step_seconds=[2.0, 0.10, 0.12, 0.11])
    ignored = TrainResult("accelerate", "fp16", "cpu", "lesson", losses=[0.7, 0.5, 0.3],
                          step_seconds=[2.0, 0.12, 0.13, 0.14])  # fp16 ignored: fp32's arithmetic
    noise = step_time_noise(ignored, fp32)
    assert noise.same_losses and (noise.run, noise.baseline) == ("fp16", "fp32")
    assert noise.step_ratio == 0.13 / 0.11  # steady steps: the medians after the first
    assert noise.paragraphs() == [
        f"The fp16 run's losses are the fp32 run's to the last bit, and its steady step took "
        f"{0.13 / 0.11:.2f}x as long:\nbetween runs that agree to the last bit, a difference of "
        "that size is this machine's noise (warm-up, the order of the runs, other work on it)."]
    ran = TrainResult("accelerate", "fp16", "cuda", "lesson", losses=[0.7, 0.5002, 0.3],
                      step_seconds=[2.0, 0.05])
    other = step_time_noise(ran, fp32)
    assert not other.same_losses and other.step_ratio == 0.05 / 0.11
    assert other.paragraphs() == []  # different arithmetic: the gap need not be noise
    unmeasured = TrainResult("accelerate", "bf16", "cpu", "lesson", losses=fp32.losses)
    assert math.isnan(step_time_noise(unmeasured, fp32).step_ratio)  # no steady step
    with pytest.raises(TypeError, match="two TrainResults"):
        step_time_noise(ran, {"losses": []})


def test_accuracy_rise_is_beyond_chance_only_past_two_standard_errors_of_the_held_out_set():
    # the band: two standard deviations of the accuracy of coin flips on 256 reviews
    flips = torch.rand(20_000, 256, generator=torch.Generator().manual_seed(0)) < 0.5
    spread = 2 * flips.float().mean(dim=1).std().item()
    within = accuracy_rise([0.5, 0.531, 0.55], held_out=256, steps=126)
    assert within.noise == 2 * (0.25 / 256) ** 0.5 == 0.0625
    assert within.noise == pytest.approx(spread, rel=0.03)
    assert (within.first, within.last, within.rise) == (0.5, 0.55, 0.55 - 0.5)
    assert not within.beyond_chance and (within.held_out, within.steps) == (256, 126)
    assert within.says() == ("In 126 steps the accuracy moved by +0.050, within the ±0.062 "
                             "that chance gives on 256 reviews: too few steps for this model to "
                             "learn")
    assert within.says("on a GPU it trains longer").endswith("learn (on a GPU it trains longer)")
    beyond = accuracy_rise([0.5, 0.8], held_out=256, steps=126)
    assert beyond.beyond_chance and beyond.rise == 0.8 - 0.5
    assert str(beyond) == beyond.says("unused") == (
        "The accuracy rose by 0.300, past the ±0.062 that chance gives on 256 reviews: the "
        "model learned.")
    fell = accuracy_rise([0.8, 0.55], held_out=256, steps=126)  # worse, past chance
    assert fell.fell and not fell.beyond_chance and not within.fell and not beyond.fell
    assert "fell by 0.250" in fell.says() and "within" not in fell.says()
    small = accuracy_rise([0.5, 0.65], held_out=32, steps=4)  # the same rise, 32 reviews
    assert small.noise == pytest.approx(0.1768, abs=1e-4) and not small.beyond_chance
    with pytest.raises(ValueError, match="got none"):
        accuracy_rise([], held_out=32, steps=4)
    with pytest.raises(ValueError, match="positive int"):
        accuracy_rise([0.5], held_out=0, steps=4)
