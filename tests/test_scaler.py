"""mplab.amp.scaler.GradScaler against torch.amp.GradScaler, run side by side in lockstep.

Every test drives two identical setups, one with torch's scaler and one with mplab's, through the
same calls, and asserts that the scales, growth trackers, skip decisions, parameters (bit for bit)
and exceptions (type and message) agree after every call.
"""

import copy
import inspect
import math
import pickle
import random
import warnings

import pytest
import torch
from torch import nn

import mplab.amp.scaler
from mplab.amp.scaler import GradScaler, UpdateRecord

TorchScaler = torch.amp.GradScaler


def fused_adamw_on_cpu() -> bool:
    """torch >= 2.4 has fused AdamW on CPU; older versions accept fused=True for CUDA only."""
    try:
        p = nn.Parameter(torch.ones(1))
        p.grad = torch.ones(1)
        torch.optim.AdamW([p], fused=True).step()
        return True
    except (RuntimeError, TypeError):
        return False


FUSED_ON_CPU = fused_adamw_on_cpu()
INJECT = [math.inf, -math.inf, math.nan, 3.0e38, -3.3e38]  # the last two are finite: no skip


# ---- helpers ---------------------------------------------------------------------------------


def bits(t: torch.Tensor) -> torch.Tensor:
    """A tensor's raw bytes, so NaNs compare equal to themselves and -0.0 differs from 0.0."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def same_bits(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is b
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def outcome(fn, *args, **kwargs):
    """("ok", result) or (exception type, message): what a call did, comparable across scalers."""
    try:
        return ("ok", fn(*args, **kwargs))
    except Exception as e:  # noqa: BLE001 - every exception is part of the behaviour under test
        return (type(e), str(e))


def same_outcome(a, b) -> bool:
    if a[0] == "ok" and b[0] == "ok":
        x, y = a[1], b[1]
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            return same_bits(x, y)
        return x == y or (x != x and y != y)
    return a == b


def stages(scaler, optimizers) -> list:
    """Each optimizer's stage as an int (None: not seen this iteration), without creating one."""
    states = scaler._per_optimizer_states
    result = []
    for opt in optimizers:
        state = states.get(id(opt))
        if state is not None:
            state = state["stage"] if isinstance(state, dict) else state.stage  # torch's or ours
        result.append(None if state is None else state.value)
    return result


def assert_same_scaler(t: TorchScaler, m: GradScaler) -> None:
    assert t.is_enabled() == m.is_enabled()
    if not t.is_enabled():
        return
    assert (t._scale is None) == (m._scale is None)
    if t._scale is not None:
        assert same_bits(t._scale, m._scale), (t._scale, m._scale)
        assert same_bits(t._growth_tracker, m._growth_tracker)
    assert same_outcome(outcome(t.get_scale), outcome(m.get_scale))
    assert t._get_growth_tracker() == m.get_growth_tracker()
    assert t.state_dict() == m.state_dict() or math.isnan(t.get_scale())
    assert len(t._per_optimizer_states) == len(m._per_optimizer_states)


def assert_same_params(a: list[nn.Parameter], b: list[nn.Parameter]) -> None:
    for p, q in zip(a, b, strict=True):
        assert same_bits(p, q)
        assert same_bits(p.grad, q.grad)


