"""Activation checkpointing through the Trainer on 2 ranks (issue 21): the strategy's option ("full" and
"selective"), the user's own ``torch.utils.checkpoint(use_reentrant=False)`` and Hugging Face's
``gradient_checkpointing_enable()``.
Each is exact against the same model without checkpointing, and a probe counts each block's forwards:
2 per micro-batch when checkpointed (F, and B's one recompute, whose operands W keeps), 1 when not."""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, TensorDataset

import lightning_twobp  # noqa: F401  (registers "twobp")
from lightning_twobp import TwoBPStrategy
from lightning_twobp.models.llama import Block, LlamaConfig

import conftest
from conftest import launch, lightning_env, quiet_trainer

pytestmark = [pytest.mark.dist, pytest.mark.timeout(900)]

STEPS, M, BATCH, DIM = 3, 4, 8, 32


# ---------------------------------------------------------------------------------------------- the probe
class Counted(nn.Module):
    """A tiny-LLaMa block and a PReLU (whose slope W would push through autograd: taken in B when
    checkpointed) that counts its forwards, recomputes included."""

    def __init__(self) -> None:
        super().__init__()
        self.block = Block(LlamaConfig(dim=DIM, n_heads=4, max_seq_len=16))
        self.act = nn.PReLU()
        self.calls = 0

    def forward(self, x):  # (B, T, C)
        self.calls += 1
        return self.act(self.block(x))


