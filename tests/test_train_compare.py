"""mplab.train.compare: the three ways to train measured from the code that really runs."""

import pytest

from mplab.train import compare


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
    assert torch_path.lines_of_code > trainer.lines_of_code
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
    assert counts == {"torch": (29, "9 of 9"), "accelerate": (30, "6 of 9"),
                      "trainer": (20, "0 of 9")}
    assert compare.steps_written("accelerate") == ("backward", "unscale + clip",
                                                   "optimizer step", "zero_grad",
                                                   "lr schedule", "accumulation")
    trainer = compare.method_lines("trainer")
    assert "training_args = TrainingArguments(" in trainer and "trainer.train(" in " ".join(
        trainer)
    assert not any("Run.start" in line or "run.finish" in line for line in trainer)


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