class Setup:
    """A two-headed model, two losses, two optimizers: SGD with momentum on trunk + head A,
    and `kind` ("adam", "adamw" or "fused_adamw") on head B."""

    def __init__(self, seed: int, kind: str = "adam", dtype=torch.float32):
        torch.manual_seed(seed)
        self.trunk = nn.Sequential(nn.Linear(5, 7), nn.Tanh()).to(dtype)
        self.head_a = nn.Linear(7, 2).to(dtype)
        self.head_b = nn.Linear(7, 3).to(dtype)
        group_a = [*self.trunk.parameters(), *self.head_a.parameters()]
        group_b = [*self.head_b.parameters()]
        self.params = group_a + group_b
        self.groups = [group_a, group_b]
        sgd = torch.optim.SGD(group_a, lr=0.05, momentum=0.9)
        if kind == "adam":
            other = torch.optim.Adam(group_b, lr=0.01)
        elif kind == "adamw":
            other = torch.optim.AdamW(group_b, lr=0.01, weight_decay=0.1)
        else:
            other = torch.optim.AdamW(group_b, lr=0.01, fused=True)
        self.optimizers = [sgd, other]
        self.dtype = dtype

    def losses(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.trunk(x.to(self.dtype))
        return self.head_a(h).square().mean(), self.head_b(h).sin().sum()


def kinds() -> list[str]:
    return ["adam", "adamw"] + (["fused_adamw"] if FUSED_ON_CPU else [])


# ---- random lockstep training runs -----------------------------------------------------------


def random_run(seed: int) -> None:
    rng = random.Random(seed)
    kind = rng.choice(kinds())
    config = dict(
        init_scale=rng.choice([2.0**16, 3.0, 1000.5, 2.0**-3, 1.0, 7e4, 2.0**100]),
        growth_factor=rng.choice([2.0, 1.7, 1.1, 3.0, 1.0001]),
        backoff_factor=rng.choice([0.5, 0.37, 0.9, 0.125]),
        growth_interval=rng.choice([1, 2, 3, 5]),
    )
    pair = [Setup(seed, kind), Setup(seed, kind)]
    scalers = [TorchScaler("cpu", **config), GradScaler("cpu", **config)]
    expected_history: list[UpdateRecord] = []
    seen: list[int] = []  # optimizer positions in the order mplab's scaler first saw them
    data = torch.Generator().manual_seed(seed)

    for _ in range(rng.randint(8, 16)):
        micro_batches = rng.choice([1, 1, 1, 2, 3])
        xs = [torch.randn(4, 5, generator=data) for _ in range(micro_batches)]
        injections = [
            (rng.randrange(len(pair[0].params)), rng.random(), rng.choice(INJECT))
            for _ in range(rng.choice([0, 0, 0, 1, 2]))
        ]
        actions = ["step", "step", "clip+step", "closure", "unscale", "none"]
        plan = [rng.choice(actions), rng.choice(actions)]
        update = rng.choice(["auto"] * 8 + ["float", "tensor"])
        new_scale = rng.choice([2.0**10, 1234.5, 3.0])

        results = []
        for setup, scaler in zip(pair, scalers):
            outcomes = []
            for x in xs:  # gradient accumulation: scale (loss / N) on every micro-batch
                loss_a, loss_b = setup.losses(x)
                scaled = scaler.scale([loss_a / micro_batches, (loss_b / micro_batches,)])
                torch.autograd.backward([scaled[0], scaled[1][0]])
            for index, where, value in injections:
                grad = setup.params[index].grad.view(-1)
                grad[int(where * grad.numel())] = value
            for opt, group, what in zip(setup.optimizers, setup.groups, plan):
                if what in ("clip+step", "unscale"):
                    outcomes.append(outcome(scaler.unscale_, opt))
                if what == "clip+step":
                    torch.nn.utils.clip_grad_norm_(group, max_norm=1.0)
                if what in ("step", "clip+step"):
                    outcomes.append(outcome(scaler.step, opt))
                if what == "closure":  # a positional closure is passed through; its value returned
                    outcomes.append(outcome(scaler.step, opt, lambda: 42.0))
            if isinstance(scaler, TorchScaler):  # what mplab's history should say
                found = {}
                for position, opt in enumerate(setup.optimizers):
                    state = scaler._per_optimizer_states.get(id(opt))
                    if state is not None:
                        called = plan[position] in ("step", "clip+step", "closure")
                        found_inf = sum(f.item() for f in state["found_inf_per_device"].values())
                        found[position] = (called, found_inf)
                scale_before = scaler.get_scale()
            arg = {"auto": None, "float": new_scale, "tensor": torch.tensor(new_scale)}[update]
            outcomes.append(outcome(scaler.update, arg))
            results.append(outcomes)

        for a, b in zip(*results, strict=True):
            assert same_outcome(a, b), (a, b)
        assert_same_scaler(*scalers)
        assert stages(scalers[0], pair[0].optimizers) == stages(scalers[1], pair[1].optimizers)
        assert_same_params(pair[0].params, pair[1].params)

        if results[0][-1][0] == "ok":
            for position in found:
                if position not in seen:
                    seen.append(position)
            combined = sum(f for _, f in found.values())
            expected_history.append(
                UpdateRecord(
                    iteration=len(expected_history),
                    scale=scale_before,
                    new_scale=scalers[0].get_scale(),
                    growth_tracker=scalers[0]._get_growth_tracker(),
                    found_inf=combined != 0,
                    stepped={seen.index(p): c and f == 0 for p, (c, f) in found.items()},
                    manual=update != "auto",
                )
            )
        set_to_none = rng.random() < 0.5
        for opt in (*pair[0].optimizers, *pair[1].optimizers):
            opt.zero_grad(set_to_none=set_to_none)

        if rng.random() < 0.15:  # change a hyper-parameter through the setters
            factor = rng.choice([1.3, 2.0, 4.0])
            for scaler in scalers:
                scaler.set_growth_factor(factor)
        if rng.random() < 0.2 and results[0][-1][0] == "ok":
            # Checkpoint both ways: each scaler resumes from the *other* one's state_dict.
            assert scalers[1].history == expected_history
            expected_history, seen = [], []
            state_t, state_m = scalers[0].state_dict(), scalers[1].state_dict()
            assert state_t == state_m
            scalers = [TorchScaler("cpu"), GradScaler("cpu")]
            scalers[0].load_state_dict(state_m)
            scalers[1].load_state_dict(state_t)
            assert_same_scaler(*scalers)
    assert scalers[1].history == expected_history


@pytest.mark.parametrize("block", range(10))
def test_random_training_runs_match_torch_step_by_step(block):
    for seed in range(block * 10, block * 10 + 10):
        random_run(seed)


def train(setup, scaler, steps, data, start=0):
    """A plain loop with an inf every third step; returns (scale, tracker) after each update."""
    trajectory = []
    for step in range(start, start + steps):
        loss_a, loss_b = setup.losses(torch.randn(4, 5, generator=data))
        scaler.scale(loss_a + loss_b).backward()
        if step % 3 == 1:
            setup.params[0].grad[0, 0] = math.inf
        for opt in setup.optimizers:
            scaler.step(opt)
        scaler.update()
        for opt in setup.optimizers:
            opt.zero_grad()
        trajectory.append((scaler.get_scale(), scaler._get_growth_tracker()))
    return trajectory


@pytest.mark.parametrize("resume_with", [TorchScaler, GradScaler])
def test_checkpoint_resume_gives_the_uninterrupted_trajectory(resume_with):
    config = dict(init_scale=1000.5, growth_factor=1.7, backoff_factor=0.37, growth_interval=2)
    reference = Setup(3, "adamw")
    expected = train(reference, TorchScaler("cpu", **config), 12, torch.Generator().manual_seed(9))
    full = Setup(3, "adamw")
    ours = train(full, GradScaler("cpu", **config), 12, torch.Generator().manual_seed(9))
    assert ours == expected
    assert_same_params(reference.params, full.params)

    first = Setup(3, "adamw")
    data = torch.Generator().manual_seed(9)
    scaler = GradScaler("cpu", **config)
    trajectory = train(first, scaler, 5, data)
    checkpoint = pickle.loads(pickle.dumps({
        "model": [p.detach().clone() for p in first.params],
        "optimizers": [opt.state_dict() for opt in first.optimizers],
        "scaler": scaler.state_dict(),
    }))
    second = Setup(99, "adamw")  # other initial weights, all overwritten by the checkpoint
    with torch.no_grad():
        for p, saved in zip(second.params, checkpoint["model"]):
            p.copy_(saved)
    for opt, saved in zip(second.optimizers, checkpoint["optimizers"]):
        opt.load_state_dict(saved)
    resumed = resume_with("cpu")  # defaults: every setting must come from the checkpoint
    resumed.load_state_dict(checkpoint["scaler"])
    trajectory += train(second, resumed, 7, data, start=5)

    assert trajectory == expected
    assert_same_params(full.params, second.params)


# ---- random misuse -----------------------------------------------------------------------------

MISUSE = ["backward", "backward", "backward_a", "zero_grad", "unscale", "unscale", "step", "step",
          "step_closure_kwarg", "update", "update", "update_new", "pickle", "inject", "scale_bad"]


@pytest.mark.parametrize("block", range(4))
def test_random_call_sequences_raise_the_same_errors_and_leave_the_same_state(block):
    for seed in range(block * 40, block * 40 + 40):
        rng = random.Random(seed)
        kind = rng.choice(kinds())
        pair = [Setup(seed, kind), Setup(seed, kind)]
        scalers = [TorchScaler("cpu", init_scale=3.0), GradScaler("cpu", init_scale=3.0)]
        x = torch.randn(3, 5)
        for _ in range(14):
            op, which = rng.choice(MISUSE), rng.randrange(2)
            value = rng.choice(INJECT)
            results = []
            for setup, scaler in zip(pair, scalers):
                opt = setup.optimizers[which]
                if op.startswith("backward"):
                    loss_a, loss_b = setup.losses(x)
                    loss = loss_a if op == "backward_a" else loss_a + loss_b
                    result = outcome(lambda s=scaler, loss=loss: s.scale(loss).backward())
                elif op == "zero_grad":
                    result = outcome(opt.zero_grad)
                elif op == "unscale":
                    result = outcome(scaler.unscale_, opt)
                elif op == "step":
                    result = outcome(scaler.step, opt)
                elif op == "step_closure_kwarg":
                    result = outcome(scaler.step, opt, closure=lambda: 1.0)
                elif op == "update":
                    result = outcome(scaler.update)
                elif op == "update_new":
                    result = outcome(scaler.update, 512.0)
                elif op == "pickle":
                    result = outcome(lambda s=scaler: len(pickle.dumps(s)) > 0)
                elif op == "inject":
                    grad = setup.params[0].grad
                    result = ("ok", grad is None)
                    if grad is not None:
                        grad.view(-1)[0] = value
                else:
                    result = outcome(scaler.scale, [3.0])
                results.append(result)
            assert same_outcome(*results), (seed, op, results)
            assert_same_scaler(*scalers)
            assert stages(scalers[0], pair[0].optimizers) == stages(scalers[1], pair[1].optimizers)
            assert_same_params(pair[0].params, pair[1].params)


def test_misuse_messages_are_torchs():
    t, m = TorchScaler("cpu"), GradScaler("cpu")
    opt_t = torch.optim.SGD([nn.Parameter(torch.ones(2))])
    opt_m = torch.optim.SGD([nn.Parameter(torch.ones(2))])
    for name in ("unscale_", "step"):
        assert same_outcome(outcome(getattr(t, name), opt_t), outcome(getattr(m, name), opt_m))
    expected = outcome(t.update)
    assert expected[0] is AssertionError and "_scale is None" in expected[1]
    assert outcome(m.update) == expected
    for s in (t, m):
        s.scale(torch.ones(()))
    assert outcome(m.step, opt_m) == outcome(t.step, opt_t)  # no grads: no inf checks recorded
    assert outcome(m.update) == outcome(t.update)
    assert outcome(m.load_state_dict, {}) == outcome(t.load_state_dict, {})
    partial = {"scale": 2.0}
    assert outcome(m.load_state_dict, dict(partial)) == outcome(t.load_state_dict, dict(partial))


def test_constructor_validation_and_cuda_check_match_torch():
    for kwargs in (dict(growth_factor=1.0), dict(backoff_factor=1.0), dict(growth_factor=0.5)):
        assert outcome(GradScaler, "cpu", **kwargs) == outcome(TorchScaler, "cpu", **kwargs)
        assert GradScaler("cpu", enabled=False, **kwargs).is_enabled() is False  # not validated
    if not torch.cuda.is_available():
        with pytest.warns(UserWarning) as ours:
            m = GradScaler()
        with pytest.warns(UserWarning) as theirs:
            t = TorchScaler()
        assert [str(w.message) for w in ours] == [str(w.message) for w in theirs]
        assert m.is_enabled() is t.is_enabled() is False
    # Only the string "cuda" is checked, in both: a torch.device slips through.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert GradScaler(torch.device("cuda")).is_enabled() == TorchScaler(
            torch.device("cuda")
        ).is_enabled()


