"""Answers as data, for a grader that decides in its own process.

A value answer travels as :func:`pack_answer`'s data: torch.save bytes read back with
``weights_only=True``, so loading one never runs code. A function answer cannot travel (its
code would run in the grader), so the kernel runs the exercise's check on a :class:`Recording`
of it: each call's result, and each argument it changed in place, kept as data. The grader then
runs the same check again on a :class:`Replay` of that record: every input is the grader's own
(the public ones and hidden ones drawn from this run's seed, :func:`grade_seed`), every
reference output is computed in the grader, and the learner's function is only ever the record
of what it returned. An output the record lacks is a record mplab did not write.
"""

from __future__ import annotations

import builtins
import contextlib
import dataclasses
import importlib
import keyword
import os
import threading
from types import SimpleNamespace

__all__ = ["MAX_ANSWER_BYTES", "SEED_ENV", "grade_seed", "pack_answer", "unpack_answer",
           "Recording", "Replay", "RecordIncomplete", "watching", "note", "code_names",
           "copied", "stood_in"]

#: The largest answer a log record carries (a tensor of a million floats).
MAX_ANSWER_BYTES = 1 << 22
#: The grader draws a seed per run; hidden inputs come from it, in the kernel and the grader.
SEED_ENV = "MPLAB_GRADE_SEED"
_TAG = "__mplab_answer__"
#: Dataclasses an answer may be (the fields their constructor takes travel, and the grader
#: builds them again).
_DATACLASSES = {"MixedPrecisionPolicy": "torch.distributed.fsdp",
                "TrainingArguments": "transformers"}


def grade_seed(default: int = 0) -> int:
    """This grading run's seed (`default` outside grading): hidden inputs drawn from it differ
    from run to run, so an answer that only knows the public inputs' outputs fails them."""
    try:
        return int(os.environ.get(SEED_ENV, default))
    except ValueError:
        return default


def _known_dataclass(value):
    module = _DATACLASSES.get(type(value).__name__)
    if module is None or not dataclasses.is_dataclass(value):
        return None
    with contextlib.suppress(ImportError, AttributeError):
        if type(value) is getattr(importlib.import_module(module), type(value).__name__):
            return type(value).__name__
    return None


def _plain(value):
    """value with what torch.load(weights_only=True) refuses made plain, tagged so that
    :func:`_restored` gives it back: Fractions, Decimals, sets, numpy scalars and arrays, and
    the dataclasses in `_DATACLASSES` (their fields)."""
    import decimal
    import fractions

    if isinstance(value, fractions.Fraction):
        return {_TAG: "fraction", "n": str(value.numerator), "d": str(value.denominator)}
    if isinstance(value, decimal.Decimal):
        return {_TAG: "decimal", "text": str(value)}
    if isinstance(value, set | frozenset):
        return {_TAG: "set", "items": [_plain(v) for v in value]}
    if isinstance(value, list | tuple):
        items = [_plain(v) for v in value]
        return items if isinstance(value, list) else tuple(items)
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if type(value).__module__ == "numpy":  # a numpy scalar or array, as torch holds it
        import torch

        return value.item() if getattr(value, "ndim", 1) == 0 else torch.from_numpy(value)
    name = _known_dataclass(value)
    if name is not None:  # to_dict() where there is one: TrainingArguments' enums as values
        values = value.to_dict() if hasattr(value, "to_dict") else vars(value)
        return {_TAG: "dataclass", "name": name,
                "fields": {f.name: _plain(values[f.name]) for f in dataclasses.fields(value)
                           if f.init and f.name in values}}
    return value


def _restored(value):
    import decimal
    import fractions

    if isinstance(value, dict) and value.get(_TAG) == "fraction":
        return fractions.Fraction(int(value["n"]), int(value["d"]))
    if isinstance(value, dict) and value.get(_TAG) == "decimal":
        return decimal.Decimal(value["text"])
    if isinstance(value, dict) and value.get(_TAG) == "set":
        return {_restored(v) for v in value["items"]}
    if isinstance(value, dict) and value.get(_TAG) == "dataclass":
        module = _DATACLASSES.get(value.get("name"))
        if module is None:
            raise ValueError(f"an answer of a type the grader does not build: {value.get('name')}")
        kind = getattr(importlib.import_module(module), value["name"])
        return kind(**{k: _restored(v) for k, v in value["fields"].items()})
    if isinstance(value, dict) and value.get(_TAG) == "unreadable":
        return Unreadable(str(value.get("type", "object")))
    if isinstance(value, list | tuple):
        items = [_restored(v) for v in value]
        return items if isinstance(value, list) else tuple(items)
    if isinstance(value, dict):
        return {k: _restored(v) for k, v in value.items()}
    return value


