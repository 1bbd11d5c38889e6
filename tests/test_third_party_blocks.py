"""The split backward on blocks we did not write: tiny Hugging Face models built from their configs, and
the graph shapes they showed, reduced.

Each case runs micro-batches of two sizes through ``Stage``'s F, B and W (W per micro-batch) against
plain autograd on a copy: the input gradients and every parameter's ``.grad`` equal (fp32, rtol 1e-5),
``deferred_fraction`` as documented, no slow-path warning. Checkpointed with the strategy's option, each
block runs its forward once in F and once in B, never in W.

DeBERTa-v2 (``share_att_key``, its v3 checkpoints' default) adds a Linear's bias both to the input's
product and to the product of its relative-position embeddings, a weight-only tensor. B took that bias
as a parameter "used by several ops", getting its whole gradient, and W then pushed the weight-only
product's share into it again: a silent wrong gradient (40% off), and a crash once checkpointed."""

from __future__ import annotations

import copy
import functools
import warnings
from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_twobp.engine import Stage
from lightning_twobp.lightning.checkpointing import _checkpointed
from lightning_twobp.lightning.modulelist_contract import identical_blocks

SIZES = (2, 1)  # micro-batch sizes: the second smaller


def _split_vs_fused(
    module: nn.Module,
    xs: list[torch.Tensor],
    w_together: bool = False,
    ref: nn.Module | None = None,
    phase: Callable[[str], None] = lambda _: None,
) -> Stage:
    """F of every micro-batch, B of every one, then W (each alone, or all in one call), against plain
    autograd on ``ref`` (a copy made first by default): input gradients and every parameter's ``.grad``
    equal. ``phase`` hears "F", "B", "W" as each begins."""
    ref = copy.deepcopy(module) if ref is None else ref
    g = torch.Generator().manual_seed(2)
    stage = Stage(module)
    grads_out, want_in = [], []
    for x in xs:
        xr = x.clone().requires_grad_()
        out = ref(xr)
        outs = out if isinstance(out, tuple) else (out,)
        gs = [torch.randn(o.shape, generator=g) for o in outs]
        torch.autograd.backward(outs, gs)
        grads_out.append(gs[0] if len(gs) == 1 else tuple(gs))
        want_in.append(xr.grad)
    phase("F")
    for mb, x in enumerate(xs):
        stage.forward(mb, x.clone().requires_grad_())
    phase("B")
    got_in = [stage.backward_input(mb, grads_out[mb])[0] for mb in range(len(xs))]
    phase("W")
    for mbs in [list(range(len(xs)))] if w_together else [[mb] for mb in range(len(xs))]:
        stage.backward_weight(mbs)
    assert stage.in_flight == ()
    for mb, (got, want) in enumerate(zip(got_in, want_in, strict=True)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=f"input grad, micro-batch {mb}")
    for (n, p), q in zip(module.named_parameters(), ref.parameters(), strict=True):
        if q.grad is None:
            assert p.grad is None or not p.grad.any(), n
            continue
        assert p.grad is not None, n
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=n)
    return stage


# ------------------------------------------------------------------------------ the shapes, reduced
class SharedProjection(nn.Module):
    """DeBERTa-v2's ``share_att_key``: one Linear applied to the input and to a weight-only table."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.rel = nn.Parameter(torch.randn(6, 8))

    def forward(self, x):  # (B, T, 8) -> (B, T, 6)
        return self.proj(x) @ self.proj(self.rel).t()


class ScaleAlsoReturned(nn.Module):
    """A scale used twice on the input path and also in an output that reaches no input; the ``pow``
    (no formula) keeps B's graph for W, so nothing fails loudly."""

    def __init__(self) -> None:
        super().__init__()
        self.s = nn.Parameter(torch.randn(8))
        self.p = nn.Parameter(torch.rand(8) + 0.5)

    def forward(self, x):
        return torch.pow(x.abs() + 1, self.p) + x * self.s + self.s, self.s * 2


