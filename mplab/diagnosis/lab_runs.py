"""The failure lab's runs (lesson 7): each broken run, with the lines that fix it, on the lab
model (the lesson transformer at hidden 64, one layer) and the shipped sentiment data, with a
`Recorder` watching. :mod:`mplab.diagnosis.lab` names each one by its cause (`FAILURES`) and
runs it; a runner's source is what lesson 7 shows as the code that ran.
"""

from __future__ import annotations

import functools
import statistics
import warnings
from collections.abc import Iterator

import torch

from mplab._display import Table
from mplab.data import DATA_DIR, batches, encode, load_dataset
from mplab.hardware import UNITS, has_units, resolve_device
from mplab.models import lesson_tokenizer, warm_start
from mplab.numerics.bf16_updates import LowPrecisionUpdate
from mplab.train import NonFiniteLossError, Recorder, TrainResult, TrainWarning, train

__all__ = ["CannotReproduce", "LAB_SHAPE", "BATCH", "LAB_PRETRAINED", "LR", "lab_model",
           "lab_batches", "lab_autocast", "Fp32Island", "fp16_overflow", "grow_feed_forward",
           "no_scaler", "clip_before_unscale", "extra_update", "scale_collapse",
           "accumulation_scaler", "accumulation_error", "fp16_ignored", "no_units",
           "scaler_bypassed", "diverged", "autocast_off", "scaler_with_bf16", "frequent_skips",
           "stalled", "fp8_grad_scale", "pure_bf16", "BF16_FIX_BYTES", "compare_bf16_fixes"]


class CannotReproduce(ValueError):
    """A failure this machine cannot show (low precision without units, on a CPU that has
    them): the message says why."""


LAB_SHAPE = {"hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
             "intermediate_size": 128}
BATCH = 16
LAB_PRETRAINED = DATA_DIR / "lab_pretrained"  # data/make_lesson_pretrained.py --shape lab
LR = 1e-3


# ---- the lab's pieces ------------------------------------------------------------------------

def lab_model(seed: int = 0) -> torch.nn.Module:
    """The lab's small transformer (the lesson model at hidden 64, one layer), fp32 weights:
    its shipped warm start (an encoder trained on the reviews, a fresh head from `seed`), so a
    healthy run's loss falls from ln 2 within the lab's tens of steps and a broken one's
    visibly does not."""
    return warm_start(LAB_PRETRAINED, seed=seed)


def lab_batches(steps: int, batch_size: int = BATCH, device="cpu") -> Iterator[dict]:
    """`steps` shuffled batches of the shipped training reviews (seeded, epochs repeat)."""
    encoded = _encoded_reviews()
    done, epoch = 0, 0
    while done < steps:
        for batch in batches(encoded, batch_size, seed=epoch, device=device):
            if done == steps:
                return
            done += 1
            yield batch
        epoch += 1


@functools.cache
def _encoded_reviews() -> dict[str, torch.Tensor]:
    """The training reviews tokenized once: lesson 7 runs the lab some twenty times, and each
    tokenizing of the 4000 reviews would add its time to every run (benchmarks/RECORDS.md;
    batches index these, never change them)."""
    reviews = load_dataset("sentiment", "train")
    return encode(lesson_tokenizer(), reviews.texts, reviews.labels)


class Fp32Island(torch.nn.Module):
    """Run `module` in fp32 inside an autocast region: the fix for one layer whose values
    outgrow fp16 (65504) while the rest of the model stays in fp16."""

    def __init__(self, module: torch.nn.Module):
        super().__init__()
        self.module = module

    def forward(self, *args):
        device = next(self.module.parameters()).device.type
        with torch.autocast(device, enabled=False):
            return self.module(*(a.float() if torch.is_floating_point(a) else a for a in args))


def _train(model, **settings) -> TrainResult:
    """The lab's settings for mplab.train: its batch and lr, constant from the first step (as
    its own loops run), no evaluation. Its warnings stay in the result, where diagnose reads
    them, rather than on the screen."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TrainWarning)
        return train(model=model, **{"batch_size": BATCH, "lr": LR, "schedule": "constant",
                                     "warmup_steps": 0, "eval_samples": 0, "progress": False,
                                     **settings})


def lab_autocast(precision: str, device: torch.device) -> torch.autocast:
    """The autocast every lab run writes inline, as a user's own loop does."""
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(precision, torch.float32)
    return torch.autocast(device.type, dtype=dtype, enabled=precision != "fp32")


