"""No false alarms (issue 34, item 7): `mplab.diagnose` on healthy mixed precision runs names
no problem. Each run is small and realistic, on the CPU: a custom autograd Function kept in
fp32 by `custom_fwd`, fp16 with a GradScaler and clipping after `unscale_`, a bf16 Llama (also
with bf16 weights and Kahan-compensated updates), Accelerate with gradient accumulation, the
Hugging Face Trainer with bf16=True, and a Recorder told nothing. What the diagnosis may say of
them: only what is true of this machine (`no_units` where the CPU lacks units for the
precision, `mplab.hardware.has_units`) and notes (the scale calibrating, compensated weights).
"""

import statistics
import warnings

import pytest
import torch
from test_attach import accelerate_run
from torch.nn import functional as F
from torch.utils.data import DataLoader
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    LlamaConfig,
    LlamaForCausalLM,
    Trainer,
    TrainingArguments,
)

import mplab
from mplab.hardware import has_units
from mplab.numerics.bf16_updates import LowPrecisionUpdate
from mplab.train import Recorder

warnings.filterwarnings("ignore", category=UserWarning)

LOW = {"bf16": torch.bfloat16, "fp16": torch.float16}
#: notes a healthy run may carry: the first skipped steps of an fp16 run, compensated weights
NOTES = {"scale_calibrating", "compensated_weights"}


