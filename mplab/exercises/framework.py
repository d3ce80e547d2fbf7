"""The exercise framework: an :class:`Exercise` record, a :class:`Lesson` of them (check, hint,
solution, the notebook's task cells), the :class:`Result` every call returns, the helpers the
lesson modules build their checks from, and the grading log. See :mod:`mplab.exercises`."""

from __future__ import annotations

import contextlib
import functools
import html
import json
import math
import numbers
import os
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from mplab.exercises.answers import (
    MAX_ANSWER_BYTES,
    SEED_ENV,
    Recording,
    Replay,
    copied,
    grade_seed,
    pack_answer,
    unpack_answer,
)

__all__ = ["Result", "Exercise", "Lesson", "Incorrect", "STATUSES", "is_blank", "untouched",
           "cell", "choice_list", "one_letter", "multiple_choice", "same_tensors", "in_order",
           "python_block", "grading", "as_number", "call", "GRADING_ENV", "GRADE_LOG_ENV",
           "CELL_METADATA_KEY", "HIDDEN_FAILED", "pack_answer", "unpack_answer",
           "MAX_ANSWER_BYTES", "SEED_ENV", "grade_seed"]

#: How a failed hidden check's message starts.
HIDDEN_FAILED = "The public checks pass, but a hidden check does not. "
#: The statuses a check can end in (hint() and solution() results use "hint" and "solution").
STATUSES = ("passed", "failed", "not attempted", "error")
GRADING_ENV = "MPLAB_GRADING"
GRADE_LOG_ENV = "MPLAB_GRADE_LOG"
#: An exercise cell carries ``{"mplab": {"exercise": "1.1"}}`` in its metadata.
CELL_METADATA_KEY = "mplab"

_STYLE = {  # status -> (symbol, text colour, background)
    "passed": ("✓", "#1b5e20", "#e8f5e9"),
    "failed": ("✗", "#b71c1c", "#ffebee"),
    "error": ("!", "#e65100", "#fff3e0"),
    "not attempted": ("…", "#424242", "#f5f5f5"),
    "hint": ("?", "#0d47a1", "#e3f2fd"),
    "solution": ("★", "#4a148c", "#f3e5f5"),
}


@dataclass
class Result:
    """What check(), hint() or solution() says about one exercise."""

    id: str
    status: str
    points: float
    max_points: float
    message: str
    code: str = ""  # the reference cell, for solution()

    @property
    def passed(self) -> bool:
        return self.status == "passed"

    def as_dict(self) -> dict:
        return asdict(self)

    def _headline(self) -> str:
        head = f"Exercise {self.id}: {self.status}"
        if self.status in STATUSES:
            head += f" ({self.points:g}/{self.max_points:g} points)"
        return head

    def __str__(self) -> str:
        symbol = _STYLE.get(self.status, ("·",))[0]
        text = f"{symbol} {self._headline()}\n{self.message}"
        if self.code:
            text += "\n\n" + self.code
        return text

    __repr__ = __str__

    def _repr_html_(self) -> str:
        symbol, colour, background = _STYLE.get(self.status, ("·", "#212121", "#fafafa"))
        code = (f"<pre style='margin:6px 0 0;background:#fff;padding:6px'>"
                f"{html.escape(self.code)}</pre>" if self.code else "")
        return (f"<div style='border-left:6px solid {colour};background:{background};"
                f"color:#212121;padding:8px 12px;margin:4px 0;border-radius:4px'>"
                f"<b style='color:{colour}'>{symbol} {html.escape(self._headline())}</b>"
                f"<div style='white-space:pre-wrap'>{html.escape(self.message)}</div>{code}</div>")


class Incorrect(Exception):
    """Raised inside a check to end it with a message; status "error" when the learner's code
    raised, "failed" for a wrong answer."""

    def __init__(self, message: str, status: str = "failed"):
        super().__init__(message)
        self.status = status


def is_blank(answer) -> bool:
    """The untouched starter: ``...`` or None."""
    return answer is ... or answer is None


