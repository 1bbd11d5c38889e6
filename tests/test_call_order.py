"""Where the modules outside a ModuleList's blocks go (lightning/call_order.py): the side of the loop a meta copy of
the model calls them on, for Hugging Face models that register them elsewhere (OPT, DeBERTa-v2) and for the cases
that must not move a module (a metadata read, tied weights, a call between blocks); the original model untouched;
and a run whose data the trace must leave as one process reads it."""

from __future__ import annotations

import random
import warnings

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset, TensorDataset

from lightning_twobp import TwoBPStrategy
from lightning_twobp.lightning import call_order
from lightning_twobp.lightning.contract import find_contract
from lightning_twobp.processes import free_port, rank_env, run_distributed

from conftest import lightning_env, quiet_trainer

transformers = pytest.importorskip("transformers", reason="the Hugging Face models need transformers")


def _sides(lm: nn.Module, layers: str, *args, **kwargs) -> dict[str, str]:
    """The traced side of each outside module when ``lm.model(*args, **kwargs)`` runs (the step's call)."""
    contract = find_contract(lm, layers)
    meta = [a.to("meta") if isinstance(a, torch.Tensor) else a for a in args]
    kw = {k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    return call_order.call_sides(call_order._meta_copy(lm.model), "model", contract, tuple(meta), kw)


class Holder(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model


def test_opt_and_deberta_are_traced_where_their_forward_calls_them():
    opt = transformers.OPTForCausalLM(
        transformers.OPTConfig(
            vocab_size=32, num_hidden_layers=2, num_attention_heads=2, hidden_size=8, ffn_dim=16,
            word_embed_proj_dim=8, max_position_embeddings=16, dropout=0.0,
        )
    )  # fmt: skip
    ids = torch.randint(2, 32, (2, 6))
    sides = _sides(Holder(opt), "model.model.decoder.layers", input_ids=ids)
    # registered before the layers and called after them (the error OPT met at its first step); the head is tied to
    # the embedding, and each is placed by its own call
    assert sides["model.model.decoder.final_layer_norm"] == "after"
    assert sides["model.model.decoder.embed_tokens"] == "before" and sides["model.lm_head"] == "after"
    config = transformers.DebertaV2Config(
        vocab_size=32, hidden_size=8, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
        max_position_embeddings=16, relative_attention=True, position_buckets=4, max_relative_positions=16,
        pos_att_type=["p2c", "c2p"], norm_rel_ebd="layer_norm", pad_token_id=0,
    )  # fmt: skip
    deberta = transformers.DebertaV2ForMaskedLM(config)
    sides = _sides(Holder(deberta), "model.deberta.encoder.layer", input_ids=ids)
    # both registered after the layer list; the relative embeddings are read by weight, not called
    assert sides["model.deberta.encoder.rel_embeddings"] == "before"
    assert sides["model.deberta.encoder.LayerNorm"] == "before"


def test_a_mixture_of_experts_whose_meta_kernel_takes_bf16_only_is_traced_in_bf16():
    """torch's grouped matmul on meta takes bf16 only, as on a GPU: an fp32 Jamba's trace failed there and fell back
    to registration order (its modules are registered in call order, so nothing showed); it is traced again in bf16."""
    config = transformers.JambaConfig(
        vocab_size=32, num_hidden_layers=2, num_attention_heads=2, hidden_size=16, intermediate_size=16,
        num_key_value_heads=2, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1,
        num_experts=2, num_experts_per_tok=1, mamba_d_state=4, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=4,
        use_cache=False,
    )  # fmt: skip
    model = Holder(transformers.JambaForCausalLM(config))
    contract = find_contract(model, "model.model.layers")
    ids = torch.randint(0, 32, (2, 6))
    sides, why = call_order.sides_on_meta(
        contract, model.model, "model", [ids], lambda ts: ((), {"input_ids": ts[0]}), training=True
    )
    assert why is None and sides == {
        "model.model.embed_tokens": "before",
        "model.model.final_layernorm": "after",
        "model.lm_head": "after",
    }
    assert all(q.dtype == torch.float32 and not q.is_meta for q in model.parameters())


class Loop(nn.Module):
    """A loop whose ``kind`` of outside use the trace must not take for a call on the other side."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.norm = nn.LayerNorm(4)  # registered before the blocks, called after them
        self.embed = nn.Embedding(10, 4)
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))
        self.head = nn.Linear(4, 10)
        if kind == "tied":
            self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids).to(self.norm.weight.dtype)  # a read of its dtype: no use of its values
        for i, block in enumerate(self.blocks):
            h = block(h)
            if self.kind == "inside" and i == 0:
                h = self.norm(h)
        if self.kind == "weight":
            return h @ self.embed.weight.T  # the embedding's weight used after the loop by no module (norm unused)
        return self.head(self.norm(h))


@pytest.mark.parametrize(
    "kind, norm, embed, head",
    [("", "after", "before", "after"), ("tied", "after", "before", "after"), ("inside", "inside", "before", "after")]
    + [("weight", None, "both", None)],
)
def test_a_metadata_read_a_tied_weight_and_a_call_between_blocks_are_told_apart(kind, norm, embed, head):
    model = Holder(Loop(kind))
    sides = _sides(model, "model.blocks", torch.randint(0, 10, (2, 3)))
    assert (sides.get("model.norm"), sides.get("model.embed"), sides.get("model.head")) == (norm, embed, head)


def test_a_weight_read_outside_its_modules_calls_is_recorded_with_its_side():
    """A direct read (``h @ embed.weight.T``) is recorded as a read, with its side; a head tied as a module reads
    nothing outside a call (its use is its own call's); neither module's call counts as a read."""
    for kind, reads in [("weight", {(("model.embed", "model.embed.weight", (10, 4)),): {"after"}}), ("tied", {})]:
        model = Holder(Loop(kind))
        contract = find_contract(model, "model.blocks")
        found: call_order.Reads = {}
        ids = torch.randint(0, 10, (2, 3), device="meta")
        call_order.call_sides(call_order._meta_copy(model.model), "model", contract, (ids,), {}, found)
        assert found == reads, kind


def test_the_trace_leaves_the_model_as_it_was():
    model = Holder(Loop(""))
    seen: list[str] = []
    model.model.norm.register_forward_pre_hook(lambda *_: seen.append("norm"))
    model.eval()
    twin = call_order._meta_copy(model.model).train(True)
    assert _sides(model, "model.blocks", torch.randint(0, 10, (2, 3)))["model.norm"] == "after"
    assert not seen and not model.training and twin.training  # the user's hook did not run on the copy
    assert all(not q.is_meta for q in model.parameters()) and all(q.is_meta for q in twin.parameters())
    model.model(torch.randint(0, 10, (2, 3)))
    assert seen == ["norm"]


# ---------------------------------------------------------------------------------------------- the data
class Drawn(Dataset):
    """Samples drawn from Python's and NumPy's generators as they are read (augmentation in the main process)."""

    def __len__(self) -> int:
        return 32

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.tensor([random.random(), float(np.random.rand())] * 2, dtype=torch.float32)
        return x, x[:2] * 0.5


class Stream(IterableDataset):
    """A stream read once: a batch read before training would be gone from it."""

    def __init__(self) -> None:
        self.left = [torch.full((4,), float(k)) for k in range(32)]

    def __iter__(self):
        while self.left:
            x = self.left.pop(0)
            yield x, x[:2] * 0.5


class InOrder(nn.Module):
    """Registered as called: it trains whether the call order is traced or not (a stream is not read to trace)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 4)
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = torch.tanh(block(h))
        return self.head(h)


class Recorder(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = Holder(InOrder())
        self.seen: dict[int, set[float]] = {}  # global step -> the samples its calls read (every micro-batch's)

    def training_step(self, batch, batch_idx):
        x, y = batch
        if getattr(self.trainer.strategy, "_pipeline", True) is not None:  # not the trace's run before the cut
            self.seen.setdefault(self.trainer.global_step, set()).update(x[:, 0].tolist())
        return F.mse_loss(self.model.model(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _first_batches(rank: int | None, world: int, data: str) -> dict[int, list[float]]:
    """The samples each step read: one process (``rank`` None), or the pipeline's two stages on one rank (ZB-V),
    whose setup traces the call order first."""
    if rank is not None:
        lightning_env(rank, world)
    random.seed(0)
    np.random.seed(0)
    model = Recorder()
    strategy = "auto" if rank is None else TwoBPStrategy(schedule="zb-v", num_microbatches=2)
    loader = DataLoader(Drawn() if data == "drawn" else Stream(), batch_size=8)
    quiet_trainer(strategy, 1, max_steps=2).fit(model, loader)
    return {step: sorted(seen) for step, seen in model.seen.items()}


@pytest.mark.dist
@pytest.mark.timeout(240)
@pytest.mark.parametrize("data", ["drawn", "stream"])
def test_the_trace_leaves_the_data_as_one_process_reads_it(data):
    """Reading the first batch to trace on drew from Python's and NumPy's generators (the trace put back torch's
    alone) and took a stream's first batch, which training then missed: both silent."""
    ours = run_distributed(_first_batches, 1, data, timeout=200)[0]
    assert ours == _first_batches(None, 1, data)


# the two options that read the first batch before the cut to profile the layers
PROFILING = pytest.mark.parametrize(
    "options",
    [dict(schedule="zb-v", balance="time"), dict(schedule="auto", memory_limit="4x1f1b")],
    ids=["time", "auto"],
)


class Restarted(IterableDataset):
    """A stream that each ``iter()`` starts again, as PyTorch asks of an IterableDataset."""

    def __iter__(self):
        for k in range(32):
            x = torch.full((4,), float(k))
            yield x, x[:2] * 0.5


def _steps_read(options: dict | None, data: str) -> tuple[dict[int, list[float]], list[str]]:
    """The samples each step read from a stream and what was said of it: one process (``options`` None), or a
    one-rank pipeline with ``options``."""
    rank_env(0, 1, free_port())
    random.seed(0)
    np.random.seed(0)
    model = Recorder()
    strategy = "auto" if options is None else TwoBPStrategy(num_microbatches=2, **options)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        quiet_trainer(strategy, 1, max_steps=2).fit(
            model, DataLoader({"once": Stream, "restarted": Restarted}[data](), batch_size=8)
        )
    return {step: sorted(seen) for step, seen in model.seen.items()}, [
        str(w.message) for w in said if "IterableDataset" in str(w.message)
    ]


@pytest.mark.dist
@pytest.mark.timeout(240)
@PROFILING
def test_profiling_a_stream_reads_one_batch_ahead_and_says_when_it_was_lost(options, no_leftover_process_group):
    """balance="time" and schedule="auto" read the first batch before the cut. On a stream that iterates once they
    took its first two batches (the loop's early setup read one ahead, the profile another) and training started
    at its third, silently. Now the setup is not run early for a stream, and the one batch the profile reads is
    said when the first training batch is not it; a stream that iter() restarts trains as one process, nothing said."""
    restarted, said = _steps_read(options, "restarted")
    assert restarted == _steps_read(None, "restarted")[0] and not said, said
    once, said = _steps_read(options, "once")
    assert once[0][0] == 8.0, once  # the profile's batch, 0-7, and no more
    assert len(said) == 1 and "training has skipped that batch" in said[0], said


class TwoLoaders(Recorder):
    """A step that takes a dict of two loaders' batches, as Lightning combines them (``max_size_cycle``)."""

    def training_step(self, batch, batch_idx):
        (x, y), (u, v) = batch["a"], batch["b"]
        return super().training_step((torch.cat([x, u]), torch.cat([y, v])), batch_idx)


def _two_loaders(options: dict | None) -> dict[int, list[float]]:
    rank_env(0, 1, free_port())
    model = TwoLoaders()
    strategy = "auto" if options is None else TwoBPStrategy(num_microbatches=2, **options)
    x = torch.arange(64.0).repeat_interleave(4).reshape(64, 4)
    loaders = {k: DataLoader(TensorDataset(x[i::2], x[i::2, :2] * 0.5), batch_size=4) for i, k in enumerate("ab")}
    quiet_trainer(strategy, 1, max_steps=2).fit(model, loaders)
    return {step: sorted(seen) for step, seen in model.seen.items()}


@pytest.mark.dist
@pytest.mark.timeout(240)
@PROFILING
def test_a_step_over_several_loaders_is_profiled_on_the_batch_it_receives(options, no_leftover_process_group):
    """The profile read the first loader's batch alone (a tuple), and a step that takes the dict Lightning makes
    of several loaders failed before training; it reads them combined as the fit loop does, and trains as one
    process."""
    assert _two_loaders(options) == _two_loaders(None)


def _agree_on(rank: int, world: int) -> list:
    """``_agreed`` on ranks that traced the same order, then on ranks that did not (rank 1 saw the head first)."""
    from lightning_twobp.lightning.call_order import _agreed

    same = _agreed({"model.norm": "after", "lm_head": "after"}, None, {})
    differ = _agreed({"model.norm": "after", "lm_head": "after" if rank == 0 else "before"}, None, {})
    return [same, differ]


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_ranks_that_traced_different_call_orders_place_by_registration_alike():
    """Each rank traces its own first batch. Where the traces differ, no rank places by its own (the ranks would
    cut the model differently and deadlock): every rank gets none, and why, naming both orders."""
    for same, differ in run_distributed(_agree_on, 2, timeout=100):
        assert same == ({"model.norm": "after", "lm_head": "after"}, None, {})
        assert differ == (
            {},
            "the ranks traced different call orders (rank 0: {'model.norm': 'after', 'lm_head': 'after'}; "
            "rank 1: {'model.norm': 'after', 'lm_head': 'before'})",
            {},
        )


def test_a_long_reason_is_cut_at_a_sentences_end():
    """torch's meta-kernel errors run on for a paragraph: the reason the trace failed ends at a sentence, not
    mid-word (litgpt's Mixtral: "... please set 'torch.fx.experimental._con")."""
    reason = "The register_meta function for torch.nonzero() raises unimplemented by default. " * 5
    cut = call_order._first_line(NotImplementedError(reason))
    assert cut.endswith("by default.") and len(cut) <= 300, cut
    assert call_order._first_line(ValueError("x" * 400)) == "x" * 300 + "..."
    abbreviated = "Cannot trace the op (e.g. Nonzero) here. " + "More words follow. " * 20
    assert call_order._first_line(RuntimeError(abbreviated)).startswith("Cannot trace the op (e.g. Nonzero) here.")


def test_a_trace_stopped_after_the_blocks_places_the_parameters_used_before_them():
    """Hugging Face's CTC loss has no meta kernel: the trace stops after the blocks, the modules keep their
    registration places, and a parameter the model holds directly that was used before the first block (Wav2Vec2's
    masked_spec_embed) is placed there all the same, not said to be untraced; one also used later, or seen in no
    block's company, is not placed."""
    from lightning_twobp.lightning.call_order import _BLOCK, _before_blocks

    paths = {"model.a", "model.b", "model.c"}
    assert _before_blocks(["model.c", "model.a", _BLOCK, _BLOCK, "model.b"], paths) == {
        "model.a": "before",
        "model.c": "before",
    }
    assert _before_blocks(["model.a", _BLOCK, "model.a"], paths) == {}  # used inside or after too
    assert _before_blocks(["model.a"], paths) == {}  # stopped before any block
