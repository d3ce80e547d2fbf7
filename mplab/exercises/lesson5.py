"""Lesson 5, from PyTorch to Accelerator: the exercises.

    from mplab.exercises import lesson5 as ex
    ex.check("5.1", train_loop); ex.hint("5.1"); ex.solution("5.1")

The references are the real Accelerate: a learner's loop runs with a real `Accelerator` on the
lesson model and is compared, weights bit for bit, with the course's Accelerate loop, in bf16
and as fp16 on a GPU runs (where a `loss.backward()` or an unprepared optimizer or dataloader
changes the weights; what the loop handed Accelerate only explains a failure); why fp16 was
no faster is answered by `mplab.amp.audit` of a real fp16 Accelerator on the CPU; the audit to
read is built and audited here, the way the notebook shows it.
"""

from __future__ import annotations

import functools
import inspect
import textwrap

import torch

from mplab import fixtures
from mplab.amp.audit import Audit, audit
from mplab.exercises.answers import note, watching
from mplab.exercises.framework import (
    Exercise,
    Incorrect,
    Lesson,
    call,
    choice_list,
    grade_seed,
    multiple_choice,
    python_block,
)
from mplab.fixtures import lesson_batch
from mplab.hardware import has_units
from mplab.models import lesson_model
from mplab.train.accelerate_path import fresh_accelerate

__all__ = ["check", "hint", "solution", "exercise_cells", "cells", "task_markdown",
           "EXERCISES", "LESSON", "colleague_audit"]

# --- 5.1 convert a loop to Accelerate ---------------------------------------------------------

TORCH_LOOP = '''def train_loop(model, optimizer, dataloader):
    scaler = torch.amp.GradScaler("cuda")
    for batch in dataloader:
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(**batch).loss
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()'''

_REFERENCE_LOOP = '''def train_loop(accelerator, model, optimizer, dataloader):
    model, optimizer, dataloader = accelerator.prepare(model, optimizer, dataloader)
    for batch in dataloader:
        loss = model(**batch).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()'''


def _reference_loop(accelerator, model, optimizer, dataloader, *, zero_grad=True):
    model, optimizer, dataloader = accelerator.prepare(model, optimizer, dataloader)
    for batch in dataloader:
        loss = model(**batch).loss
        accelerator.backward(loss)
        optimizer.step()
        if zero_grad:
            optimizer.zero_grad()


@functools.cache
def _reviews(n: int) -> tuple[dict, ...]:
    """The first n lesson reviews, one dict per review (what a DataLoader collates)."""
    batch = lesson_batch(n)
    return tuple({k: v[i] for k, v in batch.items()} for i in range(n))


# a few seeds' worth: a grader that grades a class draws the hidden run's weights per notebook
@functools.lru_cache(maxsize=4)
def _initial_weights(seed: int) -> tuple[torch.Tensor, ...]:
    return tuple(p.detach().clone() for p in lesson_model(seed=seed).parameters())


