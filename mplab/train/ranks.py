"""What each process of a multi-process run holds and sends (lesson 8), measured, not computed
from the parameter count.

- `CommWatch`: the collectives this process issues through torch.distributed's ops (FSDP2's
  all-gathers and reduce-scatters), each with its dtype and the bytes this rank puts in.
- `counting_hook`: a DDP comm hook that wraps another (fp32 all-reduce, or the bf16 / fp16
  compress hooks) and counts what each bucket's all-reduce really sends; DDP's own reducer
  calls its all-reduce from C++, past any dispatch mode.
- `held_bytes`: the bytes of every tensor the model and optimizer own on this rank, by what
  they are (weights, gradients, optimizer states), each storage counted once, so a shard's
  padding shows.
- `rank_report`: one rank's figures as plain data; `gather_reports` brings every rank's to
  rank 0 (`TrainResult.ranks`); `ranks_table` reads them as the audit across ranks.
- `overflow_on_one_rank`: the fp16 step in which one rank alone finds an inf, per scaler.
- `side_by_side`: DDP and FSDP2 runs, what each rank holds and sends per step (`RING`).
"""

from __future__ import annotations

import math
from collections import defaultdict

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mplab._display import Table
from mplab.numerics.formats import dtype_name

from .watch import inner_optimizer, local_shard

__all__ = ["COLLECTIVES", "Traffic", "CommWatch", "counting_hook", "transformer_blocks",
           "held_bytes", "shards", "rank_report", "gather_reports", "overflow_on_one_rank",
           "collectives_table", "ranks_table", "allreduce_table", "agreement_table", "held_table",
           "overflow_table", "RING", "side_by_side"]

# c10d's ops by the name lesson 8 uses, and the argument holding what this rank puts in.
COLLECTIVES = {"_allgather_base_": ("all_gather", "input_tensor"),
               "allgather_into_tensor_coalesced_": ("all_gather", "inputs"),
               "_reduce_scatter_base_": ("reduce_scatter", "input_tensor"),
               "reduce_scatter_tensor_coalesced_": ("reduce_scatter", "inputs"),
               "allreduce_": ("all_reduce", "tensors"),
               "broadcast_": ("broadcast", "tensors")}


class Traffic:
    """Collectives seen, by (op, dtype): how many calls and how many bytes this rank put in."""

    def __init__(self):
        self.calls: dict[tuple[str, str], int] = defaultdict(int)
        self.bytes: dict[tuple[str, str], int] = defaultdict(int)

    def add(self, op: str, tensors) -> None:
        tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        for dtype in {t.dtype for t in tensors}:
            key = (op, dtype_name(dtype))
            self.calls[key] += 1
            self.bytes[key] += sum(t.numel() * t.element_size() for t in tensors
                                   if t.dtype == dtype)

    def rows(self) -> list[dict]:
        """One row per (op, dtype), as plain data: op, dtype, calls, bytes."""
        return [{"op": op, "dtype": dtype, "calls": self.calls[op, dtype],
                 "bytes": self.bytes[op, dtype]} for op, dtype in sorted(self.calls)]


class CommWatch(TorchDispatchMode):
    """Within `with CommWatch() as seen:`, every torch.distributed collective that goes
    through the dispatcher (FSDP2's do, and `dist.all_reduce`) is recorded in `seen.traffic`.
    A dispatch mode sees each op, so it costs time: lesson 8 watches one step."""

    def __init__(self, traffic: Traffic | None = None):
        super().__init__()
        self.traffic = traffic if traffic is not None else Traffic()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "c10d" and func._opname in COLLECTIVES:
            op, argument = COLLECTIVES[func._opname]
            names = [a.name for a in func._schema.arguments]
            where = names.index(argument)
            self.traffic.add(op, args[where] if where < len(args) else kwargs[argument])
        return func(*args, **kwargs)


def counting_hook(traffic: Traffic, hook=None):
    """A DDP comm hook that runs `hook` (torch's `default_hooks.allreduce_hook`, the same fp32
    all-reduce as DDP's own, if None; or `bf16_compress_hook` / `fp16_compress_hook`) under a
    `CommWatch`, so each bucket's all-reduce is counted in the dtype it really went in."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    hook = hook or default_hooks.allreduce_hook

    def counted(state, bucket):
        with CommWatch(traffic):
            return hook(state, bucket)

    return counted


def transformer_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's repeated blocks: the modules of its first ModuleList (a Hugging Face
    encoder's `layer`, a decoder's `layers`); each becomes one FSDP unit."""
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList):
            return list(module)
    return []