# ---- edges of the update rule -------------------------------------------------------------------


def lockstep_single(config, grads):
    """One parameter and one SGD per scaler, fed the given gradient values step by step.
    Returns mplab's scale after each update, and mplab's parameter."""
    pair = []
    for cls in (TorchScaler, GradScaler):
        p = nn.Parameter(torch.ones(3))
        pair.append((p, torch.optim.SGD([p], lr=0.5), cls("cpu", **config)))
    scales = []
    for grad in grads:
        results = []
        for p, opt, scaler in pair:
            scaler.scale(torch.ones(()))
            p.grad = torch.tensor(grad)
            results += [outcome(scaler.step, opt), outcome(scaler.update)]
        assert results[:2] == results[2:]
        assert_same_scaler(pair[0][2], pair[1][2])
        assert same_bits(pair[0][0], pair[1][0])
        scales.append(pair[1][2].get_scale())
    return scales, pair[1][0]


def test_scale_backs_off_all_the_way_to_zero_and_then_corrupts_params_like_torch():
    config = dict(init_scale=1.0, backoff_factor=0.5)
    scales, param = lockstep_single(config, [[math.inf, 0.0, 1.0]] * 150 + [[0.0, 2.0, 3.0]])
    assert scales[125] == 2.0**-126 and scales[148] == 2.0**-149 and scales[149:] == [0.0, 0.0]
    # Hand-checked: at scale 0, 1/scale is inf; the grads (finite when checked) become NaN and
    # inf, the step runs, and the parameters are ruined.
    assert param[0].isnan() and param[1:].isinf().all()


