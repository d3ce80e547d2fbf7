"""Lesson 3, loss scaling and the GradScaler: the exercises.

    from mplab.exercises import lesson3 as ex
    ex.check("3.1", update_scale); ex.hint("3.1"); ex.solution("3.1")

The reference for every check is torch itself: its update-scale and unscale kernels
(``torch._amp_update_scale_``, ``torch._amp_foreach_non_finite_check_and_unscale_``) and
``torch.amp.GradScaler`` run on the same inputs. A learner's code is compared with them bit for
bit, as mplab's own GradScaler is.
"""

from __future__ import annotations

import contextlib
import functools
import math
import random
import warnings

import torch

from mplab.exercises.answers import Replay, copied, stood_in
from mplab.exercises.framework import (
    Exercise,
    Lesson,
    as_number,
    call,
    choice_list,
    grade_seed,
    multiple_choice,
    python_block,
    same_tensors,
)

__all__ = ["check", "hint", "solution", "exercise_cells", "cells", "task_markdown",
           "EXERCISES", "LESSON"]

# --- 3.1 the update rule ----------------------------------------------------------------------

UPDATE, UNSCALE = "_amp_update_scale_", "_amp_foreach_non_finite_check_and_unscale_"
_POISONED_TRACKER = -7  # what the poisoned update leaves: a tracker never counts below 0


def _poisoned_update(scale, tracker, *settings):  # aten._amp_update_scale_, meanwhile
    scale.fill_(math.nan)
    tracker.fill_(_POISONED_TRACKER)
    return scale


def _poisoned_unscale(grads, found_inf, inv_scale):  # aten's unscale-and-check, meanwhile
    for t in [found_inf, *grads]:
        t.fill_(math.nan)


def _twin_update(self, found_inf):  # runs as mplab's GradScaler._update_scale, meanwhile
    self._scale.fill_(float("nan"))
    self._growth_tracker.fill_(-7)


def _twin_found_inf(grads, device):  # runs as mplab.amp.scaler.found_inf_in, meanwhile
    for g in grads:
        g.fill_(float("nan"))
    return torch.full((), float("nan"), device=device)


@contextlib.contextmanager
def _poisoned(kernel: str, fn):
    """3.1 and 3.5 ask the learner to write what torch's `kernel` does, and are checked against
    it: while the learner's `fn` runs, the kernel gives NaN scales and gradients and an
    impossible tracker however it is reached (torch.X, a name saved earlier, torch.ops.aten,
    GradScaler, another thread: the dispatcher itself is overridden), and so does mplab's
    GradScaler, its twin. An answer that uses them returns outputs that fail the exact
    comparison, in the kernel and so in the grader's replay (where no learner code runs)."""
    from mplab.amp import scaler as twin

    lib = None if isinstance(fn, Replay) else torch.library.Library("aten", "IMPL")
    swap = ((twin.GradScaler._update_scale, _twin_update) if kernel == UPDATE
            else (twin.found_inf_in, _twin_found_inf))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch warns that an aten kernel is overridden
            for key in ("CPU", "CUDA", "MPS") if lib else ():  # every device with a kernel
                lib.impl(kernel, _poisoned_update if kernel == UPDATE else _poisoned_unscale,
                         key)
        with stood_in(fn, [swap]):
            yield
    finally:
        if lib is not None:
            lib._destroy()  # torch's own kernel again


def _poisoned_call(kernel: str, args: tuple, fn) -> None:
    """One hidden call, as the kernel records it for the grader: under the same poison."""
    with _poisoned(kernel, fn):
        fn(*copied(args))


def torch_update(scale, tracker, found_inf, growth_factor, backoff_factor, growth_interval):
    """What torch's own kernel makes of one update: (new scale, new tracker)."""
    s = torch.tensor([scale], dtype=torch.float32)
    t = torch.tensor([tracker], dtype=torch.int32)
    f = torch.tensor([1.0 if found_inf else 0.0])
    torch._amp_update_scale_(s, t, f, growth_factor, backoff_factor, growth_interval)
    return s.item(), int(t.item())