class LoopRun:
    """One run of a training loop `fn(accelerator, model, optimizer, dataloader)` with a real
    Accelerator on the CPU, the lesson model (AdamW) and `batches` batches of `batch_size`
    lesson reviews. `as_gpu`: fp16 as on a GPU (a GradScaler handed to the Accelerator, which
    builds none on a CPU), gradient_accumulation_steps=2 and batches shuffled by a seeded
    sampler: there an unprepared optimizer never unscales, loss.backward() neither scales nor
    divides the loss and an unprepared dataloader deals another order, each changing the
    weights. Only the weights decide (a grader's replay writes them back); what the loop
    handed Accelerate is noted on the way (mplab.exercises.note) to choose the message."""

    def __init__(self, fn, mixed_precision: str = "bf16", batches: int = 3,
                 batch_size: int = 8, seed: int = 0, as_gpu: bool = False):
        from accelerate import Accelerator, DataLoaderConfiguration
        from torch.utils.data import DataLoader

        with fresh_accelerate(), watching() as seen:
            accelerator = Accelerator(
                mixed_precision=mixed_precision, cpu=True, gradient_accumulation_steps=1 + as_gpu,
                dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True,
                                                          data_seed=seed))
            if as_gpu:
                scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
                scaler.scale(torch.ones(()))  # its scale made: a step after loss.backward()
                accelerator.native_amp, accelerator.scaler = True, scaler  # unscales, no error
            model = lesson_model(seed=seed)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
            dataloader = DataLoader(  # unprepared, its own generator deals another order
                list(_reviews(batches * batch_size)), batch_size=batch_size, shuffle=as_gpu,
                generator=torch.Generator().manual_seed(seed + 1))
            names = {id(model): "model", id(optimizer): "optimizer", id(dataloader): "dataloader"}
            prepare, backward = accelerator.prepare, accelerator.backward

            def watched_prepare(*args, **kwargs):
                for a in args:
                    note("prepare " + names.get(id(a), type(a).__name__))
                return prepare(*args, **kwargs)

            def watched_backward(loss, **kwargs):
                note("backward")
                return backward(loss, **kwargs)

            accelerator.prepare, accelerator.backward = watched_prepare, watched_backward
            fn(accelerator, model, optimizer, dataloader)
        # "model", "optimizer", "dataloader", in call order
        self.prepared = [e.removeprefix("prepare ") for e in seen if e.startswith("prepare ")]
        self.backward_calls = seen.count("backward")
        self.weights = [p.detach().clone() for p in model.parameters()]
        self.initial = _initial_weights(seed)

    def same_weights(self, other: LoopRun) -> bool:
        return all(torch.equal(a, b) for a, b in zip(self.weights, other.weights))

    @property
    def trained(self) -> bool:
        return not all(torch.equal(a, b) for a, b in zip(self.weights, self.initial))


@functools.lru_cache(maxsize=8)
def _reference_run(mixed_precision: str = "bf16", batches: int = 3, batch_size: int = 8,
                   seed: int = 0, as_gpu: bool = False, zero_grad: bool = True) -> LoopRun:
    return LoopRun(functools.partial(_reference_loop, zero_grad=zero_grad), mixed_precision,
                   batches, batch_size, seed, as_gpu)


def _run(fn, **settings) -> LoopRun:
    """Run the learner's loop; an exception in it ends the check as an "error"."""
    return call(functools.partial(LoopRun, **settings), fn,
                what="train_loop(accelerator, model, optimizer, dataloader)")


def _loop_feedback(fn, **settings) -> str | None:
    """Why `fn` does not train as the course's Accelerate loop does (run with these LoopRun
    settings), naming the concept missed; None when it does. The weights decide; the notes
    (what the loop handed Accelerate, which its code could forge) only choose the message."""
    run, reference = _run(fn, **settings), _reference_run(**settings)
    if run.same_weights(reference):
        return None
    missing = [name for name in ("model", "optimizer", "dataloader") if name not in run.prepared]
    if not run.prepared:
        return ("Nothing was handed to the accelerator train_loop is given: until the model, "
                "optimizer and dataloader go through it, it cannot autocast the forward pass, "
                "scale the loss, step through its GradScaler or shard the batches.")
    if "model" in missing:
        return ("The model was not prepared, so its forward pass ran in fp32: Accelerate puts "
                "the autocast for mixed_precision inside the prepared model's forward.")
    if "optimizer" in missing:
        return ("The optimizer was not prepared: the prepared optimizer's step() is where "
                "Accelerate's GradScaler unscales the gradients, skips a step with inf/NaN and "
                "updates the scale (fp16), and where accumulation waits for the last "
                "micro-batch.")
    if "dataloader" in missing:
        return ("The dataloader was not prepared: under accelerate launch the prepared one gives "
                "each process its own share of every epoch (shuffled in its seeded order), and "
                "puts the batches on the device.")
    if run.backward_calls == 0 and run.trained:
        return ("The gradients came from loss.backward(), behind Accelerate's back: the "
                "accelerator's backward is where the loss is scaled for fp16 and divided for "
                "gradient accumulation, so these weights are not the course loop's (with fp16 "
                "on a GPU it would train on unscaled, underflowing gradients).")
    if not run.trained:
        return ("The weights never changed: the loop computes the loss but the optimizer never "
                "steps (or it never loops over the batches).")
    if run.same_weights(_reference_run(**settings, zero_grad=False)):
        return ("The gradients are never cleared, so each step adds to the last one's: "
                "clear them after every optimizer step.")
    if run.backward_calls != reference.backward_calls:
        return (f"backward ran {run.backward_calls} times for {reference.backward_calls} "
                "batches: each batch's loss needs exactly one backward pass, through the "
                "accelerator.")
    return ("The weights differ from the course's Accelerate loop's. Prepare everything once "
            "before the loop; then, per batch: the loss from the prepared model, the "
            "accelerator's backward, the optimizer's step, zero_grad.")


