"""A model built on the meta device: each rank makes the weights of its own stages only.

A model that does not fit one device does not fit one host either when every rank builds all of it
(eight ranks of a 70B model in fp32: 2.2 TB of host memory before setup frees the other stages). Built
under ``with torch.device("meta")`` (in ``__init__`` or ``configure_model``), it costs nothing until
setup, where :func:`materialize` gives this rank the tensors of its stages' layers and of every module
outside the pipelined layers, on the rank's device, and leaves the other stages' layers on ``meta``.

**The values are one process's.** One process building the model on that device draws each module's
initial values as it constructs it: children before the module that holds them, in the order they are
registered, each with the module's own ``reset_parameters()`` (a Hugging Face model: its
``_init_weights``), which torch's layers call from their constructors. :func:`materialize` replays
those calls in that order (post-order, as Hugging Face's ``smart_apply`` initializes) from the random
state the Trainer call starts in, which a meta build has not drawn from: a layer of another stage is
made for its call only, one module at a time, and freed again, so the generator steps through the same
draws as one process and ends where one process's construction left it. Every rank therefore holds
exactly the weights one process builds, and the data loaders shuffle alike after. Where a model's
constructor draws in another order (a parent initializing before its children, draws between modules),
the weights are a fresh initialization from the same calls, not one process's: a checkpoint or
``load_state_dict`` after fit's setup decides them then.

**Nothing is left unset.** A meta tensor has no value, and ``to_empty`` memory holds whatever was there:
a buffer computed in ``__init__`` (rotary frequencies, a causal mask) that ``reset_parameters`` does not
make again would train on garbage. So before any compute, on every rank alike (every rank makes every
module, its own or for its call): a module with meta tensors and no ``reset_parameters`` is refused,
naming it; floating tensors start as NaN and integer ones at their dtype's largest value, and one still
so after its module's initialization is refused, naming it; a boolean buffer, which no fill can tell
apart from a set value, is refused. Each message names the fix.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from lightning_twobp.lightning.local_model import replace_tensors

__all__ = ["built_on_meta", "check_meta_options", "custom_inits", "materialize"]

_FIX = (
    "under strategy='twobp' a model built on the meta device gets each module's values from its "
    "reset_parameters() (a Hugging Face model: its _init_weights), on the rank that holds it"
)


def _direct(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]


def built_on_meta(model: nn.Module, left_by_us: set[int]) -> bool:
    """Whether ``model`` holds meta tensors the user put there (not the layers an earlier Trainer call
    left on ``meta``, whose ids are ``left_by_us``)."""
    return any(t.is_meta and id(t) not in left_by_us for _, t in _all(model))


def check_meta_options(balance: Any, schedule: str) -> None:
    """Refuse the options that time the layers on real weights before the model is made."""
    if schedule == "auto" or balance == "time":
        what = "schedule='auto'" if schedule == "auto" else "balance='time'"
        raise ValueError(
            f"the model is built on the meta device and {what} times every layer before the pipeline is cut, "
            f"which needs every layer's weights on every rank: build the model on a real device, or name a "
            f"schedule with balance='params' (the default) or a list of layers per stage"
        )


def custom_inits(model: nn.Module) -> list[str]:
    """The modules of ``model`` outside Hugging Face's that define an initialization of their own
    (``_init_weights``, ``init_weights``: nanoGPT's ``self.apply(self._init_weights)``, torchtitan's; or,
    holding no tensors themselves, ``_reset_parameters``: ``nn.Transformer`` re-initializes its layers),
    which a constructor on the meta device ran on no values and :func:`materialize` does not call."""
    found = []
    for name, module in model.named_modules():
        kinds = ["_init_weights", "init_weights"] + ([] if _direct(module) else ["_reset_parameters"])
        if not _hugging_face(module) and any(callable(getattr(type(module), f, None)) for f in kinds):
            found.append(f"{name or type(model).__name__} ({type(module).__name__})")
    return found


def _hugging_face(module: nn.Module) -> bool:
    """A transformers ``PreTrainedModel`` (by name: transformers is optional)."""
    return any(c.__name__ == "PreTrainedModel" for c in type(module).__mro__)


def _all(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    for module in model.modules():
        yield from _direct(module)


def _post_order(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every module once, children before their parent, in registration order (Hugging Face's
    ``smart_apply``; torch's layers construct their children before initializing themselves)."""
    seen: set[int] = set()
    out: list[tuple[str, nn.Module]] = []

    def visit(name: str, module: nn.Module) -> None:
        if id(module) in seen:
            return
        seen.add(id(module))
        for child_name, child in module.named_children():
            visit(f"{name}.{child_name}" if name else child_name, child)
        out.append((name, module))

    visit("", model)
    return out