PUBLIC_3_1 = [  # (scale, tracker, found_inf, growth, backoff, interval): every branch once
    (65536.0, 0, False, 2.0, 0.5, 3), (65536.0, 1, False, 2.0, 0.5, 3),
    (65536.0, 2, False, 2.0, 0.5, 3), (65536.0, 2, True, 2.0, 0.5, 3),
    (1024.0, 0, True, 2.0, 0.25, 1), (1024.0, 0, False, 4.0, 0.5, 1),
]


def _hidden_3_1(seed: int | None = None) -> list[tuple]:
    """The hidden check's calls, in order: a few edges, then cases drawn for this run."""
    rng = random.Random(grade_seed() if seed is None else seed)
    top = torch.finfo(torch.float32).max
    cases = [(3.0, 0, False, 1.001, 0.5, 1),  # 3.003 is not an fp32 number: rounded once
             (1000.0, 4, True, 2.0, 0.37, 5), (top / 1.5, 0, False, 2.0, 0.5, 1),  # no inf
             (2.0**-149, 0, True, 2.0, 0.5, 1)]  # backs off to 0
    for _ in range(40):
        scale = rng.choice([2.0**rng.randint(-10, 40), rng.uniform(1, 1e6)])
        scale = torch.tensor(scale).item()  # a scaler's scale is always an fp32 number
        cases.append((scale,
                      rng.randint(0, 5), rng.random() < 0.3, rng.choice([2.0, 1.5, 1.001, 3.7]),
                      rng.choice([0.5, 0.25, 0.37, 0.999]), rng.randint(1, 6)))
    return cases


def _update_matches(fn, cases) -> str | None:
    for case in cases:
        shown = "update_scale" + repr(case)
        with _poisoned(UPDATE, fn):
            got = call(fn, *case, what=shown)
        if got is None:
            return f"{shown} returned None: is a return statement missing?"
        if not isinstance(got, tuple | list) or len(got) != 2:
            return f"{shown} returned {got!r:.60}; return a pair (new_scale, new_tracker)."
        scale = as_number(got[0], what=f"the scale {shown} returned")
        tracker = as_number(got[1], what=f"the tracker {shown} returned")
        want_scale, want_tracker = torch_update(*case)  # torch's own kernel, after the call
        if scale == want_scale and tracker == want_tracker:
            continue
        if math.isnan(scale) or tracker == _POISONED_TRACKER:  # what the poison leaves
            return _calls_the_kernel(shown, UPDATE)
        s, t, found, growth, backoff, interval = case
        if found:
            why = "An inf/NaN was found: back off (scale × backoff_factor) and reset the tracker."
        elif t + 1 == interval and math.isinf(
                torch.tensor(s * growth, dtype=torch.float64).float().item()):
            why = ("Growing would make the fp32 scale inf; torch keeps the scale instead (and "
                   "still resets the tracker).")
        elif t + 1 == interval:
            why = (f"This is the {interval}th clean update in a row: the scale grows by "
                   "growth_factor and the tracker starts again from 0.")
        else:
            why = "A clean update that does not reach growth_interval: count it, keep the scale."
        if tracker == want_tracker and scale != want_scale and math.isclose(scale, want_scale,
                                                                             rel_tol=1e-6):
            why = ("Nearly: the scale is an fp32 number. torch multiplies in float64 and rounds "
                   "the product once to fp32; a Python float keeps all 53 bits.")
        return (f"{shown} gave ({scale!r}, {tracker!r}); torch gives ({want_scale!r}, "
                f"{want_tracker}). {why} (Compared exactly.)")
    return None


def _calls_the_kernel(shown: str, kernel: str) -> str:
    return (f"{shown} calls torch.{kernel}, the kernel your function is checked against (or "
            "mplab's GradScaler, which does the same): the exercise is to write what it does, "
            "with your own arithmetic and tensor operations.")