def test_non_power_of_two_factors_follow_the_float64_then_round_rule():
    config = dict(init_scale=0.9, growth_factor=1.7, backoff_factor=0.37, growth_interval=1)
    rng = random.Random(0)
    grads = [[rng.choice([math.inf, 1.0, 1.0]), 0.5, 0.25] for _ in range(400)]
    lockstep_single(config, grads)
    for backoff in (0.0, 1e-30):
        lockstep_single(dict(config, backoff_factor=backoff), [[math.nan, 1.0, 1.0]] * 3)
    # Hand-checked against the reference: growth by 1.1 from 65536 in float64-then-round
    # gives 127711.1328125 on the 7th growth, where a float32 multiply gives 127711.140625.
    scales, _ = lockstep_single(dict(growth_factor=1.1, growth_interval=1), [[1.0, 1.0, 1.0]] * 7)
    assert scales[5:] == [116101.03125, 127711.1328125]


def test_growth_stops_before_inf():
    big = 3.0e38
    scales, _ = lockstep_single(dict(init_scale=big, growth_interval=1), [[1.0, 1.0, 1.0]] * 3)
    assert scales == [torch.tensor(big).item()] * 3
    near = torch.finfo(torch.float32).max / 1.0001
    config = dict(init_scale=near, growth_factor=1.00005, growth_interval=1)
    lockstep_single(config, [[1.0] * 3] * 4)