def untouched(answer, starter_value) -> bool:
    """Is `answer` still what the starter cell made (`starter_value`)? A function is compared
    by its code (the starter's `return ...` left as it was); any other value by ``==``."""
    if is_blank(answer):
        return True
    if callable(starter_value):
        return callable(answer) and _same_code(getattr(answer, "__code__", None),
                                               getattr(starter_value, "__code__", None))
    try:
        return type(answer) is type(starter_value) and bool(answer == starter_value)
    except Exception:  # a learner's object whose == misbehaves is an attempt
        return False


def _same_code(a, b) -> bool:
    if a is None or b is None:
        return False
    consts = len(a.co_consts) == len(b.co_consts) and all(
        type(x) is type(y) and (_same_code(x, y) if hasattr(x, "co_code") else x == y)
        for x, y in zip(a.co_consts, b.co_consts))
    return (a.co_code == b.co_code and a.co_names == b.co_names
            and a.co_varnames == b.co_varnames and consts)


def cell(comment: str, body: str, id: str, arg: str = "answer") -> str:
    """An exercise cell's source: a comment line, the body, and the check of `arg`."""
    return f'# {comment}\n{body}\nex.check("{id}", {arg})'


def choice_list(choices: dict[str, str]) -> str:
    """Lettered choices as a markdown list, one per line: ``- (a) ...``."""
    return "\n".join(f"- ({letter}) {text}" for letter, text in choices.items())


def one_letter(answer, choices: dict[str, str]) -> str:
    """The letter a learner chose, lower-cased, or :class:`Incorrect` naming the letters."""
    if not isinstance(answer, str) or answer.strip().lower() not in choices:
        raise Incorrect("Answer with one letter: " + ", ".join(f'"{k}"' for k in choices)
                        + f"; got {answer!r:.40}.")
    return answer.strip().lower()


def multiple_choice(choices: dict[str, str], right, why) -> Callable[[Any], str | None]:
    """The check of a multiple-choice exercise: the learner's letter against `right` (a
    letter, or a function giving it where the answer depends on the machine); a wrong letter
    gets `why[letter]` (or `why(letter)`): the concept that letter missed."""
    def check(answer) -> str | None:
        letter = one_letter(answer, choices)
        if letter == (right() if callable(right) else right):
            return None
        return why(letter) if callable(why) else why[letter]
    return check


def same_tensors(a, b) -> bool:
    """Two sequences of tensors (weights after training, say) equal bit for bit."""
    import torch  # only when a check compares tensors

    a, b = list(a), list(b)
    return len(a) == len(b) and all(torch.equal(p, q) for p, q in zip(a, b))


def in_order(exercises: list[Exercise]) -> list[Exercise]:
    """A lesson's exercises by number ("4.2" before "4.10"): the order a learner meets them."""
    return sorted(exercises, key=lambda e: tuple(int(n) for n in e.id.split(".")))


def python_block(source: str) -> str:
    """Code to read (to fix, convert or compare) as a fenced markdown block."""
    code = source.strip("\n")
    return f"```python\n{code}\n```"


def grading() -> bool:
    """True inside the grader's kernel, where hidden checks run too."""
    return os.environ.get(GRADING_ENV, "") not in ("", "0")


def as_number(answer, what: str = "Your answer") -> float:
    """A learner's number as a float (ints, floats, Fractions, numeric text like "2**-24",
    one-element tensors); anything else ends the check with a message that says what to give."""
    from mplab.numerics.formats import (
        parse_number,  # formats imports torch: only when a check needs it
    )

    if isinstance(answer, str):
        try:
            answer = parse_number(answer)
        except ValueError as e:
            raise Incorrect(f"{what} is text that does not read as a number: {e}") from None
    if hasattr(answer, "item") and not isinstance(answer, numbers.Real):
        try:
            answer = answer.item()  # a one-element tensor or array
        except (ValueError, RuntimeError):
            pass  # more elements than one: reported below
    if isinstance(answer, bool) or not isinstance(answer, numbers.Real):
        raise Incorrect(f"{what} should be a number, not {type(answer).__name__} "
                        f"({answer!r:.60}).")
    try:
        return float(answer)
    except OverflowError:  # an int or Fraction beyond any double
        return math.copysign(math.inf, answer)


