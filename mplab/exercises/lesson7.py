"""Lesson 7, will mixed precision help, and why did my run break: the exercises.

    from mplab.exercises import lesson7 as ex
    ex.check("7.1", answer); ex.hint("7.1"); ex.solution("7.1")

The references are the machine at hand (which units its CPU has, mplab.hardware), the failure
lab's real runs read by mplab.diagnose, torch's GradScaler driving a correct accumulation loop,
and torch's own bf16 casts for the rounding a learner writes.
"""

from __future__ import annotations

import functools
import math

import torch

from mplab._display import Table
from mplab.diagnosis import CAUSES, diagnose, lab
from mplab.diagnosis.origins import harmful
from mplab.exercises.answers import note, watching
from mplab.exercises.framework import (
    Exercise,
    Incorrect,
    Lesson,
    call,
    choice_list,
    grade_seed,
    in_order,
    multiple_choice,
    python_block,
    same_tensors,
)
from mplab.exercises.speedup import HINTS_7_7, PROMPT_7_7, check_7_7
from mplab.hardware import UNITS, has_units

__all__ = ["check", "hint", "solution", "exercise_cells", "cells", "task_markdown",
           "EXERCISES", "LESSON", "mystery_records", "origin_records", "origin_runs"]

# --- 7.1 why bf16 loses at the lesson size ----------------------------------------------------

CHOICES_7_1 = {
    "a": "This CPU has no bf16 arithmetic units, so every bf16 matmul is converted to fp32 and "
         "back.",
    "b": "The matrices are too small: converting to bf16 and back costs more than the faster "
         "matmul saves.",
    "c": "bf16 needs a GradScaler, and scaling costs a pass over every gradient.",
    "d": "bf16 has fewer mantissa bits, so the optimizer needs more steps.",
}


_LOOK_AT_THE_MACHINE = (
    "Look at this machine first: hardware.cpu_features() says which low-precision flags the "
    "CPU reports, and hardware.UNITS[\"bf16\"] which of them are bf16 units. With them, bf16 "
    "gets faster as the matrices grow (the larger models' rows); without them, no size helps.")
# the answer on the machine at hand: no units (a), else too small (b)
_check_7_1 = multiple_choice(CHOICES_7_1, lambda: "b" if has_units("bf16") else "a", {
    "a": _LOOK_AT_THE_MACHINE, "b": _LOOK_AT_THE_MACHINE,
    "c": "bf16 has fp32's exponent range: it needs no GradScaler, and the lesson's bf16 rows "
         "use none (lesson 3).",
    "d": "The benchmark times steps, not steps to a given loss: fewer mantissa bits do not "
         "change how long one step takes."})


# --- 7.4 read the records ---------------------------------------------------------------------

MYSTERY = {"A": "extra_update", "B": "clip_before_unscale", "C": "no_scaler"}
#: Settings a mystery run differs by from the lab's run of the same name: B's scale is not the
#: 65536 of the lesson's clipping demo, so its norm is read against its own scale, not matched.
MYSTERY_SETTINGS = {"B": {"init_scale": 2.0**12}}
#: Iterations each mystery run trains: every telling figure shows from the first few, and an
#: fp16 step on a CPU without fp16 units costs tens of fp32 ones.
MYSTERY_STEPS = 12

_TORCH_SCALER = torch.amp.GradScaler("cpu")  # torch's defaults, to say them as they are
#: The loop behind each mystery run, as the lab's code has it (tests compare the two), with
#: what a reader needs to weigh the figures and nothing of the cause.
MYSTERY_LOOPS = {
    "A": f"two AdamW optimizers, one for the classifier head at lr {10 * lab.LR:g} and one for "
         f"the rest of the model at lr {lab.LR:g}, both stepped through one "
         "`GradScaler(growth_interval=10)` (its scale doubles after 10 updates in a row without "
         f"an inf, instead of torch's {_TORCH_SCALER.get_growth_interval()})",
    "B": f"one AdamW at lr {lab.LR:g}, a `GradScaler(init_scale="
         f"2**{math.log2(MYSTERY_SETTINGS['B']['init_scale']):.0f})` (its scale starts at "
         f"{MYSTERY_SETTINGS['B']['init_scale']:.0f} instead of torch's "
         f"{_TORCH_SCALER.get_scale():.0f}), and `torch.nn.utils.clip_grad_norm_("
         "model.parameters(), max_norm=1.0)` in every iteration",
    "C": f"one AdamW at lr {lab.LR:g}, the loss multiplied by 2**-16 before `backward()` (the "
         "lab's stand-in for a large model's small gradients)",
}