def test_growth_tracker_wraps_and_is_compared_exactly_with_the_interval():
    for sd in ({"_growth_tracker": 2**31 - 1, "growth_interval": -(2**31)},
               {"_growth_tracker": 7, "growth_interval": 3},
               {"_growth_tracker": 4, "growth_interval": 2**32 + 5}):
        pair = []
        for cls in (TorchScaler, GradScaler):
            scaler = cls("cpu")
            scaler.load_state_dict({"scale": 8.0, "growth_factor": 3.0, "backoff_factor": 0.25,
                                    **sd})
            pair.append(scaler)
        for _ in range(3):
            for scaler in pair:
                p = nn.Parameter(torch.ones(1))
                scaler.scale(torch.ones(()))
                p.grad = torch.ones(1)
                scaler.step(torch.optim.SGD([p]))
                scaler.update()
            assert_same_scaler(*pair)


def test_load_state_dict_then_one_clean_iteration_hand_checked():
    scaler = GradScaler("cpu")
    scaler.load_state_dict({"scale": 8.0, "growth_factor": 3.0, "backoff_factor": 0.25,
                            "growth_interval": 5, "_growth_tracker": 4})
    assert scaler.get_scale() == 8.0 and scaler.get_growth_tracker() == 4
    p = nn.Parameter(torch.ones(1))
    scaler.scale(torch.ones(()))
    p.grad = torch.ones(1)
    scaler.step(torch.optim.SGD([p]))
    scaler.update()
    assert (scaler.get_scale(), scaler.get_growth_tracker()) == (24.0, 0)


def test_unscale_uses_the_float32_reciprocal_of_the_scale_hand_checked():
    scaler = GradScaler("cpu", init_scale=3.0)
    p = nn.Parameter(torch.ones(1))
    opt = torch.optim.SGD([p])
    scaler.scale(p.sum() * 0.1).backward()
    scaler.unscale_(opt)
    assert p.grad.item() == 0.10000000894069672


def test_new_scale_forms_match_torch():
    forms = [2.0, 0.75, torch.tensor(4.0), torch.tensor([4.0]), torch.tensor([1.0, 2.0]),
             torch.tensor(3.0, requires_grad=True), torch.tensor(5.0, dtype=torch.float64),
             torch.tensor(6, dtype=torch.int32), 3, torch.tensor(2.0, device="meta"), True]
    for form in forms:
        results = []
        pair = [TorchScaler("cpu"), GradScaler("cpu")]
        for scaler in pair:
            scaler.scale(torch.ones(()))
            results.append(outcome(scaler.update, form))
        assert same_outcome(*results), (form, results)
        assert_same_scaler(*pair)
    # The value is copied: changing the tensor later does not change the scale.
    source = torch.tensor(64.0)
    scaler = GradScaler("cpu")
    scaler.scale(torch.ones(()))
    scaler.update(source)
    source.fill_(1.0)
    assert scaler.get_scale() == 64.0
    # A torch.device("cpu") scaler rejects every tensor new_scale, in torch as here.
    pair = [TorchScaler(torch.device("cpu")), GradScaler(torch.device("cpu"))]
    results = [outcome(lambda s=s: s.update(s.scale(torch.ones(())) * 2)) for s in pair]
    assert same_outcome(*results) and results[0][0] is AssertionError


