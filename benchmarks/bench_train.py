"""mplab.train against a bare PyTorch loop, and fp16 / bf16 against fp32, side by side.

    python benchmarks/bench_train.py                       # CPU: about 3 minutes on 2 cores
    python benchmarks/bench_train.py --steps 100 --parity-steps 300
    python benchmarks/bench_train.py --device cuda         # adds a >= 100M-parameter model
    python benchmarks/bench_train.py --choices --threads 1 # the figures in RECORDS.md

1. Overhead. samples/s of `mplab.train` (fp32, bf16) and of the smallest loop that does the
   same arithmetic (autocast, forward, backward, AdamW, the same lr schedule) on the same model,
   the same batches, the same steps, run in back-to-back pairs; the overhead is the median of
   the pairs' ratios (a shared machine's speed drifts, a pair's ratio barely). Target: 5 %.
2. bf16 / fp32 throughput. Target >= 1.5x on a CPU with AVX-512-BF16 or AMX; a CPU without
   bf16 units runs bf16 far slower than fp32, and the table says so.
3. Loss parity: fp16 and bf16 against fp32 from the same seed, the mean of the last 20 losses.
   Target: within 2 %.
4. On CUDA only: fp16 and bf16 against fp32 on a 126M-parameter BERT (the lesson model at
   hidden 1024, 10 layers, built from its config, no download). Target >= 2.5x.

`--choices` prints instead the figures the code's choices rest on (benchmarks/RECORDS.md):
encoding the lesson data, the check `low_precision_cost` runs before a CPU run, a lesson step
with and without `by_length` batches (pairs), and the training panel's redraw against a step.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch

from mplab import data, models
from mplab._display import Table
from mplab.hardware import cpu_features, describe, has_units, resolve_device
from mplab.numerics.formats import dtype_of
from mplab.train import NonFiniteLossError, TrainConfig, TrainWarning, train
from mplab.train.inputs import encoded_splits, global_batches, model_inputs
from mplab.train.run import lr_schedule

OVERHEAD_TARGET, BF16_TARGET, PARITY_TARGET, CUDA_TARGET = 0.05, 1.5, 0.02, 2.5
BIG = {"hidden_size": 1024, "num_hidden_layers": 10, "num_attention_heads": 16,
       "intermediate_size": 4096, "max_position_embeddings": 128}


def bare_loop(config: TrainConfig, batch_list: list[dict], device: torch.device) -> float:
    """Seconds for the steps of the textbook loop: nothing but the arithmetic."""
    model = models.lesson_model(seed=config.seed).to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr,
                                  weight_decay=config.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_schedule(config))
    ctx = torch.autocast(device.type, dtype=dtype_of(config.precision),
                         enabled=config.precision != "fp32")
    scaler = torch.amp.GradScaler(device.type, enabled=config.precision == "fp16")
    sync(device)
    start = time.perf_counter()
    for batch in batch_list:
        with ctx:
            loss = model(batch["input_ids"], labels=batch["labels"],
                         **model_inputs(batch, config)).loss
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
    sync(device)
    return time.perf_counter() - start


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def quiet(**settings):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TrainWarning)
        return train(**settings)


def overhead(device: torch.device, steps: int, batch_size: int, rounds: int) -> dict:
    """Per precision: samples/s of the bare loop and of mplab.train, one pair per round.

    The two of a pair run back to back, in alternating order: on a shared machine the speed
    drifts by 1.5x over seconds, so only a pair's ratio is a fair comparison.
    """
    speeds: dict[tuple[str, str], list[float]] = {}
    train_set = data.load_dataset("sentiment", "train")
    encoded = data.encode(models.lesson_tokenizer(), train_set.texts, train_set.labels)
    for round_ in range(rounds):
        for precision in ("fp32", "bf16"):
            settings = {"precision": precision, "device": device.type, "steps": steps,
                        "batch_size": batch_size, "eval_samples": 0, "progress": False}
            config = TrainConfig(**settings)
            stream = global_batches(encoded, batch_size, config, device)
            batch_list = [next(stream)[2] for _ in range(steps)]  # the library's own batches
            for kind in sorted(("bare loop", "mplab.train"), reverse=round_ % 2 == 1):
                if kind == "bare loop":
                    speed = steps * batch_size / bare_loop(config, batch_list, device)
                else:
                    speed = quiet(**settings).samples_per_s
                speeds.setdefault((precision, kind), []).append(speed)
    return speeds


def parity(device: torch.device, steps: int, batch_size: int) -> dict[str, object]:
    """The same seeded run in each precision; mean of the last 20 losses, accuracy, speed."""
    runs = {}
    for precision in ("fp32", "bf16", "fp16"):
        runs[precision] = quiet(precision=precision, device=device.type, steps=steps,
                                batch_size=batch_size, eval_samples=500, progress=False)
    return runs


def tail(losses: list[float], n: int = 20) -> float:
    return sum(losses[-n:]) / len(losses[-n:])


def cuda_speedup(steps: int, batch_size: int, device: str = "cuda", shape=BIG) -> Table:
    """fp16 / bf16 / fp32 samples/s of a 126M-parameter BERT on the GPU (`device` and `shape`
    let a CPU run the same code on a tiny model, to check it)."""
    rows, base = [], None
    for precision in ("fp32", "fp16", "bf16"):
        settings = {"precision": precision, "device": device, "batch_size": batch_size,
                    "eval_samples": 0, "progress": False, "lr": 1e-4, "warmup_steps": 10}
        # A warm-up run first: CUDA context, cuBLAS handles and kernel choice are paid once.
        quiet(model=models.lesson_model(**shape), steps=3, **settings)
        try:
            run = quiet(model=models.lesson_model(**shape), steps=steps, **settings)
        except NonFiniteLossError as err:
            rows.append({"precision": precision, "matmuls ran in": "-", "samples/s": float("nan"),
                         "speed vs fp32": float("nan"), "final loss": float("nan"),
                         "peak memory GiB": float("nan"), "note": str(err).splitlines()[0]})
            continue
        base = base or run.samples_per_s
        rows.append({"precision": precision, "matmuls ran in": str(run.compute_dtype),
                     "samples/s": run.samples_per_s, "speed vs fp32": run.samples_per_s / base,
                     "final loss": tail(run.losses, 5),
                     "peak memory GiB": run.peak_memory_bytes / 2**30,
                     "note": f"{run.parameters / 1e6:.0f}M parameters"})
    return Table(rows, title=f"{describe(device)}: {steps} steps of batch {batch_size} "
                             f"(target >= {CUDA_TARGET}x over fp32)")


def choices(device: torch.device, steps: int, batch_size: int, rounds: int) -> None:
    """The figures behind the code's choices (benchmarks/RECORDS.md), each printed once."""
    import io

    from mplab.plots import LossCurveWarning, loss_curves_plot
    from mplab.train.errors import low_precision_cost

    train_set, tokenizer = data.load_dataset("sentiment", "train"), models.lesson_tokenizer()
    t = time.perf_counter()
    encoded_splits(TrainConfig(), tokenizer, train_set)  # train and test splits, as a run does
    splits = time.perf_counter() - t
    t = time.perf_counter()
    data.encode(tokenizer, train_set.texts, train_set.labels)
    again = time.perf_counter() - t
    print(f"a run's train and test splits encoded (inputs.encoded_splits, first call): "
          f"{splits:.2f} s; the {len(train_set)} training reviews again: {again:.2f} s")
    if device.type == "cpu":
        for precision in ("bf16", "fp16"):
            t = time.perf_counter()
            low_precision_cost(precision, device)
            print(f"low_precision_cost({precision!r}) before a CPU run: "
                  f"{time.perf_counter() - t:.2f} s")
    step = {True: [], False: []}
    for round_ in range(rounds):  # pairs, alternating which goes first
        for grouped in (True, False) if round_ % 2 == 0 else (False, True):
            run = quiet(precision="fp32", device=device.type, steps=steps,
                        batch_size=batch_size, eval_samples=0, progress=False,
                        by_length=grouped)
            step[grouped].append(run.steady_step_seconds)
    ratio = statistics.median(b / a for a, b in zip(step[True], step[False]))
    grouped, plain = (statistics.median(step[k]) * 1e3 for k in (True, False))
    print(f"a lesson step, fp32, batch {batch_size}: {grouped:.1f} ms with by_length batches, "
          f"{plain:.1f} ms without ({ratio:.2f}x, median of {rounds} pairs)")
    redraws = []
    for _ in range(3):
        t = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", LossCurveWarning)
            loss_curves_plot([run, run], pyplot=False).savefig(io.BytesIO(), format="png")
        redraws.append(time.perf_counter() - t)
    redraw = statistics.median(redraws)
    print(f"the training panel's redraw (loss curves to PNG): {redraw * 1e3:.0f} ms, "
          f"{redraw * 1e3 / grouped:.1f} lesson steps (by_length)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="auto", help="auto, cpu or cuda")
    p.add_argument("--steps", type=int, default=40, help="steps per overhead round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--parity-steps", type=int, default=200)
    p.add_argument("--parity-batch-size", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--cuda-steps", type=int, default=40)
    p.add_argument("--cuda-batch-size", type=int, default=256)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--choices", action="store_true",
                   help="print only the figures behind the code's choices (RECORDS.md)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    feats = cpu_features()
    print(f"{describe(args.device)}; torch {torch.__version__}, {torch.get_num_threads()} "
          f"threads; CPU features: " + ", ".join(f"{k}={'yes' if v else 'no'}"
                                               for k, v in feats.items()))
    if args.choices:
        print()
        choices(device, args.steps, args.batch_size, args.rounds)
        return

    speeds = overhead(device, args.steps, args.batch_size, args.rounds)
    rows = []
    for precision in ("fp32", "bf16"):
        bare, lib = speeds[precision, "bare loop"], speeds[precision, "mplab.train"]
        cost = statistics.median(1 - b / a for a, b in zip(bare, lib))
        rows.append({"precision": precision, "bare loop samples/s (best)": max(bare),
                     "mplab.train samples/s (best)": max(lib),
                     "library overhead (median of pairs)": f"{cost:+.1%}",
                     "within 5 %": "yes" if cost <= OVERHEAD_TARGET else "NO"})
    print()
    print(Table(rows, title=f"overhead: {args.rounds} pairs of {args.steps} steps, batch "
                            f"{args.batch_size}, lesson model on {device.type}"))
    best = {key: max(values) for key, values in speeds.items()}
    ratio = best["bf16", "mplab.train"] / best["fp32", "mplab.train"]
    print(f"\nbf16 / fp32 throughput: {ratio:.2f}x (target >= {BF16_TARGET}x on a CPU with "
          "AVX-512-BF16 or AMX).")
    if device.type == "cpu" and not has_units("bf16"):
        print("This CPU has no bf16 units (no avx512_bf16 / amx_bf16): torch converts every bf16 "
              "element to fp32 and back, so bf16 is slower here and the target cannot be met on "
              "this machine. It is a fact about the hardware, not about the loop.")

    runs = parity(device, args.parity_steps, args.parity_batch_size)
    rows = []
    for name, run in runs.items():
        versus = run.versus(runs["fp32"], last=20)
        rows.append({"precision": name, "matmuls ran in": str(run.compute_dtype),
                     "mean of last 20 losses": tail(run.losses),
                     "vs fp32": f"{versus['loss_change']:+.2%}",
                     "within 2 %": "yes" if abs(versus["loss_change"]) <= PARITY_TARGET else "NO",
                     "accuracy (500)": run.eval_accuracy, "samples/s": run.samples_per_s,
                     "speed vs fp32": versus["speedup"], "skipped steps": len(run.skipped_steps)})
    print()
    print(Table(rows, title=f"loss parity: {args.parity_steps} steps of batch "
                            f"{args.parity_batch_size} from seed 0 on {device.type}"))
    for note in runs["fp16"].warnings:
        print(f"\nfp16: {note}")

    if torch.cuda.is_available() and device.type == "cuda":
        print()
        print(cuda_speedup(args.cuda_steps, args.cuda_batch_size))
    else:
        print("\nNo CUDA GPU here: the >= 100M-parameter fp16/bf16 speed-up table runs with "
              "--device cuda on a GPU machine.")


if __name__ == "__main__":
    main()