# ---- the failures ----------------------------------------------------------------------------

def fp16_overflow(fix=None, steps=20, device="auto") -> TrainResult:
    """A model whose feed-forward outputs outgrow fp16, as T5's did after bf16 pretraining
    (66,246 > 65,504): the first fp16 forward pass gives inf, LayerNorm turns it into NaN."""
    model = lab_model()
    grow_feed_forward(model, next(lab_batches(1)), largest=1e5)
    if fix == "fp32_island":
        for layer in model.bert.encoder.layer:
            layer.output.dense = Fp32Island(layer.output.dense)
    precision = "bf16" if fix == "bf16" else "fp16"
    try:
        return _train(model, precision=precision, steps=steps, device=device)
    except NonFiniteLossError as err:  # mplab.train stops at the first non-finite loss
        return err.result


def grow_feed_forward(model, batch: dict, largest: float = 1e5) -> float:
    """Scale each feed-forward output layer so its largest output on `batch` is `largest`
    (fp32; the LayerNorm after it normalizes that away). Returns the largest seen before."""
    denses = [layer.output.dense for layer in model.bert.encoder.layer]
    seen = []
    hooks = [d.register_forward_hook(lambda m, a, out: seen.append(out.abs().max().item()))
             for d in denses]
    with torch.no_grad():
        model(**batch)
    for hook in hooks:
        hook.remove()
    for dense, before in zip(denses, seen):
        dense.weight.data *= largest / before
        dense.bias.data *= largest / before
    return max(seen)


def no_scaler(fix=None, steps=30, device="auto") -> TrainResult:
    """fp16 without a GradScaler. The loss is scaled by 2**-16 to put the lab model's
    gradients where many real models' are (most of SSD's activation gradients lie below
    2**-24, Micikevicius et al. 2018); without a scaler they flush to 0."""
    device = resolve_device(device)
    model = lab_model().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    autocast = lab_autocast("bf16" if fix == "bf16" else "fp16", device)
    scaler = torch.amp.GradScaler(device.type, enabled=fix == "scaler")
    with Recorder(model, optimizer, scaler=scaler if fix == "scaler" else None,
                  autocast=autocast) as rec:
        for batch in lab_batches(steps, device=device):
            with autocast:
                loss = model(**batch).loss * 2**-16
            scaler.scale(loss).backward()  # a disabled scaler passes the loss through
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
            rec.step(loss * 2**16)  # record the loss on its usual scale
        return rec.finish()


def clip_before_unscale(fix=None, steps=30, device="auto", init_scale=2.0**16) -> TrainResult:
    """Gradient clipping on the scaled gradients: the norm is the scale (65536 by default)
    times too big."""
    device = resolve_device(device)
    model = lab_model().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    autocast = lab_autocast("fp16", device)
    scaler = torch.amp.GradScaler(device.type, init_scale=init_scale)
    with Recorder(model, optimizer, scaler=scaler, autocast=autocast, max_grad_norm=1.0) as rec:
        for batch in lab_batches(steps, device=device):
            with autocast:
                loss = model(**batch).loss
            scaler.scale(loss).backward()
            if fix == "unscale_first":
                scaler.unscale_(optimizer)  # the fix: clip the true gradients
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
            rec.step(loss, grad_norm=norm)
        return rec.finish()


def extra_update(fix=None, steps=30, device="auto") -> TrainResult:
    """Two optimizers (the classifier head at a higher learning rate), each followed by its
    own `scaler.update()`: the scale moves twice per iteration."""
    device = resolve_device(device)
    model = lab_model().to(device)
    head = list(model.classifier.parameters())
    body = [p for p in model.parameters() if all(p is not h for h in head)]
    body_opt = torch.optim.AdamW(body, lr=LR)
    head_opt = torch.optim.AdamW(head, lr=10 * LR)
    autocast = lab_autocast("fp16", device)
    scaler = torch.amp.GradScaler(device.type, growth_interval=10)
    with Recorder(model, body_opt, scaler=scaler, autocast=autocast) as rec:
        for batch in lab_batches(steps, device=device):
            with autocast:
                loss = model(**batch).loss
            scaler.scale(loss).backward()
            scaler.step(body_opt)
            if fix != "update_once":
                scaler.update()  # the bug: an update per optimizer
            scaler.step(head_opt)
            scaler.update()
            body_opt.zero_grad()
            head_opt.zero_grad()
            rec.step(loss)
        return rec.finish()