def _initializer(model: nn.Module, name: str, module: nn.Module) -> tuple[Callable[[], None], str] | None:
    """The call that gives ``module`` its values, and its name for messages: the innermost enclosing
    Hugging Face model's ``_init_weights(module)``, else the module's own ``reset_parameters``."""
    for prefix in _prefixes(name):
        owner = model.get_submodule(prefix)
        init: Any = getattr(owner, "_init_weights", None)
        if _hugging_face(owner) and callable(init):
            return functools.partial(init, module), f"{type(owner).__name__}._init_weights"
    method = "_reset_parameters" if isinstance(module, nn.MultiheadAttention) else "reset_parameters"
    reset = getattr(module, method, None)  # MultiheadAttention's constructor calls its private one
    return (reset, f"{type(module).__name__}.{method}") if callable(reset) else None


def _prefixes(name: str) -> list[str]:
    """``a.b.c`` -> ``a.b.c``, ``a.b``, ``a``, ``""``: the module and its ancestors, innermost first."""
    parts = name.split(".") if name else []
    return [".".join(parts[:k]) for k in range(len(parts), -1, -1)]


def _unset_value(t: torch.Tensor) -> float | int:
    return float("nan") if t.dtype.is_floating_point or t.dtype.is_complex else torch.iinfo(t.dtype).max


def _unset(device: torch.device) -> Callable[[torch.Tensor], torch.Tensor]:
    """A maker of new tensors like its argument on ``device``, holding the value that means "not set"."""
    return lambda t: torch.full(t.shape, _unset_value(t), dtype=t.dtype, device=device)


