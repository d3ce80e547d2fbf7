"""Reading a training record: the figures several checks share (the loss's fall in words,
skipped steps at the end, a setting, the audit's fallbacks)."""

from __future__ import annotations

import math
import statistics

from mplab.train.result import TrainResult

__all__ = ["finite", "median", "loss_drop", "loss_words", "trailing_skips", "setting",
           "fallback"]


def finite(values) -> list[float]:
    return [v for v in values if isinstance(v, (int, float)) and math.isfinite(v)]


def median(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def loss_drop(losses: list[float]) -> float | None:
    """How much the loss fell, relative: mean of the first quarter (up to 10) against the
    last; None with under 8 finite losses."""
    losses = finite(losses)
    if len(losses) < 8:
        return None
    k = max(2, min(10, len(losses) // 4))
    first, last = sum(losses[:k]) / k, sum(losses[-k:]) / k
    return (first - last) / first if first else None


def loss_words(result: TrainResult) -> str:
    losses = finite(result.losses)
    drop = loss_drop(result.losses)
    if drop is None:
        return ""
    k = max(2, min(10, len(losses) // 4))
    first, last = sum(losses[:k]) / k, sum(losses[-k:]) / k
    moved = f"fell by {drop:.1%}" if drop >= 0 else f"rose by {-drop:.1%}"
    return (f"over {len(losses)} steps the loss {moved}: {first:.4f} on average over the first "
            f"{k} steps, {last:.4f} over the last {k}")


def trailing_skips(result: TrainResult) -> int:
    skipped, n, count = set(result.skipped_steps), len(result.losses), 0
    while n - count >= 1 and (n - count) in skipped:
        count += 1
    return count


def setting(result: TrainResult, name: str, default: float) -> float:
    value = result.config.get(name, default)
    return value if isinstance(value, (int, float)) else default


def fallback(result: TrainResult, *codes: str) -> str | None:
    """The text of the audit's first fallback with one of `codes`, or None."""
    found = result.audit.fallbacks if result.audit is not None else []
    return next((f.text for f in found if f.code in codes), None)