def scale_collapse(fix=None, steps=40, device="auto") -> TrainResult:
    """A penalty on the length of the token vectors, sqrt(sum(h**2)) with padding masked to
    0: the gradient of sqrt at 0 is inf, and inf × 0 = NaN at every step, whatever the scale.
    The scaler skips every step and halves the scale each time (torch issue #99640)."""
    device = resolve_device(device)
    model = lab_model().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    autocast = lab_autocast("fp16", device)
    scaler = torch.amp.GradScaler(device.type)
    eps = 1e-6 if fix == "eps" else 0.0  # the fix: keep sqrt away from 0
    with Recorder(model, optimizer, scaler=scaler, autocast=autocast) as rec:
        for batch in lab_batches(steps, device=device):
            with autocast:
                out = model(**batch, output_hidden_states=True)
                tokens = out.hidden_states[-1] * batch["attention_mask"][..., None]
                lengths = (tokens.float().pow(2).sum(-1) + eps).sqrt()
                loss = out.loss + 1e-3 * lengths.mean()
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
            rec.step(loss)
        return rec.finish()


def accumulation_scaler(fix=None, steps=12, device="auto", micro_batches=4) -> TrainResult:
    """Gradient accumulation over 4 micro-batches with clipping on each: unscale_ twice
    raises, so the loop below also calls update() on every micro-batch to silence it."""
    device = resolve_device(device)
    model = lab_model().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    autocast = lab_autocast("fp16", device)
    scaler = torch.amp.GradScaler(device.type)
    with Recorder(model, optimizer, scaler=scaler, autocast=autocast, max_grad_norm=1.0) as rec:
        for batch in lab_batches(steps, batch_size=BATCH * micro_batches, device=device):
            total = 0.0
            for i in range(micro_batches):
                micro = {k: v[i::micro_batches] for k, v in batch.items()}
                with autocast:
                    loss = model(**micro).loss / micro_batches
                scaler.scale(loss).backward()
                total += loss.detach()
                last = i == micro_batches - 1
                if fix == "step_only" and not last:
                    continue  # the fix: nothing but backward on a micro-batch that does not step
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
                if last:
                    scaler.step(optimizer)
                scaler.update()
            optimizer.zero_grad()
            rec.step(total)
        return rec.finish()


def accumulation_error() -> str:
    """What torch says to the same loop without the update() on each micro-batch."""
    model = lab_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    scaler = torch.amp.GradScaler("cpu")
    batch = next(lab_batches(1))
    for _ in range(2):
        scaler.scale(model(**batch).loss).backward()
        try:
            scaler.unscale_(optimizer)
        except RuntimeError as err:
            return f"RuntimeError: {err}"
    return "no error"


def fp16_ignored(fix=None, steps=12, path="accelerate") -> TrainResult:
    """`Accelerator(mixed_precision="fp16")` (or `TrainingArguments(fp16=True)`) on a CPU:
    no autocast and no scaler are built, and nothing says so."""
    precision = ("bf16" if has_units("bf16") else "fp32") if fix == "supported" else "fp16"
    return _train(lab_model(), path=path, precision=precision, steps=steps, device="cpu")


def no_units(fix=None, steps=12) -> TrainResult:
    """Low-precision autocast on a CPU without units for it: correct, and slow. fp16 where
    the CPU has no fp16 units (most CPUs), else bf16 where it has none for bf16."""
    missing = next((p for p in ("fp16", "bf16") if not has_units(p)), None)
    if missing is None:
        raise CannotReproduce("this CPU has bf16 and fp16 units ("
                         + ", ".join(f for p in UNITS for f in UNITS[p])
                         + "), so low precision is never slow for want of them here: no_units "
                         "cannot be reproduced on this machine")
    precision = "fp32" if fix == "fp32" else missing
    return _train(lab_model(), precision=precision, steps=steps, device="cpu")


