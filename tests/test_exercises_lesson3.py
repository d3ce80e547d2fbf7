"""Lesson 3's exercises: references against torch's kernels and GradScaler, and the feedback
a learner's likely mistakes get."""

import functools
import math
from pathlib import Path

import pytest
import torch
from conftest import failed_saying, run_cell

from mplab.amp.scaler import GradScaler
from mplab.exercises import lesson3 as ex
from mplab.exercises import same_tensors

IDS = list(ex.EXERCISES)
NOTEBOOK = Path(__file__).parent.parent / "notebooks" / "03_loss_scaling_gradscaler.ipynb"


def test_there_are_five_exercises_worth_six_points():
    assert IDS == ["3.1", "3.2", "3.3", "3.4", "3.5"]
    assert sum(e.points for e in ex.EXERCISES.values()) == 6


def test_3_1_task_gives_the_signature_and_what_it_returns():
    prompt = ex.EXERCISES["3.1"].prompt
    assert ("`update_scale(scale, tracker, found_inf, growth_factor, backoff_factor, "
            "growth_interval)`") in prompt and "`(new_scale, new_tracker)`" in prompt


def test_3_1_task_states_the_exact_rules_and_what_each_value_is():
    prompt = ex.EXERCISES["3.1"].prompt
    assert "`tracker + 1 == growth_interval`" in prompt and "exactly equal" in prompt
    assert "back off to 0" in prompt and "restarts at 0" in prompt and "fp32" in prompt
    assert "a float" in prompt and "an int" in prompt


def rule(scale, tracker, found, growth, backoff, interval, *, reaches=lambda t, i: t + 1 == i,
         floor=0.0):
    """The stated rule, with a way to get the growth test or the backoff wrong."""
    def fp32(v):
        return torch.tensor(v, dtype=torch.float64).float().item()
    if found:
        return max(fp32(scale * backoff), floor), 0
    if reaches(tracker, interval):
        grown = fp32(scale * growth)
        return (grown if math.isfinite(grown) else scale), 0
    return scale, tracker + 1


def test_3_1_the_rules_the_task_states_are_the_ones_the_grader_tells_apart(monkeypatch):
    monkeypatch.setenv("MPLAB_GRADING", "1")
    assert ex.check("3.1", rule).passed
    at_least = functools.partial(rule, reaches=lambda t, i: t + 1 >= i)
    assert ex.check("3.1", at_least).status == "failed"  # a tracker past the interval counts on
    never_zero = functools.partial(rule, floor=2.0**-149)
    assert ex.check("3.1", never_zero).status == "failed"  # backoff is not tested: 0 is allowed
    assert any(t + 1 > i and not f for _, t, f, _, _, i in ex._hidden_3_1())


def test_3_1_and_3_5_answers_are_not_in_the_lesson_above_them():
    """MiniScaler and unscale_ call torch's kernels: the rules are the learner's to write."""
    import nbformat

    nb = nbformat.read(NOTEBOOK, 4)
    code = "\n".join(c.source for c in nb.cells if c.cell_type == "code"
                     and "mplab" not in c.metadata)
    assert "isfinite" not in code and "_foreach_mul_" not in code  # the keys' own tests
    assert "torch._amp_update_scale_(" in code
    assert "torch._amp_foreach_non_finite_check_and_unscale_(" in code


def test_3_2_task_gives_the_settings_and_every_iteration():
    prompt = ex.EXERCISES["3.2"].prompt
    assert all(f"{k}={v!r}" in prompt for k, v in ex.SETTINGS_3_2.items())
    assert f"`{' '.join(ex.EVENTS_3_2)}`" in prompt


# --- 3.1 ----------------------------------------------------------------------------------------

def test_3_1_reference_kernel_agrees_with_a_real_gradscaler_update():
    for case in ex.PUBLIC_3_1 + ex._hidden_3_1()[:10]:
        scale, tracker, found, growth, backoff, interval = case
        scaler = torch.amp.GradScaler("cpu", init_scale=scale, growth_factor=growth,
                                      backoff_factor=backoff, growth_interval=interval)
        scaler.load_state_dict({**scaler.state_dict(), "_growth_tracker": tracker})
        w = torch.nn.Parameter(torch.ones(1))
        opt = torch.optim.SGD([w], lr=0.0)
        scaler.scale(w.sum()).backward()
        if found:
            w.grad.fill_(math.nan)
        scaler.step(opt)
        scaler.update()
        assert (scaler.get_scale(), scaler._get_growth_tracker()) == ex.torch_update(*case)


def double_precision(scale, tracker, found, growth, backoff, interval):
    """Right rule, but Python floats: not fp32-rounded, and growing into inf."""
    if found:
        return scale * backoff, 0
    if tracker + 1 == interval:
        return scale * growth, 0
    return scale, tracker + 1