def held_bytes(model: torch.nn.Module, optimizer=None) -> dict[str, int]:
    """Bytes of the tensors this rank holds for the model and optimizer: "weights" (the
    parameters as stored: FSDP2's local shards), "gradients" and "optimizer" (its state
    tensors), and "total". Each storage is counted once and whole, so gradients that are views
    into one flat buffer count once, and a shard padded to an even split counts its padding."""
    seen: set[int] = set()
    held = {"weights": 0, "gradients": 0, "optimizer": 0}

    def add(kind: str, tensor) -> None:
        if not isinstance(tensor, torch.Tensor):
            return
        storage = local_shard(tensor).untyped_storage()
        if storage.data_ptr() not in seen and storage.nbytes():
            seen.add(storage.data_ptr())
            held[kind] += storage.nbytes()

    params = list(model.parameters())
    for p in params:
        add("weights", p)
    for p in params:
        add("gradients", p.grad)
    if optimizer is not None:
        for state in inner_optimizer(optimizer).state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor) and value.dim() > 0:  # not Adam's step count
                    add("optimizer", value)
    held["total"] = sum(held.values())
    return held


def shards(model: torch.nn.Module) -> list[dict]:
    """Each parameter as this rank stores it: name, global shape, local shape, dtype."""
    return [{"name": name, "shape": list(p.shape), "local_shape": list(local_shard(p).shape),
             "dtype": dtype_name(p.dtype)} for name, p in model.named_parameters()]


def rank_report(rank: int, model, optimizer, traffic: Traffic | None) -> dict:
    """One rank's figures, as plain data: what it holds, its shards, the collectives it sent."""
    state_dtypes = sorted({dtype_name(v.dtype) for s in inner_optimizer(optimizer).state.values()
                           for v in s.values() if isinstance(v, torch.Tensor) and v.dim() > 0})
    grads = sorted({dtype_name(p.grad.dtype) for p in model.parameters() if p.grad is not None})
    return {"rank": rank, "held_bytes": held_bytes(model, optimizer), "shards": shards(model),
            "grad_dtypes": grads, "optimizer_state_dtypes": state_dtypes,
            "collectives": traffic.rows() if traffic is not None else []}


def gather_reports(report: dict, world_size: int) -> list[dict]:
    """Every rank's report, in rank order, on every rank (one all_gather_object)."""
    if world_size == 1:
        return [report]
    import torch.distributed as dist

    reports: list = [None] * world_size
    dist.all_gather_object(reports, report)
    return reports


def overflow_on_one_rank(scaler: str = "torch", rank_with_inf: int = 1) -> list[dict]:
    """One fp16 FSDP2 step of the lesson model in which one rank alone finds an inf: after
    backward, an inf is put into `rank_with_inf`'s shard of one gradient (as an overflow in its
    part of the reduce-scatter would leave it), then the scaler unscales, steps and updates.

    `scaler`: "torch" (torch.amp.GradScaler, whose check DTensor runs on every rank's shard and
    combines), "sharded" (torch's ShardedGradScaler, which all-reduces the found-inf), "mplab"
    (mplab.amp.scaler.GradScaler given the process group) or "mplab_alone" (without it: each rank
    checks its own shard only).
    Run in every process (`launch.run_across`); returns every rank's
    {rank, inf_here, stepped, scale} in rank order: where they differ, the ranks have parted.
    """
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    from mplab import models
    from mplab.amp.scaler import GradScaler as MplabGradScaler

    makers = {"torch": lambda: torch.amp.GradScaler("cpu", init_scale=2.0**10),
              "sharded": lambda: ShardedGradScaler("cpu", init_scale=2.0**10,
                                                   process_group=dist.group.WORLD),
              "mplab": lambda: MplabGradScaler("cpu", init_scale=2.0**10,
                                                process_group=dist.group.WORLD),
              "mplab_alone": lambda: MplabGradScaler("cpu", init_scale=2.0**10)}
    if scaler not in makers:
        raise ValueError(f"unknown scaler {scaler!r}; accepted: " + ", ".join(map(repr, makers)))
    rank, world = dist.get_rank(), dist.get_world_size()
    if not 0 <= rank_with_inf < world:
        raise ValueError(f"rank_with_inf must be a rank from 0 to {world - 1}, got "
                         f"{rank_with_inf!r}")
    model = models.lesson_model(2, seed=0, pretrained=True)
    policy = MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32)
    for block in transformer_blocks(model):
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    amp = makers[scaler]()
    stepped = []
    optimizer.register_step_post_hook(lambda *args: stepped.append(True))
    generator = torch.Generator().manual_seed(rank)  # each rank its own batch, as in training
    ids = torch.randint(5, 200, (8, 16), generator=generator)
    labels = torch.randint(0, 2, (8,), generator=generator)
    amp.scale(model(input_ids=ids, labels=labels).loss).backward()
    if rank == rank_with_inf:
        with torch.no_grad():
            local_shard(next(model.parameters()).grad).view(-1)[0] = float("inf")
    amp.step(optimizer)
    amp.update()
    report = {"rank": rank, "inf_here": rank == rank_with_inf, "stepped": bool(stepped),
              "scale": amp.get_scale()}
    return gather_reports(report, world)