def scaler_bypassed(fix=None, steps=20, device="auto") -> TrainResult:
    """`optimizer.step()` after `scaler.scale(loss).backward()`: nothing unscales, so every
    update is the scale (65536) times too large, and no step with inf/NaN gradients is
    skipped. With SGD the run blows up at once. (AdamW divides the scale away, its update
    being m / sqrt(v), which hides the bug until an inf gradient poisons its states.)"""
    device = resolve_device(device)
    model = lab_model().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.03)
    autocast = lab_autocast("fp16", device)
    scaler = torch.amp.GradScaler(device.type)
    with Recorder(model, optimizer, scaler=scaler, autocast=autocast) as rec:
        for batch in lab_batches(steps, device=device):
            with autocast:
                loss = model(**batch).loss
            scaler.scale(loss).backward()
            if fix == "scaler_step":
                scaler.step(optimizer)  # the fix: unscale, skip a step with inf/NaN, step
                scaler.update()
            else:
                optimizer.step()  # the bug: a step on the scaled gradients
            optimizer.zero_grad()
            rec.step(loss)
        return rec.finish()


def diverged(fix=None, steps=12, device="auto") -> TrainResult:
    """bf16 autocast and a learning rate 1000 times the lab's (AdamW at lr=1): the loss
    climbs to tens. bf16 has fp32's range, so nothing overflowed: the weights diverged."""
    device = resolve_device(device)
    model = lab_model().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR if fix == "lower_lr" else 1.0)
    autocast = lab_autocast("bf16", device)
    with Recorder(model, optimizer, autocast=autocast) as rec:
        for batch in lab_batches(steps, device=device):
            with autocast:
                loss = model(**batch).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            rec.step(loss)
        return rec.finish()


def autocast_off(fix=None, steps=10) -> TrainResult:
    """`torch.autocast("cuda", dtype=torch.bfloat16)`, a line from a GPU tutorial, in a run
    on the CPU: torch switches it off where there is no GPU, and where there is one it casts
    only CUDA ops. Either way the CPU's matmuls run in fp32."""
    device = torch.device("cpu")
    model = lab_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    where = device.type if fix == "same_device" else "cuda"  # the fix: the model's device
    with warnings.catch_warnings():  # torch's one warning; the record says it
        warnings.simplefilter("ignore", UserWarning)
        autocast = torch.autocast(where, dtype=torch.bfloat16)
    with Recorder(model, optimizer, autocast=autocast) as rec:
        for batch in lab_batches(steps, device=device):
            with autocast:
                loss = model(**batch).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            rec.step(loss)
        return rec.finish()


def scaler_with_bf16(fix=None, steps=10, device="auto") -> TrainResult:
    """fp16 switched to bf16 with the GradScaler left in: harmless to the numbers (bf16
    gradients do not underflow), but a check of every gradient each step, for nothing."""
    device = resolve_device(device)
    model = lab_model().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    autocast = lab_autocast("bf16", device)
    scaler = torch.amp.GradScaler(device.type, enabled=fix != "drop_scaler")
    with Recorder(model, optimizer, scaler=scaler, autocast=autocast) as rec:
        for batch in lab_batches(steps, device=device):
            with autocast:
                loss = model(**batch).loss
            scaler.scale(loss).backward()  # a disabled scaler passes the loss through
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
            rec.step(loss)
        return rec.finish()


def frequent_skips(fix=None, steps=30, device="auto") -> TrainResult:
    """A GradScaler set to grow after every clean step (growth_interval=1, from an init
    scale of 2**24): it climbs until the gradients overflow fp16, backs off, and climbs
    again, so about every other step is skipped. torch's default grows every 2000 steps."""
    device = resolve_device(device)
    model = lab_model().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    autocast = lab_autocast("fp16", device)
    growth = {} if fix == "default_growth" else {"growth_interval": 1}  # the fix: no setting
    scaler = torch.amp.GradScaler(device.type, init_scale=2.0**24, **growth)
    with Recorder(model, optimizer, scaler=scaler, autocast=autocast) as rec:
        for batch in lab_batches(steps, device=device):
            with autocast:
                loss = model(**batch).loss
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
            rec.step(loss)
        return rec.finish()


