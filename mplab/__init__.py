"""mplab: the library behind the mixed precision lessons.

`mplab.diagnose(result)` (from mplab.diagnosis) is the one name kept at the top: why did my
run break, and how do I fix it. It is imported on first use, so `import mplab` stays light.
"""

import logging

# transformers imports torchao (a requirement, for lesson 9) when it loads a model; on a CPU
# torchao then logs a warning per CUDA kernel it cannot load, and torch one per enum it
# registers. Neither concerns a learner: keep them out of every lesson's output.
for _name in ("torchao", "torch.utils._pytree"):
    logging.getLogger(_name).setLevel(logging.ERROR)


def __getattr__(name: str):
    if name == "diagnose":
        from mplab.diagnosis import diagnose

        return diagnose
    raise AttributeError(f"module 'mplab' has no attribute {name!r}")
