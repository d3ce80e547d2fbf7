"""python -m mplab.train: train once and print the key figures (see --help).

Under `torchrun --nproc_per_node N -m mplab.train ...` (any path; `--path fsdp` shards) or
`accelerate launch --multi_gpu --num_processes N -m mplab.train --path accelerate ...` every
process trains its share of each batch; only rank 0 prints and writes --json.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

from .config import COMM_HOOKS, PATHS, PRECISIONS, SCALERS, SCHEDULES, TrainConfig
from .errors import NonFiniteLossError, TrainWarning

__all__: list[str] = []


def parser() -> argparse.ArgumentParser:
    d = TrainConfig()
    p = argparse.ArgumentParser(
        prog="python -m mplab.train",
        description="Train a sequence classifier in fp32, fp16 or bf16 and print what it cost.")
    p.add_argument("--path", default=d.path, help=f"training path: {', '.join(PATHS)}")
    p.add_argument("--precision", default=d.precision, help=", ".join(PRECISIONS))
    p.add_argument("--device", default=d.device, help="auto, cpu or cuda")
    p.add_argument("--steps", type=int, default=d.steps, help="optimizer steps")
    p.add_argument("--model", default=d.model,
                   help="'lesson' (the 324k-parameter lesson BERT, random weights), "
                        "'lesson-pretrained' (its shipped trained encoder, a fresh head), "
                        "'minilm' (the packaged "
                        "22.7M-parameter all-MiniLM-L6-v2), a hub name or a folder written by "
                        "save_pretrained()")
    p.add_argument("--dataset", default=d.dataset)
    p.add_argument("--batch-size", type=int, default=d.batch_size,
                   help="per process and micro-step")
    p.add_argument("--accumulation-steps", type=int, default=d.accumulation_steps)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--weight-decay", type=float, default=d.weight_decay)
    p.add_argument("--warmup-steps", type=int, default=d.warmup_steps)
    p.add_argument("--schedule", default=d.schedule, help=", ".join(SCHEDULES))
    p.add_argument("--max-grad-norm", type=float, default=d.max_grad_norm,
                   help="clip gradients (after unscaling) to this norm")
    p.add_argument("--scaler", default=d.scaler, help=f"fp16's GradScaler: {', '.join(SCALERS)}")
    p.add_argument("--init-scale", type=float, default=d.init_scale,
                   help="fp16's first loss scale (torch's default 65536)")
    p.add_argument("--growth-factor", type=float, default=d.growth_factor)
    p.add_argument("--backoff-factor", type=float, default=d.backoff_factor)
    p.add_argument("--growth-interval", type=int, default=d.growth_interval,
                   help="clean steps before the scale grows")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--no-attention-mask", dest="attention_mask", action="store_false",
                   help="call model(input_ids, labels=labels) exactly as the course does")
    p.add_argument("--no-by-length", dest="by_length", action="store_false",
                   help="batch reviews in random order instead of grouped by length")
    p.add_argument("--max-length", type=int, default=d.max_length,
                   help="reviews are cut to this many tokens")
    p.add_argument("--eval-every", type=int, default=d.eval_every)
    p.add_argument("--eval-samples", type=int, default=d.eval_samples,
                   help="evaluate on the first N test reviews (0: no evaluation)")
    p.add_argument("--checkpoint-dir", default=d.checkpoint_dir)
    p.add_argument("--save-every", type=int, default=d.save_every)
    p.add_argument("--resume", action="store_true",
                   help="continue from --checkpoint-dir's checkpoint if there is one")
    p.add_argument("--no-progress", dest="progress", action="store_false")
    p.add_argument("--no-watch", dest="watch", action="store_false",
                   help="without the hooks diagnose reads (zero gradients, unchanged weights)")
    p.add_argument("--param-dtype", default=d.param_dtype,
                   help="fsdp: the dtype weights are all-gathered and computed in (default: "
                        "the precision's; fp32 gathers fp32 and autocasts)")
    p.add_argument("--reduce-dtype", default=d.reduce_dtype,
                   help=f"fsdp: the dtype gradients are reduce-scattered in: "
                        f"{', '.join(PRECISIONS)}")
    p.add_argument("--comm-hook", default=d.comm_hook,
                   help=f"torch path under torchrun: DDP's all-reduce in {' or '.join(COMM_HOOKS)}"
                        " (compress hooks) instead of fp32")
    p.add_argument("--json", metavar="FILE", help="write the result record here")
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = vars(p.parse_args(argv))
    json_file = args.pop("json")
    main_rank = os.environ.get("RANK", "0") == "0"
    try:
        config = TrainConfig(**args)
    except ValueError as err:
        p.error(str(err))
    from . import train

    stopped = None
    with warnings.catch_warnings():
        # The warnings are printed once, with the summary, rather than as Python warnings.
        warnings.simplefilter("ignore", TrainWarning)
        try:
            result = train(config)
        except NonFiniteLossError as err:
            result, stopped = err.result, err
        except ValueError as err:
            if main_rank:
                print(f"error: {err}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            if main_rank:
                again = ("; the same command with --resume continues from the last checkpoint"
                         if config.checkpoint_dir else "")
                print(f"\ninterrupted{again}", file=sys.stderr)
            return 130
    if not main_rank:
        return 1 if stopped else 0
    print()
    print(result.summary())
    for note in result.warnings:
        print(f"\nwarning: {note}")
    if stopped:
        print(f"\n{stopped}", file=sys.stderr)
    if json_file:
        result.write_json(json_file)
        print(f"\nwrote {json_file}")
    return 1 if stopped else 0


if __name__ == "__main__":
    sys.exit(main())