#: The public check's second run: fp16 as on a GPU (see LoopRun), 3 shuffled batches of 4.
AS_GPU = {"mixed_precision": "fp16", "batches": 3, "batch_size": 4, "as_gpu": True}
_AS_GPU_SAID = "With fp16 loss scaling, gradient_accumulation_steps=2 and shuffled batches"


def _runs_5_1(seed: int | None = None) -> list[tuple[str, dict]]:
    """(what a failure starts with, LoopRun settings) for each run, in the order they run: the
    public two, or (given the grading seed) the hidden one, on weights and batches drawn from it
    (each run's record holds the model's weights: three fit in a record)."""
    if seed is None:
        return [("", {}), (_AS_GPU_SAID + ": ", AS_GPU)]
    return [(_AS_GPU_SAID + ", other weights and 4 batches of 4: ",
             {**AS_GPU, "batches": 4, "seed": 1 + seed})]


def _check_5_1(fn, seed: int | None = None) -> str | None:
    for said, settings in _runs_5_1(seed):
        why = _loop_feedback(fn, **settings)
        if why is not None:
            return said + why
    return None


def _trials_5_1(seed: int) -> list:
    """The hidden run, given the learner's loop (the kernel runs it for the grader)."""
    return [functools.partial(LoopRun, **settings) for _, settings in _runs_5_1(seed)]


def _hidden_5_1(fn) -> str | None:
    """The same loop as fp16 on a GPU, on other weights and 4 batches of 4."""
    return _check_5_1(fn, grade_seed())


# --- 5.2 why was fp16 no faster? ---------------------------------------------------------------

CHOICES_5_2 = {
    "a": "This CPU has no fp16 arithmetic units, so the fp16 matmuls ran slowly.",
    "b": "Accelerate ignores fp16 on a CPU without a word: it built no autocast and no "
         "GradScaler, so the run computed in fp32 throughout.",
    "c": "The GradScaler skipped most of the steps while it calibrated its scale.",
    "d": "The model is too small: casting to and from fp16 costs as much as the faster matmuls "
         "save.",
}


@functools.cache
def fp16_on_cpu_audit() -> Audit:
    """The audit of `Accelerator(mixed_precision="fp16")` on this CPU: the lesson model and
    AdamW prepared, one step on 8 lesson reviews watched."""
    from accelerate import Accelerator

    with fresh_accelerate():
        accelerator = Accelerator(mixed_precision="fp16", cpu=True)
        model = lesson_model()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model, optimizer = accelerator.prepare(model, optimizer)
        return audit(model, optimizer, accelerator=accelerator, batch=lesson_batch(8))


def right_5_2() -> str:
    """The reason, read off the audit: fp16 ignored (fp32 matmuls, "b"); else, matmuls really in
    fp16, slow without units ("a") or a model too small to gain ("d")."""
    found = fp16_on_cpu_audit()
    if found.compute_dtype != torch.float16:
        return "b"
    return "a" if not has_units("fp16") else "d"


