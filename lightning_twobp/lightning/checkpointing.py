"""Activation checkpointing on this rank's blocks: ``TwoBPStrategy(activation_checkpointing=...)`` and
a Hugging Face model's own ``gradient_checkpointing_enable()``.

Each chosen block's forward runs under ``torch.utils.checkpoint(use_reentrant=False)`` for the length of
the Trainer call (an instance attribute, undone at teardown: the user's blocks are left as they were
found). Under the split a checkpointed block runs its forward twice per micro-batch, as in a plain
backward: once in F, once recomputed in B, where W's formulas keep only their operands (the weight
GEMMs' inputs) of what that recompute made and the rest is freed at B (see ``engine.graph.peek``).

Values of the option:

* ``None``: off (the default).
* ``"full"``: every block.
* ``k`` (an int >= 1): every k-th block of the model (layer indices 0, k, 2k, ...).
* ``"selective"``: every block, keeping the outputs of its matrix products and attention kernels
  (``aten.mm``, ``addmm``, ``bmm``, ``_scaled_dot_product_*``) from F to B and recomputing the rest (norms,
  activations, element-wise ops): torch's ``create_selective_checkpoint_contexts`` as the checkpoint's
  ``context_fn``. B's one recompute runs the block's forward again, its kept products served from what F
  stored and not computed again; what W keeps is the same as with ``"full"``.

A Hugging Face model with gradient checkpointing enabled is taken over the same way, whatever its
transformers version: its own switch (``gradient_checkpointing`` on the model and, from 4.5x, on each
``GradientCheckpointingLayer``) is off for the Trainer call and the blocks it would checkpoint are
checkpointed here, inside the pipeline's per-block call; the model's ``config.use_cache`` is off for the
call, as transformers itself turns the cache off while it checkpoints in training. Left to itself,
transformers 4.x checkpoints ``block.__call__`` around that call, so its recompute re-enters the
pipeline's block logic in the backward (GPT-2 hangs, Llama fails torch's saved-tensor count check); and
its default there is the reentrant form, which cannot be split. The result is the same model's gradients either way.
With the option too, a Hugging Face model's ``config.use_cache`` is off for the call: a block's
recompute would otherwise find the cache its F filled and run other ops than F did.

A block that calls ``torch.utils.checkpoint(..., use_reentrant=True)`` in its own code is refused by
the engine at its stage's first F, before any backward, with a message naming ``use_reentrant=False``.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
    noop_context_fn,
)

from lightning_twobp.lightning.in_place import starts_in_place
from lightning_twobp.lightning.modulelist_contract import caches_off
from lightning_twobp.options import check_activation_checkpointing
from lightning_twobp.private import tensor_version

__all__ = [
    "AUTO_MODES",
    "apply_activation_checkpointing",
    "check_activation_checkpointing",
    "check_auto_with_switches",
    "keep_products",
]

log = logging.getLogger(__name__)

# What activation_checkpointing="auto" weighs with schedule="auto": each a profile of the layers, searched
# together. Selective keeps the matmul products (most of a block's compute, part of its activations) and
# recomputes the rest, so it may fit where plain does not at a fraction of "full"'s recompute (how much
# it saves depends on the block: measured, 8-10% of a tiny LLaMa rank's peak; docs/benchmarks.md).
AUTO_MODES: tuple[str | None, ...] = (None, "selective", "full")

_HF_FLAG = "gradient_checkpointing"  # Hugging Face's public switch, on the model and on each block (5.x)
_TIMM_FLAG = "grad_checkpointing"  # timm's, set by model.set_grad_checkpointing() on the model (and its stages)


# The costly ops: a transformer's matrix products, a conv net's convolutions (attention: by name, below).
_PRODUCTS = {torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm, torch.ops.aten.convolution}


def keep_products(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """The ``"selective"`` policy: a matrix product's, a convolution's or an attention kernel's output is
    kept from F to B (the costly ops), every other op's is recomputed (cheap, and most of the bytes)."""
    packet = getattr(op, "overloadpacket", op)
    kept = packet in _PRODUCTS or getattr(packet, "__name__", "").startswith("_scaled_dot_product")
    return CheckpointPolicy.MUST_SAVE if kept else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_contexts() -> tuple[Any, Any]:
    return create_selective_checkpoint_contexts(keep_products)