def pack_answer(answer) -> dict:
    """An answer as data for the grader: ``{"torch": base64 of torch.save's bytes}`` for a value
    ``torch.load(weights_only=True)`` reads back (numbers, text, lists, dicts, tensors, dtypes,
    and Fractions, Decimals, sets, numpy values and a few torch dataclasses made plain: nothing
    that runs code when loaded), else ``{"unpacked": why}``."""
    import base64
    import io

    import torch  # only while grading

    buffer = io.BytesIO()
    try:
        torch.save(_plain(answer), buffer)
        torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
    except Exception as e:
        return {"unpacked": f"a {type(answer).__name__}, which the grader does not read back "
                            f"({type(e).__name__})"}
    if buffer.tell() > MAX_ANSWER_BYTES:
        return {"unpacked": f"{buffer.tell()} bytes, more than {MAX_ANSWER_BYTES}"}
    return {"torch": base64.b64encode(buffer.getvalue()).decode("ascii")}


def unpack_answer(data):
    """The answer :func:`pack_answer` packed; ValueError for anything else (a forged or
    truncated record), and for an answer it could not pack."""
    import base64
    import binascii
    import io
    import pickle

    import torch

    if not isinstance(data, dict) or not isinstance(data.get("torch"), str):
        why = data.get("unpacked") if isinstance(data, dict) else None
        raise ValueError(f"the record carries no answer ({why or 'nothing packed'})")
    try:
        raw = base64.b64decode(data["torch"], validate=True)
        if len(raw) > MAX_ANSWER_BYTES:
            raise ValueError(f"{len(raw)} bytes, more than {MAX_ANSWER_BYTES}")
        return _restored(torch.load(io.BytesIO(raw), weights_only=True))
    except (binascii.Error, ValueError, RuntimeError, EOFError, OSError, TypeError,
            pickle.UnpicklingError) as e:
        raise ValueError(f"the record's answer does not read back: {type(e).__name__}") from None


# --- function answers: recorded in the kernel, replayed in the grader ------------------------

_WATCHERS = threading.local()


@contextlib.contextmanager
def watching():
    """Collect the :func:`note` calls made inside (a check watching what the learner's
    function calls, say): the list, which a :class:`Recording` keeps and a :class:`Replay`
    makes again."""
    stack = _WATCHERS.__dict__.setdefault("stack", [])
    seen: list[str] = []
    stack.append(seen)
    try:
        yield seen
    finally:
        stack.remove(seen)


def note(event: str) -> None:
    """Tell every :func:`watching` block open on this thread that `event` happened."""
    for seen in getattr(_WATCHERS, "stack", []):
        seen.append(event)


def code_names(fn) -> set[str]:
    """The global and attribute names a function's code uses, its nested functions' too."""
    todo, names = [getattr(fn, "__code__", None)], set()
    while todo:
        code = todo.pop()
        if code is not None and hasattr(code, "co_names"):
            names |= set(code.co_names)
            todo += [c for c in code.co_consts if hasattr(c, "co_names")]
    return names


@contextlib.contextmanager
def stood_in(fn, swaps):
    """While the learner's `fn` runs inside, each (function, stand_in) pair runs the stand-in's
    code however the function is reached (its module's attribute, a name imported earlier,
    getattr, a method), and its own again after. A check makes what an exercise asks the
    learner to write give poisoned results this way, so an answer that calls it fails on its
    outputs, which is all the grader sees. A stand-in runs with the function's globals and
    defaults: it names only builtins and those. A :class:`Replay` runs no learner code: nothing
    is swapped in the grader, whose reference calls the real functions (a class grades in
    threads)."""
    if isinstance(fn, Replay):
        yield
        return
    saved = [(f, f.__code__) for f, _ in swaps]
    try:
        for f, stand_in in swaps:
            f.__code__ = stand_in.__code__
        yield
    finally:
        for f, code in saved:
            f.__code__ = code


_SCALER_STATE = ("_scale", "_growth_tracker")  # what a step changes in a GradScaler


