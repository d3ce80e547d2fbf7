"""Jobs the FSDP tests run in every process of a torchrun job (`launch.run_across`), where a
test's own Python function cannot be passed: the test puts this folder on PYTHONPATH."""

from mplab.train import train


def losses(stop_at: int | None = None, **config) -> dict:
    """Train (until step `stop_at`, then stop as Ctrl-C would); what a resume must repeat."""
    def stop(step, result):
        if step == stop_at:
            raise KeyboardInterrupt
    try:
        result = train(on_step=stop, **config)
    except KeyboardInterrupt:
        return {"stopped_at": stop_at}
    return {"losses": result.losses, "scales": result.scales,
            "resumed_from": result.resumed_from}