class NoFormula(nn.Module):
    """A parameter an op without a formula (``pow``) takes directly and a weight-only ``exp`` feeds
    too: W cannot take that op's share alone, so the micro-batch's weights are all taken in B."""

    def __init__(self) -> None:
        super().__init__()
        self.s = nn.Parameter(torch.rand(8) + 0.5)

    def forward(self, x):
        return torch.pow(x.abs() + 1, self.s) + x * self.s.exp()


class RegionAlsoReturned(nn.Module):
    """A weight-only node (``exp(a)``) shared by the input path and an output that reaches no input: W
    ran that output's backward and then pushed the input path's share through the same node, whose saved
    tensors the first call had freed ("backward through the graph a second time")."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.randn(8))
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        e = self.a.exp()
        return self.lin(x) * e, e * 3


class _Reversible(torch.autograd.Function):
    """Reformer's shape, reduced: the layer runs without a graph in F, and the backward recomputes it
    and runs its own backward, filling the layer's ``.grad`` itself (``layer`` is no tensor: no edge)."""

    @staticmethod
    def forward(ctx, x, layer):
        ctx.layer = layer
        ctx.save_for_backward(x)
        with torch.no_grad():
            return layer(x)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        with torch.enable_grad():
            x = x.detach().requires_grad_()
            torch.autograd.backward(ctx.layer(x), grad)
        return x.grad, None


class Reversible(nn.Module):
    """A two-layer MLP inside the custom Function, a Linear head outside it (deferred as usual)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8))
        self.head = nn.Linear(8, 4)

    def forward(self, x):  # (B, T, 8) -> (B, T, 4)
        return self.head(_Reversible.apply(x, self.inner))


def _inputs(*shape: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(b, *shape, generator=g) for b in SIZES]


class Whole(nn.Module):
    """``module`` in one non-reentrant checkpoint."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.inner = module

    def forward(self, x):
        return checkpoint(self.inner, x, use_reentrant=False)


@pytest.mark.parametrize("how", [None, "full", "selective", "torch"])
def test_a_bias_shared_with_a_weight_only_product_counts_once(how):
    """Fails without engine/stage.py's ``_fed_by_weights``: the bias 40% off (None), torch's "unpack
    ... already unpacked once" when checkpointed."""
    torch.manual_seed(0)
    module: nn.Module = SharedProjection()
    ref = copy.deepcopy(module)
    if how == "torch":
        module = Whole(module)
    elif how is not None:
        module.forward = _checkpointed(module, how == "selective")  # type: ignore[method-assign]
    stage = _split_vs_fused(module, _inputs(5, 8), ref=ref)
    # checkpointed: the weight-only product's region is taken in B (the bias and weight GEMMs still in W)
    assert stage.deferred_fraction == (1.0 if how is None else 2 / 3)


@pytest.mark.parametrize("w_together", [False, True])
def test_a_scale_also_returned_by_a_weight_only_output_counts_once(w_together):
    torch.manual_seed(0)
    stage = _split_vs_fused(ScaleAlsoReturned(), _inputs(3, 8), w_together)
    assert stage.deferred_fraction == 1.0


@pytest.mark.parametrize("checkpointed", [False, True])
def test_a_weight_only_node_shared_with_an_output_that_reaches_no_input_is_taken_in_b(checkpointed):
    """Fails without ``_sources``' weight roots: a crash in W."""
    torch.manual_seed(0)
    module: nn.Module = RegionAlsoReturned()
    ref = copy.deepcopy(module)
    with pytest.warns(RuntimeWarning, match="all taken in B, none deferred to W") as caught:
        stage = _split_vs_fused(Whole(module) if checkpointed else module, _inputs(3, 8), ref=ref)
    assert stage.deferred_fraction == 0.0  # the documented fallback: a weight-only node shared
    assert sum("all taken in B" in str(w.message) for w in caught) == 1, "announced once per stage"


def test_a_mixed_parameter_without_a_formula_is_taken_in_b_exactly():
    torch.manual_seed(0)
    with pytest.warns(RuntimeWarning, match="meets an op without a W formula"):
        stage = _split_vs_fused(NoFormula(), _inputs(3, 8))
    assert stage.deferred_fraction == 0.0  # the documented fallback, announced


