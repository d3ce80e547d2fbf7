"""mplab: the library behind the mixed precision lessons.

`mplab.diagnose(result)` (from mplab.diagnosis) is the one name kept at the top: why did my
run break, and how do I fix it. It is imported on first use, so `import mplab` stays light.
"""


def __getattr__(name: str):
    if name == "diagnose":
        from mplab.diagnosis import diagnose

        return diagnose
    raise AttributeError(f"module 'mplab' has no attribute {name!r}")
