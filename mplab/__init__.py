"""mplab: the library behind the mixed precision lessons. ARCHITECTURE.md maps it.

`mplab.diagnose(result)` (from mplab.diagnosis) is the one name kept at the top: why did my
run break, and how do I fix it. It is imported on first use, so `import mplab` stays light.
The packages, lowest first: `numerics` (formats, casts, what breaks), `amp` (GradScaler,
autocast's trace, the audit), `lowbit` (FP8, MX, NVFP4), `plots`, `train`, `bench`,
`diagnosis`, and the teaching on top: `widgets`, `exercises`, `grade`.
"""

import logging

from mplab._moved import MplabDeprecationWarning, install

__all__ = ["diagnose", "MplabDeprecationWarning"]

# transformers imports torchao (a requirement, for lesson 9) when it loads a model; on a CPU
# torchao then logs a warning per CUDA kernel it cannot load, and torch one per enum it
# registers. Neither concerns a learner: keep them out of every lesson's output.
for _name in ("torchao", "torch.utils._pytree"):
    logging.getLogger(_name).setLevel(logging.ERROR)

install()  # the import paths of mplab 0.1.0 (mplab.formats, ...) still work, with a warning


def __getattr__(name: str):
    if name == "diagnose":
        from mplab.diagnosis import diagnose

        return diagnose
    if not name.startswith("_"):  # a package on first use: `import mplab; mplab.diagnosis.Watch`
        import importlib

        try:
            return importlib.import_module(f"mplab.{name}")
        except ModuleNotFoundError as err:
            if err.name != f"mplab.{name}":
                raise
    raise AttributeError(f"module 'mplab' has no attribute {name!r}")