def test_weights_a_custom_function_fills_in_b_are_announced_and_counted():
    """Fails without stage.py's ``_Hidden``: ``deferred_fraction`` said 1.0 and nothing was said, while
    the inner layer's weight backward ran in B."""
    torch.manual_seed(0)
    with pytest.warns(RuntimeWarning, match=r"4 parameter\(s\) \(inner.0.weight first\).*inside a node"):
        stage = _split_vs_fused(Reversible(), _inputs(3, 8))
    assert stage.deferred_fraction == 1 / 3  # per micro-batch: head's 2 edges in W, inner's 4 parameters in B


# ------------------------------------------------------------------------------ Hugging Face blocks
class Embeds(nn.Module):
    """A tiny Hugging Face model from its embeddings (or pixels, or audio) to its last hidden state."""

    def __init__(self, model: nn.Module, key: str) -> None:
        super().__init__()
        self.model = model
        self.key = key

    def forward(self, x):
        return self.model(**{self.key: x}).last_hidden_state


def _hf(name: str) -> tuple[nn.Module, list[nn.Module], tuple[int, ...]]:
    """(the stage module, its blocks, one sample's shape): 2 layers, width 32 or less, no dropout."""
    tf = pytest.importorskip("transformers", reason="the Hugging Face blocks need transformers")
    if int(tf.__version__.split(".")[0]) < 5:  # 4.46: T5 writes into its input in place, DeBERTa-v2 falls back
        pytest.skip("these blocks' expectations are transformers 5.x's code (4.x's models differ in these blocks)")
    dec = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=64)
    if name == "deberta-v2":  # relative position buckets, share_att_key (the double count above)
        cfg = tf.DebertaV2Config(
            **dec, max_position_embeddings=32, relative_attention=True, position_buckets=8,
            max_relative_positions=16, pos_att_type=["p2c", "c2p"], share_att_key=True, norm_rel_ebd="layer_norm",
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        )  # fmt: skip
        model, key, shape = tf.DebertaV2Model(cfg), "inputs_embeds", (8, 32)
    elif name == "mistral":  # grouped-query attention, rotary, a sliding window
        model = tf.MistralModel(tf.MistralConfig(**dec, num_key_value_heads=2, sliding_window=4))
        key, shape = "inputs_embeds", (8, 32)
    elif name == "t5-encoder":  # relative position buckets, RMS norm, gated GELU
        cfg = tf.T5Config(
            d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, vocab_size=64, relative_attention_num_buckets=8,
            feed_forward_proj="gated-gelu", dropout_rate=0.0,
        )  # fmt: skip
        model, key, shape = tf.T5EncoderModel(cfg), "inputs_embeds", (8, 32)
    elif name == "wav2vec2":  # a conv feature encoder with GroupNorm, a weight-normed positional conv
        cfg = tf.Wav2Vec2Config(
            **{k: v for k, v in dec.items() if k != "vocab_size"}, conv_dim=(8, 8), conv_stride=(5, 2),
            conv_kernel=(10, 3), feat_extract_norm="group", num_conv_pos_embeddings=4,
            num_conv_pos_embedding_groups=2, apply_spec_augment=False, hidden_dropout=0.0, activation_dropout=0.0,
            attention_dropout=0.0, feat_proj_dropout=0.0, layerdrop=0.0,
        )  # fmt: skip
        model, key, shape = tf.Wav2Vec2Model(cfg), "input_values", (200,)
        model.feature_extractor._requires_grad = False  # it would set requires_grad on our non-leaf input
    elif name == "convnext":  # depthwise convolutions, channels-last LayerNorm, LayerScale
        cfg = tf.ConvNextConfig(hidden_sizes=[8, 16], depths=[1, 1], num_stages=2, layer_scale_init_value=0.1)
        model, key, shape = tf.ConvNextModel(cfg), "pixel_values", (3, 32, 32)
    else:  # mamba: the slow torch path (a selective scan in a Python loop), -exp(A_log)
        cfg = tf.MambaConfig(hidden_size=32, state_size=4, num_hidden_layers=2, vocab_size=64, use_mambapy=False)
        model, key, shape = tf.MambaModel(cfg), "inputs_embeds", (8, 32)
    model.config.use_cache = False
    model.train()
    blocks = list(model.encoder.stages) if name == "convnext" else _top_level_layers(model, tf)
    return Embeds(model, key), blocks, shape