def _why_not_5_2(letter: str) -> str:
    found = fp16_on_cpu_audit()
    ran = str(found.compute_dtype).removeprefix("torch.")
    return {
        "a": f"That is why fp16 is slow in lesson 4's torch run, where the matmuls really ran "
             f"in fp16. Here the audit observed the matmuls in {ran}: did any fp16 arithmetic "
             "happen at all?",
        "b": "Accelerate did autocast here: the audit observed fp16 matmuls. What did they cost "
             "on this CPU?",
        "c": "Look at the audit's GradScaler row (and result.scales, result.skipped_steps): was "
             "there a scaler to skip anything?",
        "d": f"The same model on the same CPU did compute in bf16 (that run's audit says mixed "
             f"precision); size decides how much low precision gains, not whether it happens. "
             f"The fp16 run's audit observed its matmuls in {ran}: why?",
    }[letter]


_check_5_2 = multiple_choice(CHOICES_5_2, right_5_2, _why_not_5_2)


# --- 5.3 read an audit ------------------------------------------------------------------------

def colleague_step():
    """A colleague's Accelerate step "in mixed precision, at half the memory": one step on 8
    lesson reviews; returns (accelerator, model, optimizer, batch) for an audit."""
    from accelerate import Accelerator

    accelerator = Accelerator(mixed_precision="bf16", cpu=True)
    model = lesson_model().to(torch.bfloat16)  # "bf16 weights: half the memory"
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    batch = fixtures.lesson_batch(8)  # as the lesson's cells call it
    loss = model(**batch).loss
    accelerator.backward(loss)
    optimizer.step()
    return accelerator, model, optimizer, batch


#: The colleague's code as the task shows it: colleague_step's body, without its import and
#: its return.
COLLEAGUE_CODE = textwrap.dedent("\n".join(
    line for line in inspect.getsource(colleague_step).splitlines()[3:]
    if line.strip() and not line.strip().startswith(("from ", "return "))))


@functools.cache
def colleague_audit() -> Audit:
    """The colleague's step audited (`audit(model, optimizer, accelerator=accelerator,
    batch=batch)`), once: the notebook shows it and 5.3 is checked against it."""
    with fresh_accelerate():
        accelerator, model, optimizer, batch = colleague_step()
        return audit(model, optimizer, accelerator=accelerator, batch=batch)


FALLBACKS_5_3 = {  # letter: (the fallback in words, the audit's code for it)
    "a": ("fp16 was asked for, and Accelerate ignored it on a CPU", "fp16_ignored"),
    "b": ("autocast is off: torch does not support the dtype on this device", "autocast_off"),
    "c": ("the weights are in low precision: there are no fp32 master weights",
          "low_precision_weights"),
    "d": ("the optimizer's states are in low precision", "low_precision_states"),
    "e": ("a GradScaler is used with bf16", "scaler_with_bf16"),
}


def named_fallbacks(report: Audit) -> set[str]:
    """The letters of FALLBACKS_5_3 that an audit names."""
    return {letter for letter, (_, code) in FALLBACKS_5_3.items() if report.has(code)}


def _letters(value) -> set[str]:
    if isinstance(value, str):
        items = value.replace(",", " ").split()
    elif isinstance(value, list | tuple | set | frozenset):
        items = list(value)
    else:
        raise Incorrect(f"\"fallbacks\" is a list of letters, like [\"a\", \"e\"] (or [] for "
                        f"none); got {value!r:.40}.")
    if not all(isinstance(i, str) for i in items):
        raise Incorrect(f"\"fallbacks\" holds letters as text, like \"a\"; got {value!r:.40}.")
    letters = {i.strip().lower() for i in items}
    unknown = sorted(letters - set(FALLBACKS_5_3))
    if unknown:
        raise Incorrect(f"Not letters of the list: {unknown!r}. Use "
                        + ", ".join(f'"{k}"' for k in FALLBACKS_5_3) + ".")
    return letters


