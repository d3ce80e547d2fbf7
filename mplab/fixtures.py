"""The lessons' fixtures: the things a notebook, its exercises and its widgets look at together.

    batch = lesson_batch(32)          # the first 32 training reviews, as the lesson model eats them
    cap = lesson_capture()            # lesson 2: the lesson model 150 steps in, one step captured
    t = lesson_trace()                # lesson 4: which dtype each op ran in under bf16 autocast
    layer_weight()                    # lesson 1: weight[0, 0] of a freshly initialised Linear
    run = ScalerRun(GradScaler("cpu"))  # lesson 3: the stepper's model, one iteration per call

Each is built from the library (mplab.data, mplab.models, mplab.train, mplab.amp.capture,
mplab.amp.trace) the way a learner would build it, and the expensive ones are cached, so a notebook
and its exercises share one and the same.
"""

from __future__ import annotations

import functools

import torch

from mplab.amp.capture import Capture, capture
from mplab.amp.trace import Trace, trace
from mplab.data import encode, load_dataset
from mplab.models import lesson_model, lesson_tokenizer
from mplab.train import train

__all__ = ["lesson_batch", "lesson_capture", "lesson_trace", "layer_weight", "ScalerRun"]


def lesson_batch(size: int = 32) -> dict[str, torch.Tensor]:
    """The first `size` reviews of the shipped sentiment training set, encoded for the lesson
    model: input_ids, attention_mask and labels on the CPU, padded to the longest of them."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"size must be a positive integer (a number of reviews), got {size!r}")
    reviews = load_dataset("sentiment", "train")
    return encode(lesson_tokenizer(), reviews.texts[:size], reviews.labels[:size])


@functools.cache
def lesson_capture(steps: int = 150, batch_size: int = 32, seed: int = 0) -> Capture:
    """Lesson 2's capture: the lesson model (``lesson_model(seed=seed)``) trained `steps` fp32
    AdamW steps by :func:`mplab.train.train` (lr 1e-3, constant, batches of `batch_size`
    reviews), then one captured step on :func:`lesson_batch` of `batch_size`. A model part-way
    through training, not just initialised: its gradients have changed as its loss fell, as a
    real run's do. ``steps=0`` captures the model as initialised.

    Seconds of training (benchmarks/RECORDS.md); cached, so a notebook and its exercises
    share one capture.
    """
    for name, v, lo in (("steps", steps, 0), ("batch_size", batch_size, 1), ("seed", seed, 0)):
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise ValueError(f"{name} must be an integer of at least {lo}, got {v!r}")
    model = lesson_model(seed=seed)
    if steps:
        train(model=model, steps=steps, batch_size=batch_size, lr=1e-3, schedule="constant",
              warmup_steps=0, eval_samples=0, seed=seed, device="cpu", progress=False)
    return capture(model, lesson_batch(batch_size))


@functools.cache
def lesson_trace() -> Trace:
    """Lesson 4's trace: the lesson model (as initialised) under bf16 autocast on the CPU, one
    forward and backward pass on :func:`lesson_batch` of 4 reviews; cached, so the notebook and
    exercise 4.1 read the same one."""
    return trace(lesson_model(), lesson_batch(4), precision="bf16", device="cpu")


@functools.cache
def layer_weight(seed: int = 0, row: int = 0, col: int = 0) -> float:
    """weight[row, col] of a torch.nn.Linear(768, 768) just initialised under manual_seed(seed):
    the precision explorer's "weight from a model". The caller's random state is left as it
    was."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        layer = torch.nn.Linear(768, 768)
    return layer.weight[row, col].item()


class ScalerRun:
    """Lesson 3's stepper: a small model (``nn.Linear(8, 1)``, seed 0), SGD (lr 0.1) and a loss
    scaler, either :class:`mplab.amp.scaler.GradScaler` or ``torch.amp.GradScaler``, run one
    iteration at a time on a fixed batch, so two runs can be compared step for step."""

    def __init__(self, scaler):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            self.model = torch.nn.Linear(8, 1)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1)
        self.scaler = scaler
        self.x = torch.linspace(-1, 1, 32).reshape(4, 8)

    def iteration(self, inject_inf: bool = False) -> None:
        """Scale the loss, backward, step, update, zero_grad. inject_inf puts an inf in a weight
        gradient first, as an fp16 overflow in the backward pass would."""
        loss = self.model(self.x).pow(2).mean()
        self.scaler.scale(loss).backward()
        if inject_inf:
            self.model.weight.grad[0, 0] = float("inf")
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad()

    def history_rows(self) -> list[dict]:
        """One row per iteration so far (an mplab GradScaler keeps its history): the scale it
        used, whether it found an inf/NaN, whether the step was taken, the new scale and the
        growth tracker. Iterations count from 1, as a training run's steps do."""
        return [{"iteration": r.iteration + 1, "scale used": r.scale,
                 "inf/NaN found": r.found_inf,
                 "step": "taken" if all(r.stepped.values()) else "skipped",
                 "new scale": r.new_scale, "tracker": r.growth_tracker}
                for r in self.scaler.history]

    def agrees_with(self, other: ScalerRun) -> bool:
        """Whether the two runs have the same scaler state (scale, growth tracker, settings)
        and the same weights, bit for bit."""
        return (self.scaler.state_dict() == other.scaler.state_dict()
                and all(torch.equal(a, b) for a, b in zip(self.model.parameters(),
                                                          other.model.parameters())))