class _Scratch:
    """One buffer the tensors of another rank's module are cut from, for its initialization only: a
    module's tensors made and freed in turn would each leave its bytes in a heap that keeps freed memory
    (``engine.memory.cpu_heap``), up to the whole model's (measured: 128 MiB of a 128 MiB model on a rank
    holding 32), where one buffer of the largest such module stays bounded and is freed once."""

    ALIGN = 64

    def __init__(self, sizes: Iterable[int], device: torch.device) -> None:
        self.buffer = torch.empty(max(sizes, default=0), dtype=torch.uint8, device=device)
        self.offset = 0

    @classmethod
    def bytes_of(cls, tensors: Iterable[torch.Tensor]) -> int:
        return sum(-(-t.numel() * t.element_size() // cls.ALIGN) * cls.ALIGN for t in tensors)

    def cut(self, t: torch.Tensor) -> torch.Tensor:
        n = t.numel() * t.element_size()
        out = self.buffer[self.offset : self.offset + n].view(t.dtype).view(t.shape)
        self.offset += self.bytes_of([t])
        return out.fill_(_unset_value(t))


def _still_unset(t: torch.Tensor) -> bool:
    if t.dtype.is_floating_point or t.dtype.is_complex:
        return bool(t.sum().isnan())  # NaN anywhere makes the sum NaN; no tensor of t's size is made
    return bool((t == torch.iinfo(t.dtype).max).any())


def _check_before(model: nn.Module, order: list[tuple[str, nn.Module]]) -> None:
    """Refuse, before anything is made, a module that nothing can initialize and a boolean buffer."""
    for name, module in order:
        meta = [(n, t) for n, t in _direct(module) if t.is_meta]
        where = name or type(model).__name__
        if _initializer(model, name, module) is None:
            raise ValueError(
                f"{where} ({type(module).__name__}) holds {', '.join(n for n, _ in meta)} on the meta device and "
                f"has no reset_parameters(): {_FIX}; give {type(module).__name__} a reset_parameters() that sets "
                f"them, or build the model on a real device"
            )
        flags = [n for n, t in meta if t.dtype == torch.bool]
        if flags:
            raise ValueError(
                f"{where}.{flags[0]} ({type(module).__name__}) is a boolean buffer built on the meta device, "
                f"whose value no check can tell was set: {_FIX}; compute it in forward, store it as a float, "
                f"or build the model on a real device"
            )


def materialize(model: nn.Module, others: Iterable[nn.Module], device: torch.device, left_by_us: set[int]) -> int:
    """Make ``model``'s meta tensors on ``device`` with one process's values (see the module's docstring),
    except those only ``others`` (the modules of other ranks' layers) use, which end on ``meta`` again.
    Returns the number of modules initialized. On a refusal the model is left as it came (on ``meta``)."""

    def user_meta(t: torch.Tensor) -> bool:
        return t.is_meta and id(t) not in left_by_us

    order = [(n, m) for n, m in _post_order(model) if any(user_meta(t) for _, t in _direct(m))]
    _check_before(model, order)
    as_built = [(m, n, t) for _, m in order for n, t in _direct(m)]
    try:
        _initialize(model, order, {id(m) for layer in others for m in layer.modules()}, device, user_meta)
    except BaseException:
        for module, n, t in as_built:
            setattr(module, n, t)
        raise
    return len(order)


def _initialize(
    model: nn.Module,
    order: list[tuple[str, nn.Module]],
    elsewhere: set[int],
    device: torch.device,
    user_meta: Callable[[torch.Tensor], bool],
) -> None:
    """Every module of ``order`` initialized in turn. A module of another rank's layer is made for its call
    only, so the draws stay one process's, and gets its own meta tensors back after (the same objects:
    ties between layers stay visible to every rank). A tensor an earlier module initialized (a tie made
    after construction, ``head.weight = embed.weight``) keeps that module's values: this module's draws go
    to a copy, as its constructor's went to the tensor the tie replaced."""
    ours = {id(t) for _, m in order if id(m) not in elsewhere for _, t in _direct(m)}
    unset = _unset(device)
    replace_tensors([model], unset, lambda t: user_meta(t) and id(t) in ours)
    scratch = _Scratch([_Scratch.bytes_of(t for _, t in _direct(m) if user_meta(t)) for _, m in order], device)
    done: set[int] = set()
    for name, module in order:
        own = _direct(module)
        scratch.offset = 0
        for n, t in own:
            if user_meta(t) or id(t) in done:
                new = scratch.cut(t) if user_meta(t) else unset(t)
                setattr(module, n, nn.Parameter(new, t.requires_grad) if isinstance(t, nn.Parameter) else new)
        init = _initializer(model, name, module)
        assert init is not None  # _check_before refused modules without one
        with torch.no_grad():
            init[0]()
        _check_after(name, module, init[1])
        for n, t in own:
            setattr(module, n, t)
        done.update(id(t) for _, t in own if not t.is_meta)


def _check_after(name: str, module: nn.Module, init: str) -> None:
    for n, t in _direct(module):
        if not t.is_meta and _still_unset(t):
            where = f"{name}.{n}" if name else n
            raise ValueError(
                f"{where} ({type(module).__name__}) was built on the meta device and {init}() left it unset: "
                f"{_FIX}; set {n} there (a buffer computed in __init__, such as rotary frequencies, is not made "
                f"again otherwise), or build the model on a real device"
            )
