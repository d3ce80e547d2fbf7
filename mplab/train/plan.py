"""Bytes per parameter, planned (lesson 8): what each rank holds for the weights, gradients,
optimizer states and master weights of a policy, at N ranks and a sharding stage.

    from mplab.train import plan
    plan.memory(7e9, "bf16_master", world_size=64, sharding="zero3").gb_per_rank   # 1.75
    plan.table([1e9, 7e9, 70e9], [8, 64, 512], "bf16_master", "zero3", gpu_gb=80)

The policies (bytes per parameter: weights, gradients, master, optimizer states; AdamW keeps
two states per parameter):

- "fp32":         4 + 4 + 0 + 8 = 16. Everything fp32.
- "amp":          4 + 4 + 0 + 8 = 16, plus a transient 2 per parameter: `torch.autocast` (and
                  FSDP2's `MixedPrecisionPolicy(param_dtype=bf16)`) keeps the fp32 weights as
                  the master and makes a bf16 copy of each weight for its forward and backward.
- "bf16":         2 + 2 + 0 + 4 = 8. Pure bf16, states too: no master (lesson 3's swamping).
- "bf16_master":  2 + 2 + 4 + 8 = 16. bf16 weights and gradients, an fp32 master and fp32
                  states (Megatron's and DeepSpeed's mixed precision; the Ultra-Scale
                  Playbook's "BF16 w/o FP32 grad acc").
- "bf16_fp32_grads": 2 + (2 + 4) + 4 + 8 = 20: the bf16 gradients and an fp32 buffer they
                  are accumulated in (the Playbook's "BF16 w/ FP32 grad acc").

Sharding: "none" (one process), "ddp" (every rank holds everything, and DDP's reducer adds
gradient buckets the size of the gradients: `buckets`), "zero1" (optimizer states and master
divided by N), "zero2" (gradients too), "zero3" / "fsdp" (weights too). Activations are not
counted: they depend on the batch and the sequence, not on the parameters.
"""

from __future__ import annotations

from dataclasses import dataclass

from mplab._display import Table

__all__ = ["POLICIES", "POLICY_WORDS", "SHARDINGS", "RANKS", "GB", "Memory", "memory", "table",
           "policies_table", "PLAYBOOK", "DIFFERENCES", "playbook_table"]

# bytes per parameter: (weights, gradients, master, optimizer states, transient copy)
POLICIES = {"fp32": (4, 4, 0, 8, 0), "amp": (4, 4, 0, 8, 2), "bf16": (2, 2, 0, 4, 0),
            "bf16_master": (2, 2, 4, 8, 0), "bf16_fp32_grads": (2, 6, 4, 8, 0)}
#: Each policy in words, as `policies_table` shows it. "Master" is always the same thing: the
#: fp32 copy of the weights the optimizer updates when the copy used for compute is in low
#: precision; it is counted as "master" only where it is a second copy beside the weights.
POLICY_WORDS = {
    "fp32": "everything fp32",
    "amp": "fp32 weights (the master), a bf16 copy made for compute, then freed",
    "bf16": "pure bf16, optimizer states too: no master",
    "bf16_master": "bf16 weights and gradients, a second copy in fp32 as the master",
    "bf16_fp32_grads": "bf16_master, and an fp32 buffer (4) the bf16 gradients add into",
}
# what each stage divides by the number of ranks
SHARDINGS = {"none": (), "ddp": (), "zero1": ("master", "optimizer"),
             "zero2": ("master", "optimizer", "gradients"),
             "zero3": ("master", "optimizer", "gradients", "weights"),
             "fsdp": ("master", "optimizer", "gradients", "weights")}
#: The GPU counts the planner offers (powers of two, as clusters are built).
RANKS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
GB = 1e9  # the Playbook's and the GPU makers' unit: an "80 GB" H100 holds 80e9 bytes


@dataclass(frozen=True)
class Memory:
    """What one rank holds, in bytes. `held` is what the model and optimizer own (what
    `mplab.train.ranks.held_bytes` measures on a run); `peak` adds the transient low-precision
    copy and DDP's buckets, which live outside them."""

    parameters: float
    policy: str
    world_size: int
    sharding: str
    weights: float
    gradients: float
    master: float
    optimizer: float
    transient: float = 0.0
    buckets: float = 0.0

    @property
    def held(self) -> float:
        return self.weights + self.gradients + self.master + self.optimizer

    @property
    def peak(self) -> float:
        return self.held + self.transient + self.buckets

    @property
    def bytes_per_parameter(self) -> float:
        """Bytes this rank holds per parameter of the whole model (held, not the peak)."""
        return self.held / self.parameters

    @property
    def gb_per_rank(self) -> float:
        return self.peak / GB

    def fits(self, gpu_gb: float) -> bool:
        return self.peak <= gpu_gb * GB

    def rows(self) -> list[dict]:
        parts = ("weights", "gradients", "master", "optimizer", "transient", "buckets")
        return [{"part": p, "bytes": getattr(self, p),
                 "per parameter": getattr(self, p) / self.parameters} for p in parts
                if getattr(self, p)]


