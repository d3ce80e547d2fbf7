"""Lesson 6, from Accelerator to Trainer: the exercises.

    from mplab.exercises import lesson6 as ex
    ex.check("6.1", answer); ex.hint("6.1"); ex.solution("6.1")

The references are the installed libraries and mplab's measurements: a learner's
TrainingArguments are built by the installed transformers (6.1) and trained for one real
optimizer step by a real Trainer, its forward passes and clipping counted and its matmuls
watched by :func:`mplab.amp.audit.audit` (6.3); which steps each path writes comes from
:mod:`mplab.train.compare` (the code `train(path=...)` runs, 6.2); a learner's fix for a model
loaded from a bf16 checkpoint is audited (6.4).
"""

from __future__ import annotations

import copy
import functools
import math
import os
import tempfile
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from mplab import data, models
from mplab.amp.audit import Audit, audit
from mplab.exercises.framework import (
    Exercise,
    Incorrect,
    Lesson,
    call,
    python_block,
)
from mplab.train import compare
from mplab.train.accelerate_path import fresh_accelerate

__all__ = ["check", "hint", "solution", "exercise_cells", "cells", "task_markdown",
           "EXERCISES", "LESSON"]

#: What the checks give TrainingArguments besides the learner's arguments: a throwaway folder
#: and a run of one step that saves, logs and reports nothing.
ONE_STEP = {"max_steps": 1, "per_device_train_batch_size": 8, "eval_strategy": "no",
            "save_strategy": "no", "logging_strategy": "no", "report_to": "none",
            "disable_tqdm": True}
_PROBE_DIR = os.path.join(tempfile.gettempdir(), "mplab-lesson6-probe")  # never written to


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


@contextmanager
def _quiet_transformers():
    """transformers' logging (a load report, max_steps notes) off while a check runs."""
    from transformers.utils import logging

    level, bars = logging.get_verbosity(), logging.is_progress_bar_enabled()
    logging.set_verbosity_error()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        logging.set_verbosity(level)
        if bars:
            logging.enable_progress_bar()


def _reviews(tokenizer, n: int = 8) -> dict[str, torch.Tensor]:
    """The first `n` lesson reviews, encoded: input_ids, attention_mask, labels."""
    train = data.load_dataset("sentiment", "train")
    return data.encode(tokenizer, train.texts[:n], train.labels[:n])


# --- TrainingArguments as the installed transformers takes them, or why not ------------------

def _training_arguments(answer: dict, output_dir: str, **fixed):
    """TrainingArguments(**answer) for a one-step run in `output_dir` (`fixed` overriding
    ONE_STEP's settings); its refusals become feedback."""
    from transformers import TrainingArguments

    try:
        return TrainingArguments(**{**answer, **ONE_STEP, **fixed, "output_dir": output_dir})
    except TypeError as err:
        raise Incorrect(_unknown_argument(err)) from None
    except ValueError as err:
        raise Incorrect(_refused(err)) from None


def _unknown_argument(err: TypeError) -> str:
    said = str(err)
    version = _transformers_version()
    if "evaluation_strategy" in said:
        return ("TrainingArguments no longer takes evaluation_strategy, the course's name for "
                "when to evaluate: renamed in transformers 4.41, removed in 4.51 (this is "
                f"{version}). help(TrainingArguments) lists today's names: one of them says "
                "when to evaluate.")
    if "no_cuda" in said:
        return ("TrainingArguments no longer takes no_cuda: it was deprecated in transformers "
                f"4.32 and is gone in 5 (this is {version}). Its replacement is named for the "
                "device you want, not the one you don't.")
    return (f"TrainingArguments (transformers {version}) refused these arguments: {said}. Use "
            "its keyword names (help(TrainingArguments) lists them).")


def _refused(err: ValueError) -> str:
    said = str(err)
    if "use_cpu" in said:
        return (f"TrainingArguments refused: \"{said}\" Without a GPU that has bf16 units, the "
                "Trainer accepts bf16 only when the arguments say that the run is meant for "
                "the CPU.")
    if "At most one" in said:
        return (f"TrainingArguments refused: \"{said}\" fp16 and bf16 are two different "
                "16-bit formats; a run computes in one of them.")
    return f"TrainingArguments refused these arguments: {said}"


# --- 6.1 the course's line, today -------------------------------------------------------------

COURSE_LINE = ('TrainingArguments(output_dir=output_dir, evaluation_strategy="epoch", '
               'fp16=True)')