def collectives_table(report: dict) -> Table:
    """One rank's collectives in step 1 (a `TrainResult.ranks` entry): op, dtype, calls,
    bytes."""
    return Table(report["collectives"], title=f"rank {report['rank']}'s collectives in step 1")


def ranks_table(reports: list[dict]) -> Table:
    """The audit across ranks, one row per rank (`TrainResult.ranks`): how much of the model
    its shards hold and in which dtype, the dtypes its parameters were all-gathered in and
    its gradients reduced in (as sent), its gradients' and optimizer states' dtypes, and the
    MiB it held after step 1."""
    rows = []
    for report in reports:
        shards = report["shards"]
        local = sum(math.prod(s["local_shape"]) for s in shards)
        whole = sum(math.prod(s["shape"]) for s in shards)
        sent = {}
        for c in report["collectives"]:
            sent.setdefault(c["op"], []).append(c["dtype"])
        rows.append({
            "rank": report["rank"], "share of the weights": f"{local / whole:.1%}",
            "stored": ", ".join(sorted({s["dtype"] for s in shards})),
            "all-gathered in": ", ".join(sent.get("all_gather", ["-"])),
            "reduced in": ", ".join(sent.get("reduce_scatter", sent.get("all_reduce", ["-"]))),
            "gradients": ", ".join(report["grad_dtypes"]) or "-",
            "optimizer states": ", ".join(report["optimizer_state_dtypes"]) or "-",
            "held MiB": round(report["held_bytes"]["total"] / 2**20, 3)})
    return Table(rows, title="each rank after step 1: its shard, and the dtypes it sent in")


# --- lesson 8's readings of several runs ------------------------------------------------------

def _sent(result, op: str) -> list[dict]:
    return [c for c in result.ranks[0]["collectives"] if c["op"] == op] if result.ranks else []


