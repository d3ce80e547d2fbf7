"""What every training path shares: data, the model, evaluation, processes, and measurements."""

from __future__ import annotations

import os
import resource
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from mplab import data, models
from mplab.hardware import describe, has_units, no_units_reason, resolve_device, time_matmul

from .config import TrainConfig


class TrainWarning(UserWarning):
    """Something about a run the learner should know: slow hardware, a setting with a cost."""


class NonFiniteLossError(FloatingPointError):
    """The loss became inf or NaN; `.result` holds the record up to the step before."""

    def __init__(self, message: str, result):
        super().__init__(message)
        self.result = result


# ---- processes ------------------------------------------------------------------------------

@dataclass
class Processes:
    """This process's place in a `torchrun` job (rank 0 of 1 when run alone)."""

    rank: int
    world_size: int
    device: torch.device
    started_group: bool = False  # we called init_process_group, so we destroy it

    @property
    def main(self) -> bool:
        return self.rank == 0

    @classmethod
    def start(cls, device: str, group: bool = False) -> Processes:
        """Read torchrun's RANK / WORLD_SIZE / LOCAL_RANK and join the process group: gloo on a
        CPU, NCCL on GPUs (one GPU per process, cuda:LOCAL_RANK). Alone, a process joins a
        group of one only with `group` (FSDP2 shards over a group even of one)."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        dev = resolve_device(device)
        if world == 1 and not group:
            return cls(0, 1, dev)
        import torch.distributed as dist

        if world == 1 and not dist.is_initialized():  # no torchrun: a store in this process
            dist.init_process_group("nccl" if dev.type == "cuda" else "gloo",
                                    store=dist.HashStore(), rank=0, world_size=1)
            return cls(0, 1, dev, started_group=True)

        if dev.type == "cuda":
            dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            torch.cuda.set_device(dev)
        started = not dist.is_initialized()
        if started:
            dist.init_process_group("nccl" if dev.type == "cuda" else "gloo")
        return cls(dist.get_rank(), dist.get_world_size(), dev, started)

    def mean(self, value: torch.Tensor) -> torch.Tensor:
        """The mean of a scalar over all processes (itself when alone)."""
        if self.world_size == 1:
            return value
        import torch.distributed as dist

        value = value.clone()
        dist.all_reduce(value)
        return value / self.world_size

    def barrier(self) -> None:
        if self.world_size > 1:
            import torch.distributed as dist

            dist.barrier()

    def close(self) -> None:
        if self.started_group:
            import torch.distributed as dist

            dist.destroy_process_group()


# ---- checks on precision and hardware --------------------------------------------------------

def check_precision(precision: str, device: torch.device) -> None:
    """bf16 needs a GPU with bf16 units (Ampere or newer); fp16 and bf16 run on any CPU."""
    if precision == "bf16" and device.type == "cuda" and not _cuda_bf16(device):
        name = torch.cuda.get_device_name(device)
        raise ValueError(f"precision 'bf16' was asked for, but {name} has no bf16 support "
                         f"(compute capability {torch.cuda.get_device_capability(device)}); "
                         "accepted on this GPU: 'fp16' (with a GradScaler), 'fp32'")


def _cuda_bf16(device: torch.device) -> bool:
    with torch.cuda.device(device):
        try:  # torch >= 2.4 counts emulated bf16 as "supported" unless told not to
            return torch.cuda.is_bf16_supported(including_emulation=False)
        except TypeError:
            return torch.cuda.is_bf16_supported()


def low_precision_cost(precision: str, device: torch.device) -> tuple[float, str] | None:
    """(slowdown, warning) where fp16/bf16 on a CPU is measured slow, else None: how many
    times as long a 256x256 matmul takes in `precision` as in fp32, and the words for it.

    Times the matmul in fp32 and in `precision` on one thread (about 0.1 s): bigger matmuls
    show the gap better, but this is paid before every CPU run in low precision.
    """
    if device.type != "cpu" or precision == "fp32":
        return None
    fp32, low = (time_matmul(256, p, "cpu", budget_s=0.2, max_repeats=8, threads=1).best
                 for p in ("fp32", precision))
    ratio = low / fp32
    if ratio < 1.5:
        return None
    why = (no_units_reason(precision) if not has_units(precision)
           else "torch has no fast kernel for it here")
    return ratio, (f"{precision} on this CPU is slow: a 256x256 matmul (1 thread) took "
                   f"{low * 1e3:.2f} ms in {precision} against {fp32 * 1e3:.3f} ms in fp32 "
                   f"({ratio:.0f}x slower), because {why}. Training runs correctly but slower "
                   "than fp32; use fp32 here, or a GPU (or a CPU with AMX / AVX-512 units) to "
                   "see low precision pay off.")


def device_name(device: torch.device) -> str:
    return describe(device.type).partition(": ")[2]


# ---- the optimizer ---------------------------------------------------------------------------

def decay_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """AdamW's parameter groups by one rule on every path, the Trainer's (and nanoGPT's):
    weights with two or more dimensions (matmul weights, embedding tables) decay; biases and
    norm weights, one dimension each, do not, as shrinking them toward 0 only hurts."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


# ---- model and data -------------------------------------------------------------------------

def load_model(config: TrainConfig, num_labels: int, model=None, tokenizer=None):
    """(model, tokenizer, name): the one given, the lesson model, or `load_pretrained`'s."""
    if model is not None:
        if not isinstance(model, torch.nn.Module):
            raise ValueError(f"model must be a torch.nn.Module, 'lesson', or a hub name / saved "
                             f"folder; got {type(model).__name__}")
        return model, tokenizer or models.lesson_tokenizer(), type(model).__name__
    if config.model in ("lesson", "lesson-pretrained"):
        pretrained = config.model == "lesson-pretrained"
        return (models.lesson_model(num_labels, seed=config.seed, pretrained=pretrained),
                models.lesson_tokenizer(), config.model)
    where = models.minilm_path() if config.model == "minilm" else config.model
    loaded, loaded_tokenizer = models.load_pretrained(where, num_labels=num_labels)
    return loaded, tokenizer or loaded_tokenizer, config.model


_ENCODED: dict[tuple, tuple] = {}  # the last few encodings: 1.4 s each for the lesson data


def encoded_splits(config: TrainConfig, tokenizer, train: data.TextDataset):
    """The train split and (the first `eval_samples` of) the test split, encoded; no test
    split with eval_samples=0. Repeated runs (a notebook, the tests) reuse the tensors."""
    key = (tokenizer.name_or_path, len(tokenizer), train.source, len(train), config.dataset,
           config.max_length, config.eval_samples)
    if key not in _ENCODED:
        train_enc = data.encode(tokenizer, train.texts, train.labels,
                                max_length=config.max_length)
        test_enc = None
        if config.eval_samples != 0:
            test = data.load_dataset(config.dataset, "test")
            n = config.eval_samples or len(test)
            test_enc = data.encode(tokenizer, test.texts[:n], test.labels[:n],
                                   max_length=config.max_length)
        while len(_ENCODED) >= 4:
            _ENCODED.pop(next(iter(_ENCODED)))
        _ENCODED[key] = (train_enc, test_enc)
    return _ENCODED[key]


def global_batches(encoded, size: int, config: TrainConfig, device: torch.device,
                   epoch: int = 0, position: int = 0) -> Iterator[tuple[int, int, dict]]:
    """(epoch, index in epoch, batch) forever, from `epoch`/`position` on.

    Each epoch's order comes from `seed` and the epoch number alone, so a resumed run
    re-creates it and skips the batches already trained on. Incomplete batches are dropped:
    every step then averages the same number of reviews.
    """
    while True:
        seed = epoch_seed(config, epoch)
        for index, batch in enumerate(data.batches(encoded, size, seed=seed, device=device,
                                                   drop_last=True, by_length=config.by_length)):
            if index >= position:
                yield epoch, index, batch
        epoch, position = epoch + 1, 0


def epoch_seed(config: TrainConfig, epoch: int) -> int:
    """The seed of one epoch's order: from the run's seed and the epoch number alone."""
    return config.seed * 100_000 + epoch


def model_inputs(batch: dict, config: TrainConfig) -> dict:
    """The keyword arguments besides input_ids: the attention mask when asked for and there."""
    if config.attention_mask and "attention_mask" in batch:
        return {"attention_mask": batch["attention_mask"]}
    return {}


@torch.no_grad()
def accuracy(model, encoded, config: TrainConfig, device: torch.device, autocast) -> float:
    """Test accuracy, called the way training calls the model (same mask policy, autocast)."""
    was_training = model.training
    model.eval()
    right = total = 0
    for batch in data.batches(encoded, 128, shuffle=False, device=device,
                              by_length=config.by_length):
        with autocast:
            logits = model(batch["input_ids"], **model_inputs(batch, config)).logits
        right += (logits.argmax(-1) == batch["labels"]).sum().item()
        total += len(batch["labels"])
    model.train(was_training)
    return right / total


# ---- measurements ---------------------------------------------------------------------------

def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory(device: torch.device) -> tuple[int, str]:
    """(bytes, what they measure): GPU tensors since the reset, or the process's peak RSS."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device), "cuda max_memory_allocated"
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak * (1 if sys.platform == "darwin" else 1024), "process peak RSS"


def non_finite_message(step: int, loss: float, precision: str, lr: float,
                       losses: list[float]) -> str:
    """Why a loss became inf/NaN, most likely first, for the step it happened at."""
    before = (f" The {len(losses)} step{'s' if len(losses) != 1 else ''} before "
              f"{'were' if len(losses) != 1 else 'was'} finite." if losses else "")
    head = (f"step {step}: the loss is {loss}, so training stopped (every later step would be "
            f"{loss} too).{before}")
    causes = []
    if not losses:
        causes.append("the very first loss is not finite, before any update: look at the "
                      "model and the data (a model pretrained in bf16 can overflow in fp16)")
    if precision == "fp16":
        causes.append("an activation overflowed fp16 (largest value 65504) in the forward "
                      "pass; a GradScaler cannot help there, it only scales gradients. Try "
                      "bf16 (fp32's range) or fp32, and find the layer with mplab.trace")
    if losses and (max(losses[-5:]) > 2 * min(losses) or lr >= 1e-2):
        causes.append(f"the learning rate (lr={lr:g}) is too high: the weights diverged "
                      f"(the loss went from {min(losses):.4g} up to {max(losses[-5:]):.4g} "
                      f"before it broke). Lower it, e.g. to {lr / 10:g}, or clip gradients "
                      "with max_grad_norm")
    if not causes:
        causes.append(f"the weights diverged; lower the learning rate (lr={lr:g}) or clip "
                      "gradients with max_grad_norm")
    return head + "\nLikely cause: " + "\nOr: ".join(causes) + "."