def _trials_3_1(seed: int) -> list:
    return [functools.partial(_poisoned_call, UPDATE, case) for case in _hidden_3_1(seed)]


def _check_3_1(fn) -> str | None:
    return _update_matches(fn, PUBLIC_3_1)


def _hidden_check_3_1(fn) -> str | None:
    return _update_matches(fn, _hidden_3_1())


# --- 3.2 predict the scale --------------------------------------------------------------------

SETTINGS_3_2 = {"init_scale": 1024.0, "growth_factor": 2.0, "backoff_factor": 0.5,
                "growth_interval": 3}
EVENTS_3_2 = "ok ok ok ok inf ok ok inf inf ok ok ok ok".split()


def torch_scales(events: list[str], **settings) -> list[float]:
    """The scale after each update of torch.amp.GradScaler, with an inf gradient injected in
    the iterations marked "inf"."""
    w = torch.nn.Parameter(torch.ones(1))
    opt = torch.optim.SGD([w], lr=0.0)
    scaler = torch.amp.GradScaler("cpu", **settings)
    out = []
    for e in events:
        scaler.scale((w * 2).sum()).backward()
        if e == "inf":
            w.grad.fill_(math.inf)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        out.append(scaler.get_scale())
    return out


def _variant(events, init, growth, backoff, interval, *, reset_on_inf=True, consecutive=True,
             offset=0) -> float:
    """A mistaken version of the rule, to say which mistake an answer comes from."""
    scale, tracker, clean = init, 0, 0
    for e in events:
        if e == "inf":
            scale *= backoff
            tracker = 0 if reset_on_inf else tracker
            continue
        clean += 1
        tracker += 1
        count = tracker if consecutive else clean
        if count == interval + offset or (not consecutive and clean % interval == 0):
            scale *= growth
            tracker = 0
    return scale


def _check_3_2(answer) -> str | None:
    got = as_number(answer)
    want = torch_scales(EVENTS_3_2, **SETTINGS_3_2)[-1]
    if got == want:
        return None
    s = SETTINGS_3_2
    args = (EVENTS_3_2, s["init_scale"], s["growth_factor"], s["backoff_factor"],
            s["growth_interval"])
    mistakes = [
        (_variant(*args, reset_on_inf=False), "An inf resets the growth tracker to 0: the "
                                              "clean iterations must come *in a row*."),
        (_variant(*args, consecutive=False), "Growth needs growth_interval clean updates *in "
                                             "a row* since the last growth or inf, not every "
                                             "growth_interval-th clean one overall."),
        (_variant(*args, offset=1), "Off by one: the scale grows on the growth_interval-th "
                                    "clean update itself (the tracker counts 1, 2, 3, then "
                                    "grows and restarts at 0)."),
        (s["init_scale"], "The scale does change along the way: follow it update by update."),
    ]
    why = next((text for value, text in mistakes if value == got), None)
    return why or ("Not the scale torch ends with. Walk through the events one at a time, "
                   "keeping both the scale and the growth tracker.")


# --- 3.3 the clipping bug ---------------------------------------------------------------------

MAX_NORM = 1.0


def _problem(seed: int = 0):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = torch.nn.Linear(6, 2)
        x = torch.randn(16, 6) * 4  # large inputs: gradient norms well above MAX_NORM
        y = torch.randn(16, 2)
    return model, torch.optim.SGD(model.parameters(), lr=0.05), x, y


def _reference_step(model, optimizer, scaler, x, y, order: str) -> None:
    loss = torch.nn.functional.mse_loss(model(x), y)
    scaler.scale(loss).backward()
    if order == "right":
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    elif order == "buggy":
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        scaler.unscale_(optimizer)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad()


def _trials_3_3(seed: int, steps: int = 3) -> list[tuple]:
    """The calls `steps` steps make: the same model, optimizer and scaler, stepped in turn."""
    model, optimizer, x, y = _problem(seed)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    return [(model, optimizer, scaler, x, y)] * steps


def _run(step, seed: int = 0):
    trials = _trials_3_3(seed)
    for args in trials:
        step(*args)
    return [p.detach().clone() for p in trials[0][0].parameters()]