def _checkpointed(block: nn.Module, selective: bool) -> Callable[..., Any]:
    forward = block.forward
    contexts = _selective_contexts if selective else noop_context_fn
    buffers = [(m, n) for m in block.modules() for n, _ in m.named_buffers(recurse=False)]
    # A block that changes its input in place (torchvision's classifiers start with Dropout(inplace=True))
    # changes what the checkpoint recomputes from: torch refuses the recompute ("modified by an inplace
    # operation"), in one process too. Inside the checkpoint it changes a copy, made again by each recompute.
    inner = _on_copies(forward) if starts_in_place(block) else forward
    # A module's own generator (torchtune's LayerDropout keeps one per layer): torch's checkpoint forks and puts back
    # the global generators only, so the recompute drew another skip mask than F (a trial: torch's "a different
    # number of tensors was saved", or another batch shape in B). The recompute draws from F's state.
    generators = [g for m in block.modules() for g in vars(m).values() if isinstance(g, torch.Generator)]
    stepped = inner

    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():  # evaluation: nothing is saved, nothing to recompute
            return forward(*args, **kwargs)
        inner = _GeneratorsAsF(stepped, generators) if generators else stepped
        if not buffers:
            return checkpoint(inner, *args, use_reentrant=False, context_fn=contexts, **kwargs)
        call = _BuffersAsF(inner, buffers)
        out = checkpoint(call, *args, use_reentrant=False, context_fn=contexts, **kwargs)
        call.keep_changed()
        return out

    return run


def _on_copies(forward: Callable[..., Any]) -> Callable[..., Any]:
    def run(*args: Any, **kwargs: Any) -> Any:
        return forward(*(a.clone() if isinstance(a, torch.Tensor) else a for a in args), **kwargs)

    return run


class _GeneratorsAsF:
    """One checkpointed call of a block whose recompute draws from its modules' own generators as F did: their
    states before F are kept, set for the recompute, and the states the recompute found put back after it."""

    def __init__(self, forward: Callable[..., Any], generators: list[torch.Generator]) -> None:
        self.forward = forward
        self.generators = generators
        self.before = [g.get_state() for g in generators]  # outside the checkpoint, before F
        self.ran = False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self.ran:  # F
            self.ran = True
            return self.forward(*args, **kwargs)
        now = [g.get_state() for g in self.generators]
        for g, state in zip(self.generators, self.before, strict=True):
            g.set_state(state)
        try:
            return self.forward(*args, **kwargs)
        finally:
            for g, state in zip(self.generators, now, strict=True):
                g.set_state(state)


# A norm's running statistics: its kernel writes them in a training forward without counting the write.
_RUNNING = {"running_mean", "running_var"}


class _BuffersAsF:
    """One checkpointed call of a block whose recomputes see its buffers as F saw them and leave them as
    F left them. torch's checkpoint runs the block's forward again in B; a module that writes a buffer
    in its forward would otherwise see F's write there and write again. A training BatchNorm counted the
    micro-batch twice (``num_batches_tracked`` 2 against 1, the running mean 8e-3 off after one step);
    a module whose output reads such a buffer (spectral norm's power iteration, an EMA codebook, a
    running scale) recomputed another output than F's, and every gradient below it was wrong (a running
    scale: 2.0 off in a weight's gradient). So F's call keeps a copy of every buffer it changes, as it
    was before F (made outside the checkpoint: selective checkpointing refuses any op its forward did not
    run), and B's recompute runs on those copies, the real buffers put back after."""

    def __init__(self, forward: Callable[..., Any], buffers: list[tuple[nn.Module, str]]) -> None:
        self.forward = forward
        self.ran = False
        found = [(m, n, getattr(m, n)) for m, n in buffers]
        self.copies: dict[int, torch.Tensor] = {id(t): t.detach().clone() for _, _, t in found}  # a shared one once
        self._before = [(m, n, t, tensor_version(t)) for m, n, t in found]
        self.changed: list[tuple[nn.Module, str, int]] = []  # (module, name, its copy's key)
        self.used = False

    def keep_changed(self) -> None:
        """After F: keep the copies of the buffers F wrote or replaced; drop the rest (most: masks, caches).
        A write counts in the tensor's version, except a batch norm kernel's into its running statistics
        (measured): those count whenever their module trains. (Not compared by value: on a GPU each
        comparison would wait for the device.)"""
        self.changed = [
            (m, n, id(t))
            for m, n, t, v in self._before
            if getattr(m, n) is not t or tensor_version(t) != v or (n in _RUNNING and m.training)
        ]
        keys = {k for _, _, k in self.changed}
        self.copies = {k: c for k, c in self.copies.items() if k in keys}
        self._before = []

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self.ran:  # F
            self.ran = True
            return self.forward(*args, **kwargs)
        if not self.changed:
            return self.forward(*args, **kwargs)
        if self.used:
            raise RuntimeError(_RECOMPUTED_TWICE)
        # The copies themselves, not fresh clones of them: selective checkpointing refuses any op in a
        # recompute that F did not run, a clone included. So they serve one recompute, which is what B
        # runs (and a plain backward); a second would see the first's writes, and is refused above.
        self.used = True
        real = [getattr(m, n) for m, n, _ in self.changed]
        for m, n, k in self.changed:
            setattr(m, n, self.copies[k])
        try:
            return self.forward(*args, **kwargs)
        finally:
            for (m, n, _), t in zip(self.changed, real, strict=True):
                setattr(m, n, t)


