"""How long the precision explorer's callbacks take: each interaction must stay under 100 ms.

    python benchmarks/bench_explorer.py               # in a fresh ipykernel (the real cost)
    python benchmarks/bench_explorer.py --in-process  # here, without a kernel

In a kernel every widget update becomes a comm message on the iopub socket, as it does when
a learner clicks in JupyterLab; in process the messages go nowhere, so that figure is the
computing and drawing alone. Prints median and max milliseconds per kind of interaction, then
the ulp plot's frames: `plots.MarkerPng` against a savefig of the whole figure.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import textwrap

BENCH = textwrap.dedent('''
    import statistics, time
    from mplab.widgets.lesson1 import precision_explorer, presets

    def bench(n=20, budget_ms=100):
        t0 = time.perf_counter()
        ex = precision_explorer(0.1)
        build_ms = (time.perf_counter() - t0) * 1e3
        texts = ["0.1", "1e-8", "1/3", "2**-24", "pi", "65504", "-3.75", "70000", "448", "1e-3"]
        rows = list(ex.rows.values())
        # each kind: a list of n zero-argument actions, run one at a time
        kinds = {
            "type a number": [lambda t=texts[i % len(texts)]: setattr(ex.text, "value", t)
                              for i in range(n)],
            "pick a preset": [lambda v=presets()[i % len(presets())][1]:
                              setattr(ex.preset, "value", v) for i in range(n)],
            "flip a bit": [lambda r=rows[i % len(rows)], i=i:
                           r.buttons[(3 * i) % r.f.bits].click() for i in range(n)],
            "step ◀ ▶": [lambda r=rows[i % len(rows)], i=i: (r.up if i % 2 else r.down).click()
                         for i in range(n)],
        }
        print(f"build: {build_ms:.0f} ms (once, when the cell runs)")
        print(f"{'interaction':<16}{'median ms':>10}{'max ms':>10}   (n = {n} each)")
        worst = 0.0
        for kind, actions in kinds.items():
            ex.value = 0.1
            times = []
            for act in actions:
                t = time.perf_counter()
                act()
                times.append((time.perf_counter() - t) * 1e3)
            assert not ex.message.value.count("wrong"), ex.message.value
            worst = max(worst, max(times))
            print(f"{kind:<16}{statistics.median(times):>10.1f}{max(times):>10.1f}")
        verdict = "under" if worst < budget_ms else "OVER"
        print(f"slowest interaction {worst:.1f} ms: {verdict} the {budget_ms} ms budget")

    def frames(n=10):
        """plots.MarkerPng against savefig of the whole ulp plot, side by side (RECORDS.md)."""
        import io
        from mplab import plots
        t = time.perf_counter()
        frames = plots.MarkerPng(plots.ulp_plot(None, pyplot=False))
        frames.png(0.1)  # the static part drawn once, as the explorer's first view does
        static_ms = (time.perf_counter() - t) * 1e3
        whole, frame = [], []
        for i in range(n):
            t = time.perf_counter()
            frames.fig.savefig(io.BytesIO(), format="png")
            whole.append((time.perf_counter() - t) * 1e3)
            t = time.perf_counter()
            frames.png(10.0 ** (i - 5))
            frame.append((time.perf_counter() - t) * 1e3)
        w, f = statistics.median(whole), statistics.median(frame)
        print(f"ulp plot: built and first frame {static_ms:.0f} ms; savefig of the whole figure "
              f"{w:.0f} ms, a MarkerPng frame {f:.0f} ms ({w / f:.1f}x; medians of {n})")

    bench()
    frames()
''')


def in_kernel() -> None:
    from jupyter_client.manager import start_new_kernel

    km, kc = start_new_kernel(kernel_name="python3", stderr=subprocess.DEVNULL)
    try:
        out = []

        def keep(msg):
            if msg["msg_type"] == "stream":
                out.append(msg["content"]["text"])
            elif msg["msg_type"] == "error":
                out.append("\n".join(msg["content"]["traceback"]))

        reply = kc.execute_interactive(BENCH, timeout=300, output_hook=keep)
        print("".join(out), end="")
        if reply["content"]["status"] != "ok":
            sys.exit(1)
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--in-process", action="store_true",
                        help="time the callbacks here, without a kernel's comm messages")
    args = parser.parse_args()
    if args.in_process:
        print("Precision explorer, in process (no kernel, no comm messages):")
        exec(BENCH, {})
    else:
        print("Precision explorer, in a fresh ipykernel (comm messages sent as in JupyterLab):")
        in_kernel()


if __name__ == "__main__":
    main()