def _check_6_1(fn) -> str | None:
    from transformers import TrainingArguments

    # A folder name, not made: the same in the kernel and in the grader, which replays the
    # arguments the function returned (TrainingArguments makes no folder)
    folder = "mplab-6.1-output"
    with fresh_accelerate():
        try:
            args = fn(folder)
        except TypeError as err:
            if "unexpected keyword argument" in str(err):
                return _unknown_argument(err)
            raise Incorrect(f"course_arguments(output_dir) raised TypeError: {err}",
                            status="error") from None
        except ValueError as err:
            return _refused(err)
        except Exception as err:
            raise Incorrect(f"course_arguments(output_dir) raised {type(err).__name__}: {err}",
                            status="error") from None
        if not isinstance(args, TrainingArguments):
            return (f"course_arguments(output_dir) must return the TrainingArguments it builds; "
                    f"it returned {type(args).__name__}.")
        if os.path.abspath(str(args.output_dir)) != os.path.abspath(folder):
            return (f"The arguments write to {args.output_dir!r}, not to the output_dir given "
                    "to course_arguments: pass it on.")
        strategy = getattr(args.eval_strategy, "value", args.eval_strategy)
        if strategy != "epoch":
            return (f"The course's line evaluates after every epoch; these arguments evaluate "
                    f"on the strategy {strategy!r}. Keep the course's evaluation, under "
                    "today's name.")
        if not args.fp16:
            return ("The course's line asks for fp16 mixed precision, and these arguments do "
                    "not: keep its fp16=True (what it does on a CPU is for section 4). Only "
                    "the name that no longer runs changes.")
    return None


# --- 6.2 what the Trainer takes over ----------------------------------------------------------

STEPS = tuple(compare.STEPS)


def taken_over() -> set[str]:
    """The steps the Accelerate path's code writes and the Trainer path's does not, as
    mplab.train.compare measures them in the code that runs."""
    accelerate, trainer = compare.profile("accelerate"), compare.profile("trainer")
    return set(accelerate.steps_written) - set(trainer.steps_written)


def _check_6_2(answer) -> str | None:
    if isinstance(answer, str) or not isinstance(answer, list | tuple | set):
        raise Incorrect(f"Give a list of step names, like [\"backward\"]; got "
                        f"{type(answer).__name__}.")
    names = [str(a).strip().lower() for a in answer]
    unknown = [n for n in names if n not in STEPS]
    if unknown:
        return f"Not step names: {unknown!r}. Use names from the list: {list(STEPS)!r}."
    given, want = set(names), taken_over()
    hidden_already = set(compare.profile("accelerate").steps_hidden)
    if given & hidden_already:
        return (f"{sorted(given & hidden_already)}: the Accelerate loop does not write "
                f"{'these' if len(given & hidden_already) > 1 else 'this'} either: Accelerate "
                "already does it inside the prepared model and optimizer (lesson 5). The "
                "question is what the Trainer takes over from the code the Accelerate loop "
                "still writes itself.")
    missing = want - given
    if missing:
        return (f"{len(missing)} of the steps the Accelerate loop writes itself "
                f"{'is' if len(missing) == 1 else 'are'} missing from your list. Read the - "
                "lines of the loop: every call on the loss, the optimizer, the scheduler and "
                "the accelerator is a step you wrote there.")
    return None


# --- 6.3 change the steps through the arguments ---------------------------------------------

@dataclass(frozen=True)
class OneStep:
    """One optimizer step of a real Trainer, watched: the forward passes (micro-batches) it
    took, how many times it clipped the gradients, and the audit of what ran."""

    forwards: int
    clipped: int
    audit: Audit


def one_step(args) -> OneStep:
    """Train the lesson model one optimizer step with a real Trainer and these arguments (their
    batch size and accumulation), on lesson reviews; count the model's forward passes and the
    Trainer's calls of `accelerator.clip_grad_norm_` that clip (to a finite norm), then audit
    what ran (the matmuls watched over one more step)."""
    from transformers import PrinterCallback, Trainer

    rows = args.per_device_train_batch_size * args.gradient_accumulation_steps
    with _quiet_transformers(), fresh_accelerate():
        model = models.lesson_model()
        batch = _reviews(models.lesson_tokenizer(), rows)
        # rows as dicts of tensors: any sequence is a Trainer dataset (no `datasets` needed)
        dataset = [{k: v[i] for k, v in batch.items()} for i in range(rows)]
        trainer = Trainer(model=model, args=args, train_dataset=dataset)
        trainer.remove_callback(PrinterCallback)
        counts = Counter()
        hook = model.register_forward_pre_hook(lambda *_: counts.update(["forwards"]))
        clip = trainer.accelerator.clip_grad_norm_

        def counted_clip(parameters, max_norm, *a, **kw):
            # the Trainer also calls it with an infinite norm, only to measure the norm
            counts["clipped"] += math.isfinite(max_norm)
            return clip(parameters, max_norm, *a, **kw)

        trainer.accelerator.clip_grad_norm_ = counted_clip
        try:
            trainer.train()
        finally:
            hook.remove()
        found = audit(trainer.model, trainer.optimizer, accelerator=trainer.accelerator,
                      batch=_reviews(models.lesson_tokenizer()))
    return OneStep(counts["forwards"], counts["clipped"], found)