def call(fn: Callable, *args, what: str = ""):
    """Call the learner's function; an exception it raises ends the check as an "error" that
    names the call and the exception (not a traceback), and a `...` it returns (the starter's
    placeholder, left in) ends it as "failed", saying so."""
    shown = what or f"{getattr(fn, '__name__', 'your function')}{args}"
    try:
        value = fn(*args)
    except Exception as e:
        raise Incorrect(f"{shown} raised {type(e).__name__}: {e}", status="error") from None
    if value is ...:
        raise Incorrect(f"{shown} returned ..., the starter's placeholder: replace the `...` "
                        "with your code.")
    return value


Check = Callable[[Any], "str | None"]  # the reason an answer is wrong, or None when it is right


@dataclass(frozen=True)
class Exercise:
    """One graded exercise.

    `prompt` is the whole task in markdown, in the lesson's voice, as the notebook shows it
    under the title (:meth:`Lesson.task_markdown`): what to answer or write (with the
    signature), and any choices (:func:`choice_list`) or code to fix (:func:`python_block`), so
    that it reads complete without running anything. `check` returns why an answer is wrong
    (naming the concept missed, never the answer) or None; it may raise :class:`Incorrect`.
    `hidden` runs the same way but only when grading.

    The notebook cell is built from the id once given: its comment line (`comment`), then
    `body` (what the learner edits), then ``ex.check("<id>", <arg>)``; `starter` is that cell
    and `solution_code` the same cell with `key` (the reference answer) as its body. An answer
    the starter's body still makes is "not attempted" (`blank`, by default from the starter).
    """

    id: str
    title: str
    prompt: str
    comment: str
    body: str
    key: str
    check: Check
    hints: tuple[str, ...]
    hidden: Check | None = None
    points: int = 1
    arg: str = "answer"
    blank: Callable[[Any], bool] | None = None
    # A function answer's hidden check calls it on exactly these arguments, in order (drawn
    # from the run's seed): the kernel makes those calls for the grader, which judges them.
    # An entry may be a run that calls the function itself (given it), where its arguments
    # are live objects made for the call (an Accelerator).
    trials: Callable[[int], list[tuple]] | None = None

    @property
    def starter(self) -> str:
        """The exact notebook cell a learner sees."""
        return cell(f"{self.id}: {self.comment}", self.body, self.id, self.arg)

    @property
    def solution_code(self) -> str:
        """That cell filled in with the reference answer."""
        return cell(f"{self.id}: {self.comment}", self.key, self.id, self.arg)

    @property
    def takes_function(self) -> bool:
        """Whether the answer is a function the learner writes (the starter binds one)."""
        return callable(_starter_value(self.body, self.arg))

    def is_blank(self, answer) -> bool:
        """Not attempted: `blank`'s verdict, or else whether the answer is still what the
        starter's body makes."""
        if self.blank is not None:
            return self.blank(answer)
        return untouched(answer, _starter_value(self.body, self.arg))


@functools.cache
def _starter_value(body: str, arg: str):
    """What the starter's body binds to `arg` (None if it needs the notebook's names)."""
    namespace: dict = {}
    try:
        exec(compile(body, "<starter>", "exec"), namespace)
    except Exception:  # a starter that reads the notebook's names: only `...` is blank
        return None
    return namespace.get(arg)


LESSON_FUNCTIONS = ("check", "hint", "solution", "exercise_cells", "cells", "task_markdown")