_RECOMPUTED_TWICE = (
    "activation checkpointing: a block whose forward writes its buffers (a batch norm's running statistics, "
    "a running scale, spectral norm's power iteration) was recomputed a second time for one forward (a "
    "backward over a checkpointed block run twice, retain_graph=True). Each recompute must see the buffers as "
    "F did, and only one copy of them is kept: checkpoint this block without TwoBPStrategy's "
    "activation_checkpointing (torch.utils.checkpoint in the block's own code) or backward through it once."
)


def apply_activation_checkpointing(
    layers: Iterable[tuple[int, nn.Module]],
    value: str | int | None,
    model: nn.Module | None = None,
    contract: Any = None,
) -> Callable[[], None]:
    """Checkpoint the blocks of the chosen ``(layer index, layer)`` pairs (those ``value`` picks and
    those ``model``'s Hugging Face switch picks); returns the function that undoes it, switch included.
    Under the ModuleList contract a layer is a group of modules and its block is ``contract.blocks[i]``
    (the module the model's loop calls). With ``"selective"`` every chosen block, the Hugging Face switch's
    included, keeps its products (:func:`keep_products`)."""
    loop_blocks = getattr(contract, "blocks", None)
    blocks = [(i, b if loop_blocks is None else loop_blocks[i]) for i, b in layers]
    every = value if isinstance(value, int) else 1
    chosen = {id(b): b for i, b in blocks if value is not None and i % every == 0}
    switches = _hf_switches(model)
    if switches:
        model_wide = any(not _is_block(m, blocks) for m in switches)
        for _, b in blocks:  # 4.x: the model's switch covers every block; 5.x: each block has its own
            if b in switches or (model_wide and not hasattr(b, _HF_FLAG)):
                chosen[id(b)] = b
        for m in _switched_outside(switches, blocks, [layer for _, layer in layers]):  # an encoder's layers
            chosen[id(m)] = m
        log.info(
            "Hugging Face gradient checkpointing is taken over for this Trainer call: %d block(s) on this rank "
            "run under torch.utils.checkpoint(use_reentrant=False) inside the pipeline's block call",
            len(chosen),
        )
    timm_switches = _take_over_timm(model, blocks, chosen) if loop_blocks is not None else []
    # What Hugging Face does while it checkpoints, kept, whoever asked for the checkpointing: no cache in
    # training (its models turn ``use_cache`` off then; a block's recompute would find the cache F
    # filled and run other ops, and a per-block cache is also a value the pipeline cannot return)
    owners = model.modules() if chosen and model is not None else switches
    caches_on = caches_off(owners)
    for m in switches:
        setattr(m, _HF_FLAG, False)
    # An instance attribute, undone below to what was there: a block's own instance forward (accelerate's
    # hooks, a wrapper of the user's) is what the checkpoint runs, and stays after.
    before = {k: b.__dict__.get("forward", _NONE) for k, b in chosen.items()}
    for b in chosen.values():
        b.forward = _checkpointed(b, value == "selective")

    def undo() -> None:
        for k, b in chosen.items():
            if before[k] is _NONE:
                del b.forward
            else:
                b.forward = before[k]
        for m in switches:
            setattr(m, _HF_FLAG, True)
        for m in timm_switches:
            setattr(m, _TIMM_FLAG, True)
        caches_on()

    return undo


_NONE = object()  # a block without an instance forward of its own