def test_3_1_feedback(monkeypatch):
    assert ex.check("3.1", double_precision).passed  # public cases are exact powers of two
    monkeypatch.setenv("MPLAB_GRADING", "1")
    failed_saying(ex.check("3.1", double_precision), "hidden", "fp32")
    failed_saying(ex.check("3.1", lambda *a: (a[0], 0)), "update_scale(")
    failed_saying(ex.check("3.1", lambda *a: a[0]), "pair")
    assert ex.check("3.1", lambda *a: 1 / 0).status == "error"


# --- 3.2 ----------------------------------------------------------------------------------------

def test_3_2_reference_is_torch_and_mplab_agrees():
    want = ex.torch_scales(ex.EVENTS_3_2, **ex.SETTINGS_3_2)
    w = torch.nn.Parameter(torch.ones(1))
    opt = torch.optim.SGD([w], lr=0.0)
    ours = GradScaler("cpu", **ex.SETTINGS_3_2)
    for e in ex.EVENTS_3_2:
        ours.scale(w.sum()).backward()
        if e == "inf":
            w.grad.fill_(math.inf)
        ours.step(opt)
        ours.update()
        opt.zero_grad()
    assert [r.new_scale for r in ours.history] == want
    assert ex.check("3.2", want[-1]).passed
    assert ex.check("3.2", "512").passed  # numeric text is read as a number
    other = ex._variant(ex.EVENTS_3_2, 1024.0, 2.0, 0.5, 3, consecutive=False)
    if other != want[-1]:
        failed_saying(ex.check("3.2", other), "in a row")
    failed_saying(ex.check("3.2", 3.0), "walk through")


# --- 3.3 ----------------------------------------------------------------------------------------

def test_3_3_task_shows_the_buggy_step_to_fix_as_python():
    assert f"```python\n{ex.BUGGY_3_3}\n```" in ex.EXERCISES["3.3"].prompt


def test_3_3_the_buggy_loop_fails_and_the_fix_passes():
    _, ns = run_cell(f"{ex.BUGGY_3_3}\n0", ex=ex)
    failed_saying(ex.check("3.3", ns["train_step"]), "*scaled* gradients", "unscale first")
    no_clip = ex.BUGGY_3_3.replace(
        f"    torch.nn.utils.clip_grad_norm_(model.parameters(), {ex.MAX_NORM})\n", "")
    _, ns = run_cell(f"{no_clip}\n0", ex=ex)
    failed_saying(ex.check("3.3", ns["train_step"]), "so is the clipping")
    # the clipping really matters on this problem: the two loops end apart
    assert not same_tensors(ex._run(lambda *a: ex._reference_step(*a, order="right")),
                            ex._run(lambda *a: ex._reference_step(*a, order="none")))


# --- 3.4 ----------------------------------------------------------------------------------------

def test_3_4_task_lists_every_choice_on_its_own_line():
    lines = ex.EXERCISES["3.4"].prompt.splitlines()
    assert all(f"- ({k}) {v}" in lines for k, v in ex.CHOICES_3_4.items())


def test_3_4_every_wrong_choice_explains_itself():
    assert ex.check("3.4", " B ").passed
    for letter in "acd":
        failed_saying(ex.check("3.4", letter))
    assert ex.check("3.4", "e").status == "failed" and "one letter" in ex.check("3.4", 2).message


# --- 3.5 ----------------------------------------------------------------------------------------

def summing_check(grads, inv_scale):
    found = any(not torch.isfinite(g.sum()) for g in grads)
    for g in grads:
        g.mul_(inv_scale)
    return found


def out_of_place(grads, inv_scale):
    found = any(not torch.isfinite(g).all() for g in grads)
    grads = [g * inv_scale for g in grads]  # new tensors: the optimizer never sees them
    return found


def test_3_5_feedback(monkeypatch):
    assert ex.check("3.5", summing_check).message.startswith("Public checks passed")
    monkeypatch.setenv("MPLAB_GRADING", "1")
    failed_saying(ex.check("3.5", summing_check), "overflows on large finite numbers")
    failed_saying(ex.check("3.5", lambda grads, inv: [g.mul_(inv) for g in grads] and False),
                  "holds an inf or nan")
    failed_saying(ex.check("3.5", lambda grads, inv: any(not torch.isfinite(g).all()
                                                         for g in grads)), "in place")
    failed_saying(ex.check("3.5", out_of_place), "in place")


def test_3_5_hidden_cases_are_what_torch_kernel_says():
    for grads, scale in ex._hidden_3_5():
        copies = [g.clone() for g in grads]
        found = ex.torch_unscale(copies, ex._inv(scale))
        assert found == any(not torch.isfinite(g).all() for g in grads)



def _through_the_kernel(scale, tracker, found_inf, growth_factor, backoff_factor, interval):
    s, t = torch.tensor([scale]), torch.tensor([tracker], dtype=torch.int32)
    torch._amp_update_scale_(s, t, torch.tensor([float(found_inf)]), growth_factor,
                             backoff_factor, interval)
    return s.item(), int(t.item())


SAVED = torch._amp_update_scale_, torch._amp_foreach_non_finite_check_and_unscale_


