"""Graded exercises: checks that explain, staged hints, reference answers, a grading log.

A lesson module (``lesson1``, ...) builds a :class:`Lesson` from :class:`Exercise` records and
exposes its methods, so a notebook writes::

    from mplab.exercises import lesson1 as ex
    ex.check("1.2", answer)   # passed / failed / not attempted / error, and why
    ex.hint("1.2")            # one more hint per call: concept -> API -> nearly the answer
    ex.solution("1.2")        # the reference cell (the grader's report notes the reveal)

The library is the one source of what a notebook shows for an exercise: the markdown cell right
before its cell is ``Lesson.task_markdown(id)`` (the title and the whole task), and the cell is
the exercise's starter. ``python -m mplab.exercises.sync NOTEBOOK...`` rewrites them from here.

Every call returns a :class:`Result`, which prints as text and renders as a coloured box in
Jupyter. ``check`` never raises for anything a learner passes: a blank answer (``...`` or
None) is "not attempted", a wrong one "failed" with the concept that was missed, and an
exception from the learner's code "error" with its message (no traceback).

The grader (``python -m mplab.grade``) runs a notebook with ``MPLAB_GRADING=1`` (hidden checks
on), ``MPLAB_GRADE_SEED`` (the run's seed, from which hidden inputs are drawn) and
``MPLAB_GRADE_LOG=<file>``: check/hint/solution append one JSON line per call there. A check's
line carries the answer as data (a function answer as the record of its calls), and the grader
checks it again in its own process (:mod:`mplab.exercises.answers`): the line's verdict is
evidence, not the score.
"""

from mplab.exercises.framework import (
    CELL_METADATA_KEY,
    GRADE_LOG_ENV,
    GRADING_ENV,
    HIDDEN_FAILED,
    MAX_ANSWER_BYTES,
    SEED_ENV,
    STATUSES,
    Exercise,
    Incorrect,
    Lesson,
    Result,
    as_number,
    call,
    cell,
    choice_list,
    grade_seed,
    grading,
    in_order,
    is_blank,
    multiple_choice,
    one_letter,
    pack_answer,
    python_block,
    same_tensors,
    unpack_answer,
    untouched,
)

__all__ = ["Result", "Exercise", "Lesson", "Incorrect", "STATUSES", "is_blank", "untouched", "cell",
           "choice_list", "one_letter", "multiple_choice", "same_tensors", "in_order",
           "python_block", "grading", "as_number", "call", "GRADING_ENV", "GRADE_LOG_ENV",
           "CELL_METADATA_KEY", "HIDDEN_FAILED", "pack_answer", "unpack_answer", "MAX_ANSWER_BYTES",
           "SEED_ENV", "grade_seed"]