def _check_5_3(answer) -> str | None:
    if not isinstance(answer, dict) or set(answer) != {"mixed", "fallbacks"}:
        raise Incorrect("Give a dict with two keys, like the starter's: {\"mixed\": True or "
                        "False, \"fallbacks\": a list of letters}.")
    mixed = answer["mixed"]
    if not isinstance(mixed, bool):
        raise Incorrect(f"\"mixed\" is True or False; got {mixed!r:.40}.")
    report = colleague_audit()
    if mixed != report.mixed:
        return ("Mixed precision means low-precision matmuls over fp32 master weights. Read "
                "two rows of the audit: what the matmuls ran in, and what the weights are.")
    given, named = _letters(answer["fallbacks"]), named_fallbacks(report)
    wrong = sorted(given - named)
    if wrong:
        why = {"a": "fp16 was never asked for here: read the audit's \"asked for\" row.",
               "b": "Read the autocast row: Accelerate's bf16 autocast is on (the CPU supports "
                    "it).",
               "c": "Read the weights row: what dtype is the master copy?",
               "d": "Read the optimizer states row.",
               "e": "Read the GradScaler row: Accelerate builds one for fp16 only."}
        return f"({wrong[0]}) is not among the silent fallbacks the audit names. {why[wrong[0]]}"
    if given != named:
        return (f"The audit names {len(named)} silent fallbacks here; you listed "
                f"{len(given)}. Each shows in a row of the table: hold every choice against "
                "the row it is about.")
    return None


# --- 5.4 where did the GradScaler go? ---------------------------------------------------------

TORCH_CALLS_5_4 = {  # the mixed precision calls of lesson 4's loop, which clips
    "autocast": "with torch.autocast(device, dtype=torch.float16):",
    "scale": "scaler.scale(loss).backward()",
    "unscale_": "scaler.unscale_(optimizer)",
    "step": "scaler.step(optimizer)",
    "update": "scaler.update()",
}
ACCELERATE_CALLS_5_4 = {  # where an fp16 Accelerator on a GPU makes them
    "prepare": "model, optimizer = accelerator.prepare(model, optimizer)",
    "forward": "loss = model(**batch).loss",
    "backward": "accelerator.backward(loss)",
    "clip_grad_norm_": "accelerator.clip_grad_norm_(model.parameters(), max_norm)",
    "optimizer.step": "optimizer.step()",
    "zero_grad": "optimizer.zero_grad()",
}
#: Read from accelerate's source (amp_behaviour.md §5) and checked against the real library in
#: tests/test_exercises_lesson5.py, by a spying GradScaler, in a loop that clips (without
#: clipping, scaler.step's own unscale_ runs inside optimizer.step).
WHERE_5_4 = {"autocast": "forward", "scale": "backward", "unscale_": "clip_grad_norm_",
             "step": "optimizer.step", "update": "optimizer.step"}
#: Feedback for a call placed at one particular wrong answer, where the generic one is unfair.
WRONG_5_4 = {
    ("autocast", "prepare"): "prepare wraps the model's forward once; an autocast is a "
                             "context that is entered and left again each time the forward "
                             "runs: in which call does it run?",
    ("unscale_", "optimizer.step"): "The prepared step() (torch's scaler.step too) unscales "
                                    "only gradients nothing has unscaled yet. In this loop, "
                                    "which clips, something needs their true size before the "
                                    "step: which call?",
}
WHY_5_4 = {
    "autocast": "Autocast covers the forward pass, and in Accelerate the forward pass is the "
                "prepared model's: which call runs it?",
    "scale": "The loss is scaled on its way into the backward pass: which Accelerate call takes "
             "the loss?",
    "unscale_": "Gradients are unscaled where something needs their true size before the step: "
                "clipping.",
    "step": "A prepared optimizer is an AcceleratedOptimizer holding the accelerator's scaler: "
            "what does its own step() call?",
    "update": "torch's loop calls update() right after step(); Accelerate does both in one "
              "call.",
}


def _check_5_4(answer) -> str | None:
    if not isinstance(answer, dict) or set(answer) != set(TORCH_CALLS_5_4):
        raise Incorrect("Give a dict with the five keys of the starter ("
                        + ", ".join(f'"{k}"' for k in TORCH_CALLS_5_4)
                        + "), each set to the name of an Accelerate call.")
    for key, value in answer.items():
        if not isinstance(value, str) or value.strip() not in ACCELERATE_CALLS_5_4:
            raise Incorrect(f"{key!r}: {value!r:.40} is not one of the Accelerate calls; use "
                            + ", ".join(f'"{k}"' for k in ACCELERATE_CALLS_5_4) + ".")
    wrong = [k for k in TORCH_CALLS_5_4 if answer[k].strip() != WHERE_5_4[k]]
    if not wrong:
        return None
    first = wrong[0]
    more = f" ({len(wrong) - 1} more to look at.)" if len(wrong) > 1 else ""
    why = WRONG_5_4.get((first, answer[first].strip()), WHY_5_4[first])
    return f"{first!r}: {why}{more}"


