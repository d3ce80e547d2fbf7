"""Lesson 8's widget: the bytes per GPU of a model no CPU can train, planned.

    from mplab.widgets import lesson8
    lesson8.planner()            # parameters, ranks, policy, sharding, GPU -> GB per GPU, fits?
"""

from __future__ import annotations

import html

import ipywidgets as widgets

from mplab._display import Table
from mplab.train import plan
from mplab.widgets._common import StaticView, guarded

__all__ = ["RANKS", "GPUS", "COLOURS", "Planner", "planner"]

RANKS = plan.RANKS
GPUS = {"80 GB (A100 / H100)": 80, "141 GB (H200)": 141, "24 GB": 24}
COLOURS = {"weights": "#4c72b0", "gradients": "#dd8452", "master": "#55a868",
           "optimizer": "#c44e52", "transient": "#8172b3", "buckets": "#937860"}


class Planner(StaticView, widgets.VBox):
    """Sliders and pickers for `mplab.train.plan.memory`; shows each part's GB per GPU as a bar
    against the GPU's memory and whether it fits. As data: `memory` (the plan.Memory shown, or
    None after a setting it refuses), `rows` (a Table of the parts), `message` (the refusal)."""

    def __init__(self, parameters: float = 7e9, world_size: int = 8,
                 policy: str = "bf16_master", sharding: str = "zero3", gpu_gb: float = 80):
        super().__init__()
        plan.memory(parameters, policy, world_size, sharding)  # a bad start raises, clearly
        if world_size not in RANKS:
            raise ValueError(f"world_size must be one of {', '.join(map(str, RANKS))}, got "
                             f"{world_size!r}")
        if gpu_gb not in GPUS.values():
            raise ValueError(f"gpu_gb must be one of {', '.join(map(str, GPUS.values()))}, got "
                             f"{gpu_gb!r}")
        self.memory: plan.Memory | None = None
        self.rows = Table([], title="")
        self.parameters = widgets.FloatLogSlider(value=parameters, base=10, min=8, max=12,
                                                 step=0.05, description="parameters",
                                                 readout_format=".3g")
        self.ranks = widgets.Dropdown(options=RANKS, value=world_size, description="GPUs")
        self.policy = widgets.Dropdown(options=list(plan.POLICIES), value=policy,
                                       description="policy")
        self.sharding = widgets.Dropdown(options=list(plan.SHARDINGS), value=sharding,
                                         description="sharding")
        self.gpu = widgets.Dropdown(options=list(GPUS.items()), value=gpu_gb,
                                    description="GPU")
        self.view = widgets.HTML()
        self.message = widgets.HTML()
        for control in (self.parameters, self.ranks, self.policy, self.sharding, self.gpu):
            control.observe(lambda change: self._update(), names="value")
        for name in ("parameters", "ranks", "policy", "sharding", "gpu", "view", "message"):
            getattr(self, name).add_class(f"mplab-planner-{name}")  # for the browser test
        self.add_class("mplab-planner")
        self.children = [widgets.HBox([self.parameters, self.ranks]),
                         widgets.HBox([self.policy, self.sharding, self.gpu]),
                         self.view, self.message]
        self._update()

    @guarded
    def _update(self) -> None:
        self.message.value = ""
        try:
            memory = plan.memory(self.parameters.value, self.policy.value, self.ranks.value,
                                 self.sharding.value)
        except ValueError as err:  # a combination the planner refuses: said, nothing lost
            self.memory, self.rows = None, Table([], title="")
            self.view.value = ""
            self.message.value = f"<span style='color:#b00020'>{html.escape(str(err))}</span>"
            return
        self.memory = memory
        gpu = self.gpu.value
        self.rows = Table([{"part": r["part"], "GB per GPU": round(r["bytes"] / plan.GB, 3),
                            "bytes per parameter": round(r["per parameter"], 3)}
                           for r in memory.rows()],
                          title=f"{memory.parameters / 1e9:.3g}B parameters, {memory.policy}, "
                                f"{memory.sharding}, {memory.world_size} GPUs")
        self.view.value = _bar(memory, gpu) + self.rows._repr_html_()


def _bar(memory: plan.Memory, gpu_gb: float) -> str:
    """The parts as one stacked bar, scaled to the GPU's memory (or to the total, past it)."""
    total, width = memory.peak / plan.GB, 420
    scale = width / max(total, gpu_gb)
    parts = "".join(
        f"<div title='{r['part']}' style='display:inline-block;height:18px;"
        f"width:{max(1, round(r['bytes'] / plan.GB * scale))}px;background:{COLOURS[r['part']]}'>"
        "</div>" for r in memory.rows())
    limit = round(gpu_gb * scale)
    fits = memory.fits(gpu_gb)
    verdict = (f"<b style='color:#1a7f37'>fits</b>: {total:.3g} GB of {gpu_gb:g} GB"
               if fits else f"<b style='color:#b00020'>does not fit</b>: {total:.3g} GB against "
                            f"{gpu_gb:g} GB, before any activation")
    legend = " ".join(f"<span style='color:{COLOURS[r['part']]}'>■</span> {r['part']}"
                      for r in memory.rows())
    return (f"<div style='position:relative;width:{width}px;border:1px solid #ccc'>{parts}"
            f"<div style='position:absolute;top:0;left:{limit}px;height:18px;"
            f"border-left:2px dashed #000'></div></div><div>{legend}</div><p>{verdict}</p>")


def planner(**settings) -> Planner:
    """The planner, starting from `settings` (parameters, world_size, policy, sharding,
    gpu_gb)."""
    return Planner(**settings)
