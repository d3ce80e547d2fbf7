"""The lesson datasets: load texts and labels, turn them into tensors, cut them into batches.

    ds = load_dataset("sentiment", "train")          # shipped in data/, no network
    enc = encode(tokenizer, ds.texts, ds.labels)     # {"input_ids", "attention_mask", "labels"}
    for batch in batches(enc, batch_size=32, seed=epoch):
        loss = model(**batch).loss

`load_dataset` takes a shipped name ("sentiment"), a folder holding `<split>.jsonl`, or a
`.jsonl` file; any other name goes to the Hugging Face `datasets` library, if installed.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from mplab.hardware import resolve_device

__all__ = ["DATA_DIR", "TextDataset", "shipped_datasets", "load_dataset", "hf_dataset", "Columns",
           "encode", "batches", "batch_rows"]

DATA_DIR = Path(__file__).resolve().parent.parent / "data"


@dataclass(frozen=True)
class TextDataset:
    """Texts and their integer labels, side by side; `source` says where they came from.

    `label_names[i]` names label i; by default "negative", "positive" for two labels, else
    "0", "1", ...
    """

    texts: list[str]
    labels: list[int]
    source: str
    split: str
    label_names: tuple[str, ...] = ()

    def __post_init__(self):
        if not self.label_names:
            n = max((x for x in self.labels if isinstance(x, int)), default=1) + 1
            names = ("negative", "positive") if n <= 2 else tuple(str(i) for i in range(n))
            object.__setattr__(self, "label_names", names)

    @property
    def num_labels(self) -> int:
        return len(self.label_names)

    def __len__(self) -> int:
        return len(self.texts)

    def __getitem__(self, i: int) -> tuple[str, int]:
        return self.texts[i], self.labels[i]


def shipped_datasets() -> list[str]:
    """Names of the datasets in data/ (folders holding a train.jsonl)."""
    return sorted(p.parent.name for p in DATA_DIR.glob("*/train.jsonl"))


def load_dataset(name_or_path: str | Path = "sentiment", split: str = "train", *,
                 text_field: str = "text", label_field: str = "label") -> TextDataset:
    """Texts and labels of one split of a shipped, local or hub dataset.

    `name_or_path`: a shipped name (see `shipped_datasets()`), a folder with `<split>.jsonl`
    files, a `.jsonl` file (then `split` only names it), or a Hugging Face hub dataset name,
    which needs `pip install datasets` (and a reachable hub, or its local cache).
    """
    if not isinstance(name_or_path, str | Path) or not str(name_or_path).strip():
        raise ValueError(f"dataset must be a name or a path, got {name_or_path!r}; shipped: "
                         f"{_quoted(shipped_datasets())}, or a folder or .jsonl file")
    if not isinstance(split, str):
        raise ValueError(f"split must be a string such as 'train' or 'test', got {split!r}")
    name = str(name_or_path)
    path = Path(name).expanduser()
    if name in shipped_datasets():
        path = DATA_DIR / name
    if path.is_dir():
        splits = sorted(p.stem for p in path.glob("*.jsonl"))
        if split not in splits:
            raise ValueError(f"dataset {name!r} has no split {split!r}; accepted: "
                             f"{_quoted(splits) or 'none (the folder holds no .jsonl files)'}")
        path = path / f"{split}.jsonl"
    if path.is_file():
        texts, labels = _read_jsonl(path, text_field, label_field)
        return _checked(TextDataset(texts, labels, source=str(path), split=split))
    if path.exists() or _looks_like_a_path(name):
        raise ValueError(f"dataset {name!r} is not a folder of .jsonl files or a .jsonl file "
                         f"(no such file or folder); shipped: {_quoted(shipped_datasets())}")
    return _checked(_load_from_hub(name, split, text_field, label_field))


def hf_dataset(name_or_path: str | Path = "sentiment", split: str = "train"):
    """One split as a Hugging Face `datasets.Dataset`, as the Trainer lessons load it: a shipped
    name, a folder of `<split>.jsonl` files or a `.jsonl` file through
    `datasets.load_dataset("json", data_files=...)`; any other name from the hub by the same
    library (where a hub is reachable, or cached). Its rows are `load_dataset`'s, in order.
    Where `datasets` is not installed, the same rows as `Columns` (a shipped name or a path)."""
    found = load_dataset(name_or_path, split)  # the same checks and errors as every path's
    try:
        import datasets
    except ImportError:  # a GPU image without it: the same rows, as the Trainer path reads them
        return Columns({"text": list(found.texts), "label": list(found.labels)})
    if Path(found.source).is_file():
        return datasets.load_dataset("json", data_files={split: found.source}, split=split)
    return datasets.load_dataset(found.source, split=split)


class Columns:
    """Rows as named columns, for where `datasets` is not installed: what the Trainer path asks
    of a `datasets.Dataset` (`map(f, batched=True)`, `[:]`, `select`, `num_rows`), the same
    values in the same order."""

    def __init__(self, columns: dict[str, list]):
        self.columns = columns

    @property
    def num_rows(self) -> int:
        return len(next(iter(self.columns.values()), []))

    @property
    def column_names(self) -> list[str]:
        return list(self.columns)

    def map(self, function, batched: bool = False) -> Columns:
        if not batched:
            raise ValueError("Columns.map applies `function` to all rows at once: "
                             "pass batched=True")
        return Columns({**self.columns, **{k: list(v) for k, v in function(self[:]).items()}})

    def select(self, indices) -> Columns:
        return Columns({k: [v[i] for i in indices] for k, v in self.columns.items()})

    def __getitem__(self, key):
        if key == slice(None):
            return dict(self.columns)
        if isinstance(key, str):
            return self.columns[key]
        raise TypeError(f"Columns takes [:] or a column name, got {key!r}")

    def __len__(self) -> int:
        return self.num_rows


def encode(tokenizer, texts: Sequence[str], labels: Sequence[int] | None = None,
           max_length: int = 64) -> dict[str, torch.Tensor]:
    """Token ids, attention mask and labels as tensors, padded to the longest text.

    Texts longer than `max_length` tokens are truncated. Without `labels` there is no "labels"
    key (for prediction).
    """
    texts = list(texts)
    if not texts:
        raise ValueError("encode got no texts; give a non-empty list of strings")
    bad = next((i for i, t in enumerate(texts) if not isinstance(t, str)), None)
    if bad is not None:
        raise ValueError(f"texts must all be strings; texts[{bad}] is {texts[bad]!r}")
    if labels is not None and len(labels) != len(texts):
        raise ValueError(f"got {len(texts)} texts but {len(labels)} labels; give one label "
                         "per text")
    if not isinstance(max_length, int) or max_length < 2:
        raise ValueError(f"max_length must be an integer of at least 2 (room for [CLS] and "
                         f"[SEP]), got {max_length!r}")
    enc = tokenizer(texts, padding="longest", truncation=True, max_length=max_length,
                    return_tensors="pt")
    out = {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}
    if labels is not None:
        out["labels"] = torch.as_tensor(list(labels), dtype=torch.long)
    return out


def batches(encoded: dict[str, torch.Tensor], batch_size: int = 32, shuffle: bool = True,
            seed: int = 0, device: str | torch.device = "auto", drop_last: bool = False,
            by_length: bool = False) -> Iterator[dict[str, torch.Tensor]]:
    """Yield dicts of `batch_size` rows of `encoded` on `device`, ready for `model(**batch)`.

    The order is a permutation drawn from `seed` (pass the epoch number for a new order each
    epoch) and does not touch torch's global random state. Columns that are padding in every
    row of a batch are dropped, so a batch of short texts costs less. `by_length=True` puts
    texts of similar length together (within pools of 50 batches, in shuffled batch order), so
    batches hold almost no padding: on the lesson data a training step of the lesson model
    takes markedly less time (benchmarks/RECORDS.md).
    """
    dev = resolve_device(device) if isinstance(device, str) else device
    for rows in batch_rows(encoded, batch_size, shuffle, seed, drop_last, by_length):
        batch = {key: value[rows] for key, value in encoded.items()}
        if "attention_mask" in batch:
            used = batch["attention_mask"].any(dim=0)
            batch = {key: value[:, used] if value.dim() == 2 else value
                     for key, value in batch.items()}
        yield {key: value.to(dev) for key, value in batch.items()}


def batch_rows(encoded: dict[str, torch.Tensor], batch_size: int = 32, shuffle: bool = True,
               seed: int = 0, drop_last: bool = False,
               by_length: bool = False) -> list[torch.Tensor]:
    """The row indices of each batch `batches()` yields with the same arguments, in order.

    A training path that batches through its own DataLoader (Accelerate, the Trainer) uses
    them to train on exactly the batches the plain PyTorch path trains on.
    """
    if not isinstance(encoded, dict) or "input_ids" not in encoded:
        raise ValueError("batches takes the dict that encode() returns, with 'input_ids', "
                         f"'attention_mask' and 'labels'; got {type(encoded).__name__}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    n = len(encoded["input_ids"])
    generator = torch.Generator().manual_seed(seed)
    order = torch.randperm(n, generator=generator) if shuffle else torch.arange(n)
    stop = n - n % batch_size if drop_last else n
    if by_length:
        return _grouped_by_length(order[:stop], encoded["attention_mask"].sum(dim=1),
                                  batch_size, generator if shuffle else None)
    return [order[start:start + batch_size] for start in range(0, stop, batch_size)]


def _grouped_by_length(order: torch.Tensor, lengths: torch.Tensor, batch_size: int,
                       generator: torch.Generator | None) -> list[torch.Tensor]:
    pool = batch_size * 50
    groups = []
    for start in range(0, len(order), pool):
        rows = order[start:start + pool]
        rows = rows[torch.argsort(lengths[rows], stable=True)]
        groups += [rows[i:i + batch_size] for i in range(0, len(rows), batch_size)]
    if generator is None:
        return groups
    return [groups[i] for i in torch.randperm(len(groups), generator=generator).tolist()]


def _read_jsonl(path: Path, text_field: str, label_field: str) -> tuple[list[str], list[int]]:
    texts, labels = [], []
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                text, label = row[text_field], row[label_field]
            except (json.JSONDecodeError, KeyError, TypeError) as err:
                raise ValueError(f"{path}, line {number}: expected a JSON object with "
                                 f"{text_field!r} and {label_field!r}, got {line.strip()[:80]!r}"
                                 ) from err
            texts.append(text)
            labels.append(label)
    return texts, labels


def _load_from_hub(name: str, split: str, text_field: str, label_field: str) -> TextDataset:
    try:
        import datasets
    except ImportError:
        raise ValueError(
            f"unknown dataset {name!r}: not a shipped dataset ({_quoted(shipped_datasets())}) "
            "and no file or folder by that name. Datasets from the Hugging Face hub load "
            "through the `datasets` library, which is not installed: pip install datasets"
        ) from None
    try:
        hub = datasets.load_dataset(name, split=split)
    except Exception as err:  # offline, unknown name, unknown split: all say why in `err`
        raise ValueError(f"could not load split {split!r} of dataset {name!r} with the "
                         f"`datasets` library: {err}") from err
    missing = [f for f in (text_field, label_field) if f not in hub.column_names]
    if missing:
        raise ValueError(f"dataset {name!r} has no column {_quoted(missing)}; its columns are "
                         f"{_quoted(hub.column_names)}; pass text_field= / label_field=")
    names = getattr(hub.features.get(label_field), "names", None)
    return TextDataset(list(hub[text_field]), list(hub[label_field]), source=name, split=split,
                       label_names=tuple(names or ()))


def _checked(ds: TextDataset) -> TextDataset:
    if not ds.texts:
        raise ValueError(f"dataset {ds.source!r} (split {ds.split!r}) is empty; a dataset "
                         "needs at least one row of text and label")
    for i, (text, label) in enumerate(zip(ds.texts, ds.labels)):
        if (not isinstance(text, str) or isinstance(label, bool) or not isinstance(label, int)
                or not 0 <= label < ds.num_labels):
            raise ValueError(f"dataset {ds.source!r}, row {i}: expected a string text and an "
                             f"integer label from 0 to {ds.num_labels - 1}, got {text!r} and "
                             f"{label!r}")
    return ds


def _looks_like_a_path(name: str) -> bool:
    return name.endswith(".jsonl") or name.startswith((".", "~", "/")) or "\\" in name


def _quoted(items) -> str:
    return ", ".join(repr(i) for i in items)
