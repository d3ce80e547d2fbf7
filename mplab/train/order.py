"""The torch path's batches for a DataLoader: what the Accelerate and Trainer paths train on.

The torch path draws each step's global batch itself (`common.global_batches`). Accelerate and
the Trainer take a Dataset and a DataLoader instead, and deal its batches to the processes in
turn. `RunOrder` lays the same reviews out in the order that dealing needs, so every path
trains on the same batches and their losses agree.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from mplab import data

from .inputs import epoch_seed

__all__ = ["Rows", "RunOrder", "epoch_layout"]

if TYPE_CHECKING:
    from .run import Run


class Rows(torch.utils.data.Dataset):
    """Reviews in a given order, each cut (or padded on the right) to a given width: item i is
    row `layout[i][0]` of `columns` at width `layout[i][1]`, as a dict of tensors.

    `columns`: a tokenized split as columns: mplab's encoded tensors (`data.encode`), or a
    Hugging Face dataset's token lists (`dataset[:]`); labels as "labels" or "label".
    `keys`: the model inputs to give besides the labels.
    """

    def __init__(self, columns: dict, layout: list[tuple[int, int]], keys=("input_ids",),
                 pad_id: int = 0):
        self.columns, self.layout, self.keys, self.pad_id = columns, layout, list(keys), pad_id
        self.label = "labels" if "labels" in columns else "label"

    def __len__(self) -> int:
        return len(self.layout)

    def __getitem__(self, i: int) -> dict:
        row, width = self.layout[i]
        item = {"labels": torch.as_tensor(self.columns[self.label][row])}
        for key in self.keys:
            value = self.columns[key][row]
            if isinstance(value, torch.Tensor):
                item[key] = value[:width]
            else:  # a token list of the review's own length
                fill = self.pad_id if key == "input_ids" else 0
                item[key] = torch.tensor(list(value[:width]) + [fill] * (width - len(value)))
        return item

    def collate(self, items: list[dict]) -> dict:
        """Items into a batch, each key padded on the right to the batch's widest item: under
        several processes, a process's last evaluation batch is filled up with rows from the
        start of the split (Accelerate's even batches), which are cut to other widths."""
        width = max(len(item["input_ids"]) for item in items)
        batch = {"labels": torch.stack([item["labels"] for item in items])}
        for key in self.keys:
            fill = self.pad_id if key == "input_ids" else 0
            batch[key] = torch.stack([torch.nn.functional.pad(item[key],
                                                              (0, width - len(item[key])),
                                                              value=fill) for item in items])
        return batch


class RunOrder(Rows):
    """The run's training reviews in the order the torch path trains on them, one epoch at a
    time, for a `DataLoader(order, batch_size=config.batch_size)` that Accelerate (alone or
    inside the Trainer) shards over the processes: each process then gets, micro-batch by
    micro-batch, exactly the rows the torch path gives it, each cut (or padded) to the width
    of its global batch, so the losses agree. `set_epoch(e)` (which Accelerate's prepared
    loader calls) switches to epoch e's order. `columns`: the run's own encoded tensors by
    default, or a Hugging Face dataset's columns (see `Rows`).
    """

    def __init__(self, run: Run, columns: dict | None = None, pad_id: int = 0):
        self.run = run
        keys = ["input_ids"] + (["attention_mask"] if run.config.attention_mask else [])
        super().__init__(columns if columns is not None else run.train_data, [], keys, pad_id)
        if len(self.columns[self.label]) != len(run.train_data["labels"]):
            raise ValueError(f"the columns hold {len(self.columns[self.label])} reviews, the "
                             f"run's training split {len(run.train_data['labels'])}: give the "
                             "same split")
        self.set_epoch(run.epoch)

    def set_epoch(self, epoch: int) -> None:
        self.layout = epoch_layout(self.run, epoch)

    def width(self, position: int) -> int:
        """The width of the epoch's global batch number `position`."""
        return self.layout[position * self.run.global_size][1]


def epoch_layout(run: Run, epoch: int) -> list[tuple[int, int]]:
    """(row, width) of each review of `epoch`, laid out for `RunOrder`: the torch path's
    global batches in order, each as its micro-batches, each micro-batch as one
    `batch_size` slice per process (the round-robin order in which Accelerate deals a
    DataLoader's batches to processes); width: the global batch's longest review."""
    config, world = run.config, run.procs.world_size
    lengths = run.train_data["attention_mask"].sum(dim=1)
    layout = []
    for rows in data.batch_rows(run.train_data, run.global_size,
                                seed=epoch_seed(config, epoch), drop_last=True,
                                by_length=config.by_length):
        width = int(lengths[rows].max())
        for micro in range(config.accumulation_steps):
            for rank in range(world):
                start = rank * run.per_process + micro * config.batch_size
                layout += [(int(r), width) for r in rows[start:start + config.batch_size]]
    return layout