def test_update_with_new_scale_keeps_the_tracker_and_needs_no_step():
    pair = [TorchScaler("cpu", growth_interval=10), GradScaler("cpu", growth_interval=10)]
    for scaler in pair:
        scaler.load_state_dict({**scaler.state_dict(), "_growth_tracker": 2})
        scaler.scale(torch.ones(()))
        scaler.update(100.0)
    assert_same_scaler(*pair)
    assert pair[1].get_growth_tracker() == 2 and pair[1].history[-1].manual


# ---- dtypes, sparse, fused -------------------------------------------------------------------


def test_bf16_and_mixed_dtype_grads_match_torch():
    for seed in range(6):
        config = dict(init_scale=1000.5, growth_factor=1.7, growth_interval=2)
        pair = [Setup(seed, "adam", torch.bfloat16), Setup(seed, "adam", torch.bfloat16)]
        extras = []
        for setup in pair:  # one fp32 parameter in the bf16 optimizer: a mixed-dtype group
            extra = nn.Parameter(torch.linspace(0.5, 1.5, 3))
            setup.optimizers[1].add_param_group({"params": [extra]})
            extras.append(extra)
        scalers = [TorchScaler("cpu", **config), GradScaler("cpu", **config)]
        data = torch.Generator().manual_seed(seed)
        for step in range(8):
            x = torch.randn(4, 5, generator=data)
            results = []
            for setup, extra, scaler in zip(pair, extras, scalers):
                loss_a, loss_b = setup.losses(x)
                scaler.scale(loss_a.float() + loss_b.float() * extra.sum()).backward()
                if step == 3:
                    setup.params[1].grad[0] = math.nan
                results += [outcome(scaler.step, opt) for opt in setup.optimizers]
                scaler.update()
            assert results[:2] == results[2:]
            assert_same_scaler(*scalers)
            assert_same_params(pair[0].params + extras[:1], pair[1].params + extras[1:])


def test_fp16_grads_raise_like_torch():
    results = []
    for cls in (TorchScaler, GradScaler):
        p = nn.Parameter(torch.ones(4, dtype=torch.float16))
        opt = torch.optim.SGD([p], lr=0.1)
        scaler = cls("cpu")
        scaler.scale(p.float().sum()).backward()
        results += [outcome(scaler.unscale_, opt), outcome(scaler.step, opt)]
    assert results[:2] == results[2:]
    assert results[0] == (ValueError, "Attempting to unscale FP16 gradients.")