def memory(parameters: float, policy: str = "amp", world_size: int = 1,
           sharding: str = "none") -> Memory:
    """The bytes one rank holds for `parameters` under `policy` at `world_size` ranks sharded
    by `sharding` (see the module's doc for both). Shards are taken as even: a real run pads
    each uneven shard up to the next whole row (FSDP2), a few bytes the plan leaves out."""
    if isinstance(parameters, bool) or not isinstance(parameters, int | float) \
            or not parameters > 0:
        raise ValueError(f"parameters must be a positive number (e.g. 7e9), got {parameters!r}")
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; accepted: "
                         + ", ".join(map(repr, POLICIES)))
    if sharding not in SHARDINGS:
        raise ValueError(f"unknown sharding {sharding!r}; accepted: "
                         + ", ".join(map(repr, SHARDINGS)))
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer (ranks), got {world_size!r}")
    if sharding == "none" and world_size != 1:
        raise ValueError(f"sharding='none' is one process; with world_size={world_size} "
                         "accepted: 'ddp', 'zero1', 'zero2', 'zero3', 'fsdp'")
    weights, gradients, master, optimizer, transient = POLICIES[policy]
    per = {"weights": weights, "gradients": gradients, "master": master,
           "optimizer": optimizer}
    held = {part: parameters * b / (world_size if part in SHARDINGS[sharding] else 1)
            for part, b in per.items()}
    # FSDP2 gathers one unit at a time, so its transient copy is a unit's, not the model's
    # (a fraction that depends on the model's blocks); the plan keeps the whole as a bound.
    buckets = parameters * gradients if sharding == "ddp" else 0.0
    return Memory(parameters, policy, world_size, sharding, **held,
                  transient=parameters * transient, buckets=buckets)


def table(parameters: list[float], world_sizes: list[int], policy: str = "bf16_master",
          sharding: str = "zero3", gpu_gb: float = 80) -> Table:
    """GB per GPU for each model size and number of ranks, and whether it fits `gpu_gb`."""
    rows = []
    for n in parameters:
        for w in world_sizes:
            m = memory(n, policy, w, sharding)
            rows.append({"parameters": f"{n / 1e9:g}B", "ranks": w,
                         "GB per GPU": round(m.gb_per_rank, 2),
                         f"fits {gpu_gb:g} GB": "yes" if m.fits(gpu_gb) else "no"})
    return Table(rows, title=f"{policy}, {sharding}: weights, gradients, master and optimizer "
                             "states per GPU (no activations)")


def policies_table() -> Table:
    """Every policy: what it stores, and its bytes per parameter by part (`POLICIES`)."""
    rows = [{"policy": name, "what it stores": POLICY_WORDS[name], "weights": w,
             "gradients": g, "master": m, "optimizer states": o, "held": w + g + m + o,
             "+ freed after compute": t}
            for name, (w, g, m, o, t) in POLICIES.items()]
    return Table(rows, title="the plan's policies: bytes per parameter, one process, AdamW",
                 note="'held' is what a rank keeps between steps; the last column lives only "
                      "while a block computes (a Memory's .peak counts it).")


# The Ultra-Scale Playbook's table of weights + gradients + optimizer states for one GPU
# (huggingface.co/spaces/nanotron/ultrascale-playbook, "Memory usage in Transformers"), in GB:
# parameters -> (bf16 w/o fp32 gradient accumulation, bf16 with it). mplab's "bf16_master" and
# "bf16_fp32_grads" reproduce it (a test says so); where mplab differs is named in DIFFERENCES.
PLAYBOOK = {1e9: (16, 20), 7e9: (112, 140), 70e9: (1120, 1400), 405e9: (6480, 8100)}
DIFFERENCES = (
    "DDP: the Playbook counts no gradient buckets; DDP's reducer copies the gradients into "
    "buckets of their size (gradient_as_bucket_view=False, its default), so mplab's 'ddp' "
    "adds one more gradient's worth per rank.",
    "FSDP2 with MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32) is 'amp' sharded, "
    "not 'bf16_master': it stores the fp32 shard as the weights (no separate master) and keeps "
    "the reduced gradients in fp32, 4 + 4 + 8 = 16 per parameter divided by N, the same total "
    "as the Playbook's ZeRO-3 but with fp32 gradients in place of a bf16 copy.",
    "A run pads each uneven shard to whole rows (FSDP2 splits dim 0 into N equal parts), so "
    "a rank holds a little more than parameters x bytes / N.",
)


def playbook_table() -> Table:
    """The Playbook's one-GPU table beside mplab's `bf16_master` and `bf16_fp32_grads`."""
    rows = [{"parameters": f"{n / 1e9:g}B", "Playbook, bf16": book[0],
             "mplab bf16_master": memory(n, "bf16_master").gb_per_rank,
             "Playbook, bf16 + fp32 grad acc": book[1],
             "mplab bf16_fp32_grads": memory(n, "bf16_fp32_grads").gb_per_rank}
            for n, book in PLAYBOOK.items()]
    same = all(r["Playbook, bf16"] == r["mplab bf16_master"] and
               r["Playbook, bf16 + fp32 grad acc"] == r["mplab bf16_fp32_grads"] for r in rows)
    return Table(rows, title="GB on one GPU, no sharding: the Ultra-Scale Playbook and mplab",
                 note="mplab's figures are the Playbook's." if same else
                 "mplab and the Playbook differ: see plan.DIFFERENCES.")