def _median_step(result) -> float:
    times = result.step_seconds[1:] or result.step_seconds  # step 1 also builds and watches
    return sorted(times)[len(times) // 2]


def allreduce_table(runs: dict, baseline: str) -> Table:
    """DDP runs side by side (name -> TrainResult, or the error a run raised): the dtype and
    bytes rank 0's all-reduce sent in step 1, the step time and last loss against `baseline`'s,
    and in `note` what that says on this machine."""
    base = runs[baseline]
    rows, refused = [], []
    for name, r in runs.items():
        if isinstance(r, dict):  # a run the backend refused, as raised
            refused.append(f"{name}: {r.get('error')}: {r.get('message')}")
            continue
        sent = _sent(r, "all_reduce")
        total = sum(c["bytes"] for c in sent)
        drift = (r.losses[-1] - base.losses[-1]) / base.losses[-1]
        rows.append({"run": name, "all-reduce dtype": ", ".join(c["dtype"] for c in sent) or "-",
                     "bytes sent per step": total, "bytes per parameter": total / r.parameters,
                     "step time vs " + baseline: _median_step(r) / _median_step(base),
                     "last loss": r.losses[-1],
                     "loss vs " + baseline: f"{drift:+.3%}"})
    most = max(row["bytes sent per step"] for row in rows)
    words = []
    for row in rows:
        if row["bytes sent per step"] < most:
            ratio = row["step time vs " + baseline]
            words.append(f"{row['run']} sent {row['bytes sent per step'] / most:.0%} of the "
                         f"bytes in {ratio:.2f}x the step time.")
    if words and not any(row["step time vs " + baseline] < 0.8 for row in rows
                         if row["bytes sent per step"] < most):
        words.append("Half the bytes did not make a step clearly faster here (by a fifth or "
                     "more): between processes on one machine the all-reduce is a small part "
                     "of a step, and each cast to 2 bytes and back costs time, so what is left "
                     "is that cost and noise. The hooks pay where a step waits on the network.")
    words.append("Refused: " + "; ".join(refused) if refused else
                 "The backend took every dtype asked of it.")
    return Table(rows, title=f"DDP on {base.world_size} processes: rank 0's all-reduce in "
                             f"step 1, {base.parameters:,} parameters", note=" ".join(words))


def agreement_table(by_count: dict) -> Table:
    """The same run's loss per step on 1, 2, ... processes ({processes: TrainResult}), and in
    `note` the largest relative difference between any two."""
    results = list(by_count.values())
    steps = min(len(r.losses) for r in results)
    rows = [{"step": i + 1, **{f"{n} process{'es' * (n > 1)}": r.losses[i]
                               for n, r in by_count.items()}} for i in range(steps)]
    worst = max(abs(a.losses[i] - b.losses[i]) / abs(b.losses[i]) for i in range(steps)
                for a in results for b in results if b.losses[i])
    note = (f"The largest difference between any two, over {steps} steps: {worst:.2g} of the "
            "loss, " + ("fp32's rounding of the same sums taken in another order."
                        if worst < 1e-4 else "more than a different order of additions "
                        "explains: the runs did not see the same batches or weights."))
    return Table(rows, title="the same run's loss per step, by the number of processes",
                 note=note)


def _by_rank(where: str, pairs: list[tuple[int, int]]) -> str:
    """"fsdp at 4, ranks 0 and 1 (+3,592 B each), rank 2 (+1,536 B)": every rank named, ranks
    that differ by the same bytes together, in rank order."""
    groups: dict[int, list[int]] = {}
    for rank, extra in pairs:
        groups.setdefault(extra, []).append(rank)
    parts = []
    for extra, ranks in groups.items():
        names = (f"rank {ranks[0]}" if len(ranks) == 1 else
                 "ranks " + ", ".join(map(str, ranks[:-1])) + f" and {ranks[-1]}")
        parts.append(f"{names} ({extra:+,} B{' each' * (len(ranks) > 1)})")
    return f"{where}, " + ", ".join(parts)


def held_table(runs: list[tuple[str, int, object]], policy: str = "amp") -> Table:
    """What every rank of each run held after step 1 (`held_bytes`) against
    `mplab.train.plan.memory(parameters, policy, processes, sharding)`: runs are (sharding,
    processes, TrainResult). `note` names every rank that held more than the plan, and every
    one that held less, and why."""
    from mplab.train import plan

    rows, ddp = [], False
    above: dict[str, list] = {}
    below: dict[str, list] = {}
    for sharding, n, r in runs:
        planned = round(plan.memory(r.parameters, policy, n, "none" if n == 1 else sharding).held)
        ddp = ddp or sharding == "ddp"
        for report in r.ranks:
            held = report["held_bytes"]
            rows.append({"run": f"{sharding}, {n} process{'es' * (n > 1)}",
                         "rank": report["rank"], "weights": held["weights"],
                         "gradients": held["gradients"], "optimizer": held["optimizer"],
                         "held": held["total"], "planned": planned,
                         "off by": f"{(held['total'] - planned) / planned:+.2%}"})
            extra = held["total"] - planned
            if extra:
                side = above if extra > 0 else below
                side.setdefault(f"{sharding} at {n}", []).append((report["rank"], extra))
    if not above and not below:
        words = ["Every rank holds what the plan says."]
    else:
        words = [f"{label}: " + "; ".join(_by_rank(where, pairs) for where, pairs in side.items())
                 + "." for label, side in (("Above the plan", above), ("Below it", below))
                 if side]
        words.append("FSDP2 splits each parameter's first dimension into equal parts, padding "
                     "the last up to a whole row per rank: every shard's weights and gradients "
                     "are stored at the padded size, while AdamW's states follow the rows a "
                     "rank really has, so a rank whose rows are padding holds less than one "
                     "whose rows are all real.")
    if ddp:
        words.append("DDP's gradient buckets (one more gradient's worth) belong to its reducer, "
                     "not to the model or optimizer: the plan counts them in .peak "
                     "(plan.memory(...).buckets), not in .held.")
    note = " ".join(words)
    return Table(rows, title=f"bytes each rank held after step 1, against plan.memory(..., "
                             f"{policy!r})", note=note)


# What a ring algorithm (NCCL's and gloo's usual one) sends from each of N ranks, per byte the
# rank hands to the collective: an all-reduce passes (N - 1)/N of its buffer round to sum it
# and as much again to share the sums; an all-gather forwards every other rank's shard
# (N - 1 shards of its own size); a reduce-scatter passes (N - 1)/N of its input.
RING = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: n - 1,
        "reduce_scatter": lambda n: (n - 1) / n}