def _check_3_3(fn, seed: int = 0) -> str | None:
    got = call(_run, fn, seed, what="train_step(model, optimizer, scaler, x, y)")
    if same_tensors(got, _run(lambda *a: _reference_step(*a, order="right"), seed)):
        return None
    if same_tensors(got, _run(lambda *a: _reference_step(*a, order="buggy"), seed)):
        return ("Still the bug: clip_grad_norm_ runs on the *scaled* gradients, whose norm is "
                "about `scale` times too large, so clipping shrinks them far too much (and "
                "max_norm means nothing). Unscale first, then clip.")
    if same_tensors(got, _run(lambda *a: _reference_step(*a, order="none"), seed)):
        return ("The bug is gone, but so is the clipping: keep clip_grad_norm_(model."
                f"parameters(), {MAX_NORM}), just in the right place.")
    return ("After 3 steps your model's weights differ from a correct loop's. Keep the same "
            "calls as the buggy loop (same loss, same max_norm), only in the right order.")


def _hidden_3_3(fn) -> str | None:
    """The same 3 steps from weights and data drawn for this grading run."""
    return _check_3_3(fn, grade_seed())


# --- 3.4 why bf16 needs no scaler -------------------------------------------------------------

CHOICES_3_4 = {
    "a": "bf16 has more mantissa bits than fp16, so small gradients keep their precision.",
    "b": "bf16 has fp32's exponent range, so gradients that fp16 flushes to 0 stay nonzero.",
    "c": "Under autocast, backward always runs in fp32, whatever the forward used.",
    "d": "`torch.amp.GradScaler` does not support bf16 gradients.",
}
WHY_NOT_3_4 = {
    "a": "Look again at the fields: bf16 has 7 mantissa bits, fp16 has 10. bf16 is *less* "
         "precise; what does it have more of?",
    "c": "Under autocast the backward of a matmul runs in the same low precision as its "
         "forward (lesson 4's trace shows it); the gradients really are bf16 or fp16.",
    "d": "GradScaler works with bf16 too (it unscales bf16 gradients); it is just not needed. "
         "Think about which values a scaler rescues.",
}


_check_3_4 = multiple_choice(CHOICES_3_4, "b", WHY_NOT_3_4)


# --- 3.5 unscale and check, exactly -----------------------------------------------------------

def torch_unscale(grads: list[torch.Tensor], inv_scale: torch.Tensor) -> bool:
    """torch's own kernel: multiply in place, and say whether any value was inf or NaN."""
    found = torch.zeros(1)
    torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inv_scale.reshape(1))
    return bool(found.item())


def _inv(scale: float) -> torch.Tensor:
    return torch.tensor(scale, dtype=torch.float64).reciprocal().float()  # as GradScaler does


def _grads(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(5, 7, generator=g) * 1e3, torch.randn(11, generator=g) * 1e-3]


PUBLIC_3_5 = [(_grads(0), 2.0**16), (_grads(1) + [torch.tensor([1.0, math.inf])], 2.0**16),
              (_grads(2) + [torch.tensor([math.nan, 2.0])], 1024.0)]


def _hidden_3_5(seed: int | None = None) -> list[tuple[list[torch.Tensor], float]]:
    seed = grade_seed() if seed is None else seed  # drawn afresh for each grading run
    big = torch.full((8,), 3e38)  # finite, but their sum is inf
    return [([big, torch.ones(3)], 1.0), ([torch.tensor([-math.inf])], 8.0),
            ([g.bfloat16() for g in _grads(seed)], 3.0), ([], 2.0**16),
            (_grads(seed + 1), 3.0), ([torch.zeros(0), torch.tensor([5.0])], 2.0**24)]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