def _top_level_layers(model: nn.Module, tf) -> list[nn.Module]:
    layer = getattr(getattr(tf, "modeling_layers", None), "GradientCheckpointingLayer", None)
    if layer is None:  # transformers 4.x: the stack of identical blocks that holds the most weights
        stacks = [ml for ml in model.modules() if isinstance(ml, nn.ModuleList) and identical_blocks(ml)]
        return list(max(stacks, key=lambda ml: sum(q.numel() for q in ml.parameters())))
    found: list[nn.Module] = []
    for m in model.modules():
        if isinstance(m, layer) and not any(m in set(f.modules()) for f in found):
            found.append(m)
    return found


class Calls:
    """Each submodule's calls inside the blocks, by phase. A recompute calls them again (torch stops it
    early once it has what the backward needs: the last ones may be left out), so the block's forwards in
    a phase are the most any submodule made, per forward without checkpointing."""

    def __init__(self, blocks: list[nn.Module]) -> None:
        self.phase = "plain"
        self.counts: dict[str, dict[nn.Module, int]] = {}
        for b in blocks:
            for m in b.modules():
                if m is not b:
                    m.register_forward_pre_hook(self._hit)

    def _hit(self, module: nn.Module, *_: object) -> None:
        mine = self.counts.setdefault(self.phase, {})
        mine[module] = mine.get(module, 0) + 1

    def forwards(self, micro_batches: int) -> dict[str, float]:
        plain = self.counts.pop("plain")
        return {
            phase: max(n / (plain[m] * micro_batches) for m, n in mine.items()) for phase, mine in self.counts.items()
        }


HF_CASES = ["deberta-v2", "mistral", "t5-encoder", "wav2vec2", "convnext", "mamba"]


@pytest.mark.parametrize("how", [None, "selective"])
@pytest.mark.parametrize("name", HF_CASES)
def test_hugging_face_blocks_split_exactly_and_recompute_once(name, how):
    """Plain: every weight gradient deferred to W. Checkpointed ("selective": its policy and the full
    recompute both run): a block's forward once in F, once in B, none in W; a few weight-only regions
    and nodes inside a block are taken in B (documented), most of the weight work still deferred."""
    torch.manual_seed(0)
    module, blocks, shape = _hf(name)
    xs = _inputs(*shape)
    ref = copy.deepcopy(module)  # the truth: no checkpointing
    calls = Calls(blocks)
    with torch.no_grad():
        module(xs[0])
    for b in blocks if how else ():
        b.forward = _checkpointed(b, selective=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # the slow-path warning fails the case
        stage = _split_vs_fused(module, xs, ref=ref, phase=functools.partial(setattr, calls, "phase"))
    forwards = calls.forwards(len(xs))
    assert forwards == ({"F": 1.0, "B": 1.0} if how else {"F": 1.0}), forwards
    if how is None:
        assert stage.deferred_fraction == 1.0
    else:
        assert 0.85 < stage.deferred_fraction <= 1.0, stage.deferred_fraction


def test_reformer_reversible_layers_are_announced_as_taken_in_b():
    """Reformer's reversible layers fill their weights' ``.grad`` inside its custom backward, in B."""
    tf = pytest.importorskip("transformers", reason="the Hugging Face blocks need transformers")
    cfg = tf.ReformerConfig(
        hidden_size=32, feed_forward_size=64, num_attention_heads=2, attention_head_size=16,
        attn_layers=["local", "local"], local_attn_chunk_length=4, axial_pos_embds=False,
        max_position_embeddings=32, vocab_size=64, is_decoder=False, hidden_dropout_prob=0.0,
        local_attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    module = Embeds(tf.ReformerModel(cfg), "inputs_embeds")
    with pytest.warns(RuntimeWarning, match="inside a node"):
        stage = _split_vs_fused(module, _inputs(8, 32))
    assert stage.deferred_fraction < 0.2, stage.deferred_fraction  # the layers' weights: 24 of 27 edges in B