def one_step_audit(args):
    """The audit of one optimizer step of a real Trainer with these arguments (`one_step`)."""
    return one_step(args).audit


#: What 6.3 asks of the Trainer's steps: micro-batches per optimizer step, and no clipping.
ACCUMULATION_6_3 = 4
#: The check's micro-batches: small, as 6.3's run takes ACCUMULATION_6_3 of them.
MICRO_BATCH_6_3 = 2


def _check_6_3(answer) -> str | None:
    if not isinstance(answer, dict):
        raise Incorrect(f"Give a dict of TrainingArguments' keyword arguments, like "
                        f"{{\"learning_rate\": 1e-3}}; got {type(answer).__name__}.")
    odd = [k for k in answer if not isinstance(k, str)]
    if odd:
        raise Incorrect(f"The dict's keys are argument names, as text; got {odd[0]!r}.")
    with tempfile.TemporaryDirectory(prefix="mplab-6.3-") as folder:
        args = _training_arguments(answer, folder,
                                   per_device_train_batch_size=MICRO_BATCH_6_3)
        if not (args.bf16 or args.fp16):
            return ("Nothing in these arguments asks for a 16-bit format: the Trainer trains "
                    "in fp32 unless told otherwise.")
        if args.device.type != "cpu":
            return (f"These arguments train on {args.device} (this machine has a GPU): the "
                    "task is bf16 on the CPU, so they must say so (use_cpu is the argument "
                    "for the device).")
        if args.max_grad_norm is None:
            return (f"transformers {_transformers_version()} compares the clipping norm with 0 "
                    "at every step (clipping happens when it is above 0), so None stops the "
                    "training with a TypeError. Which number never is above 0?")
        if not 1 <= args.gradient_accumulation_steps <= 8 * ACCUMULATION_6_3:
            return (f"These arguments accumulate over {args.gradient_accumulation_steps} "
                    f"micro-batches per optimizer step; the task is {ACCUMULATION_6_3}.")
        run = one_step(args)
    if args.fp16:
        return (f"fp16=True raised no error, but in the one-step run the matmuls ran in "
                f"{_name(run.audit.compute_dtype)} (observed): the Trainer, through Accelerate, "
                "ignores fp16 on a CPU without a word. The CPU's mixed precision is the other "
                "16-bit format.")
    if not run.audit.mixed:
        return f"The one-step run was not mixed precision: {run.audit.verdict}."
    if run.forwards != ACCUMULATION_6_3:
        return (f"The Trainer ran {run.forwards} forward pass{'es' * (run.forwards != 1)} "
                f"(micro-batch{'es' * (run.forwards != 1)}) for its one optimizer step; the "
                f"task is {ACCUMULATION_6_3}. The Trainer steps after every micro-batch unless "
                "told how many to accumulate.")
    if run.clipped:
        return ("The Trainer clipped the gradients before its step (it calls "
                "accelerator.clip_grad_norm_, which unscales and clips): it clips to a norm "
                "of 1.0 unless told otherwise. Which value of the clipping norm turns it off?")
    return None


def _name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


# --- 6.4 the missing master weights -----------------------------------------------------------

@functools.cache
def _saved_in_bf16() -> torch.nn.Module:
    """The lesson model saved in bf16 and loaded back the transformers 5 way (as saved)."""
    from transformers import AutoModelForSequenceClassification

    with tempfile.TemporaryDirectory(prefix="mplab-6.4-") as folder, _quiet_transformers():
        models.lesson_model().to(torch.bfloat16).save_pretrained(folder)
        return AutoModelForSequenceClassification.from_pretrained(folder)


def bf16_checkpoint_model() -> torch.nn.Module:
    """A fresh copy of the lesson model as loaded from a checkpoint saved in bf16: every
    weight bfloat16, no fp32 master copy (what 6.4's fix is given)."""
    return copy.deepcopy(_saved_in_bf16())


