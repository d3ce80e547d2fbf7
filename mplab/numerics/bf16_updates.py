"""Pure bf16 weights, and the two fixes for swamped updates that keep them bf16.

A bf16 number carries 8 significant bits, so one ulp of a weight near 1.0 is 2**-7. An optimizer
update ``lr * step`` smaller than half an ulp of the weight rounds back to the same weight: it is
*swamped*, and a model whose weights are stored in bf16 (``model.to(torch.bfloat16)``, or a bf16
checkpoint loaded as is) stops learning long before its fp32 twin would. Three fixes, by what
each costs on top of the 2 bytes of a bf16 weight:

- fp32 master weights (+4 bytes/param): train fp32 params under autocast; not this module.
- Kahan-compensated updates (+2 bytes/param): keep the part of each new weight that the bf16
  rounding threw away in a bf16 *compensation* buffer, and add it back before the next update,
  so small updates pile up there until they are big enough to move the weight.
- Stochastic rounding (+0): round each new weight up or down at random, up with probability
  equal to how far it is from the lower neighbour, so the rounding is right on average
  (E[result] == x) and small updates move the weight in proportion to their size.

:class:`LowPrecisionUpdate` wraps any torch optimizer and applies one of these roundings (or plain
round-to-nearest, the swamping baseline) to its bf16 and fp16 params. Whatever the rounding, the
inner optimizer's states are fp32 (AdamW's two: +8 bytes/param), as they are over fp32 weights.
"""

from __future__ import annotations

import torch

__all__ = ["LowPrecisionUpdate", "stochastic_round", "ROUNDINGS"]

ROUNDINGS = ("nearest", "kahan", "stochastic")
LOW_PRECISION = (torch.bfloat16, torch.float16)


def stochastic_round(x: torch.Tensor, dtype: torch.dtype = torch.bfloat16,
                     generator: torch.Generator | None = None) -> torch.Tensor:
    """Round fp32 ``x`` to bf16, up or down at random so that E[result] == x.

    Each result is one of the two bf16 neighbours of x (x itself when it is representable): the
    one further from zero with probability |x - nearer-to-zero neighbour| / gap. The classic bit
    trick: bf16 is the top 16 bits of fp32, and the fp32 bit patterns of one sign run evenly
    through each gap between bf16 neighbours, so adding a uniform integer in [0, 2**16) to the
    bits and clearing the low 16 bits rounds the magnitude up with exactly that probability
    (x's low 16 bits / 2**16).
    inf stays inf and NaN stays NaN. A finite x above bf16's largest value (3.39e38) rounds to
    inf with probability (|x| - max) / ulp: inf is its upper neighbour, as in round-to-nearest.
    The noise is drawn from ``generator`` (on its device) or torch's default generator.
    """
    if dtype != torch.bfloat16:
        raise ValueError(f"stochastic_round rounds to torch.bfloat16 only, got dtype={dtype}")
    if x.dtype != torch.float32:
        raise TypeError(f"stochastic_round takes a float32 tensor, got {x.dtype}")
    device = generator.device if generator is not None else x.device
    noise = torch.randint(0, 1 << 16, x.shape, dtype=torch.int32, device=device,
                          generator=generator).to(x.device)
    # Sign and magnitude bits: the int32 add grows the magnitude for either sign. Only NaN
    # patterns can carry into the sign bit or lose their payload, so NaN is kept as it was.
    bits = (x.contiguous().view(torch.int32) + noise) & -(1 << 16)
    return torch.where(x.isnan(), x, bits.view(torch.float32)).to(dtype)


def _inner(name: str) -> property:
    """An attribute read from, and written to, the wrapped optimizer."""
    return property(lambda self: getattr(self.optimizer, name),
                    lambda self, value: setattr(self.optimizer, name, value))