def stalled(fix=None, steps=100, device="auto") -> TrainResult:
    """A learning rate 1000 times too low (AdamW at 1e-6, fp32): nothing is wrong with the
    precision, and in 100 steps the loss does not fall from its start near ln 2 = 0.693
    (the lab's 1e-3 takes it below 0.5 within 30 steps)."""
    device = resolve_device(device)
    model = lab_model().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR if fix == "higher_lr" else 1e-6)
    with Recorder(model, optimizer) as rec:
        for batch in lab_batches(steps, device=device):
            loss = model(**batch).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            rec.step(loss)
        return rec.finish()


def fp8_grad_scale(fix=None, device="cpu") -> TrainResult:
    """Lesson 9's broken FP8 recipe: each Linear's output gradient cast to e4m3 at scale 1, so
    nearly every value falls below e4m3's smallest (2^-9) and flushes to 0; the fix scales each
    gradient tensor by 57344 / amax and casts it to e5m2 (mplab's recipe, torchao's
    tensorwise). 40 steps from the lesson model's warm start (mplab.train.fp8)."""
    from mplab.train.fp8 import fp8_run

    return fp8_run("e4m3_unscaled" if fix is None else "mplab", device=device)


def pure_bf16(fix=None, steps=80, device="auto", lr=LR / 10) -> TrainResult:
    """Weights in bf16 (a bf16 checkpoint loaded as saved, transformers 5's default, or
    model.to(torch.bfloat16)) and AdamW's states with them: updates smaller than half a
    bf16 ulp of their weight are rounded away."""
    return _bf16_run(fix, steps, device, lr)[0]


def _bf16_run(fix, steps, device, lr):
    device = resolve_device(device)
    model = lab_model().to(device)
    if fix != "fp32_master":
        model.to(torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    if fix in ("kahan", "stochastic"):
        optimizer = LowPrecisionUpdate(optimizer, rounding=fix, seed=0)
    autocast = lab_autocast("bf16", device)
    with Recorder(model, optimizer, autocast=autocast, precision="bf16") as rec:
        for batch in lab_batches(steps, device=device):
            with autocast:
                loss = model(**batch).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            rec.step(loss)
        return rec.finish(), model


#: bytes each weight costs in memory, weights and what keeps their updates (AdamW's two
#: fp32 states, 8 bytes, come on top of every row)
BF16_FIX_BYTES = {None: 2, "fp32_master": 4, "kahan": 4, "stochastic": 2}


def compare_bf16_fixes(steps: int = 80, device="auto", lr: float = LR / 10) -> Table:
    """Pure bf16 and its three fixes side by side on the same run (model, batches, seed):
    the loss, the share of stored weights a step left unchanged, and how far each run's
    weights ended from the fp32-master run's, relative to how far those moved."""
    start = [p.detach().float().clone() for p in lab_model().parameters()]
    runs = {fix: _bf16_run(fix, steps, device, lr) for fix in (None, "fp32_master", "kahan",
                                                                "stochastic")}
    master = [p.detach().float().cpu() for p in runs["fp32_master"][1].parameters()]
    moved = sum(float((m - s).pow(2).sum()) for m, s in zip(master, start)) ** 0.5
    rows = []
    for fix, (result, model) in runs.items():
        weights = [p.detach().float().cpu() for p in model.parameters()]
        off = sum(float((w - m).pow(2).sum()) for w, m in zip(weights, master)) ** 0.5
        unchanged = [u for u in result.unchanged_weight_fractions if u is not None]
        last = result.losses[-10:]
        rows.append({
            "run": {None: "pure bf16 (the accident)", "fp32_master": "fp32 master weights",
                    "kahan": "bf16 + Kahan compensation",
                    "stochastic": "bf16 + stochastic rounding (seed 0)"}[fix],
            "fix": fix,
            "bytes per weight": BF16_FIX_BYTES[fix],
            "mean loss, last 10 steps": statistics.mean(last),
            "loss std, last 10 steps": statistics.stdev(last) if len(last) > 1 else 0.0,
            "weights unchanged per step": (sorted(unchanged)[len(unchanged) // 2]
                                           if unchanged else 0.0),
            "distance from fp32 master": off / moved if moved else float("nan"),
        })
    return Table(rows, title=f"pure bf16 and its fixes: {steps} AdamW steps at lr {lr:g}")