def _unscale_matches(fn, cases) -> str | None:
    for grads, scale in cases:
        mine, ref = [g.clone() for g in grads], [g.clone() for g in grads]
        shown = (f"unscale_and_check(<{len(grads)} grads: "
                 + ", ".join(f"{g.dtype} {tuple(g.shape)}" for g in grads)
                 + f">, inv_scale of {scale:g})")
        with _poisoned(UNSCALE, fn):
            got = call(fn, mine, _inv(scale), what=shown)
        want = torch_unscale(ref, _inv(scale))  # torch's own kernel, after the call
        if not isinstance(got, bool | torch.Tensor) or (
                isinstance(got, torch.Tensor) and got.numel() != 1):
            return f"{shown} returned {got!r:.60}; return True or False."
        if any(a.numel() and a.isnan().all() and not b.isnan().all() for a, b in zip(mine, ref)
               ) or (isinstance(got, torch.Tensor) and got.isnan().all()):  # the poison's NaNs
            return _calls_the_kernel(shown, UNSCALE)
        if bool(got) != want:
            if want:
                return f"{shown} returned False, but a gradient holds an inf or NaN."
            return (f"{shown} returned True, but every gradient is finite. A check that adds "
                    "values up (sum, norm) overflows on large finite numbers: test each value "
                    "(torch.isfinite).")
        if not all(torch.equal(_bits(a), _bits(b)) for a, b in zip(mine, ref)):
            return (f"{shown}: the gradients were not multiplied in place to exactly what torch "
                    "gives. Multiply each one by inv_scale in place (g.mul_(inv_scale)), "
                    "infs and NaNs included. (Compared bit for bit.)")
    return None


def _trials_3_5(seed: int) -> list:
    """The calls the hidden check makes, in its order, each on (grads, inv_scale)."""
    return [functools.partial(_poisoned_call, UNSCALE, (grads, _inv(scale)))
            for grads, scale in _hidden_3_5(seed)]


def _check_3_5(fn) -> str | None:
    return _unscale_matches(fn, PUBLIC_3_5)


def _hidden_check_3_5(fn) -> str | None:
    return _unscale_matches(fn, _hidden_3_5())


# --- the exercises ----------------------------------------------------------------------------

BUGGY_3_3 = f'''def train_step(model, optimizer, scaler, x, y):
    loss = torch.nn.functional.mse_loss(model(x), y)
    scaler.scale(loss).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), {MAX_NORM})
    scaler.unscale_(optimizer)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad()'''