class OwnCheckpoint(nn.Module):
    """The user's own non-reentrant checkpoint inside a block."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = Counted()

    @property
    def calls(self) -> int:
        return self.inner.calls

    def forward(self, x):
        return checkpoint(self.inner, x, use_reentrant=False)


class Blocks(pl.LightningModule):
    """Four probe blocks in one nn.Sequential; an MSE loss; SGD."""

    def __init__(self, own_checkpoint: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.Sequential(*(OwnCheckpoint() if own_checkpoint else Counted() for _ in range(4)))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.layers(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def _block_data() -> DataLoader:
    g = torch.Generator().manual_seed(1)
    return DataLoader(
        TensorDataset(torch.randn(STEPS * BATCH, 7, DIM, generator=g), torch.randn(STEPS * BATCH, 7, DIM, generator=g)),
        batch_size=BATCH,
    )


def _own(model: nn.Module) -> dict:
    return {n: q.detach().clone() for n, q in model.named_parameters() if not q.is_meta}


def _fit_blocks(rank: int, world: int, schedule: str, how: str) -> dict:
    """``how``: "off" (no checkpointing), "option" (activation_checkpointing="full"), "selective" (the
    option's "selective"), "own" (the blocks' own torch.utils.checkpoint). Returns this rank's weights and
    forwards per local block per micro-batch."""
    lightning_env(rank, world)
    model = Blocks(own_checkpoint=how == "own")
    ac = _OPTION.get(how)
    strategy = TwoBPStrategy(schedule=schedule, num_microbatches=M, activation_checkpointing=ac)
    quiet_trainer(strategy, world, max_steps=STEPS, num_sanity_val_steps=0).fit(model, _block_data())
    params = {n.replace(".inner.", "."): v for n, v in _own(model).items()}  # the same names each way
    local = [i for i in range(4) if any(n.startswith(f"layers.{i}.") for n in params)]
    return {"params": params, "forwards": {i: model.layers[i].calls / (STEPS * M) for i in local}}


_OPTION = {"option": "full", "selective": "selective"}  # the strategy's activation_checkpointing per way
WAYS = ("option", "selective", "own")


def _fit_blocks_each_way(rank: int, world: int, schedule: str) -> dict:
    return {how: _fit_blocks(rank, world, schedule, how) for how in ("off", *WAYS)}


SCHEDULES = ["1f1b", "zb-h1", "zb-v"]  # 1F1B with the split (2BP), ZB-H1, ZB-V (2 stages per rank)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_checkpointed_blocks_train_as_without_and_recompute_once(two_ranks, request, schedule):
    ways = two_ranks[request.node.name]
    off = [w["off"] for w in ways]
    reference = {n: v for out in off for n, v in out["params"].items()}
    plain = {i: f for out in off for i, f in out["forwards"].items()}
    # one F per micro-batch; the first stage also runs its blocks once per fit to learn the shapes it sends
    assert all(f in (1.0, 1.0 + 1 / (STEPS * M)) for f in plain.values()), plain
    for how in WAYS:  # "selective" counts the block's forwards: its recompute serves the products from F's store
        results = [w[how] for w in ways]
        held = {n: v for out in results for n, v in out["params"].items()}
        assert set(held) == set(reference), how
        for n, value in held.items():
            torch.testing.assert_close(value, reference[n], rtol=1e-6, atol=1e-7, msg=f"{how}: {n}")
        forwards = {i: f for out in results for i, f in out["forwards"].items()}
        recomputes = {i: round(f - plain[i], 9) for i, f in forwards.items()}
        assert recomputes == {i: 1.0 for i in range(4)}, f"{how}: recomputes per block per micro-batch {recomputes}"


# ---------------------------------------------------------------------------------------------- Hugging Face
VOCAB, SEQ = 13, 8


def _hf(name: str) -> nn.Module:
    transformers = pytest.importorskip("transformers", reason="the Hugging Face models need transformers")
    if name == "gpt2":
        cfg = transformers.GPT2Config(
            n_layer=4, n_embd=DIM, n_head=2, vocab_size=VOCAB, n_positions=SEQ, bos_token_id=0, eos_token_id=0,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        )  # fmt: skip
        return transformers.GPT2LMHeadModel(cfg)
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=DIM, intermediate_size=2 * DIM, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=SEQ, bos_token_id=0, eos_token_id=0, pad_token_id=None,
        use_cache=False,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(cfg)


def _hf_blocks(model: nn.Module) -> nn.ModuleList:
    return model.transformer.h if hasattr(model, "transformer") else model.model.layers


class HFLM(pl.LightningModule):
    """A Hugging Face causal LM, optionally with its own gradient checkpointing on; counts each block's
    MLP calls (inside the checkpointed forward, so recomputes count too)."""

    def __init__(self, name: str, checkpointed: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = _hf(name)
        if checkpointed:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # transformers 5 calls it a deprecated alias
                self.model.gradient_checkpointing_enable()  # transformers' default kwargs for its version
        self.calls = [0] * 4
        for i, block in enumerate(_hf_blocks(self.model)):
            block.mlp.register_forward_pre_hook(lambda *_, i=i: self.calls.__setitem__(i, self.calls[i] + 1))

    def training_step(self, batch, batch_idx):
        ids, targets = batch
        logits = self.model(input_ids=ids).logits
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def _tokens() -> DataLoader:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (STEPS * BATCH, SEQ), generator=g)
    return DataLoader(TensorDataset(ids, (ids + 1) % VOCAB), batch_size=BATCH)


def _hf_reference(name: str) -> dict:
    """One process, no checkpointing, the pipeline's micro-batches accumulated."""
    model = HFLM(name, checkpointed=False)
    data = DataLoader(_tokens().dataset, batch_size=BATCH // M)
    quiet_trainer("auto", 1, max_steps=STEPS, accumulate_grad_batches=M, num_sanity_val_steps=0).fit(model, data)
    return _own(model)


def _fit_hf(rank: int, world: int, name: str, schedule: str, how: str) -> dict:
    """``how``: "hf" (the model's own gradient_checkpointing_enable()), "option" or "selective" (the
    strategy's "full" or "selective")."""
    lightning_env(rank, world)
    model = HFLM(name, checkpointed=how == "hf")
    ac = _OPTION.get(how)
    strategy = TwoBPStrategy(
        schedule=schedule, num_microbatches=M, gather_full_model=False, activation_checkpointing=ac
    )
    quiet_trainer(strategy, world, max_steps=STEPS, num_sanity_val_steps=0).fit(model, _tokens())
    switched = [n for n, m in model.named_modules() if getattr(m, "gradient_checkpointing", False)]
    params = _own(model)
    prefix = "model.transformer.h" if name == "gpt2" else "model.model.layers"
    local = [i for i in range(4) if any(n.startswith(f"{prefix}.{i}.") for n in params)]
    return {"params": params, "forwards": {i: model.calls[i] / (STEPS * M) for i in local}, "switched": switched}


HF_CASES = {
    "gpt2-1f1b": ("gpt2", "1f1b", "hf"),
    "llama-zb-h1": ("llama", "zb-h1", "hf"),
    # the strategy's option on the ModuleList contract's blocks (the modules the model's loop calls)
    "llama-zb-v-option": ("llama", "zb-v", "option"),
    "gpt2-1f1b-selective": ("gpt2", "1f1b", "selective"),  # Conv1D's addmm kept
    "llama-zb-v-selective": ("llama", "zb-v", "selective"),  # attention's SDPA kernel kept
}


@pytest.mark.parametrize("case", list(HF_CASES))
def test_hugging_face_gradient_checkpointing_is_exact_and_recomputes_once(
    two_ranks, request, case, no_leftover_process_group
):
    name, _, how = HF_CASES[case]
    results = two_ranks[request.node.name]  # a hang would end the launch at its timeout, failing here
    reference = _hf_reference(name)
    held = {n: v for out in results for n, v in out["params"].items()}
    assert set(held) == set(reference)
    for n, value in held.items():
        torch.testing.assert_close(value, reference[n], rtol=1e-5, atol=1e-6, msg=n)
    forwards = {i: f for out in results for i, f in out["forwards"].items()}
    # F and B's one recompute; the first stage also runs its blocks once per fit to learn the shapes it sends,
    # and under a V a later stage of the same rank runs the meta twin of a block it skips once, for its hooks
    # (this probe is one: a hook collecting values for the loss is refused there, test_modulelist.py)
    extra = {i: round(f - 2.0, 9) for i, f in forwards.items()}
    allowed = {0.0, round(1 / (STEPS * M), 9), round(2 / (STEPS * M), 9)}
    assert set(extra) == set(range(4)) and set(extra.values()) <= allowed, forwards
    if how == "hf":
        assert all(out["switched"] for out in results), "the model's own switch was not put back after fit"


class TimmLike(nn.Module):
    """timm's switch: ``set_grad_checkpointing()`` sets ``grad_checkpointing`` on the model, whose forward then
    checkpoints each block of its Sequential itself (timm's ``checkpoint_seq``); counts each block's calls (of its
    first layer: a recompute reruns the block's forward, not its hooks)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.stem, self.head = nn.Linear(8, 16), nn.Linear(16, 8)
        self.blocks = nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16), nn.Tanh()) for _ in range(4)])
        self.grad_checkpointing = False
        self.calls = [0] * 4
        for i, block in enumerate(self.blocks):
            block[0].register_forward_pre_hook(lambda *_, i=i: self.calls.__setitem__(i, self.calls[i] + 1))

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        self.grad_checkpointing = enable

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        if self.grad_checkpointing:
            for block in self.blocks:
                x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
        else:
            x = self.blocks(x)
        return self.head(x)


class TimmLM(pl.LightningModule):
    def __init__(self, checkpointed: bool) -> None:
        super().__init__()
        self.model = TimmLike()
        self.model.set_grad_checkpointing(checkpointed)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.model(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def _vectors() -> DataLoader:
    g = torch.Generator().manual_seed(4)
    return DataLoader(
        TensorDataset(torch.randn(STEPS * BATCH, 8, generator=g), torch.randn(STEPS * BATCH, 8, generator=g)),
        batch_size=BATCH,
    )


def _state(model: nn.Module) -> dict:
    return {n: t.detach().clone() for n, t in model.state_dict().items() if not t.is_meta}


def _fit_timm(rank: int, world: int, schedule: str) -> dict:
    lightning_env(rank, world)
    model = TimmLM(checkpointed=True)
    strategy = TwoBPStrategy(schedule=schedule, num_microbatches=M, layers="model.blocks")
    quiet_trainer(strategy, world, max_steps=STEPS, num_sanity_val_steps=0).fit(model, _vectors())
    state = _state(model)
    local = [i for i in range(4) if f"model.blocks.{i}.0.weight" in state]
    forwards = {i: model.model.calls[i] / (STEPS * M) for i in local}
    return {"state": state, "forwards": forwards, "switched": model.model.grad_checkpointing}


TIMM_SCHEDULES = ["1f1b", "zb-v"]


@pytest.mark.parametrize("schedule", TIMM_SCHEDULES)
def test_timms_own_gradient_checkpointing_is_taken_over(two_ranks, request, schedule, no_leftover_process_group):
    """A timm model's forward checkpoints each block itself under its switch: the recompute re-entered the
    pipeline's block call in B and failed (ElsewhereWrite). The switch is taken over as Hugging Face's is: the
    blocks run checkpointed inside the pipeline's call and recompute once; every parameter equals one process
    without checkpointing; the switch is back on after fit."""
    results = two_ranks[request.node.name]
    model = TimmLM(checkpointed=False)
    data = DataLoader(_vectors().dataset, batch_size=BATCH // M)
    quiet_trainer("auto", 1, max_steps=STEPS, accumulate_grad_batches=M, num_sanity_val_steps=0).fit(model, data)
    reference = _state(model)
    held = {n: v for out in results for n, v in out["state"].items()}
    assert set(held) == set(reference)
    assert all(torch.equal(v, reference[n]) for n, v in held.items()), [
        n for n, v in held.items() if not torch.equal(v, reference[n])
    ]
    forwards = {i: f for out in results for i, f in out["forwards"].items()}
    extra = {i: round(f - 2.0, 9) for i, f in forwards.items()}  # F and B's one recompute, as above
    assert set(extra) == set(range(4)) and set(extra.values()) <= {
        0.0,
        round(1 / (STEPS * M), 9),
        round(2 / (STEPS * M), 9),
    }, forwards
    assert all(out["switched"] for out in results), "timm's switch was not put back after fit"


def test_auto_checkpointing_with_timms_switch_on_is_refused():
    from lightning_twobp.lightning.checkpointing import check_auto_with_switches

    model = TimmLike()
    check_auto_with_switches(model)  # off: nothing to say
    model.set_grad_checkpointing(True)
    with pytest.raises(ValueError, match=r"timm's gradient checkpointing is on .*set_grad_checkpointing\(False\)"):
        check_auto_with_switches(model)


@pytest.fixture(scope="module")
def two_ranks(request) -> conftest.Launch:
    """Every case of this module in one launch of 2 ranks."""
    cases = {
        f"test_checkpointed_blocks_train_as_without_and_recompute_once[{s}]": (_fit_blocks_each_way, (s,))
        for s in SCHEDULES
    }
    cases |= {
        f"test_hugging_face_gradient_checkpointing_is_exact_and_recomputes_once[{k}]": (_fit_hf, args)
        for k, args in HF_CASES.items()
    }
    cases |= {f"test_timms_own_gradient_checkpointing_is_taken_over[{s}]": (_fit_timm, (s,)) for s in TIMM_SCHEDULES}
    return launch(request, 2, cases, timeout=840)


def _checkpointed_like_one_process(ref: nn.Module, mode: str, shape: tuple[int, ...]) -> None:
    """Two micro-batches through ``ref``'s copies, checkpointed in ``mode``, split (B then W) and fused:
    every buffer and every parameter's gradient equal to ``ref`` run plainly on the same inputs."""
    import copy

    from lightning_twobp.engine import Stage
    from lightning_twobp.lightning.checkpointing import apply_activation_checkpointing

    split, fused = copy.deepcopy(ref), copy.deepcopy(ref)
    undo = apply_activation_checkpointing([(0, split), (1, fused)], mode)
    stages = {"split": Stage(split), "fused": Stage(fused)}
    for mb in range(2):
        x = torch.randn(shape)
        out = ref(x.clone().requires_grad_())
        g = torch.randn_like(out)
        out.backward(g)
        for name, st in stages.items():
            st.forward(mb, x.clone().requires_grad_())
            if name == "split":
                st.backward_input(mb, g)
                st.backward_weight(mb)
            else:
                st.backward(mb, g)
    undo()
    for name, mod in (("split", split), ("fused", fused)):
        for (n, b), r in zip(mod.named_buffers(), ref.buffers(), strict=True):
            torch.testing.assert_close(b, r, rtol=1e-5, atol=1e-6, msg=f"{name} {n}")
        for (n, q), r in zip(mod.named_parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(q.grad, r.grad, rtol=1e-5, atol=1e-6, msg=f"{name} {n}")


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_a_checkpointed_batch_norm_counts_each_micro_batch_once(mode):
    """torch's checkpoint runs the block's forward again in B; the BatchNorms' running statistics must
    still count each micro-batch once (as without checkpointing), under the split and fused alike."""
    from lightning_twobp.models.resnet import Bottleneck

    torch.manual_seed(0)
    ref = Bottleneck(16, 4, stride=2)
    ref.bn1.momentum = None  # a cumulative average: divides by the batch count, the spare one included
    _checkpointed_like_one_process(ref, mode, (2, 16, 8, 8))


class _RunningScale(nn.Module):
    """Divides by a running mean of its input's size, updated in its training forward (as an EMA codebook
    or an observation normaliser is): its output reads the buffer its forward writes."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.scale.mul_(0.5).add_(0.5 * x.detach().abs().mean())
        return x / self.scale


class _BufferReader(nn.Module):
    def __init__(self, norm: str) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        if norm == "spectral":
            # close top singular values: the power iteration moves u far on each call, F's or a recompute's
            with torch.no_grad():
                q1, _ = torch.linalg.qr(torch.randn(8, 8))
                q2, _ = torch.linalg.qr(torch.randn(8, 8))
                self.a.weight.copy_(q1 @ torch.diag(torch.tensor([1.0, 0.97, 0.5, 0.4, 0.3, 0.2, 0.1, 0.05])) @ q2)
            self.a = nn.utils.parametrizations.spectral_norm(self.a)
        self.n = _RunningScale() if norm == "running-scale" else nn.Identity()
        self.b = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.b(torch.tanh(self.n(self.a(x))))


@pytest.mark.parametrize("mode", ["full", "selective"])
@pytest.mark.parametrize("norm", ["running-scale", "spectral"])
def test_a_checkpointed_block_recomputes_with_its_buffers_as_f_saw_them(norm, mode):
    """A module whose training forward writes a buffer its output reads (a running scale; spectral norm's
    power iteration): B's recompute must see the buffer as F did, or it computes another output and
    every gradient below it is wrong (the running scale: 2.0 off in a weight's gradient)."""
    torch.manual_seed(0)
    _checkpointed_like_one_process(_BufferReader(norm), mode, (4, 8))


class _OwnGenerator(nn.Module):
    """A block drawing its mask from a generator of its own (torchtune's LayerDropout keeps one per layer)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.generator = torch.Generator().manual_seed(3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.a(x) * (torch.rand(x.shape, generator=self.generator) > 0.5)


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_a_checkpointed_block_recomputes_with_its_own_generator_as_f_drew(mode):
    """torch's checkpoint forks the global generators only: a block's own generator drew another mask in the
    recompute than in F, and the gradients were silently wrong (same shapes). The recompute draws from F's state,
    and leaves the generator where F left it."""
    torch.manual_seed(0)
    _checkpointed_like_one_process(_OwnGenerator(), mode, (4, 8))


def test_a_second_recompute_of_a_block_that_writes_its_buffers_is_refused():
    """Only one copy of F's buffers is kept (selective checkpointing allows no clone in a recompute), so a
    second backward through the same checkpointed forward must say so, not recompute on written buffers."""
    from lightning_twobp.lightning.checkpointing import apply_activation_checkpointing

    block = _BufferReader("running-scale")
    undo = apply_activation_checkpointing([(0, block)], "full")
    out = block(torch.randn(4, 8, requires_grad=True)).sum()
    out.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="recomputed a second time"):
        out.backward()
    undo()


def test_a_blocks_own_instance_forward_runs_checkpointed_and_stays_after():
    """A block whose forward is an instance attribute (accelerate's hooks, a user's wrapper): the checkpoint
    runs it, and the undo puts it back (it deleted it, dropping the hook for good after the Trainer call)."""
    from lightning_twobp.lightning.checkpointing import apply_activation_checkpointing

    block, calls = nn.Linear(4, 4), []
    plain = block.forward

    def hooked(x: torch.Tensor) -> torch.Tensor:
        calls.append(torch.is_grad_enabled())
        return plain(x)

    block.forward = hooked
    undo = apply_activation_checkpointing([(0, block)], "full")
    block(torch.randn(2, 4, requires_grad=True)).sum().backward()
    assert len(calls) == 2  # F, and B's recompute: the block's own forward both times
    undo()
    assert block.__dict__["forward"] is hooked


@pytest.mark.parametrize("split", [True, False])
def test_a_block_that_starts_in_place_is_checkpointed_like_one_process(split):
    """torchvision's EfficientNet and MobileNet classifiers start with Dropout(inplace=True): torch's checkpoint
    refuses their recompute (the input it recomputes from was changed; one process too). The checkpointed call
    changes a copy instead: the same output, the same mask in the recompute, the same gradients."""
    from lightning_twobp.engine import Stage
    from lightning_twobp.lightning.checkpointing import apply_activation_checkpointing

    torch.manual_seed(0)
    first, head = nn.Linear(8, 16), nn.Sequential(nn.Dropout(0.5, inplace=True), nn.Linear(16, 2))
    model = nn.Sequential(first, head)
    x = torch.randn(4, 8, requires_grad=True)
    torch.manual_seed(1)
    model(x).sum().backward()
    ref = [q.grad.clone() for q in model.parameters()] + [x.grad.clone()]
    model.zero_grad()
    undo = apply_activation_checkpointing([(1, head)], "full")
    stage = Stage(model)
    torch.manual_seed(1)
    out = stage.forward(0, x)
    if split:
        (gx,) = stage.backward_input(0, torch.ones_like(out))
        stage.backward_weight(0)
    else:
        (gx,) = stage.backward(0, torch.ones_like(out))
    undo()
    for got, want in zip([q.grad for q in model.parameters()] + [gx], ref, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
