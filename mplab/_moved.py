"""The import paths of mplab 0.1.0, before its modules were grouped into packages, kept working
in 0.2 (gone in 0.3): importing one warns once and hands back the module's new home.

    import mplab.formats           # MplabDeprecationWarning: now mplab.numerics.formats
    from mplab.train.common import decay_groups   # split: found in mplab.train.run

Installed by ``mplab/__init__.py`` as a finder at the end of ``sys.meta_path``, so it is asked
only for names no real module answers to.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings

__all__ = ["MOVED", "SPLIT", "MplabDeprecationWarning", "install"]

#: old module -> the module it became.
MOVED = {
    "mplab.parse": "mplab.numerics.parse",
    "mplab.formats": "mplab.numerics.formats",
    "mplab.explain": "mplab.numerics.explain",
    "mplab.casts": "mplab.numerics.casts",
    "mplab.histograms": "mplab.numerics.histograms",
    "mplab.failures": "mplab.numerics.failures",
    "mplab.bf16": "mplab.numerics.bf16_updates",
    "mplab.quantize": "mplab.lowbit.quantize",
    "mplab.microscaling": "mplab.lowbit.microscaling",
    "mplab.disagree": "mplab.lowbit.disagree",
    "mplab.accumulate": "mplab.lowbit.accumulator",
    "mplab.train.qdq": "mplab.lowbit.qdq",
    "mplab.scaler": "mplab.amp.scaler",
    "mplab.trace": "mplab.amp.trace",
    "mplab.audit": "mplab.amp.audit",
    "mplab.capture": "mplab.amp.capture",
    "mplab.lab": "mplab.diagnosis.lab",
    "mplab.lessons": "mplab.fixtures",
    "mplab.cast_plots": "mplab.plots.casts",
    "mplab.plan": "mplab.train.plan",
    "mplab.widgets.lesson4": "mplab.widgets.training",
}
#: old module -> the modules its names went to (looked up in this order).
SPLIT = {
    "mplab.train.common": ("mplab.train.errors", "mplab.train.processes", "mplab.train.inputs",
                           "mplab.train.run"),
}


class MplabDeprecationWarning(FutureWarning):
    """An mplab name that moved. A FutureWarning, so that a notebook shows it (Python hides
    DeprecationWarning outside ``__main__``)."""


def _warn(old: str, new: str) -> None:
    warnings.warn(f"{old} moved to {new}; mplab 0.2 still takes the old path, 0.3 will not: "
                  f"import {new}", MplabDeprecationWarning, stacklevel=2)


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        if name in MOVED or name in SPLIT:
            return importlib.machinery.ModuleSpec(name, self)
        return None

    def create_module(self, spec):
        return None  # a placeholder module, replaced in exec_module

    def exec_module(self, module):
        name = module.__name__
        if name in MOVED:
            _warn(name, MOVED[name])
            # importlib returns what sys.modules holds under the name after this call
            sys.modules[name] = importlib.import_module(MOVED[name])
            return
        homes = [importlib.import_module(m) for m in SPLIT[name]]
        _warn(name, " / ".join(SPLIT[name]))

        def __getattr__(attr):
            for home in homes:
                if hasattr(home, attr):
                    return getattr(home, attr)
            raise AttributeError(f"{name} had no {attr!r}; it was split into "
                                 f"{', '.join(SPLIT[name])}")

        module.__getattr__ = __getattr__
        module.__doc__ = f"Moved: split into {', '.join(SPLIT[name])}."


def install() -> None:
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.append(_Finder())