def _saved_earlier(scale, tracker, found_inf, growth_factor, backoff_factor, interval):
    s, t = torch.tensor([scale]), torch.tensor([tracker], dtype=torch.int32)
    SAVED[0](s, t, torch.tensor([float(found_inf)]), growth_factor, backoff_factor, interval)
    return s.item(), int(t.item())


def _through_torch_ops(scale, tracker, found_inf, growth_factor, backoff_factor, interval):
    s, t = torch.tensor([scale]), torch.tensor([tracker], dtype=torch.int32)
    torch.ops.aten._amp_update_scale_(s, t, torch.tensor([float(found_inf)]), growth_factor,
                                      backoff_factor, interval)
    return s.item(), int(t.item())


def _in_a_thread(*case):  # a dispatch mode is per thread; the dispatcher's override is not
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as pool:
        return pool.submit(_saved_earlier, *case).result()


def _through_a_gradscaler(scale, tracker, found_inf, growth_factor, backoff_factor, interval,
                          kind=torch.amp.GradScaler):
    scaler = kind("cpu", init_scale=scale, growth_factor=growth_factor,
                  backoff_factor=backoff_factor, growth_interval=interval)
    scaler.load_state_dict({**scaler.state_dict(), "_growth_tracker": tracker})
    w = torch.nn.Parameter(torch.ones(1))
    scaler.scale(w.sum()).backward()
    if found_inf:
        w.grad.fill_(math.nan)
    scaler.step(torch.optim.SGD([w], lr=0.0))
    scaler.update()
    return scaler.get_scale(), int(scaler.state_dict()["_growth_tracker"])


def _through_mplabs_twin(*case):  # mplab's GradScaler spells the kernel out: poisoned too
    return _through_a_gradscaler(*case, kind=GradScaler)


def _unscaled_by_the_kernel(grads, inv_scale):
    found = torch.zeros(1)
    torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inv_scale.reshape(1))
    return bool(found.item())


def _unscaled_in_a_thread(grads, inv_scale):
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as pool:
        return pool.submit(_unscaled_by_the_kernel, grads, inv_scale).result()


def _unscaled_by_a_gradscaler(grads, inv_scale, kind=torch.amp.GradScaler):
    if not grads:
        return False
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(params, grads):
        p.grad = g  # the scaler unscales these very tensors, in place
    scaler = kind("cpu", init_scale=1 / inv_scale.item())  # exact for a power of two
    scaler.scale(torch.ones(()))
    optimizer = torch.optim.SGD(params, lr=0.0)
    scaler.unscale_(optimizer)
    return any(bool(f) for f in scaler._found_inf_per_device(optimizer).values())


def _unscaled_by_mplabs_twin(grads, inv_scale):
    return _unscaled_by_a_gradscaler(grads, inv_scale, kind=GradScaler)


UPDATES = [_through_the_kernel, _saved_earlier, _through_torch_ops, _in_a_thread,
           _through_a_gradscaler, _through_mplabs_twin]
UNSCALES = [_unscaled_by_the_kernel, _unscaled_in_a_thread, _unscaled_by_a_gradscaler,
            _unscaled_by_mplabs_twin]


@pytest.mark.parametrize("answer", UPDATES, ids=lambda f: f.__name__)
def test_3_1_an_answer_that_calls_the_kernel_fails_on_its_outputs(answer, graded_apart):
    """However it reaches torch's kernel (or mplab's twin of it), the answer is torch's rule
    outside the check, and inside it gives the poison's NaN scale: wrong outputs, in the kernel
    and so in the grader's replay of the record; torch's kernel is its own again after."""
    for case in ex.PUBLIC_3_1 + ex._hidden_3_1(5)[:12]:
        assert answer(*case) == ex.torch_update(*case)
    kernel, grader = graded_apart("3.1", answer)
    failed_saying(kernel, "calls torch._amp_update_scale_", "write what it does")
    assert (grader.status, grader.message) == (kernel.status, kernel.message)
    assert (torch._amp_update_scale_, torch._amp_foreach_non_finite_check_and_unscale_) == SAVED
    assert _through_the_kernel(*ex.PUBLIC_3_1[2]) == (131072.0, 0)  # torch's own again


@pytest.mark.parametrize("answer", UNSCALES, ids=lambda f: f.__name__)
def test_3_5_an_answer_that_calls_the_kernel_fails_on_its_outputs(answer, graded_apart):
    for grads, scale in ex.PUBLIC_3_5:  # powers of two: a scaler's inverse is exact
        mine, ref = [g.clone() for g in grads], [g.clone() for g in grads]
        assert answer(mine, ex._inv(scale)) == ex.torch_unscale(ref, ex._inv(scale))
        assert all(torch.equal(ex._bits(a), ex._bits(b)) for a, b in zip(mine, ref))
    kernel, grader = graded_apart("3.5", answer)
    failed_saying(kernel, "calls torch._amp_foreach_non_finite_check_and_unscale_")
    assert (grader.status, grader.message) == (kernel.status, kernel.message)