def side_by_side(runs: dict, ddp: str, fsdp: str) -> Table:
    """DDP and FSDP2 runs side by side (name -> TrainResult): what a rank held after step 1
    (the most any of its ranks held, `held_bytes`), what rank 0 handed to its collectives in
    step 1 (as recorded) and what a ring sends for that (`RING`). `note` sets run `fsdp`
    against run `ddp`, which should have the same processes and precision."""
    rows = []
    for name, r in runs.items():
        n, collectives = r.world_size, r.ranks[0]["collectives"]
        held = max(report["held_bytes"]["total"] for report in r.ranks)
        handed = sum(c["bytes"] for c in collectives if c["op"] in RING)
        sent = sum(c["bytes"] * RING[c["op"]](n) for c in collectives if c["op"] in RING)
        ops = ", ".join(f"{c['op']} {c['dtype']}" for c in collectives if c["op"] in RING)
        rows.append({"run": name, "processes": n, "held per rank": held,
                     "held per parameter": round(held / r.parameters, 3),
                     "collectives in a step": ops, "handed in per step": handed,
                     "sent per step (ring)": round(sent),
                     "sent per parameter": round(sent / r.parameters, 3)})
    by_name = {row["run"]: row for row in rows}
    a, b = by_name[ddp], by_name[fsdp]
    words = [f"On {b['processes']} processes, \"{fsdp}\" held "
             f"{b['held per rank'] / a['held per rank']:.0%} of the bytes per rank "
             f"\"{ddp}\" held ({b['held per parameter']:.3g} against "
             f"{a['held per parameter']:.3g} per parameter) and sent "
             f"{b['sent per step (ring)'] / a['sent per step (ring)']:.0%} of its bytes per "
             "step: it gathers the weights (for the forward, and each block again for the "
             "backward) where DDP sends only the gradients."]
    handed = a["handed in per step"] / runs[ddp].parameters
    for row in rows:
        if row["run"] != fsdp and "all_gather" in row["collectives in a step"]:
            n = row["processes"]
            words.append(f"\"{row['run']}\": {row['held per parameter']:.3g} bytes held and "
                         f"{row['sent per parameter']:.3g} sent per parameter" + (
                             "." if n == a["processes"] else
                             f"; DDP's gradients, as \"{ddp}\" handed them in, sent by a ring "
                             f"on {n} processes: {handed * RING['all_reduce'](n):.3g}."))
    buckets = runs[ddp].ranks[0]["held_bytes"]["gradients"]
    words.append(f"Not in 'held': DDP's reducer also keeps buckets its gradients are copied "
                 f"into, {buckets:,} B more per rank (plan.memory(...).buckets).")
    return Table(rows, title="DDP and FSDP2 on the lesson model: what each rank holds and sends",
                 note=" ".join(words))


def overflow_table(results: dict) -> Table:
    """`overflow_on_one_rank` per scaler ({scaler: every rank's report}), and in `note` which
    scalers let the ranks part."""
    rows = [{"scaler": scaler, "rank": r["rank"], "inf in its shard": r["inf_here"],
             "stepped": r["stepped"], "scale after": r["scale"]}
            for scaler, reports in results.items() for r in reports]
    parted = [s for s, reports in results.items()
              if len({(r["stepped"], r["scale"]) for r in reports}) > 1]
    kept = [s for s in results if s not in parted]
    note = (f"Skipped on every rank: {', '.join(kept) or 'none'}. " + (
        f"Parted: {', '.join(parted)}: one rank stepped while the other skipped, and from "
        "here their weights and scales differ." if parted else "No scaler let the ranks part."))
    if "torch" in kept:
        note += (" torch's plain GradScaler kept them together because FSDP2's gradients are "
                 "DTensors: its unscale op runs through DTensor, whose rule for it combines "
                 "the found-inf over every rank. A scaler that checks only the local shard "
                 "(mplab_alone) does not.")
    return Table(rows, title="one fp16 FSDP2 step with an inf on one rank only", note=note)