@pytest.mark.skipif(not FUSED_ON_CPU, reason="this torch has no fused AdamW on CPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fused_optimizer_gets_grad_scale_and_found_inf_like_torch(dtype):
    pair = []
    for cls in (TorchScaler, GradScaler):
        torch.manual_seed(0)
        p = nn.Parameter(torch.randn(16).to(dtype))
        pair.append((p, torch.optim.AdamW([p], lr=0.1, fused=True), cls("cpu", init_scale=3.0)))
    for step in range(10):
        results = []
        for p, opt, scaler in pair:
            scaler.scale((p.float() * torch.arange(16.0)).sum()).backward()
            if step in (2, 5):
                p.grad[step] = math.inf
            if step % 4 == 3:
                results.append(outcome(scaler.unscale_, opt))  # the UNSCALED path
            results.append(outcome(scaler.step, opt, lambda: 7.0))
            results.append(outcome(scaler.update))
            assert not hasattr(opt, "grad_scale") and not hasattr(opt, "found_inf")
            opt.zero_grad()
        half = len(results) // 2
        assert all(same_outcome(a, b) for a, b in zip(results[:half], results[half:]))
        assert_same_scaler(pair[0][2], pair[1][2])
        assert same_bits(pair[0][0], pair[1][0])


def test_optimizer_with_the_old_grad_scaler_kwarg_contract():
    class OldFused(torch.optim.SGD):
        _step_supports_amp_scaling = True

        def step(self, closure=None, grad_scaler=None):
            found = grad_scaler._check_inf_per_device(self)
            if not sum(v.item() for v in found.values()):
                with torch.no_grad():
                    for p in self.param_groups[0]["params"]:
                        p -= 0.1 * p.grad / grad_scaler._get_scale_async()
            return "stepped"

    results, params = [], []
    for cls in (TorchScaler, GradScaler):
        p = nn.Parameter(torch.ones(2))
        opt, scaler = OldFused([p], lr=0.1), cls("cpu", init_scale=4.0)
        scaler.scale(p.sum()).backward()
        with pytest.warns(FutureWarning) as caught:
            results.append(outcome(scaler.step, opt))
        results.append([str(w.message) for w in caught])
        scaler.update()
        results.append(scaler.get_scale())
        params.append(p)
    assert results[:3] == results[3:]
    assert same_bits(*params)


def test_sparse_grads_are_unscaled_value_by_value_like_torch():
    pair = []
    for cls in (TorchScaler, GradScaler):
        torch.manual_seed(0)
        emb = nn.Embedding(10, 3, sparse=True)
        pair.append((emb, torch.optim.SGD(emb.parameters(), lr=0.1), cls("cpu", init_scale=3.0)))
    for step in range(5):
        index = torch.tensor([1, 4, 1, 7, 1])  # repeated rows: an uncoalesced sparse grad
        results = []
        for emb, opt, scaler in pair:
            scaler.scale(emb(index).sum() * 0.1).backward()
            if step == 2:
                emb.weight.grad._values()[0, 0] = math.inf
            results.append(outcome(scaler.unscale_, opt))
            results.append(("ok", emb.weight.grad._values().clone()))
            results += [outcome(scaler.step, opt), outcome(scaler.update)]
            opt.zero_grad()
        assert all(same_outcome(a, b) for a, b in zip(results[:4], results[4:]))
        assert_same_scaler(pair[0][2], pair[1][2])
        assert same_bits(pair[0][0].weight, pair[1][0].weight)


def test_large_finite_grads_are_not_mistaken_for_overflow():
    # 100 values of 3e38 sum (or square) to inf; none of them is inf, so nothing is skipped.
    scalers = [TorchScaler("cpu", init_scale=1.0), GradScaler("cpu", init_scale=1.0)]
    for scaler in scalers:
        p = nn.Parameter(torch.zeros(100))
        scaler.scale(torch.ones(()))
        p.grad = torch.full((100,), 3e38)
        assert scaler.step(torch.optim.SGD([p], lr=1e-30), lambda: "stepped") == "stepped"
        scaler.update()
    assert_same_scaler(*scalers)
    assert scalers[1].history[0].found_inf is False


# ---- scale(), disabled, pickling, history ------------------------------------------------------


def test_scale_handles_nested_containers_like_torch():
    ones = torch.ones(2)
    cases = [
        [ones, (ones * 2, [ones.half()])],
        (torch.tensor(2.0, dtype=torch.float16), torch.tensor([2.0], dtype=torch.float16)),
        [torch.tensor([1.5], dtype=torch.bfloat16), torch.tensor(3.0, dtype=torch.float64)],
        [],
    ]

    def flatten(value):
        if isinstance(value, torch.Tensor):
            return [value]
        return [t for v in value for t in flatten(v)]

    def structure(value):
        if isinstance(value, torch.Tensor):
            return "T"
        return (type(value).__name__, [structure(v) for v in value])

    for case in cases:
        out_t = TorchScaler("cpu", init_scale=3.0).scale(case)
        out_m = GradScaler("cpu", init_scale=3.0).scale(case)
        assert structure(out_t) == structure(out_m)
        assert all(same_bits(a, b) for a, b in zip(flatten(out_t), flatten(out_m), strict=True))
    lazy_t = TorchScaler("cpu").scale(t for t in [ones])
    lazy_m = GradScaler("cpu").scale(t for t in [ones])
    assert type(lazy_t) is type(lazy_m) is map
    assert same_bits(next(lazy_t), next(lazy_m))
    def consume(value, depth=4):  # a dict is mapped over its keys: strings, iterable forever
        if isinstance(value, torch.Tensor):
            return value.tolist()
        return "..." if depth == 0 else [consume(v, depth - 1) for v in value]

    for odd in (3.0, [ones, 3.0], {"a": ones}, {ones: 1}):
        scalers = (TorchScaler("cpu"), GradScaler("cpu"))
        results = [outcome(lambda s=s, odd=odd: consume(s.scale(odd))) for s in scalers]
        assert results[0] == results[1]
    # fp16 1-d tensors stay fp16 and overflow, as in torch.
    assert GradScaler("cpu").scale(torch.tensor([2.0], dtype=torch.float16)).isinf().all()


def test_disabled_scaler_is_a_pass_through_like_torch():
    pair = [TorchScaler("cpu", enabled=False), GradScaler("cpu", enabled=False)]
    loss = torch.ones(())
    for scaler in pair:
        assert scaler.scale(loss) is loss
        p = nn.Parameter(torch.ones(1))
        p.grad = torch.ones(1)
        assert scaler.step(torch.optim.SGD([p]), closure=lambda: 5.0) == 5.0
        assert scaler.unscale_(torch.optim.SGD([p])) is None and scaler.update() is None
        scaler.load_state_dict({})
    assert [s.get_scale() for s in pair] == [1.0, 1.0]
    assert [s.state_dict() for s in pair] == [{}, {}]
    assert pair[0]._get_growth_tracker() == pair[1].get_growth_tracker() == 0
    assert outcome(pair[0].get_growth_factor) == outcome(pair[1].get_growth_factor)
    assert pickle.loads(pickle.dumps(pair[1])).is_enabled() is False
    assert pair[1].history == []


def test_pickling_only_between_iterations():
    pair = [TorchScaler("cpu", init_scale=3.0), GradScaler("cpu", init_scale=3.0)]
    params = [nn.Parameter(torch.ones(2)) for _ in pair]
    for scaler, p in zip(pair, params):
        scaler.scale(p.sum()).backward()
        scaler.unscale_(torch.optim.SGD([p]))
    assert outcome(pickle.dumps, pair[1]) == outcome(pickle.dumps, pair[0])
    assert outcome(pickle.dumps, pair[1])[0] is AssertionError
    for scaler in pair:
        scaler.update()
    copies = [pickle.loads(pickle.dumps(s)) for s in pair]
    assert copies[0]._scale is None and copies[1]._scale is None
    assert copies[0].state_dict() == copies[1].state_dict() == pair[1].state_dict()
    assert copies[1].history == pair[1].history
    deep = copy.deepcopy(pair[1])
    assert deep.state_dict() == pair[1].state_dict()


def test_history_records_each_update():
    scaler = GradScaler("cpu", init_scale=8.0, growth_interval=2)
    a, b = nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(2))
    opt_a, opt_b = torch.optim.SGD([a], lr=0.1), torch.optim.SGD([b], lr=0.1)
    for step in range(4):
        scaler.scale(a.sum() + b.sum()).backward()
        if step == 1:
            b.grad[0] = math.inf
        if step == 2:  # b is only unscaled: it does not step
            scaler.unscale_(opt_b)
        else:
            scaler.step(opt_b)
        scaler.step(opt_a)
        scaler.update()
        opt_a.zero_grad()
        opt_b.zero_grad()
    scaler.scale(a.sum())
    scaler.update(2.0)
    assert scaler.history == [
        UpdateRecord(0, 8.0, 8.0, 1, False, {0: True, 1: True}),
        UpdateRecord(1, 8.0, 4.0, 0, True, {0: False, 1: True}),
        UpdateRecord(2, 4.0, 4.0, 1, False, {0: False, 1: True}),
        UpdateRecord(3, 4.0, 8.0, 0, False, {0: True, 1: True}),
        UpdateRecord(4, 8.0, 2.0, 0, False, {}, manual=True),
    ]
    assert scaler.history[1].stepped[0] is False  # plain bools, ready to print or plot


def test_history_is_flushed_in_batches(monkeypatch):
    monkeypatch.setattr(mplab.amp.scaler, "HISTORY_FLUSH", 3)
    scaler = GradScaler("cpu", growth_interval=1)
    p = nn.Parameter(torch.ones(1))
    for _ in range(7):
        scaler.scale(torch.ones(()))
        p.grad = torch.ones(1)
        scaler.step(torch.optim.SGD([p]))
        scaler.update()
    assert len(scaler._pending) == 1
    assert [r.new_scale for r in scaler.history] == [2.0**k for k in range(17, 24)]


def test_scaler_source_uses_no_private_amp_kernels():
    source = inspect.getsource(mplab.amp.scaler)
    assert "torch._amp" not in source and "torch._C" not in source
