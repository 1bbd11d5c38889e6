"""A model built on the meta device: each rank makes the weights of its own stages only.

A model that does not fit one device does not fit one host either when every rank builds all of it
(eight ranks of a 70B model in fp32: 2.2 TB of host memory before setup frees the other stages). Built
under ``with torch.device("meta")`` (in ``__init__`` or ``configure_model``), it costs nothing until
setup, where :func:`materialize` gives this rank the tensors of its stages' layers and of every module
outside the pipelined layers, on the rank's device, and leaves the other stages' layers on ``meta``.

**The values are one process's.** One process building the model on that device draws each module's
initial values as it constructs it: children before the module that holds them, in the order they are
registered, each with the module's own ``reset_parameters()``, which torch's layers call from their
constructors. :func:`materialize` replays those calls in that order (post-order) from the random state
the Trainer call starts in, which a meta build has not drawn from: a layer of another stage is made
whole for its modules' calls only, from one scratch buffer, and put back on ``meta``, so the generator
steps through the same draws as one process and ends where one process's construction left it. Every
rank therefore holds the weights one process builds, and the data loaders shuffle alike after. A
Hugging Face model is made as its own meta path makes it (``initialize_weights()``: its
``_init_weights`` on every module, post-order, as ``smart_apply`` does). Where a model's constructor
draws in another order (a parent initializing before its children, draws between modules, a tie
made the other way round), the weights are a fresh initialization from the same calls, not one
process's; the strategy warns where it can see that (:class:`Made`).

**Nothing is left unset.** A meta tensor has no value, and ``to_empty`` memory holds whatever was there:
a buffer computed in ``__init__`` (rotary frequencies, a causal mask) that ``reset_parameters`` does not
make again would train on garbage. So before any compute, on every rank alike (every rank initializes
every module, its own or for its call): a module with meta tensors and no ``reset_parameters`` is
refused, naming it, and so are a boolean buffer (no fill can tell it was set), a lazy module's
parameters, a module holding both meta and real tensors, a torchmetrics Metric built on meta (its
defaults have no values) and a ``reset_parameters`` holding pipelined layers (it may reach into layers
other ranks make); floating tensors start as NaN and integer ones at their dtype's largest value, and
one still so after its module's initialization is refused, naming it. A refusal leaves the model as it
was built and the random state as it was.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn
from torch.nn.parameter import UninitializedBuffer, UninitializedParameter

from lightning_twobp.lightning.local_model import drop_guards, like, named_own, replace_tensors

__all__ = [
    "Made",
    "built_on_meta",
    "check_timed_layers_here",
    "custom_inits",
    "made_for_timing",
    "materialize",
    "warn_made",
]

_FIX = (
    "under strategy='twobp' a model built on the meta device gets each module's values from its "
    "reset_parameters() (a Hugging Face model: its _init_weights), on the rank that holds it"
)
_CHUNK = 1 << 24  # elements per NaN check: bounded temporary memory on a large embedding


def _all(model: nn.Module) -> Iterator[torch.Tensor]:
    for module in model.modules():
        yield from named_own(module).values()


def built_on_meta(model: nn.Module, left_by_us: set[int]) -> bool:
    """Whether ``model`` holds meta tensors the user put there (not the layers an earlier Trainer call
    left on ``meta``, whose ids are ``left_by_us``)."""
    return any(t.is_meta and id(t) not in left_by_us for t in _all(model))


@contextmanager
def made_for_timing(
    model: nn.Module, layer: nn.Module, device: torch.device, cast: torch.dtype | None = None
) -> Iterator[None]:
    """``layer``'s meta tensors made on ``device`` while open, each module's from its initialization call
    (a Hugging Face model's ``_init_weights``, else ``reset_parameters``; zeros where it sets nothing),
    then the meta tensors put back: what ``balance="time"`` and ``schedule="auto"`` run a meta-built
    model's layer on, one layer at a time (:mod:`.layer_runs`). Typical values for timing, drawn from the
    caller's random state (which the profilers fork), not one process's: the layers are made as one
    process makes them only after the cut (:func:`materialize`). A tie to a tensor outside ``layer`` is
    made apart for the run. ``cast``: the dtype its floating tensors are made in (the precision's, so
    that no fp32 copy is held beside the one the run uses)."""
    if not any(t.is_meta for m in layer.modules() for t in named_own(m).values()):
        yield
        return

    def zeros(t: torch.Tensor) -> torch.Tensor:
        dtype = cast if cast is not None and t.is_floating_point() else t.dtype
        return torch.zeros(t.shape, dtype=dtype, device=device)

    originals: list[tuple[nn.Module, str, torch.Tensor]] = []
    try:
        made = _swap_in(list(layer.modules()), zeros, lambda t: t.is_meta, originals)
        _initialize_for_timing(model, layer, made, device)
        yield
    finally:
        _put_back(originals)


def _initialize_for_timing(model: nn.Module, layer: nn.Module, made: set[int], device: torch.device) -> None:
    """The initialization calls of ``layer``'s modules holding ``made`` tensors, children first."""
    names = {id(m): n for n, m in model.named_modules()}
    owners = _hf_owners(model)
    with torch.no_grad(), device:
        for _, module in _post_order(layer):
            name = names.get(id(module))
            init = _initializer(owners[name] if name is not None else None, module)
            if init is not None and _holds_made(module, made):
                init[0]()


def _holds_made(module: nn.Module, made: set[int]) -> bool:
    """Whether ``module``'s initialization is for tensors just made: its own, or, holding none itself (a
    block that initializes its children), its children's. A real tensor is never initialized again."""
    own = named_own(module).values()
    within = own if own else [t for m in module.modules() for t in named_own(m).values()]
    return any(id(t) in made for t in within)


def check_timed_layers_here(
    layers: list[nn.Module], left_by_us: set[int], what: str, after_failed_evaluation: bool = False
) -> None:
    """Refuse ``what`` (an option that times every layer before the cut, about to) where an earlier Trainer
    call of another strategy left other pipeline ranks' layers on ``meta`` here (their ids are
    ``left_by_us``): there is nothing to time them on (torch said only "Cannot copy out of meta tensor").
    Every pipeline rank lacks some layers, so every rank refuses alike. ``after_failed_evaluation``: the
    layers were left by this strategy's evaluation call, whose ``schedule="auto"`` choice a fit makes again
    (a successful one gives every rank the whole model at its end; a failed one cannot)."""
    away = [i for i, layer in enumerate(layers) if any(id(t) in left_by_us for t in _all(layer))]
    if not away:
        return
    if after_failed_evaluation:
        raise ValueError(
            f"{what} chooses again at this fit (the strategy's earlier evaluation call chose without the "
            f"backward's costs) and times every layer on every rank, but that call failed before giving every "
            f"rank the whole model: {len(away)} of the {len(layers)} layers (from layer {away[0]}) are on other "
            f"pipeline ranks here. Fit a model built anew, or run the evaluation call to its end first, or name "
            f"a schedule (the evaluation chose strategy.auto_choice.best.label; twobp-plan says its memory)"
        )
    raise ValueError(
        f"{what} times every layer on every rank before the pipeline is cut, and an earlier Trainer call left "
        f"{len(away)} of the {len(layers)} layers (from layer {away[0]}) on other pipeline ranks: this rank holds "
        f"no weights for them. Give this call the earlier call's cut and schedule (its strategy's stage_sizes as "
        f"balance=[...], and the schedule it ran: schedule='auto' chose strategy.auto_choice.best.label), or pass "
        f"gather_full_model=True to the earlier call so that every rank holds every trained weight after it"
    )


def custom_inits(model: nn.Module) -> list[str]:
    """The modules of ``model`` outside Hugging Face's that define an initialization of their own
    (``_init_weights``, ``init_weights``, ``initialize_weights``: nanoGPT's
    ``self.apply(self._init_weights)``, torchtitan's; or, holding no tensors themselves,
    ``_reset_parameters``: ``nn.Transformer`` re-initializes its layers), which a constructor on the meta
    device ran on no values and :func:`materialize` does not call, and ``nn.TransformerEncoder`` /
    ``Decoder``, whose layers one process makes as deep copies of one (all alike), each drawn here."""
    found = []
    for name, module in model.named_modules():
        kinds = ["_init_weights", "init_weights", "initialize_weights"] + (
            [] if named_own(module) else ["_reset_parameters"]
        )
        clones = isinstance(module, (nn.TransformerEncoder, nn.TransformerDecoder))  # deep copies of one layer
        if not _hugging_face(module) and (clones or any(callable(getattr(type(module), f, None)) for f in kinds)):
            found.append(f"{name or type(model).__name__} ({type(module).__name__})")
    return found


def _hugging_face(module: nn.Module) -> bool:
    """A transformers ``PreTrainedModel`` (by name: transformers is optional)."""
    return any(c.__name__ == "PreTrainedModel" for c in type(module).__mro__)


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


def _hf_owners(model: nn.Module) -> dict[str, nn.Module | None]:
    """Every module's innermost Hugging Face model (itself included), by name, in one walk from the top."""
    owners: dict[str, nn.Module | None] = {}
    for name, module in model.named_modules():  # a parent before its children
        hf = _hugging_face(module) and callable(getattr(module, "_init_weights", None))
        owners[name] = module if hf else owners.get(name.rpartition(".")[0]) if name else None
    return owners


def _initializer(owner: nn.Module | None, module: nn.Module) -> tuple[Callable[[], None], str] | None:
    """The call that gives ``module`` its values, and its name for messages: the innermost enclosing
    Hugging Face model's ``_init_weights(module)`` (then the module's own ``reset_parameters`` for what
    that leaves unset: a user's module inside a Hugging Face model), else ``reset_parameters``."""
    method = "_reset_parameters" if isinstance(module, nn.MultiheadAttention) else "reset_parameters"
    reset: Any = getattr(module, method, None)  # MultiheadAttention's constructor calls its private one
    if owner is not None:
        hf: Any = owner._init_weights

        def hf_then_own() -> None:
            hf(module)
            if callable(reset) and any(_still_unset(t) for t in named_own(module).values() if not t.is_meta):
                reset()

        return hf_then_own, f"{type(owner).__name__}._init_weights"
    return (reset, f"{type(module).__name__}.{method}") if callable(reset) else None


def _unset_value(t: torch.Tensor) -> float | int:
    return float("nan") if t.dtype.is_floating_point or t.dtype.is_complex else torch.iinfo(t.dtype).max


def _still_unset(t: torch.Tensor) -> bool:
    """Whether ``t`` still holds its fill anywhere, checked in chunks: the comparisons' temporaries stay
    small on a large embedding (and +inf with -inf is no NaN, as their sum would be)."""
    flat = t.detach().reshape(-1)
    for chunk in flat.split(_CHUNK):
        if t.dtype.is_floating_point or t.dtype.is_complex:
            wide = chunk if chunk.dtype.itemsize >= 2 or chunk.dtype.is_complex else chunk.float()  # float8
            if bool(wide.isnan().any()):
                return True
        elif bool((chunk == torch.iinfo(t.dtype).max).any()):
            return True
    return False


class _Scratch:
    """One buffer the tensors of other ranks' layers are cut from while their modules initialize: made
    and freed tensor by tensor (or buffer by buffer, between the checks' temporaries), they would each
    leave their bytes in a heap that keeps freed memory (``engine.memory.cpu_heap``), up to the whole
    model's (measured: 128 MiB of a 128 MiB model on a rank holding 32), where one buffer the size of
    the largest layer, reused layer after layer, stays bounded."""

    ALIGN = 64

    def __init__(self, size: int, device: torch.device) -> None:
        self.buffer = torch.empty(size, dtype=torch.uint8, device=device)
        self.offset = 0

    @classmethod
    def bytes_of(cls, tensors: Iterable[torch.Tensor]) -> int:
        unique = {id(t): t for t in tensors}.values()
        return sum(-(-t.numel() * t.element_size() // cls.ALIGN) * cls.ALIGN for t in unique)

    def cut(self, t: torch.Tensor) -> torch.Tensor:
        n = t.numel() * t.element_size()
        out = self.buffer[self.offset : self.offset + n].view(t.dtype).view(t.shape)
        self.offset += self.bytes_of([t])
        return out.fill_(_unset_value(t))


@dataclass
class Made:
    """What :func:`materialize` did, for the strategy's warnings, and how to undo it."""

    modules: int  # modules initialized
    undo: Callable[[], None]  # the model as built (on meta) and the random state as it was
    real: list[str] = field(default_factory=list)  # modules with parameters built on a real device beside meta ones
    ties: list[str] = field(default_factory=list)  # tensors several modules initialize: the first one's values


def _check_before(
    model: nn.Module, order: list[tuple[str, nn.Module]], owners: dict[str, Any], user_meta: Callable[..., bool]
) -> None:
    """Refuse, before anything is made, what nothing can initialize or no check can see set."""
    for name, module in order:
        meta = {n: t for n, t in named_own(module).items() if user_meta(t)}
        if not meta:
            continue
        where, kind = name or type(model).__name__, type(module).__name__
        real = [n for n, t in named_own(module).items() if not t.is_meta]
        lazy = [n for n, t in meta.items() if isinstance(t, (UninitializedParameter, UninitializedBuffer))]
        flags = [n for n, t in meta.items() if t.dtype == torch.bool]
        if lazy or real:
            what = f"lazy parameters ({', '.join(lazy)})" if lazy else f"{', '.join(real)} on a real device"
            raise ValueError(
                f"{where} ({kind}) holds {', '.join(meta)} on the meta device and {what}: {_FIX}; build the "
                f"module wholly on the meta device with its shapes known (no lazy modules), or on a real device"
            )
        if flags:
            raise ValueError(
                f"{where}.{flags[0]} ({kind}) is a boolean buffer built on the meta device, whose value no check "
                f"can tell was set: {_FIX}; compute it in forward, store it as a float, or build the model on a "
                f"real device"
            )
        if _initializer(owners[name], module) is None:
            parametrized = "parametrizations" in name.split(".")
            hint = (
                "register the parametrization (weight_norm, spectral_norm) after setup, e.g. in on_fit_start, "
                if parametrized
                else f"give {kind} a reset_parameters() that sets them, "
            )
            raise ValueError(
                f"{where} ({kind}) holds {', '.join(meta)} on the meta device and has no reset_parameters(): "
                f"{_FIX}; {hint}or build the model on a real device"
            )


def _resets(owner: nn.Module | None, module: nn.Module) -> bool:
    """Whether ``module`` has an initialization call of its own (or a Hugging Face model's for it)."""
    return owner is not None or callable(getattr(module, "reset_parameters", None))


def _check_spanning(
    model: nn.Module, order: list[tuple[str, nn.Module]], owners: dict[str, Any], pipelined: list[nn.Module]
) -> None:
    """Refuse a module outside Hugging Face's whose reset_parameters holds pipelined layers: it may reach
    into layers other ranks make (and would draw on meta there, silently), so no rank could replay it as
    one process; decided from the structure, alike on every rank."""
    roots = {id(layer) for layer in pipelined}
    for name, module in order:
        inside = [n for n, m in module.named_modules() if id(m) in roots and m is not module]
        if inside and owners[name] is None and callable(getattr(module, "reset_parameters", None)):
            where = name or type(model).__name__
            raise ValueError(
                f"{where} ({type(module).__name__}) has a reset_parameters() and holds pipelined layers "
                f"({', '.join(inside[:3])}{', ...' if len(inside) > 3 else ''}), which the ranks make apart: {_FIX}, "
                f"and this one may reach into layers of other ranks; move that initialization into the layers' "
                f"own modules, or build the model on a real device"
            )


def _check_metrics(modules: list[tuple[str, nn.Module]]) -> None:
    """A torchmetrics Metric built on the meta device: its states' defaults (a mean's zero, a minimum's
    inf) have no values, and no initialization call makes them (by duck type: torchmetrics is optional)."""
    for name, module in modules:
        defaults = getattr(module, "_defaults", None)
        if isinstance(defaults, dict) and any(isinstance(v, torch.Tensor) and v.is_meta for v in defaults.values()):
            raise ValueError(
                f"{name} ({type(module).__name__}) is a torchmetrics Metric built on the meta device: its states' "
                f"defaults have no values to start from; build the Metric outside the `with torch.device('meta')` "
                f"block (it holds no weights)"
            )


def materialize(
    model: nn.Module,
    others: Iterable[nn.Module],
    device: torch.device,
    left_by_us: set[int],
    pipelined: Iterable[nn.Module] | None = None,
) -> Made:
    """Make ``model``'s meta tensors on ``device`` with one process's values (see the module's docstring),
    except those only ``others`` (other ranks' layers) use, which end on ``meta`` again; ``pipelined``:
    every rank's layers (``others`` by default). On a refusal the model is left as it came and the random
    state as it was."""

    def user_meta(t: torch.Tensor) -> bool:
        return t.is_meta and id(t) not in left_by_us

    others = list(others)
    full, owners = _post_order(model), _hf_owners(model)
    with_meta = {id(m) for _, m in full if any(user_meta(t) for t in named_own(m).values())}
    # A module holding nothing itself may initialize its children: a block's reset_parameters, and a
    # Hugging Face model's _init_weights (GPT-2 scales c_proj from its attention module), is called too
    order = [
        (n, m)
        for n, m in full
        if id(m) in with_meta or (_resets(owners[n], m) and any(id(s) in with_meta for s in m.modules()))
    ]
    _check_metrics(full)
    _check_spanning(model, order, owners, others if pipelined is None else list(pipelined))
    _check_before(model, order, owners, user_meta)
    as_built = [(m, n, t) for _, m in order for n, t in named_own(m).items()]
    rng = _RandomState(device)

    def undo() -> None:
        for module, n, t in as_built:
            setattr(module, n, t)
        drop_guards({id(t) for _, _, t in as_built})  # a refused call's teardown guarded the layers it set aside
        rng.restore()

    try:
        ties = _initialize(model, order, owners, _Layers(model, others), device, user_meta)
    except BaseException:
        undo()
        raise
    # parameters built on a device drew from the generator before setup (a loss's class weights did not)
    real = [f"{n or type(model).__name__} ({type(m).__name__})" for n, m in full if id(m) not in with_meta and _real(m)]
    return Made(len(order), undo, real, ties)


def _real(module: nn.Module) -> bool:
    return any(p is not None and not p.is_meta for p in module._parameters.values())


class _RandomState:
    """torch's generator states on the CPU and the device, to put back after a refusal."""

    def __init__(self, device: torch.device) -> None:
        self.cpu = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
        self.device = device

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state(self.cuda, self.device)


class _Layers:
    """Which modules belong to another rank's layers only (a module shared with this rank's layers, or
    used outside the pipelined layers, is this rank's), grouped into units made whole together (layers
    sharing a module or a tensor), and which tensors are this rank's."""

    def __init__(self, model: nn.Module, others: list[nn.Module]) -> None:
        roots = {id(layer) for layer in others}
        mine: dict[int, nn.Module] = {}
        stack = [model]
        while stack:  # every module reachable without entering another rank's layer
            module = stack.pop()
            if id(module) not in mine:
                mine[id(module)] = module
                stack.extend(c for c in module.children() if id(c) not in roots)
        self.ours = {id(t) for m in mine.values() for t in named_own(m).values()}
        unit = list(range(len(others)))  # union-find over the layers: a shared module or tensor joins two

        def top(k: int) -> int:
            while unit[k] != k:
                k = unit[k]
            return k

        seen: dict[int, int] = {}
        for k, layer in enumerate(others):
            for m in layer.modules():
                for key in (id(m), *(id(t) for t in named_own(m).values())):
                    if key in seen and top(seen[key]) != top(k):
                        unit[top(seen[key])] = top(k)
                    seen.setdefault(key, k)
        groups: dict[int, list[nn.Module]] = {}
        for k, layer in enumerate(others):
            groups.setdefault(top(k), []).append(layer)
        self.units = list(groups.values())
        index = {root: u for u, root in enumerate(groups)}
        self.unit_of = {
            id(m): index[top(k)] for k, layer in enumerate(others) for m in layer.modules() if id(m) not in mine
        }


def _initialize(
    model: nn.Module,
    order: list[tuple[str, nn.Module]],
    owners: dict[str, Any],
    layers: _Layers,
    device: torch.device,
    user_meta: Callable[[torch.Tensor], bool],
) -> list[str]:
    """Every module of ``order`` initialized in turn; returns the tensors several modules initialized.

    Another rank's layer is made whole (from one scratch buffer) before its first module's call and put
    back on ``meta`` after its last, so a module's ``reset_parameters`` may reach into its children as in
    one process; its original meta tensors go back (the same objects: ties stay visible to every rank).
    A tensor an earlier module initialized (a tie made after construction, ``head.weight = embed.weight``)
    keeps that module's values: this module's draws go to a copy, as its constructor's went to the
    tensor the tie replaced. A ``reset_parameters`` that assigns new tensors has their values copied into
    the made ones (ties and this rank's tensors keep their identity)."""
    unset = _unset_fill(device)
    replace_tensors([model], unset, lambda t: user_meta(t) and id(t) in layers.ours)
    last = {layers.unit_of[id(m)]: k for k, (_, m) in enumerate(order) if id(m) in layers.unit_of}
    sizes = [
        _Scratch.bytes_of(t for m in _modules(unit) for t in named_own(m).values() if user_meta(t))
        for unit in layers.units
    ]
    pool = _Scratch(max(sizes, default=0), device)  # reused unit after unit; a second open unit gets its own
    done: dict[int, tuple[str, torch.Tensor]] = {}  # the tensor kept: its id is not reused while this runs
    ties: list[str] = []
    live: dict[int, list[tuple[nn.Module, str, torch.Tensor]]] = {}  # open units: their original tensors
    for k, (name, module) in enumerate(order):
        key = layers.unit_of.get(id(module))
        if key is not None and key not in live:  # open until its last module: its modules may interleave
            scratch = pool if not live else _Scratch(sizes[key], device)
            live[key] = _made_whole(layers.units[key], scratch, user_meta)
        before = named_own(module)
        shared = {n: t for n, t in before.items() if id(t) in done}
        ties += [f"{name}.{n} (kept {done[id(t)][0]}'s values)" for n, t in shared.items()]
        for n, t in shared.items():
            setattr(module, n, like(t, unset(t)))
        init = _initializer(owners[name], module)
        assert init is not None  # _check_before refused modules without one
        with torch.no_grad(), device:  # factories without a device: on it, as in one process built there
            init[0]()
        _keep_identity(name, module, before, shared)
        _check_after(name, module, init[1])
        done.update((id(t), (name or type(model).__name__, t)) for t in before.values() if id(t) not in done)
        if key is not None and last[key] == k:
            _put_back(live.pop(key))
    return ties


def _unset_fill(device: torch.device) -> Callable[[torch.Tensor], torch.Tensor]:
    """A maker of new tensors like its argument on ``device``, holding the value that means "not set"."""
    return lambda t: torch.full(t.shape, _unset_value(t), dtype=t.dtype, device=device)


def _modules(unit: list[nn.Module]) -> list[nn.Module]:
    return list({id(m): m for layer in unit for m in layer.modules()}.values())


def _made_whole(
    unit: list[nn.Module], scratch: _Scratch, user_meta: Callable[[torch.Tensor], bool]
) -> list[tuple[nn.Module, str, torch.Tensor]]:
    """Other ranks' layers with their meta tensors cut from the scratch buffer (ties kept); the originals."""
    scratch.offset = 0
    originals: list[tuple[nn.Module, str, torch.Tensor]] = []
    _swap_in(_modules(unit), scratch.cut, user_meta, originals)
    return originals


def _swap_in(
    modules: list[nn.Module],
    make: Callable[[torch.Tensor], torch.Tensor],
    which: Callable[[torch.Tensor], bool],
    originals: list[tuple[nn.Module, str, torch.Tensor]],
) -> set[int]:
    """The tensors of ``modules`` that ``which`` picks replaced by ``make(t)`` (one new tensor per tensor:
    ties stay tied), each original appended to ``originals`` as it goes (a failure part way can be put
    back); the ids of the new tensors."""
    made: dict[int, torch.Tensor] = {}
    for module in modules:
        for n, t in named_own(module).items():
            if which(t):
                if id(t) not in made:
                    made[id(t)] = like(t, make(t))
                originals.append((module, n, t))
                setattr(module, n, made[id(t)])
    return {id(t) for t in made.values()}


def _put_back(originals: list[tuple[nn.Module, str, torch.Tensor]]) -> None:
    for module, n, t in originals:
        setattr(module, n, t)


def _keep_identity(name: str, module: nn.Module, before: dict[str, torch.Tensor], shared: dict) -> None:
    """The tensors as they were before the call: a tie's copy dropped, a new tensor's values copied in."""
    for n, t in before.items():
        now = named_own(module).get(n)
        if n not in shared and now is not t and now is not None:
            if now.shape != t.shape:
                raise ValueError(
                    f"{name}.{n} ({type(module).__name__}) was built on the meta device as {tuple(t.shape)}, and its "
                    f"initialization assigned a {tuple(now.shape)} tensor: {_FIX}; build it in the shape it trains in"
                )
            with torch.no_grad():
                t.copy_(now)
        setattr(module, n, t)


def _check_after(name: str, module: nn.Module, init: str) -> None:
    for n, t in named_own(module).items():
        if not t.is_meta and _still_unset(t):
            where = f"{name}.{n}" if name else n
            raise ValueError(
                f"{where} ({type(module).__name__}) was built on the meta device and {init}() left it unset: "
                f"{_FIX}; set {n} there (a buffer computed in __init__, such as rotary frequencies, is not made "
                f"again otherwise), or build the model on a real device"
            )


def warn_made(made: Made, model: nn.Module) -> None:
    """What a meta build's values may not share with one process's build, where it can be seen (a Hugging
    Face model is made as its own meta path makes it: nothing to warn about)."""
    if any(_hugging_face(m) for m in model.modules()):
        return
    doc = "docs/strategy.md, 'A model built on the meta device'"
    custom = custom_inits(model)
    if custom:
        rank_zero_warn(
            f"the model was built on the meta device, and its modules got their values from their own "
            f"reset_parameters() (torch's default initialization for torch's layers) or Hugging Face's "
            f"_init_weights; {', '.join(custom)} define an initialization of their own (or copy one layer into "
            f"all), which the constructor ran on the meta device (on no values) and strategy='twobp' does not "
            f"repeat: to keep it, build the model "
            f"on a real device, or load its weights ({doc})"
        )
    if made.real:
        rank_zero_warn(
            f"the model was built partly on the meta device: {', '.join(made.real[:3])}"
            f"{' and others' if len(made.real) > 3 else ''} hold tensors built on a real device, whose constructors "
            f"drew from the random generator before setup, so the meta modules' values are a fresh initialization, "
            f"not one process's ({doc})"
        )
    if made.ties:
        rank_zero_warn(
            f"the model was built on the meta device with tensors shared between modules: {'; '.join(made.ties[:3])}. "
            f"A tie keeps the first module's initialization; one process keeps the values of the module whose "
            f"tensor the tie kept (`head.weight = embed.weight`: the embedding's, as here; `embed.weight = "
            f"head.weight`: the head's). Where that differs, load the weights, or build on a real device ({doc})"
        )