def check_auto_with_switches(model: nn.Module | None) -> None:
    """``activation_checkpointing="auto"`` weighs plain against checkpointed blocks; a Hugging Face switch
    that is on checkpoints its blocks whatever the choice, so the plain profile would not be plain (and
    the recompute's bytes would come out as nothing): refused, naming both ways out."""
    modules = list(model.modules()) if model is not None else []
    timm_on = [m for m in modules if getattr(m, _TIMM_FLAG, None) is True]
    if timm_on and any(hasattr(m, "set_grad_checkpointing") for m in modules):  # timm's switch (the model's method)
        raise ValueError(
            f"TwoBPStrategy(activation_checkpointing='auto') chooses whether to checkpoint the blocks, but timm's "
            f"gradient checkpointing is on in {len(timm_on)} module(s) ({type(timm_on[0]).__name__} first), so the "
            f"plain profile would be checkpointed too: call model.set_grad_checkpointing(False) to let 'auto' "
            f"choose, or pass activation_checkpointing=None to keep the model's own checkpointing"
        )
    on = _hf_switches(model)
    if on:
        raise ValueError(
            f"TwoBPStrategy(activation_checkpointing='auto') chooses whether to checkpoint the blocks, but "
            f"Hugging Face gradient checkpointing is on in {len(on)} module(s) ({type(on[0]).__name__} first): "
            f"call model.gradient_checkpointing_disable() to let 'auto' choose, or pass "
            f"activation_checkpointing=None to keep the model's own checkpointing"
        )


def _take_over_timm(model: nn.Module | None, blocks: list[tuple[int, nn.Module]], chosen: dict) -> list[nn.Module]:
    """timm's own switch (``model.set_grad_checkpointing()``: ``grad_checkpointing`` on the module whose forward
    runs the blocks, EVA's loop or ViT's ``checkpoint_seq(self.blocks, x)``) checkpoints each block call by
    timm's ``checkpoint``, whose recompute re-entered the pipeline's block call in the backward (a stage's B
    failed with ElsewhereWrite): taken over as Hugging Face's model-wide switch is, off for the call, the blocks
    put into ``chosen`` to be checkpointed here. Returns the switches turned off, for the undo to turn on."""
    switches = _timm_loop_switches(model, [b for _, b in blocks])
    if switches:
        chosen.update((id(b), b) for _, b in blocks)
        log.info(
            "timm's set_grad_checkpointing() is taken over for this Trainer call: %d block(s) on this rank run "
            "under torch.utils.checkpoint(use_reentrant=False) inside the pipeline's block call",
            len(blocks),
        )
        for m in switches:
            setattr(m, _TIMM_FLAG, False)
    return switches


def _timm_loop_switches(model: nn.Module | None, blocks: list[nn.Module]) -> list[nn.Module]:
    """The modules of ``model`` with timm's switch on (``grad_checkpointing is True``) that hold the pipelined
    blocks in a ModuleList or Sequential child of their own: their forward checkpoints each block call."""
    if model is None or not blocks:
        return []
    first = blocks[0]
    return [
        m
        for m in model.modules()
        if getattr(m, _TIMM_FLAG, None) is True
        and any(isinstance(c, (nn.ModuleList, nn.Sequential)) and any(e is first for e in c) for c in m.children())
    ]


def _hf_switches(model: nn.Module | None) -> list[nn.Module]:
    """The modules of ``model`` whose Hugging Face gradient checkpointing switch is on."""
    if model is None:
        return []
    return [m for m in model.modules() if getattr(m, _HF_FLAG, False) is True]


def _switched_outside(
    switches: list[nn.Module], blocks: list[tuple[int, nn.Module]], held: list[nn.Module]
) -> list[nn.Module]:
    """The layers Hugging Face would checkpoint outside the pipelined blocks, in this rank's layers: an
    encoder's, where the decoder's blocks are pipelined (it runs whole on the first stage). transformers 5.x:
    each such layer is a ``GradientCheckpointingLayer`` with its own switch; 4.x: the switch is the stack's,
    covering the entries of its ModuleLists. Their switch off, they ran without checkpointing: the first
    stage held every encoder activation that one process recomputes."""
    inside = {id(m) for _, b in blocks for m in b.modules()}
    mine = {id(m) for layer in held for m in layer.modules()}
    layer_type = _checkpointing_layer()
    out: list[nn.Module] = []
    for m in switches:
        if id(m) in inside or id(m) not in mine:
            continue
        if layer_type is not None:
            out += [m] if isinstance(m, layer_type) else []
        else:
            out += [e for c in m.children() if isinstance(c, nn.ModuleList) for e in c]
    return out


def _checkpointing_layer() -> type | None:
    """transformers' ``GradientCheckpointingLayer`` (5.x, late 4.x), or None (earlier, or not installed)."""
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:
        return None
    return GradientCheckpointingLayer


def _is_block(module: nn.Module, blocks: list[tuple[int, nn.Module]]) -> bool:
    return any(module is b for _, b in blocks)
