"""One configuration for every training path: the names match the CLI flags and the widgets."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path

__all__ = ["PATHS", "PRECISIONS", "SCALERS", "SCHEDULES", "COMM_HOOKS", "TrainConfig"]

PATHS = ("torch", "accelerate", "trainer", "fsdp")
PRECISIONS = ("fp32", "fp16", "bf16")
SCALERS = ("torch", "mplab")
SCHEDULES = ("linear", "constant")
COMM_HOOKS = ("bf16", "fp16")    # DDP's compress hooks: gradients all-reduced in this dtype


@dataclass(frozen=True)
class TrainConfig:
    """Everything a training run depends on. Defaults train the lesson model to ~0.93 accuracy.

    `batch_size` is per process and per micro-step (Hugging Face's "per device" batch): one
    optimizer step sees `batch_size * accumulation_steps * world_size` reviews, drawn as one
    batch and then split, so the same global batch trains the same way however it is split.
    `attention_mask=False` is the course's exact call, `model(input_ids, labels=labels)`;
    `by_length=True` groups reviews of similar length so that call sees almost no padding.
    """

    path: str = "torch"
    precision: str = "fp32"
    device: str = "auto"
    model: str = "lesson"              # "lesson", "lesson-pretrained", "minilm" or hub / folder
    dataset: str = "sentiment"
    steps: int = 600                   # optimizer steps
    batch_size: int = 32
    accumulation_steps: int = 1
    lr: float = 1e-3
    weight_decay: float = 0.01
    warmup_steps: int = 50
    schedule: str = "linear"           # warm-up from 0, then linear decay to 0; or "constant"
    max_grad_norm: float | None = None
    scaler: str = "torch"              # fp16 only: torch.amp.GradScaler or mplab.amp.scaler's twin
    init_scale: float = 2.0**16        # the GradScaler's settings, by torch's names and defaults
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    seed: int = 0                      # model weights, data order and torch's RNG in the run
    attention_mask: bool = True
    by_length: bool = True
    max_length: int = 64
    eval_every: int | None = None      # also evaluated once at the end, unless eval_samples=0
    eval_samples: int | None = None    # the first N test reviews; None: all of them
    checkpoint_dir: str | None = None
    save_every: int | None = None      # steps; a checkpoint is also written at the end
    resume: bool = False               # continue from checkpoint_dir's checkpoint, if any
    progress: bool = True
    watch: bool = True                 # the hooks diagnose reads (zero gradients, unchanged
    #                                    weights); off, every precision pays only its own cost
    # Across processes (lesson 8). FSDP2's MixedPrecisionPolicy, on the fsdp path: the dtype the
    # sharded fp32 weights are all-gathered in for compute (None: the precision's; "fp32" with
    # bf16/fp16 gathers fp32 and autocasts instead) and the dtype gradients are summed across
    # ranks in. DDP's gradient all-reduce, on the torch path: None (fp32) or a compress hook.
    param_dtype: str | None = None
    reduce_dtype: str = "fp32"
    comm_hook: str | None = None

    # What a resumed run may change: the rest must match the checkpoint, or it would not be
    # the same run continued.
    RESUMABLE_CHANGES = ("device", "eval_every", "eval_samples", "checkpoint_dir", "save_every",
                         "resume", "progress", "watch")

    def __post_init__(self):
        _one_of("path", self.path, PATHS)
        _one_of("precision", self.precision, PRECISIONS)
        _one_of("scaler", self.scaler, SCALERS)
        if self.scaler != "torch" and self.path not in ("torch", "fsdp"):
            raise ValueError(f"scaler={self.scaler!r} is the torch and fsdp paths' choice; the "
                             f"{self.path} path uses the GradScaler Accelerate builds (torch's), "
                             "so accepted there: 'torch'")
        _one_of("schedule", self.schedule, SCHEDULES)
        self._check_processes()
        defaults = {f.name: f.default for f in fields(TrainConfig)}
        changed = {k: v for k, v in self.scaler_settings.items() if v != defaults[k]}
        if self.path == "trainer" and changed:
            listed = ", ".join(f"{k}={v!r}" for k, v in changed.items())
            raise ValueError(f"{listed}: the Trainer builds its GradScaler with torch's defaults "
                             "and takes no scaler settings; accepted on the trainer path: the "
                             "defaults (init_scale=65536.0, growth_factor=2.0, backoff_factor="
                             "0.5, growth_interval=2000), or path='accelerate' / 'torch'")
        if not isinstance(self.device, str) or not self.device.strip():
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {self.device!r}")
        for name in ("steps", "batch_size", "accumulation_steps", "max_length"):
            _positive_int(name, getattr(self, name))
        for name in ("eval_every", "save_every"):
            if getattr(self, name) is not None:
                _positive_int(name, getattr(self, name), " or None")
        if self.eval_samples is not None:
            _positive_int("eval_samples", self.eval_samples, " or None (0 skips the evaluation)",
                          minimum=0)
        _positive_int("growth_interval", self.growth_interval)
        if not _positive_float(self.init_scale):
            raise ValueError(f"init_scale must be a positive finite number (the first loss "
                             f"scale; torch's default is 2.0**16), got {self.init_scale!r}")
        if not (_positive_float(self.growth_factor) and self.growth_factor > 1):
            raise ValueError(f"growth_factor must be a number > 1 (the scale grows by it after "
                             f"growth_interval clean steps), got {self.growth_factor!r}")
        if not (_positive_float(self.backoff_factor) and self.backoff_factor < 1):
            raise ValueError(f"backoff_factor must be a number between 0 and 1 (the scale "
                             f"shrinks by it after an inf/NaN), got {self.backoff_factor!r}")
        _non_negative_int("warmup_steps", self.warmup_steps)
        _non_negative_int("seed", self.seed)
        if not _positive_float(self.lr):
            raise ValueError(f"lr must be a positive finite number, got {self.lr!r}")
        if not _positive_float(self.weight_decay) and self.weight_decay != 0:
            raise ValueError(f"weight_decay must be a finite number >= 0, got "
                             f"{self.weight_decay!r}")
        if self.max_grad_norm is not None and not _positive_float(self.max_grad_norm):
            raise ValueError(f"max_grad_norm must be a positive number or None (no clipping), "
                             f"got {self.max_grad_norm!r}")
        if self.save_every is not None and not self.checkpoint_dir:
            raise ValueError(f"save_every={self.save_every} needs checkpoint_dir: the folder to "
                             "write checkpoints to")
        if self.resume and not self.checkpoint_dir:
            raise ValueError("resume=True needs checkpoint_dir: the folder holding the "
                             "checkpoint to continue from")
        for name in ("attention_mask", "by_length", "resume", "progress", "watch"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if not isinstance(self.model, str) or not self.model.strip():
            raise ValueError(f"model must be 'lesson', 'lesson-pretrained', 'minilm' or a hub "
                             f"name / saved folder, got {self.model!r}")

    def _check_processes(self) -> None:
        """The settings of lesson 8: each belongs to one path."""
        if self.param_dtype is not None:
            accepted = ("fp32", self.precision)
            _one_of("param_dtype", self.param_dtype, tuple(dict.fromkeys(accepted)),
                    f" with precision {self.precision!r} (None: the precision's)")
        _one_of("reduce_dtype", self.reduce_dtype, PRECISIONS)
        if self.path != "fsdp":
            for name, default in (("param_dtype", None), ("reduce_dtype", "fp32")):
                if getattr(self, name) != default:
                    raise ValueError(f"{name}={getattr(self, name)!r} is FSDP2's "
                                     f"MixedPrecisionPolicy, on path='fsdp'; the {self.path} "
                                     f"path accepts {name}={default!r}")
        if self.comm_hook is not None:
            _one_of("comm_hook", self.comm_hook, COMM_HOOKS, " or None (fp32)")
            if self.path != "torch":
                raise ValueError(f"comm_hook={self.comm_hook!r} is DDP's, on path='torch'; "
                                 f"the {self.path} path accepts comm_hook=None (on fsdp, "
                                 "reduce_dtype sets the gradients' dtype across ranks)")

    @property
    def scaler_settings(self) -> dict:
        """The GradScaler's keyword arguments, as torch names them."""
        return {"init_scale": self.init_scale, "growth_factor": self.growth_factor,
                "backoff_factor": self.backoff_factor, "growth_interval": self.growth_interval}

    def as_dict(self) -> dict:
        return asdict(self)

    def differences(self, other: dict) -> dict[str, tuple]:
        """Fields (that a resumed run may not change) whose values differ from `other`."""
        return {f.name: (other.get(f.name), getattr(self, f.name)) for f in fields(self)
                if f.name not in self.RESUMABLE_CHANGES
                and other.get(f.name) != getattr(self, f.name)}

    @property
    def checkpoint_path(self) -> Path | None:
        return Path(self.checkpoint_dir) / "checkpoint.pt" if self.checkpoint_dir else None


def _one_of(name: str, value, accepted: tuple[str, ...], note: str = "") -> None:
    if value not in accepted:
        raise ValueError(f"unknown {name} {value!r}; accepted: "
                         f"{', '.join(map(repr, accepted))}{note}")


def _positive_int(name: str, value, extra: str = "", minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        kind = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise ValueError(f"{name} must be {kind}{extra}, got {value!r}")


def _non_negative_int(name: str, value) -> None:
    _positive_int(name, value, minimum=0)


def _positive_float(value) -> bool:
    return (not isinstance(value, bool) and isinstance(value, int | float)
            and math.isfinite(value) and value > 0)