EXERCISES = {e.id: e for e in [
    Exercise(
        id="3.1", title="The update rule",
        prompt="Write the dynamic loss scaling rule as a function, exactly as torch's own "
               "kernel (`torch._amp_update_scale_`, which `GradScaler.update()` calls) computes "
               "it, without calling that kernel (an answer that calls it fails). "
               "`update_scale(scale, tracker, found_inf, growth_factor, backoff_factor, "
               "growth_interval)` is given the scale (a float that fp32 holds exactly, as a "
               "scaler's scale always is), the growth tracker (an int: "
               "clean iterations in a row so far) and whether this iteration's gradients held "
               "an inf or NaN (a bool). It returns the pair `(new_scale, new_tracker)`: a "
               "float (what `scaler.get_scale()` would then give) and an int. The rule:\n\n"
               "- **inf/NaN found**: the new scale is `scale × backoff_factor`, and the "
               "tracker restarts at 0. Nothing else is tested: a tiny scale may back off to "
               "0.\n"
               "- **clean, and `tracker + 1 == growth_interval`** (exactly equal: a tracker "
               "already past the interval just goes on counting): the new scale is `scale × "
               "growth_factor`, unless that is inf, in which case the scale stays as it was; "
               "either way the tracker restarts at 0.\n"
               "- **clean otherwise**: the scale stays, and the tracker becomes `tracker + "
               "1`.\n\n"
               "torch keeps the scale as an **fp32** number: each product is computed in "
               "float64 and rounded once to fp32, and \"inf\" means inf in fp32. The check "
               "compares with torch's kernel, exactly; the grader adds factors that are not "
               "powers of two and scales near fp32's limit.",
        comment="one update of the scale and the growth tracker, as torch does it",
        body="def update_scale(scale, tracker, found_inf, growth_factor, "
             "backoff_factor, growth_interval):\n"
             "    return ...  # (new_scale, new_tracker)",
        key="def fp32(x):  # torch keeps the scale in fp32: round the float64 product once\n"
            "    return torch.tensor(x, dtype=torch.float64).float().item()\n"
            "\n"
            "def update_scale(scale, tracker, found_inf, growth_factor, backoff_factor, "
            "growth_interval):\n"
            "    if found_inf:\n"
            "        return fp32(scale * backoff_factor), 0\n"
            "    if tracker + 1 == growth_interval:\n"
            "        grown = fp32(scale * growth_factor)\n"
            "        return (grown if math.isfinite(grown) else scale), 0\n"
            "    return scale, tracker + 1",
        arg='update_scale',
        check=_check_3_1, hidden=_hidden_check_3_1, trials=_trials_3_1,
        hints=(
            "Two cases: an inf/NaN was found (back off, start counting again), or not (count "
            "one more clean update; on the growth_interval-th in a row, grow and restart).",
            "The scale is an fp32 tensor in torch: the product is computed in float64 and "
            "rounded once, torch.tensor(x, dtype=torch.float64).float().item(). A grown scale "
            "that would be inf is not taken (math.isfinite).",
            "found_inf: (fp32(scale*backoff), 0); else if tracker + 1 == growth_interval: "
            "(fp32(scale*growth) if finite else scale, 0); else (scale, tracker + 1).",
        )),
    Exercise(
        id="3.2", title="Predict the scale",
        prompt="A GradScaler made with `GradScaler(" + ", ".join(
                   f"{k}={v!r}" for k, v in SETTINGS_3_2.items()) + ")` sees these "
               f"iterations, in order: `{' '.join(EVENTS_3_2)}` (\"inf\": a gradient "
               "overflowed). What is the scale after the last update? Work it out by hand "
               "first.",
        comment="the scale after the last update",
        body="answer = ...  # a number",
        key="# 1024 -ok ok ok-> 2048 -ok-> (tracker 1) -inf-> 1024 -ok ok-> (tracker 2)\n"
            "# -inf-> 512 -inf-> 256 -ok ok ok-> 512 -ok-> (tracker 1)\n"
            "answer = 512",
        check=_check_3_2,
        hints=(
            "Keep two numbers as you go: the scale and the growth tracker (clean updates in a "
            "row). An inf halves the scale and resets the tracker.",
            "With growth_interval 3 the scale doubles on every 3rd clean update in a row, and "
            "the tracker restarts at 0. You can check your walk with ex.torch_scales(events, "
            "**ex.SETTINGS_3_2) after answering.",
            "Start: 1024, tracker 0. The first three ok's double it to 2048; the fourth ok makes "
            "the tracker 1; the inf halves to 1024 and resets ... keep going.",
        )),
    Exercise(
        id="3.3", title="Find the bug in a clipped fp16 step",
        prompt="Gradient clipping and loss scaling are easy to combine wrongly. This training "
               "step clips the gradient norm, but something is wrong:\n\n"
               f"{python_block(BUGGY_3_3)}\n\n"
               "Write the fixed `train_step(model, optimizer, scaler, x, y)`: the same calls, "
               "in the right order. It need return nothing: it is checked by running 3 steps "
               "against a correct loop, weights compared bit for bit (the grader also starts "
               "from weights and data drawn for each grading run).",
        comment="the fixed train_step (same calls, right order)",
        body="def train_step(model, optimizer, scaler, x, y):\n"
             "    return ...  # fix the loop above",
        key="def train_step(model, optimizer, scaler, x, y):\n"
            "    loss = torch.nn.functional.mse_loss(model(x), y)\n"
            "    scaler.scale(loss).backward()\n"
            "    scaler.unscale_(optimizer)  # real gradients first ...\n"
            f"    torch.nn.utils.clip_grad_norm_(model.parameters(), {MAX_NORM})  # ... then clip\n"
            "    scaler.step(optimizer)  # knows they are unscaled: does not unscale again\n"
            "    scaler.update()\n"
            "    optimizer.zero_grad()",
        arg='train_step',
        check=_check_3_3, hidden=_hidden_3_3, trials=_trials_3_3,
        hints=(
            "After scaler.scale(loss).backward(), every gradient is multiplied by the scale "
            "(65536 by default). What does a gradient norm mean then?",
            "clip_grad_norm_ must see the real gradients. scaler.unscale_(optimizer) divides "
            "them by the scale in place, and step() then knows not to do it again.",
            "Swap two lines: unscale_ before clip_grad_norm_.",
        )),
    Exercise(
        id="3.4", title="Why bf16 needs no scaler",
        prompt="bf16 autocast is used without a GradScaler. Why does it need none? Pick the "
               f"reason:\n\n{choice_list(CHOICES_3_4)}\n\n"
               "The facts are lesson 1's: `from mplab.numerics import explain`, then "
               "`explain.format_table([\"fp16\", \"bf16\", \"fp32\"])` prints each format's "
               "exponent and mantissa bits, largest value and smallest normal and subnormal "
               "values. Answer with its letter.",
        comment="\"a\", \"b\", \"c\" or \"d\"",
        body="answer = ...",
        key="answer = \"b\"  # 8 exponent bits, like fp32: nothing to rescue",
        check=_check_3_4,
        hints=(
            "A loss scaler rescues values that would underflow. Which property of a format "
            "decides where underflow starts: its exponent bits or its mantissa bits?",
            "explain.format_table([\"fp16\", \"bf16\", \"fp32\"]) in lesson 1 compares their "
            "smallest normal and subnormal values.",
            "bf16 and fp32 share 8 exponent bits, so bf16's smallest numbers are fp32's.",
        )),
    Exercise(
        id="3.5", title="Unscale and check, exactly", points=2,
        prompt="Write the heart of `unscale_`, the exact inf/NaN check and the in-place "
               "multiplication, which section 3's `unscale_` left to torch's kernel "
               "(`torch._amp_foreach_non_finite_check_and_unscale_`), without calling that "
               "kernel (an answer that calls it fails): "
               "`unscale_and_check(grads, inv_scale)` multiplies every "
               "gradient tensor in the list `grads` by `inv_scale` (a 0-dim fp32 tensor) in "
               "place, and returns `True` if any value was inf or NaN, else `False`. The check "
               "looks at the values as they are handed in, before the multiplication (a "
               "finite value that the multiplication makes inf does not count), and the "
               "multiplication is each tensor's own `mul_`, so the result keeps the "
               "gradient's dtype. It is compared with torch's own kernel, bit for bit; the "
               "grader adds bf16 gradients, empty lists and huge finite values.",
        comment="multiply each grad by inv_scale in place; True if any inf or NaN",
        body="def unscale_and_check(grads, inv_scale):\n"
             "    return ...  # True or False",
        key="def unscale_and_check(grads, inv_scale):\n"
            "    found = False\n"
            "    for g in grads:\n"
            "        found = found or not bool(torch.isfinite(g).all())  # per value: exact\n"
            "        g.mul_(inv_scale)\n"
            "    return found",
        arg='unscale_and_check',
        check=_check_3_5, hidden=_hidden_check_3_5, trials=_trials_3_5,
        hints=(
            "Two jobs per tensor: find out whether any of its values is inf or NaN, and "
            "multiply it by inv_scale without making a copy.",
            "torch.isfinite(g).all() tests every value; g.mul_(inv_scale) multiplies in place. "
            "Summing the values first is tempting and wrong: 3e38 + 3e38 is inf in fp32.",
            "found = any(not torch.isfinite(g).all() for g in grads), then g.mul_(inv_scale) "
            "for each g; return found.",
        )),
]}

LESSON = Lesson(3, list(EXERCISES.values()))
check, hint, solution, exercise_cells, cells, task_markdown = LESSON.functions()