def _snapshot(arg):
    """A copy of what a call may change in place, as data: a tensor, a list of tensors, a
    model's state_dict, a GradScaler's scale and tracker (None before its first use); else
    None (what a check does not read back)."""
    import torch

    if isinstance(arg, torch.Tensor):
        return arg.detach().clone()
    if isinstance(arg, list | tuple) and arg and all(isinstance(a, torch.Tensor) for a in arg):
        return [a.detach().clone() for a in arg]
    if isinstance(arg, torch.nn.Module):
        return {"module": {k: v.detach().clone() for k, v in arg.state_dict().items()}}
    if isinstance(arg, torch.amp.GradScaler):
        return {"scaler": {name: None if getattr(arg, name, None) is None
                           else getattr(arg, name).detach().clone() for name in _SCALER_STATE}}
    return None


def copied(args: tuple) -> tuple:
    """Fresh copies of a call's arguments (tensors, lists of them, generators), so a call
    that changes them in place leaves the originals as they were; a model, an optimizer or a
    scaler is passed on as it is (a train step's trials step the same ones in turn)."""
    import torch

    def one(arg):
        if isinstance(arg, torch.Tensor):
            return arg.clone()
        if isinstance(arg, torch.Generator):
            return torch.Generator().set_state(arg.get_state())
        if isinstance(arg, list | tuple):
            items = [one(a) for a in arg]
            return items if isinstance(arg, list) else tuple(items)
        return arg

    return tuple(one(a) for a in args)


def _detached(value):
    import torch

    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, list | tuple):
        items = [_detached(v) for v in value]
        return items if isinstance(value, list) else tuple(items)
    return value


def _same(a, b) -> bool:
    import torch

    if a is None or b is None:
        return a is b
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(map(_same, a, b))
    if isinstance(a, dict):
        return (isinstance(b, dict) and a.keys() == b.keys()
                and all(_same(a[k], b[k]) for k in a))
    return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(a, b))


def _restore(arg, state) -> None:
    """Write a recorded state back into the grader's own argument, in place."""
    import torch

    if isinstance(state, dict) and isinstance(arg, torch.nn.Module) and "module" in state:
        _load_module(arg, state["module"])
        return
    if isinstance(state, dict) and isinstance(arg, torch.amp.GradScaler) and "scaler" in state:
        for name in _SCALER_STATE:
            value = state["scaler"].get(name)
            setattr(arg, name, None if value is None else value.clone())
        return
    targets = arg if isinstance(arg, list | tuple) else [arg]
    states = state if isinstance(state, list) else [state]
    if len(targets) != len(states) or not all(
            isinstance(t, torch.Tensor) and isinstance(s, torch.Tensor)
            and t.shape == s.shape and t.dtype == s.dtype for t, s in zip(targets, states)):
        raise RecordIncomplete("the record changes an argument it was not given")
    with torch.no_grad():
        for t, s in zip(targets, states):
            t.copy_(s)


def _load_module(module, state: dict) -> None:
    """Write a recorded state_dict into `module`: in place where the dtypes are the same (an
    optimizer keeps its parameters), and as the recorded tensors where a call changed them
    (``model.float()`` changes every weight's dtype)."""
    own = module.state_dict()
    same = all(k in own and own[k].dtype == v.dtype for k, v in state.items())
    module.load_state_dict(state, strict=True, assign=not same)


def _returned(value, args: tuple):
    """What a call returned, as data: a model as the argument it is (its changes are recorded
    with the argument's) or as its state_dict, else the value itself, detached."""
    import torch

    if isinstance(value, torch.nn.Module):
        given = [i for i, a in enumerate(args) if a is value]
        if given:
            return {_TAG: "module", "arg": given[0]}
        return {_TAG: "module", "state": _snapshot(value)["module"]}
    return _detached(value)


def _rebuilt(returned: dict, args: tuple):
    """The model a call returned, in the grader: the argument it was, or a copy of the model
    it was given holding the recorded weights; one whose weights do not fit that model comes
    back as a model with no weights (a check sees a model other than the one it gave)."""
    import copy

    import torch

    if "arg" in returned:
        try:
            return args[int(returned["arg"])]
        except (IndexError, TypeError, ValueError):
            raise RecordIncomplete("the record returns an argument it was not given") from None
    given = [a for a in args if isinstance(a, torch.nn.Module)]
    if not given or not isinstance(returned.get("state"), dict):
        return torch.nn.Module()
    model = copy.deepcopy(given[0])
    try:
        _load_module(model, returned["state"])
    except (KeyError, RuntimeError, TypeError, ValueError):
        return torch.nn.Module()
    return model


