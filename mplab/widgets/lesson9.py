"""Lesson 9's widget: a recipe below 16 bits on one of the model's own tensors.

    from mplab.widgets import lesson9
    lesson9.recipe_explorer(tensors)   # recipe x block size x tensor -> the scaled values'
                                       # histogram against the format's range, and the cost
"""

from __future__ import annotations

import html

import ipywidgets as widgets
import torch

from mplab import lowbit
from mplab._display import Table
from mplab.widgets._common import StaticView, guarded, png

__all__ = ["NO_BLOCK", "RecipeExplorer", "recipe_explorer"]

NO_BLOCK = "(set by the recipe)"


class RecipeExplorer(StaticView, widgets.VBox):
    """Pick a recipe, its block size and a tensor: see where the scaled values fall against
    the format's range (flushed to zero on the left, saturated on the right) and what the
    recipe cost. As data: `quantized` (the mplab.lowbit.quantize.Quantized shown), `rows` (its
    figures as a Table), `message` (what went wrong, if anything)."""

    def __init__(self, tensors: dict[str, torch.Tensor], recipe: str = "MXFP4",
                 block: int | None = None, tensor: str | None = None):
        super().__init__()
        if not isinstance(tensors, dict) or not tensors or not all(
                isinstance(t, torch.Tensor) and t.dim() == 2 for t in tensors.values()):
            raise ValueError("tensors must be a non-empty dict of name -> 2-D tensor, e.g. "
                             "lowbit.layer_tensors(capture, layer)")
        lowbit.apply(recipe, next(iter(tensors.values())), block)  # a bad start raises, clearly
        if tensor is not None and tensor not in tensors:
            raise ValueError(f"tensor must be one of {', '.join(map(repr, tensors))}, got "
                             f"{tensor!r}")
        self.tensors = tensors
        self.quantized = None
        self.rows = Table([], title="")
        self.recipe = widgets.Dropdown(options=list(lowbit.RECIPES), value=recipe,
                                       description="recipe")
        self.block = widgets.Dropdown(options=self._blocks(recipe), description="block")
        self.block.value = block if block is not None else self._default_block(recipe)
        self.tensor = widgets.Dropdown(options=list(tensors), value=tensor or next(iter(tensors)),
                                       description="tensor")
        self.about = widgets.HTML()
        self.figure = widgets.Image(format="png")
        self.view = widgets.HTML()
        self.message = widgets.HTML()
        self.recipe.observe(self._recipe_changed, names="value")
        for control in (self.block, self.tensor):
            control.observe(lambda change: self._update(), names="value")
        for name in ("recipe", "block", "tensor", "view", "message"):
            getattr(self, name).add_class(f"mplab-recipes-{name}")  # for the browser test
        self.add_class("mplab-recipes")
        self.children = [widgets.HBox([self.recipe, self.block, self.tensor]), self.about,
                         self.figure, self.view, self.message]
        self._update()

    @staticmethod
    def _blocks(recipe: str) -> list:
        return list(lowbit.BLOCKS[recipe] or [NO_BLOCK])

    @staticmethod
    def _default_block(recipe: str):
        return lowbit.DEFAULT_BLOCK.get(recipe, NO_BLOCK)

    def _recipe_changed(self, change) -> None:
        self._swapping = True  # new options first pick their own value: one update, after
        try:
            self.block.options = self._blocks(change["new"])
            self.block.value = self._default_block(change["new"])
        finally:
            self._swapping = False
        self._update()

    @guarded
    def _update(self) -> None:
        if getattr(self, "_swapping", False):
            return
        self.message.value = ""
        recipe, name = self.recipe.value, self.tensor.value
        block = None if self.block.value == NO_BLOCK else self.block.value
        self.about.value = f"<i>{html.escape(lowbit.RECIPES[recipe][0])}</i>"
        try:
            q = lowbit.apply(recipe, self.tensors[name], block)
        except ValueError as err:  # blocks that do not tile this tensor: said, nothing lost
            self.quantized, self.rows = None, Table([], title="")
            self.figure.value, self.view.value = b"", ""
            self.message.value = f"<span style='color:#b00020'>{html.escape(str(err))}</span>"
            return
        self.quantized = q
        self.rows = Table([{"tensor": name, "shape": "x".join(map(str, q.source.shape)),
                            "SQNR (dB)": round(q.sqnr_db, 2),
                            "flushed to 0": f"{100 * q.flushed:.2f} %",
                            "saturated": f"{100 * q.saturated:.2f} %",
                            "bytes per value": round(q.bytes_per_value, 4)}],
                          title=f"{recipe}" + (f", block {block}" if block else ""))
        self.figure.value = png(lowbit.plot_scaled(q, title=f"{q.recipe} on the {name}"))
        self.view.value = self.rows._repr_html_()


def recipe_explorer(tensors: dict[str, torch.Tensor], **settings) -> RecipeExplorer:
    """The explorer over `tensors` (name -> 2-D tensor), starting from `settings` (recipe,
    block, tensor)."""
    return RecipeExplorer(tensors, **settings)
