"""What a run trains on: the model it loads, the splits it encodes, the batches of every epoch
(the same on every path and after a resume), the inputs the model is called with, and its test
accuracy."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from mplab import data, models

from .config import TrainConfig

__all__ = ["load_model", "encoded_splits", "global_batches", "epoch_seed", "model_inputs",
           "accuracy"]


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


_ENCODED: dict[tuple, tuple] = {}  # the last few encodings, each slow (benchmarks/RECORDS.md)


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