class LowPrecisionUpdate(torch.optim.Optimizer):
    """Run ``optimizer``'s update in fp32 and write bf16/fp16 weights back with ``rounding``.

    ``rounding`` is "nearest" (a plain cast: the swamping baseline), "kahan" (compensated
    summation, Zamirai et al. 2020; the compensation buffer is kept in the param's dtype, as in
    torch-optimi) or "stochastic" (:func:`stochastic_round`, bf16 only), with noise from
    ``generator``, or a ``torch.Generator`` seeded with ``seed`` on the params' device, or, given
    neither, torch's default generator (the other roundings ignore both, so one call can build
    all three). fp32 params pass through untouched.

    Each ``step()`` swaps every low-precision param's ``.data`` for an fp32 copy (plus the
    compensation, for "kahan") and its grad for an fp32 copy, runs the inner step, rounds the
    result back into the param's dtype and puts the original grad back. The persistent weights
    stay bf16; the fp32 copies live for one step. The inner optimizer creates its state during a
    step, when the params are fp32, so its state (AdamW's exp_avg, exp_avg_sq) is fp32 too:
    unlike plain AdamW over bf16 params, whose states are bf16.

    ``param_groups``, ``state`` and ``defaults`` are the inner optimizer's, so an LR scheduler
    can be given either. Step hooks belong to the inner optimizer
    (``wrapper.optimizer.register_step_pre_hook``). A ``closure`` is evaluated once, before the
    update, with the weights in their own dtype (LBFGS, which evaluates it again inside its
    step, is not supported).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, rounding: str = "nearest", *,
                 seed: int | None = None, generator: torch.Generator | None = None):
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError("LowPrecisionUpdate wraps a torch.optim.Optimizer, such as torch.optim"
                            f".AdamW(model.parameters()); got {type(optimizer).__name__}")
        if rounding not in ROUNDINGS:
            raise ValueError(f"rounding must be one of {ROUNDINGS}, got {rounding!r}")
        if seed is not None and generator is not None:
            raise ValueError(f"give seed or generator, not both; got seed={seed!r} and a generator")
        if generator is not None and not isinstance(generator, torch.Generator):
            raise TypeError(f"generator must be a torch.Generator, got {type(generator).__name__}")
        params = [p for group in optimizer.param_groups for p in group["params"]]
        # No super().__init__: param_groups, state and defaults are read and written through to
        # the inner optimizer (as accelerate's AcceleratedOptimizer does), since its own
        # load_state_dict replaces them with new objects. Subclassing Optimizer is what lets LR
        # schedulers take the wrapper.
        self.optimizer, self.rounding = optimizer, rounding
        self._check_dtypes(params)
        if rounding != "stochastic":
            generator = None  # the other roundings draw nothing
        elif seed is not None:
            device = next((p.device for p in params if p.dtype in LOW_PRECISION), "cpu")
            generator = torch.Generator(device=device).manual_seed(seed)
        self.generator = generator
        self.compensation: dict[torch.Tensor, torch.Tensor] = {}  # "kahan": param -> buffer

    param_groups, state, defaults = _inner("param_groups"), _inner("state"), _inner("defaults")

    def add_param_group(self, param_group: dict) -> None:
        self.optimizer.add_param_group(param_group)

    def _check_dtypes(self, params: list[torch.Tensor]) -> None:
        if self.rounding == "stochastic" and any(p.dtype == torch.float16 for p in params):
            raise ValueError("rounding='stochastic' supports bf16 params only; this optimizer has "
                             "fp16 params: use rounding='kahan', or convert them to bf16")

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        low = [p for group in self.param_groups for p in group["params"]
               if p.dtype in LOW_PRECISION and p.grad is not None]
        self._check_dtypes(low)  # again: add_param_group may have brought fp16 params
        swapped = [(p, p.data, p.grad) for p in low]
        for p, data, grad in swapped:
            w32 = data.float()
            if self.rounding == "kahan" and p in self.compensation:
                w32 += self.compensation[p].float()
            p.data, p.grad = w32, grad.float()
        try:
            self.optimizer.step()
        except BaseException:  # leave the weights as they were, in their own dtype
            for p, data, grad in swapped:
                p.data, p.grad = data, grad
            raise
        for p, data, grad in swapped:
            w32 = p.data
            if self.rounding == "stochastic":
                p.data = stochastic_round(w32, data.dtype, self.generator)
            else:
                p.data = w32.to(data.dtype)  # round to nearest even
            if self.rounding == "kahan":  # what the rounding lost, added back next step
                self.compensation[p] = (w32 - p.data.float()).to(data.dtype)
            p.grad = grad
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        index = {p: i for i, p in enumerate(p for g in self.param_groups for p in g["params"])}
        return {"optimizer": self.optimizer.state_dict(), "rounding": self.rounding,
                "compensation": {index[p]: c.clone() for p, c in self.compensation.items()},
                "generator": None if self.generator is None else self.generator.get_state()}

    def load_state_dict(self, state_dict: dict) -> None:
        if "rounding" not in state_dict:
            raise ValueError("this is not a LowPrecisionUpdate state dict (it has no 'rounding'); "
                             "a plain optimizer's goes to wrapper.optimizer.load_state_dict")
        if state_dict["rounding"] != self.rounding:
            raise ValueError(f"this state dict was saved with rounding={state_dict['rounding']!r}"
                             f", but this LowPrecisionUpdate has rounding={self.rounding!r}")
        params = [p for g in self.param_groups for p in g["params"]]
        # torch casts loaded state to each param's dtype: make the params fp32 for the load,
        # or the fp32 exp_avg/exp_avg_sq would come back rounded to bf16.
        kept = [(p, p.data) for p in params if p.dtype in LOW_PRECISION]
        for p, data in kept:
            p.data = data.float()
        try:
            self.optimizer.load_state_dict(state_dict["optimizer"])
        finally:
            for p, data in kept:
                p.data = data
        self.compensation = {params[i]: c.to(params[i].device, params[i].dtype)
                             for i, c in state_dict["compensation"].items()}
        if state_dict["generator"] is not None:
            if self.generator is None:
                raise ValueError("this state dict has a generator state, but this "
                                 "LowPrecisionUpdate has none: pass seed= or generator=")
            self.generator.set_state(state_dict["generator"])

    def __getstate__(self) -> dict:  # pickle and deepcopy the wrapper whole, not torch's way
        return self.__dict__.copy()

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)

    def __repr__(self) -> str:
        return f"LowPrecisionUpdate(rounding={self.rounding!r}, optimizer={self.optimizer!r})"