class Lesson:
    """A lesson's exercises, plus the state a session keeps: hint stages and revealed solutions."""

    def __init__(self, number: int, exercises: list[Exercise]):
        self.number = number
        self.exercises = {e.id: e for e in exercises}
        self.import_code = f"from mplab.exercises import lesson{number} as ex"
        self.reset()

    def functions(self):
        """What a lesson module offers a notebook, in the order of `LESSON_FUNCTIONS`:
        ``check, hint, solution, exercise_cells, cells, task_markdown = LESSON.functions()``."""
        return tuple(getattr(self, name) for name in LESSON_FUNCTIONS)

    def reset(self) -> None:
        """Forget hint stages, passed exercises and revealed solutions (a fresh session)."""
        self.hint_stage: dict[str, int] = {}
        self.revealed: set[str] = set()
        self.passed: set[str] = set()

    def get(self, id) -> Exercise:
        key = str(id).strip()  # ex.check(1.2, ...) means "1.2"
        if key not in self.exercises:
            raise ValueError(f"unknown exercise {id!r} in lesson {self.number}; accepted: "
                             + ", ".join(map(repr, self.exercises)))
        return self.exercises[key]

    # --- the three calls a notebook makes -----------------------------------------------------
    def check(self, id, answer) -> Result:
        """Check an answer: "passed", "failed" (and why), "not attempted" or "error"."""
        ex = self.get(id)
        record: dict = {"event": "check"}
        if not os.environ.get(GRADE_LOG_ENV):  # nothing for a grader
            result = self._check(ex, answer)
        elif ex.takes_function and callable(answer) and not ex.is_blank(answer):
            # the grader cannot run the learner's code: it replays what the function gave
            recording = Recording(answer)
            result = self._check(ex, recording, hidden=False)
            if result.passed and ex.trials is not None:  # the hidden check's calls, unjudged
                for args in ex.trials(grade_seed()):
                    with contextlib.suppress(Exception):  # recorded; the grader judges it
                        args(recording) if callable(args) else recording(*copied(args))
            record["function"] = recording.data()
        else:  # the grader checks the answer again, itself; a blank needs no checking
            result = self._check(ex, answer)
            record["answer"] = ({"blank": True} if result.status == "not attempted"
                                else pack_answer(answer))
        _log({**record, **result.as_dict()})
        if result.passed:
            self.passed.add(ex.id)
        return result

    def reveal(self, id, show: Callable[[], Any]):
        """What `show()` returns, once exercise `id` has passed in this session or its solution
        was asked for; before, a line saying so: a cell that would print the answer (a table
        worked through, the library's own result) waits for the learner's own."""
        ex = self.get(id)
        if ex.id in self.passed or ex.id in self.revealed:
            return show()
        print(f"This cell shows exercise {ex.id}'s answer: it runs once your answer has passed "
              f"(or after ex.solution(\"{ex.id}\")).")
        return None

    def regrade(self, id, data, seed: int | None = None, function: bool = False) -> Result:
        """Check an answer the grader unpacked from a log record, here, in the grader's own
        process, with the hidden checks on (drawn from `seed`, the run's): the score no line
        the learner's kernel wrote can decide. `data` is :func:`pack_answer`'s data, or with
        `function` a :class:`Recording`'s, which the check runs on as a :class:`Replay`.
        Raises ValueError for data that is not an answer, or a record that lacks a call."""
        ex = self.get(id)
        if not function and isinstance(data, dict) and data.get("blank") is True:
            return Result(ex.id, "not attempted", 0, ex.points, "Not attempted.")
        settings = {GRADING_ENV: "1", SEED_ENV: None if seed is None else str(seed)}
        with _REGRADING:  # a class grades in threads: one sets and restores the variables
            # read back here too: an answer may be built again (a TrainingArguments), and
            # building one sets up accelerate's state, which is one per process
            answer = Replay(unpack_answer(data)) if function else unpack_answer(data)
            saved = {name: os.environ.get(name) for name in settings}
            _set_environment(settings)
            try:
                result = self._check(ex, answer)
            finally:
                _set_environment(saved)
        if function and answer.ran_out:
            raise ValueError("the check called the function more often than the record says")
        return result

    def hint(self, id) -> Result:
        """The next hint for an exercise: concept, then API, then nearly the answer."""
        ex = self.get(id)
        stage = self.hint_stage.get(ex.id, 0)
        n = len(ex.hints)
        if stage < n:
            self.hint_stage[ex.id] = stage + 1
            message = f"Hint {stage + 1} of {n}: {ex.hints[stage]}"
        else:
            message = (f"No more hints for {ex.id}: you have seen all {n}. The last one was:\n"
                       f'{ex.hints[-1]}\nex.solution("{ex.id}") shows the reference answer.')
        _log({"event": "hint", "id": ex.id, "stage": min(stage + 1, n)})
        return Result(ex.id, "hint", 0, ex.points, message)

    def solution(self, id) -> Result:
        """Reveal the reference answer; the reveal is recorded (and shown in a grading report)."""
        ex = self.get(id)
        self.revealed.add(ex.id)
        _log({"event": "solution", "id": ex.id})
        if not ex.key:
            return Result(ex.id, "solution", 0, ex.points, "The reference answers are not "
                          "shipped with this copy of mplab: your instructor keeps them.")
        if grading():  # an answer cell that runs the key's code answers nothing
            return Result(ex.id, "solution", 0, ex.points, "The reference answer is not shown "
                          "while a notebook is graded.")
        return Result(ex.id, "solution", 0, ex.points,
                      "The reference answer (this reveal is recorded in the grading report):",
                      code=ex.solution_code)

    # --- for notebook authors ---------------------------------------------------------------------
    def task_markdown(self, id) -> str:
        """The markdown cell a notebook shows right before the exercise's cell: a heading with
        its id and title, then its whole task (``Exercise.prompt``)."""
        ex = self.get(id)
        return f"### Exercise {ex.id} — {ex.title}\n\n{ex.prompt}"

    def exercise_cells(self) -> list[tuple[str, str]]:
        """(id, starter source) for each exercise, in order."""
        return [(e.id, e.starter) for e in self.exercises.values()]

    def cells(self, solutions: bool = False) -> list:
        """nbformat code cells for every exercise, tagged with their metadata
        (``{"mplab": {"exercise": id}}``); filled in with the reference when `solutions`."""
        import nbformat

        return [nbformat.v4.new_code_cell(e.solution_code if solutions else e.starter,
                                          metadata={CELL_METADATA_KEY: {"exercise": e.id}})
                for e in self.exercises.values()]

    # --- internals ------------------------------------------------------------------------------
    def _check(self, ex: Exercise, answer, hidden: bool | None = None) -> Result:
        """`answer` checked: the public checks, then (`hidden`, by default when grading) the
        hidden ones."""
        hidden = grading() if hidden is None else hidden

        def result(status: str, message: str) -> Result:
            return Result(ex.id, status, ex.points if status == "passed" else 0, ex.points,
                          message)

        try:
            if ex.is_blank(answer):
                edit = ("replace the ... with your answer" if "..." in ex.body else
                        f"change `{ex.arg}` from what the cell starts with to your answer")
                return result("not attempted", f"Not attempted yet: {edit} and run the cell "
                              "again.")
            if callable(_starter_value(ex.body, ex.arg)) and not callable(answer):
                return result("failed", f"Pass the function itself, ex.check(\"{ex.id}\", "
                              f"{ex.arg}), without calling it; got {answer!r:.40}, which is "
                              "not a function.")
            why = ex.check(answer)
            if why is None and ex.hidden is not None and hidden:
                why = ex.hidden(answer)
                if why is not None:
                    why = HIDDEN_FAILED + why
        except Incorrect as e:
            return result(e.status, str(e))
        except Exception as e:  # the learner's object misbehaved somewhere inside the check
            return result("error", f"Checking your answer raised {type(e).__name__}: {e}")
        if why is not None:
            return result("failed", why)
        if ex.hidden is None:
            return result("passed", "Passed.")
        if hidden:
            return result("passed", "Passed: public and hidden checks.")
        return result("passed", "Public checks passed. (Hidden checks run when the notebook "
                      "is graded.)")


_REGRADING = threading.Lock()


def _set_environment(values: dict) -> None:
    for name, value in values.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value

def _log(record: dict) -> None:
    """Append one JSON line to the grader's log, when there is one."""
    path = os.environ.get(GRADE_LOG_ENV)
    if not path:
        return
    try:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
    except OSError:
        pass  # a missing log must never break the learner's notebook