# --- the exercises ----------------------------------------------------------------------------

def _listed(calls: dict[str, str]) -> str:
    return "\n".join(f"- `{k}`: `{v}`" for k, v in calls.items())


EXERCISES = {e.id: e for e in [
    Exercise(
        id="5.1", title="Convert a loop to Accelerate",
        prompt="Here is lesson 4's fp16 loop, written for a GPU:\n\n"
               f"{python_block(TORCH_LOOP)}\n\n"
               "Write its Accelerate version, `train_loop(accelerator, model, optimizer, "
               "dataloader)`, which trains and returns nothing. The `accelerator` is made for "
               "you (`Accelerator(mixed_precision=...)`), so the precision is not your loop's "
               "business. The check runs your loop on the CPU with a real `Accelerator("
               "mixed_precision=\"bf16\")` (bf16: exercise 5.2 asks what fp16 does on "
               "a CPU), on the lesson model and 3 batches of 8 reviews; then again as an fp16 "
               "run on a GPU goes, its loss scaled by a GradScaler, with "
               "`gradient_accumulation_steps=2` (your loop still steps after every batch, as "
               "the torch loop does: no `accelerator.accumulate`) and 3 shuffled batches of 4. "
               "After each run your weights must be the course's Accelerate loop's, bit for "
               "bit, and in the second run they are only with three things done: the model, "
               "the optimizer and the dataloader each handed to `accelerator.prepare` (the "
               "prepared dataloader is the one that deals the batches out to the processes, "
               "in its seeded order, and puts them on the device), and every backward pass "
               "made through the accelerator.",
        comment="the Accelerate version of train_loop",
        body="def train_loop(accelerator, model, optimizer, dataloader):\n"
             "    ...  # prepare, then loop (it returns nothing)",
        key=_REFERENCE_LOOP,
        arg='train_loop',
        check=_check_5_1, hidden=_hidden_5_1, trials=_trials_5_1,
        hints=(
            "Everything mixed precision did in the torch loop moves into Accelerate: the "
            "autocast, the scaler and its calls go; what is left is a plain fp32-looking loop "
            "over objects Accelerate has prepared.",
            "accelerator.prepare(model, optimizer, dataloader) returns the three prepared "
            "objects; in the loop, the scaler's calls go: the scaled backward becomes "
            "accelerator.backward(loss), and the prepared optimizer's step() and zero_grad() "
            "are all that is left of the update.",
            "model, optimizer, dataloader = accelerator.prepare(...); then for each batch: "
            "loss = model(**batch).loss, accelerator.backward(loss), optimizer.step(), "
            "optimizer.zero_grad().",
        )),
    Exercise(
        id="5.2", title="Why was fp16 no faster?",
        prompt="On a GPU, `Accelerator(mixed_precision=\"fp16\")` makes training faster. On "
               "a CPU, `train(path=\"accelerate\", precision=\"fp16\")` trained at fp32's speed, "
               "give or take this machine's noise, to the same losses bit for bit (the tables "
               "above). Why? Pick the "
               f"reason:\n\n{choice_list(CHOICES_5_2)}\n\nAnswer with its letter. The answer "
               "is checked against `mplab.amp.audit`'s audit of a real "
               "`Accelerator(mixed_precision=\"fp16\")` on this CPU.",
        comment="\"a\", \"b\", \"c\" or \"d\"",
        body="answer = ...",
        key="answer = \"b\"  # the audit: fp32 matmuls, no autocast, no scaler",
        check=_check_5_2,
        hints=(
            "Before asking why low precision was slow, ask whether it happened: an audit looks "
            "at what really ran, not at what was asked for.",
            "Read the fp16 run's audit table above: its autocast, \"matmuls ran in\" and "
            "GradScaler rows, and the Accelerator's own attributes (native_amp, scaler). "
            "Compare its losses with the fp32 run's.",
            "The fp16 run's matmuls ran in float32 and its losses equal the fp32 run's: which "
            "choice says the run never left fp32?",
        )),
    Exercise(
        id="5.3", title="Read an audit",
        prompt="A colleague wrote this Accelerate step \"in mixed precision, at half the "
               f"memory\":\n\n{python_block(COLLEAGUE_CODE)}\n\nThe cell above shows what its "
               "audit, `audit(model, optimizer, accelerator=accelerator, batch=batch)`, read "
               "and observed, without the audit's conclusions "
               "(`ex.colleague_audit().table(verdict=False)`). Judge from those facts: is this "
               "run mixed precision, and which of these silent fallbacks did it fall into? "
               "The check compares your answer with the fallbacks the audit names."
               f"\n\n"
               f"{choice_list({k: v[0] for k, v in FALLBACKS_5_3.items()})}\n\n"
               "Answer with a dict: `{\"mixed\": True or False, \"fallbacks\": a list of the "
               "letters}`.",
        comment="mixed or not, and the fallbacks the audit names",
        body="answer = {\"mixed\": ..., \"fallbacks\": ...}",
        key="answer = {\"mixed\": False,  # bf16 matmuls over bf16 weights\n"
            "          \"fallbacks\": [\"c\", \"d\"]}",
        check=_check_5_3,
        hints=(
            "Mixed precision is a pair: low-precision arithmetic and fp32 master weights. An "
            "audit says which of the two happened, and names each silent fallback in a line "
            "of its own.",
            "Read the rows \"asked for\", \"autocast\", \"matmuls ran in (observed)\", "
            "\"weights (master copy)\", \"optimizer states\" and \"GradScaler\": each choice "
            "is a claim about one of them.",
            "The cast .to(torch.bfloat16) made the weights bf16, and AdamW's states follow the "
            "weights; Accelerate built no scaler for bf16.",
        )),
    Exercise(
        id="5.4", title="Where did the GradScaler go?",
        prompt="On a GPU, `Accelerator(mixed_precision=\"fp16\")` builds a "
               "`torch.amp.GradScaler` and an fp16 autocast, and makes every call of lesson 4's "
               "loop for you. The torch loop's calls (lesson 4's loop clips the gradients, so "
               f"it unscales them first):\n\n{_listed(TORCH_CALLS_5_4)}\n\n"
               "and the Accelerate calls of the course's loop, with clipping (`model` and "
               "`optimizer` are the prepared ones):\n\n"
               f"{_listed(ACCELERATE_CALLS_5_4)}\n\n"
               "For each torch call, name the Accelerate call inside which it now happens, "
               "at each step of the loop. Answer with a dict from the torch names to the "
               "Accelerate names.",
        comment="the Accelerate call that makes each of the torch loop's calls",
        body="answer = {\"autocast\": ..., \"scale\": ..., \"unscale_\": ..., "
             "\"step\": ..., \"update\": ...}",
        key="answer = {\"autocast\": \"forward\",  # the prepared model's\n"
            "          \"scale\": \"backward\",\n"
            "          \"unscale_\": \"clip_grad_norm_\",\n"
            "          \"step\": \"optimizer.step\",\n"
            "          \"update\": \"optimizer.step\"}  # right after step",
        check=_check_5_4,
        hints=(
            "Accelerate keeps the work where the torch loop did it; it only moves each call "
            "into the object that is there at that moment: the model's forward, the loss's "
            "backward, the clipping, the optimizer.",
            "prepare() wraps the model's forward, so that each forward runs in an autocast; "
            "accelerator.backward(loss) takes the loss; clip_grad_norm_ needs the true "
            "gradients; the prepared optimizer holds the accelerator's scaler.",
            "autocast in the prepared model's forward, scale in backward, unscale_ in "
            "clip_grad_norm_, and both step and update inside the prepared optimizer's step().",
        )),
]}

LESSON = Lesson(5, list(EXERCISES.values()))
check, hint, solution, exercise_cells, cells, task_markdown = LESSON.functions()