class Recording:
    """The learner's function, as a check in the kernel calls it: it runs, and each call's
    result (or the exception it raised), each argument it changed in place and each
    :func:`note` made during it are kept for :meth:`data`."""

    def __init__(self, fn):
        self.fn = fn
        self.calls: list[dict] = []

    def __getattr__(self, name):  # __code__, __name__: what a check reads off the function
        return getattr(self.fn, name)

    def __call__(self, *args):
        before = [_snapshot(a) for a in args]
        with watching() as seen:
            try:
                value = self.fn(*args)
            except Exception as e:
                self.calls.append({"raised": type(e).__name__, "message": str(e),
                                   "notes": list(seen)})
                raise
        changed = {}
        for i, (arg, old) in enumerate(zip(args, before)):
            new = _snapshot(arg) if old is not None else None
            if new is not None and not _same(new, old):
                changed[i] = new
        self.calls.append({"returned": _returned(value, args), "changed": changed,
                           "notes": list(seen)})
        return value

    def data(self) -> dict:
        """The record, packed (:func:`pack_answer`); a result that is not data is kept as its
        type's name, which the replay hands the check instead."""
        record = {"calls": self.calls, "names": sorted(code_names(self.fn)),
                  "name": str(getattr(self.fn, "__name__", "function"))}
        packed = pack_answer(record)
        if "torch" in packed:
            return packed
        for call in self.calls:
            if "returned" in call and "torch" not in pack_answer(call["returned"]):
                call["returned"] = {_TAG: "unreadable", "type": type(call["returned"]).__name__}
        return pack_answer(record)


class Unreadable:
    """What a replay returns for a result that was not data: a check rejects it by its type."""

    def __init__(self, type_name: str):
        self.type_name = type_name

    def __repr__(self) -> str:
        return f"<a {self.type_name} the grader could not read back>"


class RecordIncomplete(Exception):
    """The check called the function more often than the kernel's record says it did."""


def _exception(name: str) -> type[Exception]:
    """The exception class the learner's function raised: Python's own where it is one (so a
    check's ``except RuntimeError`` catches it again), else one named as it was."""
    builtin = getattr(builtins, name, None)
    if isinstance(builtin, type) and issubclass(builtin, Exception):
        return builtin
    ok = name.isidentifier() and not keyword.iskeyword(name)
    return type(name if ok else "Exception", (Exception,), {})


class Replay:
    """A function answer in the grader: each call gives back what the learner's function gave
    the kernel's check for the same call, writes back what it changed, and notes again what
    it noted. The grader's check supplies the inputs and computes the reference outputs."""

    def __init__(self, data: dict):
        if not isinstance(data, dict) or not isinstance(data.get("calls"), list):
            raise ValueError("the record holds no calls of a function")
        self.calls = list(data["calls"])
        self.__name__ = str(data.get("name", "function"))
        names = tuple(str(n) for n in data.get("names", []))
        # what a check reads off a function's code: the names it uses (not the code itself)
        self.__code__ = SimpleNamespace(co_names=names, co_consts=(), co_code=None,
                                        co_varnames=())
        self.ran_out = False

    def __call__(self, *args):
        if not self.calls:
            self.ran_out = True
            raise RecordIncomplete("the record has no result for this call")
        call = self.calls.pop(0)
        if not isinstance(call, dict):
            raise RecordIncomplete("a call in the record is not one mplab wrote")
        for event in call.get("notes", []):
            note(str(event))
        if "raised" in call:
            message = str(call.get("message", ""))
            try:
                error = _exception(str(call["raised"]))(message)
            except Exception:  # one of Python's that takes other arguments than a message
                error = Exception(message)
            raise error
        for i, state in dict(call.get("changed", {})).items():
            try:
                _restore(args[int(i)], state)
            except (IndexError, KeyError, RuntimeError, TypeError, ValueError):
                raise RecordIncomplete("the record changes an argument it was not given"
                                       ) from None
        returned = call.get("returned")
        if isinstance(returned, dict) and returned.get(_TAG) == "module":
            return _rebuilt(returned, args)
        return returned