@functools.cache
def _mystery_runs() -> dict:
    return {key: lab.run(name, steps=MYSTERY_STEPS, **MYSTERY_SETTINGS.get(key, {}))
            for key, name in MYSTERY.items()}


def mystery_records() -> Table:
    """Three broken runs of the failure lab, by letter, with the figures that tell them apart
    (nothing said of their cause)."""
    rows = []
    for key, r in _mystery_runs().items():
        calls = r.scaler_calls[0] if r.scaler_calls else {}
        zeros = [z for z in r.zero_grad_fractions if z is not None]
        rows.append({
            "run": key,
            "scaler": "yes" if r.scales else "none",
            "scale at the end": r.scales[-1] if r.scales else "-",
            "skipped steps": len(r.skipped_steps),
            # the norm clip_grad_norm_ returned: of the gradients as they were when clipped
            "median gradient norm before clipping": (
                sorted(r.grad_norms)[len(r.grad_norms) // 2] if r.grad_norms
                else "- (no clipping)"),
            "zero gradient entries": f"{sorted(zeros)[len(zeros) // 2]:.1%}" if zeros else "-",
            "unscale_ / step / update per iteration": (
                f"{calls['unscale_']} / {calls['step']} / {calls['update']}" if calls else "-"),
        })
    return Table(rows, title="three broken fp16 runs of the lab model")


def _check_7_4(answer) -> str | None:
    if not isinstance(answer, dict):
        raise Incorrect(f"Give a dict from run letter to cause name, like "
                        f"{{\"A\": \"no_units\"}}; got {type(answer).__name__}.")
    keys = {str(k).strip().upper(): v for k, v in answer.items()}
    if set(keys) != set(MYSTERY):
        return f"Name a cause for each of the runs {sorted(MYSTERY)} (got {sorted(keys)})."
    unknown = [v for v in keys.values() if v not in CAUSES]
    if unknown:
        return (f"{unknown[0]!r} is not a cause diagnose names; use the names of "
                "mplab.diagnosis.CAUSES (listed above).")
    wrong = [k for k in sorted(MYSTERY) if keys[k] != diagnose(_mystery_runs()[k]).cause]
    if not wrong:
        return None
    k = wrong[0]
    return (f"{len(wrong)} of 3 wrong, among them run {k}. Which column of run {k}'s row "
            "stands out against the others? Each cause leaves one figure no healthy run has.")


# --- 7.6 where the NaN began -------------------------------------------------------------------

ORIGINS = {"W": "fp16_loss", "X": "fp16_overflow", "Y": "eps_underflow", "Z": "fill_out_of_range"}
ORIGIN_STEPS = 4  # each breaks in its first steps
ORIGIN_SETTINGS = {"W": {"logit_scale": 100.0}}  # CLIP's largest: W breaks from step 1
#: The loop behind each run, as the lab has it, with nothing of the cause.
ORIGIN_LOOPS = {
    "W": "fp16 autocast with a GradScaler; the head compares the pooled output with each "
         "class's weight by cosine, times 100 (CLIP's largest logit scale), and the softmax and "
         "log of the loss are written by hand after the autocast block, on its outputs as they "
         "came out of it",
    "X": "`mplab.train` in fp16 with a GradScaler, on a copy of the lab model whose "
         "feed-forward output layer was scaled up (as a checkpoint pretrained in bf16 can be)",
    "Y": "`model.half()` and `torch.optim.Adam(model.parameters(), lr=1e-3)`, no autocast, "
         "no scaler",
    "Z": "fp16 autocast with a GradScaler; the head adds a constant to the logits of the "
         "classes a review may not take, and the loss has an entropy term",
}


@functools.cache
def origin_runs() -> dict:
    """7.6's four runs (TrainResults), by letter: `diagnose` each after the exercise."""
    return {key: lab.run(name, steps=ORIGIN_STEPS, **ORIGIN_SETTINGS.get(key, {}))
            for key, name in ORIGINS.items()}


def _number(value) -> str:
    return "-" if value is None else f"{value:.4g}" if isinstance(value, float) else str(value)


def origin_records() -> Table:
    """Four runs of the failure lab that ended in NaN, by letter: where the layers' watch saw
    the first inf/NaN (mplab.train.layers), nothing said of the cause."""
    rows = []
    for key, r in origin_runs().items():
        phase, e = harmful(r)[0]  # the first that harmed the run (not a skipped step's)
        rows.append({
            "run": key, "first seen at": f"step {e['step']}, " + {
                "forward": "a module's output", "loss": "the loss",
                "backward": "a gradient", "step": "a weight, after optimizer.step()"}[phase],
            "module (class) or weight": (f"{e['module']} ({e['kind']})" if "module" in e
                                         else e.get("parameter", "-")),
            "min / max there": (f"{_number(e['min'])} / {_number(e['max'])}"
                                if "min" in e else "-"),
            "module outputs finite": ("yes" if e.get("outputs_finite") else "no")
            if phase == "loss" else "-",
            "gradient there finite": "yes" if phase == "step" else "-",
            "loss dtype": r.numerics.get("loss_dtype") or "-",
            "optimizer states": (str(r.optimizer_state_dtype).replace("torch.", "")
                                 if r.optimizer_state_dtype else "none yet (no step taken)"),
        })
    return Table(rows, title="where four broken runs first held an inf or a NaN")


def _check_7_6(answer) -> str | None:
    if not isinstance(answer, dict):
        raise Incorrect(f"Give a dict from run letter to cause name, like "
                        f"{{\"W\": \"no_units\"}}; got {type(answer).__name__}.")
    keys = {str(k).strip().upper(): v for k, v in answer.items()}
    if set(keys) != set(ORIGINS):
        return f"Name a cause for each of the runs {sorted(ORIGINS)} (got {sorted(keys)})."
    unknown = [v for v in keys.values() if v not in ORIGINS.values()]
    if unknown:
        return (f"{unknown[0]!r} is not one of the four causes listed in the task: "
                + ", ".join(sorted(ORIGINS.values())) + ".")
    wrong = [k for k in sorted(ORIGINS) if keys[k] != diagnose(origin_runs()[k]).cause]
    if not wrong:
        return None
    k = wrong[0]
    return (f"{len(wrong)} of 4 wrong, among them run {k}. Where was run {k}'s first inf/NaN "
            "seen, and did anything finite lie near fp16's limit there before it?")


# --- 7.5 accumulation with a scaler -----------------------------------------------------------

BUGGY_7_5 = '''\
def train_step(model, optimizer, scaler, micro_batches, autocast):
    for micro in micro_batches:
        with autocast:
            loss = model(**micro).loss / len(micro_batches)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        if micro is micro_batches[-1]:
            scaler.step(optimizer)
        scaler.update()
    optimizer.zero_grad()'''


def _reference_7_5(model, optimizer, scaler, micro_batches, autocast, unscale=True) -> None:
    for micro in micro_batches:
        with autocast:
            loss = model(**micro).loss / len(micro_batches)
        scaler.scale(loss).backward()
    if unscale:
        scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad()


_SCALER_CALLS = ("unscale_", "step", "update")


def _noted(name: str, method):
    @functools.wraps(method)
    def noted(*args, **kwargs):
        note(f"scaler.{name}")  # counted for the message, and made again by the replay
        return method(*args, **kwargs)
    return noted


def _trials_7_5(seed: int = 0, steps: int = 3) -> list[tuple]:
    """The calls `steps` optimizer steps make, in turn: 2 micro-batches of 8 each, on the lab
    model (its head from `seed`), fp16 autocast on the CPU, the scaler's calls noted. The first
    step's scale overflows: the scaler must skip it (optimizer.step() would not), then 2**10."""
    model = lab.lab_model(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**40, backoff_factor=2.0**-30)
    for name in _SCALER_CALLS:
        setattr(scaler, name, _noted(name, getattr(scaler, name)))
    autocast = torch.autocast("cpu", dtype=torch.float16)
    return [(model, optimizer, scaler, [{k: v[i::2] for k, v in batch.items()} for i in range(2)],
             autocast) for batch in lab.lab_batches(steps, batch_size=16)]


def _run_7_5(step, seed: int = 0):
    """The weights after the steps of :func:`_trials_7_5`, the scaler's scale and tracker after
    each (what decides), and each step's scaler calls (notes: they only choose the message)."""
    trials, calls, states = _trials_7_5(seed), [], []
    for args in trials:
        with watching() as seen:
            step(*args)
        calls.append({name: seen.count(f"scaler.{name}") for name in _SCALER_CALLS})
        states.append({k: float(v) for k, v in args[2].state_dict().items()
                       if k in ("scale", "_growth_tracker")})
    return [p.detach().clone() for p in trials[0][0].parameters()], states, calls


@functools.lru_cache(maxsize=8)
def _reference_run_7_5(unscale: bool = True, seed: int = 0):
    return _run_7_5(functools.partial(_reference_7_5, unscale=unscale), seed)[:2]


def _check_7_5(fn, seed: int = 0) -> str | None:
    try:
        weights, states, step_calls = _run_7_5(fn, seed)
    except RuntimeError as err:
        if "unscale_() has already been called" in str(err):
            return ("torch refused: unscale_() ran twice before an update(). Each micro-batch "
                    "that does not step should only add its gradients.")
        raise Incorrect(f"train_step raised RuntimeError: {err}", status="error") from None
    except Exception as err:
        raise Incorrect(f"train_step raised {type(err).__name__}: {err}",
                        status="error") from None
    want_weights, want_states = _reference_run_7_5(seed=seed)
    if same_tensors(weights, want_weights) and states == want_states:
        return None  # the weights and the scaler's state decide; the counted calls say why
    calls = step_calls[0]
    if calls["update"] > 1 or calls["unscale_"] > 1:
        return (f"The scaler still ran unscale_ {calls['unscale_']}× and update "
                f"{calls['update']}× for one optimizer step: diagnose says "
                f"\"{CAUSES['accumulation_scaler']}\".")
    if calls["step"] != 1:
        return (f"scaler.step ran {calls['step']}× in one call: the optimizer steps once, after "
                "the last micro-batch, through scaler.step, which skips a step whose gradients "
                "overflowed (the first step's do).")
    if same_tensors(weights, _reference_run_7_5(unscale=False, seed=seed)[0]):
        return ("The scaler's calls are right, but the gradients are not unscaled before "
                "clipping (scaler.step does it too late for clip_grad_norm_): keep the clip, "
                "on the true gradients.")
    return ("After 3 steps your weights, or the scaler's scale and growth tracker, differ from "
            "a correct loop's: keep the same loss, the clip at max_norm=1.0, AdamW and "
            "zero_grad; only where the scaler's calls go changes.")


def _hidden_7_5(fn) -> str | None:
    """The same steps on the lab model with a head drawn for this grading run."""
    return _check_7_5(fn, grade_seed())


# --- 7.3 stochastic rounding ------------------------------------------------------------------

def _neighbours(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16's representable values just below and just above each fp32 value (torch casts)."""
    near = x.to(torch.bfloat16)
    toward = torch.where(near.float() > x, torch.tensor(-float("inf")),
                         torch.tensor(float("inf"))).to(torch.bfloat16)
    other = torch.nextafter(near, toward)
    low = torch.minimum(near.float(), other.float())
    high = torch.maximum(near.float(), other.float())
    exact = near.float() == x
    return torch.where(exact, x, low), torch.where(exact, x, high)


def _probe_7_3(seed: int = 7):
    g = torch.Generator().manual_seed(seed)
    x = (torch.rand(4096, generator=g) * 2 - 1) * 3.0
    return x, torch.Generator().manual_seed(0)


def _rounded_between(fn, x, gen) -> tuple[torch.Tensor | None, str | None]:
    """The learner's rounding of x, and why it is not a rounding to one of bf16's two
    neighbours of each value (None when it is)."""
    out = call(fn, x.clone(), gen, what="round_stochastic(x, generator)")
    if not isinstance(out, torch.Tensor):
        return None, f"round_stochastic must return a tensor; it returned {type(out).__name__}."
    if out.dtype != torch.bfloat16:
        return None, f"The result is {out.dtype}: return the bf16 tensor (the rounded weights)."
    if out.shape != x.shape:
        return None, f"The result's shape {tuple(out.shape)} is not the input's {tuple(x.shape)}."
    low, high = _neighbours(x)
    got = out.float()
    if not bool(((got == low) | (got == high)).all()):
        return None, ("Some results are neither of the two bf16 numbers around their input: round "
                      "only the bits bf16 drops (the low 16 of an fp32).")
    if bool((got == x.to(torch.bfloat16).float()).all()):
        return None, ("Every value went to its nearest bf16 neighbour: that is a plain cast, "
                      "x.to(torch.bfloat16). The randomness is missing.")
    return out, None


def _hidden_7_3(fn) -> str | None:
    """The same on values drawn for this grading run."""
    return _rounded_between(fn, *_probe_7_3(seed=grade_seed()))[1]


def _check_7_3(fn) -> str | None:
    x, gen = _probe_7_3()
    out, why = _rounded_between(fn, x, gen)
    if why is not None:
        return why
    exact = torch.tensor([1.0, -2.5, 0.0, 3.140625])
    kept = call(fn, exact.clone(), torch.Generator().manual_seed(1),
                what="round_stochastic(x, generator)")
    if not torch.equal(kept.float(), exact):
        return "Values bf16 holds exactly must stay as they are."
    # Unbiased: the mean of many roundings of one value is that value.
    value = torch.full((20000,), 1.0 + 2**-9)  # a quarter of the gap from 1 (gap 2**-7)
    mean = call(fn, value, torch.Generator().manual_seed(2),
                what="round_stochastic(x, generator)").float().mean().item()
    std = (0.25 * 0.75 / 20000) ** 0.5 * 2**-7
    if abs(mean - value[0].item()) > 5 * std:
        return (f"Rounded 20,000 times, 1 + 2**-9 averages {mean:.7f}, not {value[0].item():.7f}:"
                " the chance of rounding up must be the value's distance from the lower "
                "neighbour over the gap between the two.")
    again = call(fn, x.clone(), torch.Generator().manual_seed(0),
                 what="round_stochastic(x, generator)")
    if not torch.equal(again, out):
        return ("The same generator seed gave different results: draw the random numbers "
                "from the generator you are given, so a run is reproducible.")
    return None


# --- 7.2 the fix for an overflow --------------------------------------------------------------

CHOICES_7_2 = {
    "a": "A GradScaler with a lower init_scale, e.g. 2**11.",
    "b": "bf16 autocast, or that layer in fp32 inside the fp16 autocast (an fp32 island).",
    "c": "A lower learning rate.",
    "d": "Gradient clipping at max_norm=1.0.",
}

WHY_NOT_7_2 = {
    "a": "A scaler multiplies the loss *after* the forward pass. Here the forward pass itself "
         "overflows: the loss is NaN before any scaling.",
    "c": "The loss is NaN at step 1, before the learning rate has moved any weight.",
    "d": "Clipping acts on gradients; the overflow is an activation in the forward pass.",
}


_check_7_2 = multiple_choice(CHOICES_7_2, "b", WHY_NOT_7_2)


# --- the exercises ----------------------------------------------------------------------------

EXERCISES = {e.id: e for e in in_order([
    Exercise(
        id="7.1", title="What makes bf16 lose on this machine",
        prompt="On a CPU, bf16 often trains the lesson model (hidden 128, 2 layers) no "
               "faster than fp32, or slower (your table above shows what it did here). On "
               "this machine's CPU, what makes bf16 lose there? The first cell names "
               "the CPU, not its units: look them up yourself, with `hardware.cpu_features()` "
               "(the low-precision flags this CPU reports) and `hardware.UNITS` (the flags "
               "that give each precision arithmetic units), in the answer cell or a cell of "
               "your own. The check compares your answer with what this machine has.\n\n"
               + choice_list(CHOICES_7_1),
        comment="why bf16 does not pay at the lesson size here",
        body="answer = ...  # \"a\", \"b\", \"c\" or \"d\"",
        key="answer = \"b\" if hardware.has_units(\"bf16\") else \"a\"",
        check=_check_7_1,
        hints=(
            "Two things can make bf16 slow on a CPU: hardware that cannot do it, and work too "
            "small to repay the conversions. The CPU's flags tell them apart.",
            "hardware.cpu_features() lists the CPU's low-precision flags; bf16 units are "
            + " or ".join(UNITS["bf16"]) + " (hardware.UNITS[\"bf16\"]). Where the CPU has "
            "one, the bench times bf16 at the larger sizes too, and those rows show what bf16 "
            "does once the matrices are bigger.",
            "With bf16 units present, the size is to blame; without them, the hardware.",
        )),
    Exercise(
        id="7.4", title="Read three broken runs",
        prompt="The table above (printed by `ex.mystery_records()`) shows three broken fp16 "
               f"runs of the lab model, A, B and C, {MYSTERY_STEPS} iterations each, by the "
               "figures the "
               "recorder saw. Their loops (each scales the loss, calls `backward()`, then "
               "`scaler.step` and `scaler.update`, where it has a scaler):\n\n"
               + "\n".join(f"- {k}: {loop}" for k, loop in MYSTERY_LOOPS.items())
               + "\n\nThe last column counts each scaler method's calls in one iteration, as "
               "the recorder saw them: `step` once for each optimizer it stepped, and "
               "`unscale_` every unscaling, including the one `scaler.step` makes itself for "
               "an optimizer the loop did not unscale first (so a loop that never calls "
               "`unscale_` still shows one per optimizer). Name the cause of each run, without "
               "calling `mplab.diagnose`, as a dict from letter to a cause name of "
               "`mplab.diagnosis.CAUSES`:\n\n"
               + "\n".join(f"- `{name}`: {title}" for name, title in CAUSES.items()
                           if name in ("extra_update", "clip_before_unscale", "no_scaler",
                                       "scale_collapse", "accumulation_scaler", "fp16_overflow"))
               + "\n\nThe check runs diagnose on the same three runs.",
        comment="the cause of each broken run",
        body="answer = {\"A\": ..., \"B\": ..., \"C\": ...}  # cause names",
        key="answer = {\"A\": \"extra_update\", \"B\": \"clip_before_unscale\",\n"
            "          \"C\": \"no_scaler\"}",
        check=_check_7_4,
        hints=(
            "Each cause leaves one figure a healthy run does not have: a count of calls, a "
            "norm out of all proportion, or gradients that are mostly zero.",
            "A healthy fp16 run unscales and steps each optimizer once and updates the scale "
            "once per iteration, after the last optimizer stepped; it clips norms of order 1, "
            "has a scaler, and few zero gradients.",
            "Two update() per iteration; a norm near the run's own scale; no scaler and "
            "mostly zeros.",
        )),
    Exercise(
        id="7.5", title="Accumulate with a scaler",
        prompt="This step accumulates gradients over micro-batches and clips at 1.0, but it "
               "runs the scaler on every micro-batch (its author added `scaler.update()` to "
               "silence torch's \"unscale_() has already been called\" error):\n\n"
               + python_block(BUGGY_7_5)
               + "\n\nWrite a correct `train_step(model, optimizer, scaler, micro_batches, "
               "autocast)`: the same loss, clip and optimizer step, with each scaler call "
               "where it belongs; it need return nothing. The check trains the lab model 3 steps "
               "of 2 micro-batches, the first at a scale so large that the gradients overflow "
               "(the scaler must skip that step), and compares the weights, and the scaler's "
               "scale and growth tracker after each step, with a correct loop's (the grader "
               "also tries a head drawn for each grading run).",
        comment="gradient accumulation with a GradScaler, done right",
        body="def train_step(model, optimizer, scaler, micro_batches, autocast):\n"
             "    return ...  # fix the loop above",
        key="def train_step(model, optimizer, scaler, micro_batches, autocast):\n"
            "    for micro in micro_batches:\n"
            "        with autocast:\n"
            "            loss = model(**micro).loss / len(micro_batches)\n"
            "        scaler.scale(loss).backward()  # micro-batches only add gradients\n"
            "    scaler.unscale_(optimizer)  # once, before clipping the summed gradients\n"
            "    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)\n"
            "    scaler.step(optimizer)\n"
            "    scaler.update()\n"
            "    optimizer.zero_grad()",
        arg='train_step',
        check=_check_7_5,
        hidden=_hidden_7_5, trials=_trials_7_5,
        hints=(
            "One optimizer step, one unscale_, one step, one update: a micro-batch that does "
            "not step only adds its scaled gradients.",
            "Move everything after backward() out of the micro-batch loop.",
            "for micro in micro_batches: forward, scaler.scale(loss).backward(); then "
            "unscale_, clip, step, update, zero_grad once.",
        )),
    Exercise(
        id="7.6", title="Where did the NaN begin?",
        prompt="The table above (printed by `ex.origin_records()`) shows four runs of the lab "
               "model that ended in NaN, W, X, Y and Z, by where the layers' watch first saw "
               "an inf or a NaN: in a module's output (which module, and the smallest and "
               "largest value it held there), in the loss (with every module's output "
               "finite), or in a weight right after "
               "`optimizer.step()` (its gradient finite). Their loops:\n\n"
               + "\n".join(f"- {k}: {loop}" for k, loop in ORIGIN_LOOPS.items())
               + "\n\nName the cause of each, as a dict from letter to one of:\n\n"
               + "\n".join(f"- `{name}`: {CAUSES[name]}" for name in sorted(ORIGINS.values()))
               + "\n\nfp16's largest value is 65504 and its smallest 2^-24 (about 6e-8). "
               "The check runs diagnose on the same four runs.",
        comment="the cause of each run, from where its first inf/NaN was seen",
        body="answer = {\"W\": ..., \"X\": ..., \"Y\": ..., \"Z\": ...}  # cause names",
        key="answer = {\"W\": \"fp16_loss\", \"X\": \"fp16_overflow\",\n"
            "          \"Y\": \"eps_underflow\", \"Z\": \"fill_out_of_range\"}",
        check=_check_7_6,
        hints=(
            "Where the first inf/NaN appears tells the mechanism: a module's forward, the loss "
            "computed after the model, or the optimizer's own arithmetic.",
            "An output that is inf on both sides is a value that outgrew the format; inf on one "
            "side only, beside small finite values, is a constant added in; a loss that is the "
            "only non-finite value and an fp16 tensor was computed in fp16; a weight that turns "
            "inf/NaN from a finite gradient met a division in the optimizer.",
            "Adam divides by sqrt(v) + eps, and 1e-8 rounds to 0 in fp16.",
        )),
    Exercise(
        id="7.3", title="Stochastic rounding by hand",
        prompt="Write `round_stochastic(x, generator)`: round the fp32 tensor `x` to bf16 "
               "*stochastically*, to the bf16 number just above with a probability equal to "
               "x's distance from the one just below divided by the gap between them (so the "
               "mean of many roundings is x; for a negative x too, \"above\" is toward +inf), "
               "drawing random numbers only from `generator` "
               "(a `torch.Generator`). Return the bf16 tensor. A bf16 number is the top 16 "
               "bits of an fp32 one (sign, 8 exponent bits, 7 mantissa bits; lesson 1), so "
               "the fp32 bits of x below those 16 say where x lies between its two bf16 "
               "neighbours. The check's inputs are finite and within bf16's range (NaN and "
               "inf need no rounding). The check compares every "
               "result with torch's two bf16 neighbours of its input, averages 20,000 "
               "roundings, and repeats a seed; the grader also tries values drawn afresh for "
               "each grading run.",
        comment="stochastic rounding from fp32 to bf16",
        body="def round_stochastic(x, generator):\n"
             "    return ...  # a bf16 tensor",
        key="def round_stochastic(x, generator):\n"
            "    bits = x.contiguous().view(torch.int32)\n"
            "    noise = torch.randint(0, 2**16, x.shape, generator=generator,\n"
            "                          dtype=torch.int32)\n"
            "    # adding below the kept bits carries into them with the right chance\n"
            "    rounded = (bits + noise) & -65536\n"
            "    return rounded.view(torch.float32).to(torch.bfloat16)  # exact: low bits 0",
        arg='round_stochastic',
        check=_check_7_3, hidden=_hidden_7_3, trials=lambda seed: [_probe_7_3(seed)],
        hints=(
            "bf16 is the top 16 bits of an fp32: rounding drops the low 16. Stochastic "
            "rounding rounds up with the chance those dropped bits make of the gap.",
            "View the fp32 tensor as int32 (x.view(torch.int32)), add a random integer in "
            "[0, 2**16) from torch.randint(..., generator=generator), clear the low 16 bits.",
            "(bits + noise) & -65536, viewed back as float32, then .to(torch.bfloat16).",
        )),
    Exercise(
        id="7.2", title="The fix for an activation overflow",
        prompt="A model pretrained in bf16 gives a NaN loss at the first fp16 step: a "
               "feed-forward output reaches 100,000 (the T5-like run above). Which fix "
               "works?\n\n" + choice_list(CHOICES_7_2),
        comment="the fix for an fp16 activation overflow",
        body="answer = ...  # \"a\", \"b\", \"c\" or \"d\"",
        key="answer = \"b\"",
        check=_check_7_2,
        hints=(
            "Where does the overflow happen: in the forward pass or the backward pass?",
            "A GradScaler and clipping act on gradients; the learning rate on updates. The "
            "value here is an activation.",
            "Give that activation a format whose range holds 100,000.",
        )),
    Exercise(
        id="7.7", title="Where did the speed-up go?", prompt=PROMPT_7_7,
        comment="the bound, the step's speed-up, and the step without its worst op",
        body="answer = {\"bound\": ..., \"step\": ..., \"without\": ...}",
        key="p, g = 344.8 / 405.4, 344.8 / 159.7  # the matmuls' (mm, addmm) share, speed-up\n"
            "answer = {\"bound\": 1 / ((1 - p) + p / g), \"step\": 405.4 / 266.4,\n"
            "          \"without\": 405.4 / (266.4 - 68.5 + 12.4)}  # flash backward at fp32's",
        check=check_7_7, hints=HINTS_7_7),
])}

LESSON = Lesson(7, list(EXERCISES.values()))
check, hint, solution, exercise_cells, cells, task_markdown = LESSON.functions()