def assert_healthy(result, precision: str, notes=NOTES):
    """The run is healthy (finite losses that fell, its matmuls in `precision`, no inf/NaN seen
    by the layers' watch but gradients the scaler skipped), and its diagnosis names only what is
    true of this machine."""
    assert all(map(torch.isfinite, torch.tensor(result.losses))), result.losses
    k = max(3, len(result.losses) // 4)
    assert statistics.mean(result.losses[-k:]) < result.losses[0], result.losses
    first = result.numerics["first"]  # only an overflowed gradient whose step the scaler skipped
    assert all(phase == "backward" and e["step"] in result.skipped_steps
               for phase, e in first.items()), first
    found = mplab.diagnose(result)
    problems = [f.name for f in found.findings if f.severity != "note"]
    assert problems == ([] if has_units(precision) else ["no_units"]), found
    assert {f.name for f in found.findings if f.severity == "note"} <= set(notes), found
    assert result.compute_dtype == LOW[precision], result.compute_dtype
    return found


# ---- 1. a custom autograd Function, kept in fp32 as torch documents it ---------------------

class LinearFunction(torch.autograd.Function):
    """x @ w.T + b with its own backward, run in fp32 inside any autocast region."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cpu", cast_inputs=torch.float32)
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        return x @ weight.t() + bias

    @staticmethod
    @torch.amp.custom_bwd(device_type="cpu")
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        return grad @ weight, grad.t() @ x, grad.sum(0)


class CustomLinear(torch.nn.Linear):
    """An nn.Linear whose forward is the custom Function (as fused or quantised Linears are)."""

    def forward(self, x):
        return LinearFunction.apply(x, self.weight, self.bias)


class CustomLayer(torch.nn.Module):
    """The same layer, written as a plain Module holding a weight and a bias."""

    def __init__(self, n_in: int, n_out: int):
        super().__init__()
        ref = torch.nn.Linear(n_in, n_out)
        self.weight, self.bias = ref.weight, ref.bias

    def forward(self, x):
        return LinearFunction.apply(x, self.weight, self.bias)


def custom_mlp(first) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(first(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 64),
                               torch.nn.LayerNorm(64), torch.nn.GELU(), torch.nn.Linear(64, 4))


def teacher_batches(steps: int, n: int = 64):
    """Gaussian inputs labelled by a fixed random linear teacher: a task an MLP learns."""
    g = torch.Generator().manual_seed(1)
    teacher = torch.randn(32, 4, generator=g)
    for _ in range(steps):
        x = torch.randn(n, 32, generator=g)
        yield x, (x @ teacher).argmax(-1)


def custom_run(first, precision: str, steps: int = 30, **told):
    """The custom-Function MLP trained under autocast (fp16 with a GradScaler), recorded with
    `told` (autocast=True: the loop's autocast; else whatever Recorder is given)."""
    model = custom_mlp(first)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    autocast = torch.autocast("cpu", dtype=LOW[precision])
    scaler = torch.amp.GradScaler("cpu") if precision == "fp16" else None
    if told.pop("autocast", False):
        told["autocast"] = autocast
    with Recorder(model, optimizer, scaler=scaler, **told) as rec:
        for x, y in teacher_batches(steps):
            with autocast:
                loss = F.cross_entropy(model(x), y)
            if scaler is None:
                loss.backward()
                optimizer.step()
            else:
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
            optimizer.zero_grad()
            rec.step(loss)
        return rec.finish()



@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("first", [
    pytest.param(CustomLinear, id="nn.Linear-subclass"),
    pytest.param(CustomLayer, id="plain-Module")])
def test_a_custom_function_decorated_with_custom_fwd_is_healthy(first, precision):
    result = custom_run(first, precision, autocast=True)
    assert result.param_dtype == torch.float32 and result.skipped_steps == []
    assert_healthy(result, precision)


# ---- a tiny BERT from its config, on a task it learns ----------------------------------------

VOCAB, SEQ = 64, 16


def tiny_bert() -> BertForSequenceClassification:
    torch.manual_seed(0)
    return BertForSequenceClassification(BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=SEQ, num_labels=2))


def bert_rows(n: int) -> list[dict]:
    """`n` padded sequences (their attention masks 0 past each one's length), labelled by
    whether the first token is in the vocabulary's lower half."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(2, VOCAB, (n, SEQ), generator=g)
    lengths = torch.randint(SEQ // 2, SEQ + 1, (n,), generator=g)
    mask = (torch.arange(SEQ) < lengths[:, None]).long()
    ids = ids * mask
    labels = (ids[:, 0] < VOCAB // 2).long()
    return [{"input_ids": ids[i], "attention_mask": mask[i], "labels": labels[i]}
            for i in range(n)]


# ---- 2. fp16 with a GradScaler, clipping after unscale_ ---------------------------------------

MAX_NORM = 1.0


def fp16_clipped_run(steps: int = 20, **told):
    """fp16 autocast, a GradScaler, clip_grad_norm_ after scaler.unscale_, AdamW: the loop
    torch's AMP examples teach. `told`: what the Recorder is given besides the scaler
    (autocast=True: the loop's own autocast)."""
    model = tiny_bert()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    autocast = torch.autocast("cpu", dtype=torch.float16)
    scaler = torch.amp.GradScaler("cpu")
    if told.pop("autocast", False):
        told["autocast"] = autocast
    with Recorder(model, optimizer, scaler=scaler, max_grad_norm=MAX_NORM, **told) as rec:
        for batch in DataLoader(bert_rows(16 * steps), batch_size=16):
            with autocast:
                loss = model(**batch).loss
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
            rec.step(loss, grad_norm=norm)
        return rec.finish()


def test_fp16_with_a_gradscaler_and_clipping_after_unscale_is_healthy():
    result = fp16_clipped_run(autocast=True)
    assert result.precision == "fp16" and result.config["scaler"] == "torch"
    assert len(result.grad_norms) == result.steps == 20
    assert result.scaler_calls == [{"scale": 1, "unscale_": 1, "step": 1, "update": 1}] * 20
    assert_healthy(result, "fp16")


# ---- 3. a bf16 Llama: fp32 master weights, or bf16 weights with Kahan updates ---------------

def tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64))


def pattern_batches(steps: int, batch: int = 8, seq: int = 32, period: int = 8):
    """Random tokens in a repeated pattern (one of 4 motifs of `period` tokens, at a random
    phase): a causal LM learns to continue it, so its loss falls within tens of steps."""
    g = torch.Generator().manual_seed(0)
    motifs = torch.randint(0, 128, (4, period), generator=g)
    for _ in range(steps):
        pick = torch.randint(0, 4, (batch,), generator=g)
        phase = torch.randint(0, period, (batch, 1), generator=g)
        ids = torch.gather(motifs[pick], 1, (torch.arange(seq) + phase) % period)
        yield {"input_ids": ids, "labels": ids}


def llama_run(bf16_weights: bool, steps: int = 20):
    model = tiny_llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    if bf16_weights:
        model.to(torch.bfloat16)
        optimizer = LowPrecisionUpdate(optimizer, rounding="kahan")
    autocast = torch.autocast("cpu", dtype=torch.bfloat16)
    with Recorder(model, optimizer, autocast=autocast) as rec:
        for batch in pattern_batches(steps):
            with autocast:
                loss = model(**batch).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            rec.step(loss)
        return rec.finish()