def _check_6_4(fn) -> str | None:
    model = bf16_checkpoint_model()
    loaded = [p.detach().clone() for p in model.parameters()]
    names = set(model.state_dict())
    fixed = call(fn, model, what="fix(model)")
    if fixed is None:
        return ("fix(model) returned None: return the model, fixed (the check audits what "
                "it returns).")
    if not isinstance(fixed, torch.nn.Module):
        return f"fix(model) must return a torch model; it returned {type(fixed).__name__}."
    if set(fixed.state_dict()) != names:
        return ("fix(model) returned a model with other weights than the one it was given: "
                "return that model, ready for mixed precision, so that what it loaded is kept.")
    dtypes = Counter()
    for p in fixed.parameters():
        dtypes[p.dtype] += p.numel()
    if len(dtypes) > 1:
        shares = " and ".join(f"{n:,} {_name(d)}" for d, n in dtypes.most_common())
        return (f"Only part of the weights changed dtype ({shares} values): every weight "
                "needs its fp32 master copy, or its updates are still rounded to 16 bits.")
    if torch.float16 in dtypes:
        return ("float16 weights are still a 16-bit copy, with fewer exponent bits than the "
                "bf16 values they came from: there is still no fp32 master copy.")
    found = audit(fixed, batch=_reviews(models.lesson_tokenizer(), 4),
                  autocast=torch.autocast("cpu", dtype=torch.bfloat16))
    if found.param_dtype == torch.bfloat16:
        return (f"The weights are still bfloat16, so the audit says: {found.verdict}. The "
                "weights themselves must hold the master copy, in a format with more "
                "precision than the matmuls.")
    if found.param_dtype == torch.float64:
        return (f"float64 weights: autocast leaves float64 tensors alone, so the matmuls ran "
                f"in {_name(found.compute_dtype)} (observed): no mixed precision, at twice "
                "fp32's memory. The master copy of mixed precision is fp32.")
    if not found.mixed:
        return f"The audit of the returned model says: {found.verdict}."
    weights = list(fixed.parameters())
    if len(weights) != len(loaded) or not all(
            p.shape == q.shape and torch.equal(p.detach().cpu(), q.float())
            for p, q in zip(weights, loaded)):
        return ("The weights are float32, but they are not the loaded ones: a new (or "
                "re-initialised) model loses what the checkpoint held. Keep the model's own "
                "weights and change only their dtype.")
    return None


def _tiny_bf16() -> torch.nn.Module:
    return torch.nn.Linear(2, 2, dtype=torch.bfloat16)


# --- the exercises ----------------------------------------------------------------------------

