"""Lesson 2's text, read as a learner starting at lesson 2 reads it: the fixes it promises are
the fixes it shows, its terms are defined where first used, and it leaves lesson 4's
exercise 4.4 to be answered there."""

import re
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat", reason="needs nbformat, which is not installed")

from mplab.exercises import lesson4  # noqa: E402

NOTEBOOK = Path(__file__).parent.parent / "notebooks" / "02_underflow_overflow.ipynb"
NUMBERS = {"two": 2, "three": 3, "four": 4, "five": 5, "six": 6}


def cells():
    return nbformat.read(NOTEBOOK, as_version=4).cells


def test_the_intro_counts_the_fixes_the_lesson_shows():
    md = [c.source for c in cells() if c.cell_type == "markdown"]
    sentence = next(s for s in re.split(r"(?<=\.)\s", md[0]) if "fixes" in s)
    word = re.search(r"by (\w+) fixes", sentence).group(1)
    fixes = re.findall(r"\*\*(.+?)\*\*", sentence)
    assert NUMBERS[word] == len(fixes), (word, fixes)
    later = "\n".join(md[1:])
    for fix in fixes:  # each one named again, in bold, where the lesson shows it working
        assert f"**{fix}**" in later, fix


def first_use(term: str) -> str:
    """The markdown cell or exercise prompt where `term` first appears (as a word)."""
    return next(c.source for c in cells()
                if re.search(rf"\b{term}s?\b", c.source) and c.cell_type == "markdown")


def test_ulp_and_binade_are_defined_where_lesson_2_first_uses_them():
    assert "power of two to the next" in first_use("binade")
    assert "unit in the last place" in first_use("ulp")


def test_lesson_2_leaves_exercise_4_4_to_lesson_4():
    """4.4 asks why a feed-forward block's loss is NaN in fp16 (its answer: the activation
    overflows and the LayerNorm after it turns the inf into NaN). Lesson 2 teaches overflow
    and NaN on an attention head instead, and never shows lesson 4's block or its story."""
    answer = lesson4.CHOICES_4_4["b"]
    assert "LayerNorm" in answer and "feed-forward" in answer.lower()
    text = "\n".join(c.source for c in cells())
    assert "overflow_demo(" not in text.replace("attention_overflow_demo(", "")
    for cell in cells():
        words = cell.source.lower()
        if "inf" in words.split() or "nan" in words:
            assert "layernorm" not in words and "layer_norm" not in words, cell.source
            assert "feed-forward" not in words, cell.source