def test_a_bf16_llama_with_fp32_master_weights_is_healthy():
    result = llama_run(bf16_weights=False)
    assert result.param_dtype == torch.float32
    assert result.losses[-1] < 0.5 * result.losses[0], result.losses  # it learns the pattern
    assert_healthy(result, "bf16", notes=())
    assert {row["step"] for row in result.numerics["layers"]} == {1, 10, 20}


def test_a_bf16_llama_with_bf16_weights_and_kahan_updates_is_only_noted():
    result = llama_run(bf16_weights=True)
    assert result.param_dtype == torch.bfloat16 and result.config["rounding"] == "kahan"
    assert result.losses[-1] < 0.5 * result.losses[0], result.losses
    found = assert_healthy(result, "bf16", notes={"compensated_weights"})
    assert "compensated_weights" in found


# ---- 2, on the Llama: a loss summed over tokens, clipped after unscale_ -----------------------


def test_fp16_clipping_after_unscale_of_a_summed_loss_is_healthy():
    """A causal LM loss summed over the batch's tokens (reduction="sum", as many LM codebases
    write it): the true gradient norm is in the thousands, and clipping after
    scaler.unscale_ is right. The first steps are skipped while the scale falls from 65536."""
    model = tiny_llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    autocast = torch.autocast("cpu", dtype=torch.float16)
    scaler = torch.amp.GradScaler("cpu")
    with Recorder(model, optimizer, scaler=scaler, autocast=autocast,
                  max_grad_norm=MAX_NORM) as rec:
        for batch in pattern_batches(16, batch=32):
            ids = batch["input_ids"]
            with autocast:
                logits = model(input_ids=ids).logits[:, :-1]
                loss = F.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten(),
                                       reduction="sum")
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
            rec.step(loss / ids[:, 1:].numel(), grad_norm=norm)  # the loss per token
        result = rec.finish()
    assert result.skipped_steps == list(range(1, len(result.skipped_steps) + 1))
    assert_healthy(result, "fp16")


# ---- 4. Accelerate with gradient accumulation ------------------------------------------------

def test_accelerate_bf16_with_gradient_accumulation_is_healthy():
    """Accelerator(gradient_accumulation_steps=4, mixed_precision="bf16"), `with
    accelerator.accumulate(model):`, watched by watch_accelerator (test_attach's loop, on the
    lab model and its reviews): one record per optimizer step, nothing named."""
    result = accelerate_run("bf16", 1e-3, 8, False, accumulation=4)
    assert result.steps == 8 and result.skipped_steps == [] and result.scales == []
    assert result.numerics["stale_grads"] == []  # accumulating is not forgetting zero_grad
    assert_healthy(result, "bf16", notes=())


# ---- 5. the Hugging Face Trainer with bf16=True ----------------------------------------------

def test_a_bf16_trainer_run_of_a_fresh_bert_is_healthy(tmp_path):
    steps = 20
    watch = mplab.diagnosis.Watch()
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=16,
                             max_steps=steps, learning_rate=3e-3, bf16=True, use_cpu=True,
                             report_to=[], save_strategy="no", logging_steps=1000,
                             disable_tqdm=True)
    Trainer(model=tiny_bert(), args=args, train_dataset=bert_rows(16 * steps),
            callbacks=[watch]).train()
    result = watch.result
    assert result.steps == steps and result.param_dtype == torch.float32
    assert_healthy(result, "bf16", notes=())


# ---- 6. the diagnosis does not depend on what the Recorder was not told ------------------------

@pytest.mark.parametrize("run", [
    pytest.param(fp16_clipped_run, id="fp16-clipped-bert"),
    pytest.param(lambda **told: custom_run(CustomLinear, "fp16", **told),
                 id="fp16-custom-first-Linear")])
def test_the_diagnosis_is_the_same_told_autocast_or_not(run):
    told, untold = run(autocast=True), run()
    assert told.losses == untold.losses  # the same run: the watch changes nothing it computes
    assert mplab.diagnose(untold).names == mplab.diagnose(told).names
    graded = [[(f.name, f.severity) for f in mplab.diagnose(r).findings] for r in (told, untold)]
    assert graded[0] == graded[1], graded
    assert untold.precision == told.precision == "fp16"  # learned from the matmuls' dtype