EXERCISES = {e.id: e for e in [
    Exercise(
        id="6.1", title="The course's line, today",
        prompt="The course wrote this line, for an older transformers:\n\n"
               + python_block(f"training_args = {COURSE_LINE}")
               + "\n\nWith the transformers installed here it fails before anything trains "
               "(the cell above). Write `course_arguments(output_dir)`, which returns the "
               "course's arguments as today's transformers takes them: the same settings "
               "(evaluated after every epoch, `fp16=True`), under today's names. The check "
               "calls it and reads the `TrainingArguments` it returns.",
        comment="the course's TrainingArguments line, for today's transformers",
        body="def course_arguments(output_dir):\n"
             "    return ...  # TrainingArguments(output_dir=output_dir, ...)",
        key="def course_arguments(output_dir):\n"
            "    return TrainingArguments(output_dir=output_dir, eval_strategy=\"epoch\", "
            "fp16=True)",
        arg='course_arguments',
        check=_check_6_1,
        hints=(
            "Libraries rename arguments between versions: the error names the old one, and "
            "the installed TrainingArguments lists the names it takes today.",
            "help(TrainingArguments) lists them; or [f.name for f in dataclasses.fields("
            "TrainingArguments) if \"strategy\" in f.name]. One of them says when to "
            "evaluate.",
            "TrainingArguments(output_dir=output_dir, <evaluation_strategy's shorter name "
            "today>=\"epoch\", fp16=True).",
        )),
    Exercise(
        id="6.2", title="What the Trainer takes over",
        prompt="The diff above shows the code a user writes on lesson 5's Accelerate path "
               "(`-` lines) and on the Trainer path (`+` lines). Of the nine parts of a "
               "training step (as `mplab.train.compare` names them, below), the Accelerate "
               "loop writes some in its own lines; the others Accelerate already did out of "
               "sight, inside the prepared model and optimizer, and it still does them under "
               "the Trainer. Which parts that the Accelerate loop writes itself does the "
               "Trainer path's code no longer write? Leave out the parts Accelerate already "
               "did out of sight. The nine parts:\n\n"
               + "\n".join(f"- `{name}`" for name in STEPS)
               + "\n\nAnswer with a list of names, e.g. `[\"backward\"]`. The check compares it "
               "with what `compare` measures in the code that runs.",
        comment="the steps the Accelerate loop writes and the Trainer takes over",
        body="answer = ...  # a list of step names",
        key="answer = [\"backward\", \"unscale + clip\", \"optimizer step\", \"zero_grad\",\n"
            "          \"lr schedule\", \"accumulation\"]  # the whole loop body",
        check=_check_6_2,
        hints=(
            "A step the Accelerate loop writes is a call in its code: find each one in the - "
            "lines and name the part of a training step it does. The + lines hold no loop at "
            "all.",
            "compare.profile(\"accelerate\").steps_written lists what the Accelerate code "
            "writes; compare.profile(\"trainer\").steps_written what the Trainer path writes.",
            "Everything in the Accelerate loop's body: backward, clipping, the optimizer and "
            "scheduler steps, zero_grad and the accumulate context; not autocast or the "
            "scaler, which Accelerate had already hidden.",
        )),
    Exercise(
        id="6.3", title="Change the Trainer's steps through its arguments",
        prompt="The Trainer writes the loop, so you change its steps through "
               "`TrainingArguments`. Two of the steps it took over from the Accelerate loop: "
               "it takes one micro-batch per optimizer step unless told to accumulate, and it "
               "clips the gradients (unscale + clip) to a norm of `max_grad_norm`, 1.0 unless "
               "told otherwise (the Trainer clips only where it is above 0; `None` is "
               "accepted by `TrainingArguments` but breaks `train()`). "
               "Which `TrainingArguments` make the Trainer train in bf16 mixed precision on "
               f"this CPU, accumulating the gradients of {ACCUMULATION_6_3} micro-batches for "
               "each optimizer step, with no gradient clipping at all? Answer with a dict of "
               "keyword arguments, e.g. `{\"learning_rate\": 1e-3}`. The check builds "
               "`TrainingArguments(**answer)` with the installed transformers (adding an "
               f"`output_dir`, micro-batches of {MICRO_BATCH_6_3} reviews, and one optimizer "
               "step that saves and reports nothing), trains the lesson model with a real "
               "`Trainer`, counts its forward passes and its calls of "
               "`accelerator.clip_grad_norm_`, and audits which dtype its matmuls ran in.",
        comment="TrainingArguments: bf16 on this CPU, accumulation, no clipping",
        body="answer = ...  # a dict of keyword arguments",
        key=f"answer = {{\"bf16\": True, \"use_cpu\": True,\n"
            f"          \"gradient_accumulation_steps\": {ACCUMULATION_6_3}, "
            f"\"max_grad_norm\": 0.0}}",
        check=_check_6_3,
        hints=(
            "Three things to say: bf16 on the CPU (as the lesson's runs say it), how many "
            "micro-batches each optimizer step accumulates, and a clipping norm that never "
            "clips.",
            "help(TrainingArguments) lists every argument with its default: look for the "
            "accumulation steps, and for the maximum gradient norm (default 1.0, and the "
            "Trainer clips only when it is above 0).",
            f"{{\"bf16\": True, \"use_cpu\": True, \"gradient_accumulation_steps\": "
            f"{ACCUMULATION_6_3}, <the maximum gradient norm>: 0.0}}.",
        )),
    Exercise(
        id="6.4", title="Find the missing master weights",
        prompt="A model loaded from a checkpoint saved in bf16, the transformers 5 way "
               "(`AutoModelForSequenceClassification.from_pretrained(folder)`), has bf16 "
               "weights: mixed precision training of it is pure bf16, with no fp32 master "
               "weights. Write `fix(model)`, which returns the model ready for mixed "
               "precision training, its loaded weights kept. The check gives it the lesson "
               "model loaded that way and audits what `fix` returns over one bf16 autocast "
               "step (`mplab.amp.audit.audit`).",
        comment="give a model loaded in bf16 its fp32 master weights",
        body="def fix(model):\n"
             "    return ...  # the model, ready for mixed precision",
        key="def fix(model):\n"
            "    return model.float()  # before the optimizer (or Trainer) is built",
        arg='fix',
        check=_check_6_4,
        hints=(
            "Mixed precision needs the weights themselves in fp32 (the master copy); autocast "
            "makes the 16-bit copies for the matmuls on the fly.",
            "A torch.nn.Module changes the dtype of all its weights at once, in place, and "
            "returns itself: model.to(dtype) or one of its shorthand methods.",
            "return model.<the shorthand for float32>()",
        )),
]}

LESSON = Lesson(6, list(EXERCISES.values()))
check, hint, solution, exercise_cells, cells, task_markdown = LESSON.functions()

