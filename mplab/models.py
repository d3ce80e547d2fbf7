"""The lesson model, its tokenizer, and loading any Hugging Face model by hub name or path.

    tokenizer = lesson_tokenizer()                 # data/sentiment/tokenizer, offline
    model = lesson_model()                         # a small BERT, random weights, seed 0
    model, tokenizer = load_pretrained("path/or/hub-name")

The lesson model is a real `BertForSequenceClassification`, just small (324 k parameters:
hidden 128, 2 layers, 4 heads, feed-forward 256, no dropout), so a training step on a batch of
32 lesson reviews takes 30-45 ms on 2 CPU cores and every lesson can train it for real.
`load_pretrained` is the code path a hub model takes too, so what a lesson shows on the
lesson model carries over.
"""

from __future__ import annotations

from pathlib import Path

import torch

from mplab.data import DATA_DIR

LESSON_TOKENIZER = DATA_DIR / "sentiment" / "tokenizer"

# The lesson transformer's shape; any BertConfig field can be overridden in lesson_model().
# Measured on the sentiment data, 600 steps of AdamW (lr 1e-3), seeds 0-3: 4 heads reach
# 0.95-0.97 test accuracy where 2 heads reach 0.83-0.96. No dropout: runs that differ only in
# precision then differ only by rounding, and the synthetic data gives nothing to overfit.
LESSON_CONFIG = {"hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                 "intermediate_size": 256, "max_position_embeddings": 64,
                 "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}


def lesson_tokenizer(path: str | Path = LESSON_TOKENIZER):
    """The shipped word-level tokenizer, loaded the way a hub tokenizer is (AutoTokenizer)."""
    from transformers import AutoTokenizer

    path = Path(path)
    if not (path / "tokenizer.json").is_file():
        raise ValueError(f"no tokenizer at {str(path)!r} (tokenizer.json is missing); "
                         "regenerate the shipped one with: python data/make_sentiment.py")
    return AutoTokenizer.from_pretrained(str(path))


def lesson_model(num_labels: int = 2, seed: int = 0, **config_overrides):
    """A small BertForSequenceClassification with random weights drawn from `seed`.

    Its vocabulary is the shipped tokenizer's. `config_overrides` go to `BertConfig`, e.g.
    `lesson_model(num_hidden_layers=4, hidden_dropout_prob=0.0)`. The weights depend only on
    `seed`; torch's global random state is left as it was.
    """
    from transformers import BertConfig, BertForSequenceClassification

    if isinstance(num_labels, bool) or not isinstance(num_labels, int) or num_labels < 1:
        raise ValueError(f"num_labels must be a positive integer, got {num_labels!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an integer, got {seed!r}")
    tokenizer = lesson_tokenizer()
    settings = {"vocab_size": len(tokenizer), "pad_token_id": tokenizer.pad_token_id,
                **LESSON_CONFIG, "num_labels": num_labels, **config_overrides}
    try:
        config = BertConfig(**settings)
    except (TypeError, ValueError) as err:
        raise ValueError(f"BertConfig rejected the settings {config_overrides!r}: {err}") from err
    if config.hidden_size % config.num_attention_heads:
        raise ValueError(f"hidden_size ({config.hidden_size}) must be a multiple of "
                         f"num_attention_heads ({config.num_attention_heads})")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = BertForSequenceClassification(config)
    return model


def load_pretrained(name_or_path: str | Path, num_labels: int = 2):
    """(model, tokenizer) for a sequence-classification model, by hub name or local folder.

    The same call that loads "bert-base-uncased" from the hub loads a folder written by
    `model.save_pretrained(folder)` and `tokenizer.save_pretrained(folder)`. A model trained
    for another task gets a fresh classification head with `num_labels` outputs.
    """
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    name = str(name_or_path)
    path = Path(name).expanduser()
    if isinstance(name_or_path, Path) or name.startswith((".", "~", "/")) or path.exists():
        if not (path / "config.json").is_file():
            raise ValueError(f"{name!r} is not a saved model folder (no config.json there); "
                             "give a folder written by save_pretrained(), or a hub name such "
                             "as 'prajjwal1/bert-tiny'")
        name = str(path)
    try:
        model = AutoModelForSequenceClassification.from_pretrained(
            name, num_labels=num_labels, ignore_mismatched_sizes=True)
        tokenizer = AutoTokenizer.from_pretrained(name)
    except OSError as err:  # not on the hub, no network, or HF_HUB_OFFLINE=1 and not cached
        raise ValueError(f"could not load {name!r}: {err}\nGive a folder written by "
                         "save_pretrained(), or a hub name that this machine can download or "
                         "has in its Hugging Face cache") from err
    return model, tokenizer
