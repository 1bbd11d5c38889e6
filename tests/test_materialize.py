"""A model built on the meta device: each rank makes its own stages only, with one process's values.

Without processes: the replay against the same model built on the CPU (weights and the random state
after), the memory it holds while replaying, and what it refuses. On 2 ranks: a meta-built model trained
through Trainer against one process that built it on the CPU, and a tied Hugging Face GPT-2."""

from __future__ import annotations

import contextlib
import functools
import math
import os
import tempfile
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_twobp import TwoBPStrategy, models
from lightning_twobp.lightning.materialize import custom_inits, made_for_timing, materialize, warn_made

import conftest
from conftest import Regressor, launch, lightning_env, quiet_trainer, regression_data


class Block(nn.Module):
    """A block whose reset_parameters reaches into its child (as it does in its constructor), and a
    buffer computed in __init__ that reset_parameters computes again by assigning it (torchtitan's
    ``self.freqs_cis = ...``)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.gamma = nn.Parameter(torch.empty(8))
        self.register_buffer("freqs", self._freqs(), persistent=False)
        self.reset_parameters()

    def _freqs(self) -> torch.Tensor:
        return 1.0 / 10000 ** (torch.arange(0, 8).float() / 8)

    def reset_parameters(self) -> None:
        self.fc.reset_parameters()
        nn.init.normal_(self.gamma)
        self.freqs = self._freqs().to(self.gamma.device)

    def forward(self, x):
        return self.fc(x) * self.gamma + self.freqs


class Rescaled(nn.Module):
    """A block that holds no tensor itself and initializes its child in its reset_parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.fc.weight, std=0.02)

    def forward(self, x):
        return self.fc(x)


class Model(nn.Module):
    """Every kind of initialization torch's layers have: random (Linear, Conv1d, Embedding), constant
    (LayerNorm), buffers (BatchNorm's running statistics and integer count), a zeroed padding row,
    MultiheadAttention's private initialization after its output projection's, and a head tied to the
    embedding after its construction (its own draws discarded, the embedding's values kept)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 8, padding_idx=0)
        self.layers = nn.Sequential(
            nn.Linear(8, 8), nn.LayerNorm(8), Block(), Rescaled(), nn.BatchNorm1d(8), Block(), nn.Linear(8, 4)
        )
        self.conv = nn.Conv1d(4, 4, 3)
        self.attn = nn.MultiheadAttention(8, 2)
        self.head = nn.Linear(8, 10, bias=False)
        self.head.weight = self.embed.weight


def _build(meta: bool) -> nn.Module:
    torch.manual_seed(0)
    with torch.device("meta") if meta else contextlib.nullcontext():
        return Model()


def test_a_model_built_on_meta_gets_the_values_and_random_state_of_one_built_on_the_cpu():
    ref = _build(meta=False)
    after = torch.rand(4)
    for others in ([], [2, 3, 4], [5, 6]):  # the whole model here, or without some layers (another rank's)
        model = _build(meta=True)
        torch.manual_seed(0)  # the state a meta build leaves: it drew nothing
        made = materialize(model, [model.layers[i] for i in others], torch.device("cpu"), set())
        # the modules initialized: embed, 8 in the layers (2 blocks and Rescaled, each with its fc), conv,
        # attn, out_proj, head
        assert made.modules == 15 and made.real == []
        assert made.ties == ["head.weight (kept embed's values)"]
        torch.testing.assert_close(torch.rand(4), after, rtol=0, atol=0)  # the draws one process made
        held = {n: t for n, t in model.state_dict().items() if not t.is_meta}
        on_meta = {n for n, t in model.state_dict().items() if t.is_meta}
        assert on_meta == {n for n in ref.state_dict() if any(n.startswith(f"layers.{i}.") for i in others)}
        for n, t in held.items():
            assert torch.equal(t, ref.state_dict()[n]), n


class Recording(nn.Linear):
    """A layer that notes, when it is initialized, the bytes of every tensor of the model not on meta."""

    def reset_parameters(self) -> None:
        super().reset_parameters()
        root = self.__dict__.get("root")
        if root is not None:
            root.live.append(sum(t.nbytes for t in root.state_dict().values() if not t.is_meta))


def test_materializing_holds_this_ranks_layers_and_one_other_layer_at_a_time():
    with torch.device("meta"):
        model = nn.Sequential(*[Recording(64, 64) for _ in range(8)])
    model.live = []  # type: ignore[assignment]
    for layer in model:
        layer.__dict__["root"] = model
    layer_bytes = 64 * 64 * 4 + 64 * 4
    materialize(model, list(model[2:]), torch.device("cpu"), set())  # this rank holds layers 0 and 1
    assert max(model.live) == 3 * layer_bytes  # its two layers, and the other rank's one being initialized
    assert [t.is_meta for t in model.parameters()] == [False] * 4 + [True] * 12


def test_a_layer_made_for_timing_is_one_layer_initialized_and_put_back_as_built():
    """balance="time" and schedule="auto" run a meta-built model's layers one at a time on values their own
    initialization draws (layer_runs.placed); after the run the layer is on meta again, the same tensors."""
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 8))
    model[2].weight = model[0].weight  # a tie to a layer outside the one timed
    before = [(n, t) for n, t in model.named_parameters(remove_duplicate=False)]
    with made_for_timing(model, model[2], torch.device("cpu")):
        assert model[2].weight.is_floating_point() and not model[2].weight.is_meta
        made = model[2].weight.detach()
        assert made.std() > 0 and torch.isfinite(made).all()  # its reset_parameters drew it
        assert all(t.is_meta for t in [*model[0].parameters(), *model[1].parameters()])  # one layer at a time
        assert model[0].weight.is_meta, "the tie is made apart for the run"
    assert [(n, t) for n, t in model.named_parameters(remove_duplicate=False)] == before
    assert all(t.is_meta for _, t in before)


def test_a_hugging_face_layer_made_for_timing_takes_its_models_initialization():
    transformers = pytest.importorskip("transformers", reason="the Hugging Face model needs transformers")
    torch.manual_seed(0)
    with torch.device("meta"):
        gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=13, n_embd=16, n_layer=2, n_head=2))
    block = gpt2.transformer.h[1]
    with made_for_timing(gpt2, block, torch.device("cpu")):
        assert torch.equal(block.ln_1.weight, torch.ones(16)) and torch.equal(block.ln_1.bias, torch.zeros(16))
        std = float(block.mlp.c_fc.weight.detach().std())
        assert 0.01 < std < 0.03, std  # GPT2PreTrainedModel._init_weights: normal(0, 0.02)
    assert all(t.is_meta for t in gpt2.parameters())


class Scale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))

    def forward(self, x):
        return x * self.scale


class Rotary(nn.Module):
    """Frequencies computed in __init__ as a buffer, and a reset_parameters that sets only the weight."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(4))
        self.register_buffer("freqs", 1.0 / 10000 ** (torch.arange(0, 4).float() / 4), persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


class Causal(nn.Linear):
    def __init__(self) -> None:
        super().__init__(4, 4)
        self.register_buffer("mask", torch.ones(4, 4, dtype=torch.bool).tril(), persistent=False)


def _half_real() -> nn.Module:
    layer = nn.Linear(4, 4)
    layer.bias = nn.Parameter(torch.zeros(4, device="cpu"))  # a pretrained bias, say
    return layer


@pytest.mark.parametrize(
    "make, match",
    [
        (Scale, r"^1 \(Scale\) holds scale on the meta device and has no reset_parameters\(\): .*give Scale a "),
        (Rotary, r"^1.freqs \(Rotary\) was built on the meta device and Rotary.reset_parameters\(\) left it "),
        (Causal, r"^1.mask \(Causal\) is a boolean buffer built on the meta device, whose value no check can "),
        (_half_real, r"^1 \(Linear\) holds weight on the meta device and bias on a real device: .*build the module "),
        (lambda: nn.LazyLinear(4), r"^1 \(LazyLinear\) holds weight, bias on the meta device and lazy parameters"),
        (
            lambda: nn.utils.parametrizations.weight_norm(nn.Linear(4, 4)),
            r"^1.parametrizations.weight \(ParametrizationList\) holds original0, original1 .* register the "
            r"parametrization \(weight_norm, spectral_norm\) after setup",
        ),
    ],
    ids=["no-reset-parameters", "buffer-left-unset", "boolean-buffer", "half-real", "lazy", "parametrization"],
)
def test_what_cannot_be_made_is_refused_and_the_model_and_random_state_left_as_they_were(make, match):
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), make())
    before, rng = [*model.parameters(), *model.buffers()], torch.get_rng_state()
    with pytest.raises(ValueError, match=match):
        materialize(model, [], torch.device("cpu"), set())
    assert all(a is b for a, b in zip([*model.parameters(), *model.buffers()], before, strict=True))
    assert torch.equal(torch.get_rng_state(), rng)


class Clamp(nn.Linear):
    """A range buffer of infinities (set, not unset), and a parameter registered under a second name."""

    def __init__(self) -> None:
        super().__init__(4, 4)
        self.register_buffer("bounds", torch.tensor([-math.inf, math.inf]))
        self.register_parameter("alias", self.weight)

    def reset_parameters(self) -> None:
        super().reset_parameters()
        if hasattr(self, "bounds"):
            self.bounds.copy_(torch.tensor([-math.inf, math.inf]))


def test_layers_sharing_a_module_infinities_and_aliases_are_made_as_one_process_makes_them():
    def build(meta: bool) -> nn.Sequential:
        torch.manual_seed(0)
        with torch.device("meta") if meta else contextlib.nullcontext():
            shared = nn.Linear(4, 4)  # ALBERT's way: one module in two layers
            return nn.Sequential(nn.Sequential(shared, Clamp()), nn.Sequential(shared, Clamp()), nn.Linear(4, 4))

    ref = build(meta=False)
    after = torch.rand(2)
    model = build(meta=True)
    torch.manual_seed(0)
    materialize(model, [model[1]], torch.device("cpu"), set())  # layer 1 is another rank's, its shared part ours
    torch.testing.assert_close(torch.rand(2), after, rtol=0, atol=0)
    assert model[0][0] is model[1][0] and not model[0][0].weight.is_meta and model[1][1].alias.is_meta
    assert model[0][1].alias is model[0][1].weight and not model[0][1].alias.is_meta
    for n, t in model.state_dict().items():
        assert t.is_meta or torch.equal(t, ref.state_dict()[n]), n


OURS = {
    "llama": lambda: models.LlamaLM(vocab_size=32, dim=16, n_layers=4, n_heads=2, n_kv_heads=1, max_seq_len=8),
    "llama-loop": lambda: models.LlamaLoopLM(vocab_size=32, dim=16, n_layers=4, n_heads=2, max_seq_len=8),
    "bert": lambda: models.BertMLM(vocab_size=32, dim=16, n_layers=4, n_heads=2, max_seq_len=8, type_vocab_size=2),
    "mamba": lambda: models.MambaLM(vocab_size=32, dim=16, n_layers=4, d_state=4, max_seq_len=8),
    "resnet": lambda: models.ResNetClassifier(depth=50, num_classes=5, width=4, image_size=16),
}


@pytest.mark.parametrize("name", sorted(OURS))
def test_the_paper_models_built_on_meta_get_the_values_of_a_cpu_build(name):
    """The recipes' models initialize each module in its own reset_parameters, so a meta build is made
    exactly (its seed argument seeds the generator in the constructor either way), flags on parameters
    that configure_optimizers reads (Mamba's _no_weight_decay) kept."""
    ref = OURS[name]()
    after = torch.rand(2)
    with torch.device("meta"):
        model = OURS[name]()
    blocks = model.model.blocks if name == "llama-loop" else model.layers
    made = materialize(model, list(blocks[1:3]), torch.device("cpu"), set())
    assert made.real == [] and made.ties == [] and custom_inits(model) == []
    torch.testing.assert_close(torch.rand(2), after, rtol=0, atol=0)
    assert any(t.is_meta for t in model.state_dict().values())
    for n, t in model.state_dict().items():
        assert t.is_meta or torch.equal(t, ref.state_dict()[n]), n
    flags = {n for n, p in ref.named_parameters() if getattr(p, "_no_weight_decay", False)}
    assert flags == {n for n, p in model.named_parameters() if getattr(p, "_no_weight_decay", False)}
    assert bool(flags) == (name == "mamba")


class Net(nn.Module):
    """A reset_parameters over the pipelined layers (GPT-2's loop over its blocks, say)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))

    def reset_parameters(self) -> None:
        for layer in self.layers:
            nn.init.normal_(layer.weight, std=0.02)


def test_a_reset_parameters_over_the_pipelined_layers_is_refused_on_every_rank():
    for others in ([], [0], [1]):
        with torch.device("meta"):
            model = Net()
        with pytest.raises(ValueError, match=r"^Net \(Net\) has a reset_parameters\(\) and holds pipelined layers "):
            materialize(model, [model.layers[i] for i in others], torch.device("cpu"), set(), list(model.layers))


class Reads(nn.Module):
    """A block whose reset_parameters reads a child it shares with another layer."""

    def __init__(self, shared: nn.Linear) -> None:
        super().__init__()
        self.shared, self.scale = shared, nn.Parameter(torch.empty(4))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.scale.copy_(self.shared.weight.sum(0))


def test_other_ranks_layers_sharing_a_module_are_made_together():
    def build(meta: bool) -> nn.Sequential:
        torch.manual_seed(0)
        with torch.device("meta") if meta else contextlib.nullcontext():
            first = nn.Linear(4, 4)
            shared = nn.Linear(4, 4)  # built where it is first registered: the replay's order
            return nn.Sequential(first, Reads(shared), nn.Linear(4, 4), Reads(shared))

    ref = build(meta=False)
    after = torch.rand(2)
    for others in ([1, 3], [0, 1, 2, 3], [0, 2]):
        model = build(meta=True)
        torch.manual_seed(0)
        materialize(model, [model[i] for i in others], torch.device("cpu"), set())
        torch.testing.assert_close(torch.rand(2), after, rtol=0, atol=0)
        for n, t in model.state_dict().items():
            assert t.is_meta or torch.equal(t, ref.state_dict()[n]), n


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_a_hugging_face_model_is_made_as_its_own_meta_path_makes_it(arch):
    """transformers' way from meta (to_empty, initialize_weights, tie_weights): GPT-2's scaled c_proj and
    tied head, Llama's rotary frequencies; with another rank's blocks too."""
    transformers = pytest.importorskip("transformers", reason="the Hugging Face models need transformers")
    config = {
        "gpt2": lambda: transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=4, n_head=4),
        "llama": lambda: transformers.LlamaConfig(
            vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4
        ),
    }[arch]()
    make = transformers.GPT2LMHeadModel if arch == "gpt2" else transformers.LlamaForCausalLM
    with torch.device("meta"):
        ref = make(config)
    ref.to_empty(device="cpu")
    torch.manual_seed(0)
    ref.initialize_weights()
    ref.tie_weights()
    after = torch.rand(2)
    with torch.device("meta"):
        model = make(config)
    blocks = model.transformer.h if arch == "gpt2" else model.model.layers
    torch.manual_seed(0)
    materialize(model, list(blocks[2:]), torch.device("cpu"), set())
    torch.testing.assert_close(torch.rand(2), after, rtol=0, atol=0)
    held = {n: t for n, t in model.state_dict().items() if not t.is_meta}
    assert len(held) < len(model.state_dict())
    for n, t in held.items():
        assert torch.equal(t, ref.state_dict()[n]), n


def test_a_metric_built_on_meta_is_refused():
    torchmetrics = pytest.importorskip("torchmetrics")
    with torch.device("meta"):
        model = nn.ModuleDict(dict(layers=nn.Sequential(nn.Linear(2, 2)), mean=torchmetrics.MeanMetric()))
    with pytest.raises(ValueError, match=r"^mean \(MeanMetric\) is a torchmetrics Metric built on the meta device"):
        materialize(model, [], torch.device("cpu"), set())
    assert model.layers[0].weight.is_meta


def test_what_setup_cannot_see_as_one_process_is_warned_about():
    head = nn.Linear(4, 2)  # built on the CPU: it drew before the meta layers are made
    with torch.device("meta"):
        embed, loss = nn.Embedding(5, 4), nn.CrossEntropyLoss(weight=torch.ones(2, device="cpu"))
        tied = nn.Linear(4, 5, bias=False)
    tied.weight = embed.weight
    model = nn.ModuleDict(dict(embed=embed, head=head, loss=loss, tied=tied))
    made = materialize(model, [], torch.device("cpu"), set())
    assert made.real == ["head (Linear)"] and made.ties == ["tied.weight (kept embed's values)"]  # not the loss
    with pytest.warns(UserWarning) as seen:
        warn_made(made, model)
    assert [str(w.message).split(":")[0] for w in seen] == [
        "the model was built partly on the meta device",
        "the model was built on the meta device with tensors shared between modules",
    ]


def test_an_initialization_of_the_models_own_is_named():
    class NanoGPTLike(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.h = nn.Sequential(nn.Linear(4, 4))

        def _init_weights(self, module: nn.Module) -> None:
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=0.02)

    outer = nn.Sequential(NanoGPTLike())
    assert custom_inits(outer) == ["0 (NanoGPTLike)"]
    assert custom_inits(nn.Sequential(nn.Linear(2, 2), nn.MultiheadAttention(2, 1))) == []
    assert custom_inits(nn.Sequential(nn.Transformer(8, 2, 1, 1, 16))) == [
        "0 (Transformer)",
        "0.encoder (TransformerEncoder)",
        "0.decoder (TransformerDecoder)",
    ]


# ---------------------------------------------------------------------------------------------- Trainer
class MetaRegressor(Regressor):
    """The Regressor with a LayerNorm, built on the meta device unless ``cpu``."""

    def __init__(self, cpu: bool) -> None:
        def layers() -> nn.Sequential:
            return nn.Sequential(
                nn.Linear(6, 16), nn.Tanh(), nn.LayerNorm(16), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 2)
            )

        torch.manual_seed(0)
        with contextlib.nullcontext() if cpu else torch.device("meta"):
            super().__init__(layers=layers)


def _fit_regressor(strategy, world: int, model: MetaRegressor | None = None) -> dict:
    model = model or MetaRegressor(cpu=world == 1)
    quiet_trainer(strategy, world, max_epochs=1).fit(model, regression_data(32, shuffle=True))
    # the loader shuffled from the random state the build left, and so does everything after
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()}, "rand": torch.rand(3)}


class OutsideTensor(MetaRegressor):
    """An optimizer given a tensor that is no parameter of the model: refused at setup, after the model
    was made. A user who fixes it and calls fit again gets what one process makes."""

    def configure_optimizers(self):
        return torch.optim.SGD([*self.parameters(), torch.zeros(3, requires_grad=True)], lr=0.1)


def _fit_after_a_refused_setup(strategy, world: int) -> dict:
    model = MetaRegressor(cpu=world == 1)
    if world > 1:
        model.__class__ = OutsideTensor
        with pytest.raises(ValueError, match="holds 1 tensor"):
            quiet_trainer(TwoBPStrategy(), world, max_epochs=1).fit(model, regression_data(32, shuffle=True))
        model.__class__ = MetaRegressor
        assert all(t.is_meta for t in model.parameters())  # as it was built: the next call makes it again
    return _fit_regressor(strategy, world, model)


def _gpt2() -> nn.Module:
    transformers = pytest.importorskip("transformers", reason="the Hugging Face model needs transformers")
    config = transformers.GPT2Config(
        vocab_size=13,
        n_embd=16,
        n_layer=4,
        n_head=2,
        n_positions=8,
        bos_token_id=0,
        eos_token_id=0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,  # one process's dropout draws from the global stream
    )
    return transformers.GPT2LMHeadModel(config)  # tied embeddings: wte on the first stage, lm_head on the last


class MetaGPT2(conftest.pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        with torch.device("meta"):
            self.model = _gpt2()

    def training_step(self, batch, batch_idx):
        return self.model(input_ids=batch[0], labels=batch[0]).loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit_gpt2(strategy, world: int) -> dict:
    model = MetaGPT2()
    if world == 1:  # one process makes the whole model with the same calls, from the same state
        materialize(model, [], torch.device("cpu"), set())
    ids = torch.randint(1, 13, (16, 8), generator=torch.Generator().manual_seed(3))
    quiet_trainer(strategy, world, max_steps=2).fit(model, DataLoader(TensorDataset(ids), batch_size=8))
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()}, "rand": torch.rand(3)}


def _saved_llama(mixtral: bool = False) -> str:
    """A tiny LLaMa's (or Mixtral's) weights as save_pretrained writes them (on global rank 0 only, in a
    folder it names to the others): values no build from seed 0 makes."""
    transformers = pytest.importorskip("transformers", reason="the Hugging Face model needs transformers")
    ranks = dist.is_initialized()
    folder = [tempfile.mkdtemp(prefix="twobp-pretrained-") if not ranks or dist.get_rank() == 0 else None]
    if folder[0] is not None:
        with torch.random.fork_rng():
            torch.manual_seed(7)
            cls = transformers.MixtralForCausalLM if mixtral else transformers.LlamaForCausalLM
            cls(_llama_config(mixtral)).save_pretrained(folder[0])  # Mixtral's: one tensor per expert
    if ranks:
        dist.broadcast_object_list(folder)
    return str(folder[0])


def _llama_config(mixtral: bool = False) -> Any:
    if not mixtral:
        return conftest.tiny_llama_config(vocab_size=13, num_hidden_layers=4, max_position_embeddings=8)
    transformers = pytest.importorskip("transformers", reason="the Hugging Face model needs transformers")
    return transformers.MixtralConfig(
        vocab_size=13, hidden_size=16, intermediate_size=32, num_hidden_layers=4, num_attention_heads=2,
        num_key_value_heads=2, num_local_experts=3, max_position_embeddings=8,
    )  # fmt: skip


class PretrainedLlama(conftest.pl.LightningModule):
    """A Hugging Face LLaMa fine-tuned from saved weights, built on the meta device."""

    def __init__(self, mixtral: bool = False) -> None:
        super().__init__()
        transformers = pytest.importorskip("transformers", reason="the Hugging Face model needs transformers")
        torch.manual_seed(0)
        with torch.device("meta"):
            cls = transformers.MixtralForCausalLM if mixtral else transformers.LlamaForCausalLM
            self.model = cls(_llama_config(mixtral))

    def training_step(self, batch, batch_idx):
        return self.model(input_ids=batch[0], labels=batch[0]).loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.model(input_ids=batch[0], labels=batch[0]).loss)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit_pretrained_llama(strategy, world: int, mixtral: bool = False) -> dict:
    """Fit, then validate: the validation keeps the trained weights (the file is read once per model).
    ``mixtral``: a file of one tensor per expert, which from_pretrained fuses."""
    model = PretrainedLlama(mixtral)
    if world == 1:  # one process makes the whole model as the ranks do, and loads the file as transformers does
        materialize(model, [], torch.device("cpu"), set())
        model.model.load_state_dict(type(model.model).from_pretrained(_saved_llama(mixtral)).state_dict())
    ids = torch.randint(1, 13, (16, 8), generator=torch.Generator().manual_seed(3))
    trainer = quiet_trainer(strategy, world, max_steps=2)
    trainer.fit(model, DataLoader(TensorDataset(ids), batch_size=8))
    trained = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer.validate(model, DataLoader(TensorDataset(ids), batch_size=8), verbose=False)
    kept = {n: p.detach().clone() for n, p in model.named_parameters() if not p.is_meta}
    assert all(torch.equal(kept[n], trained[n]) for n in kept), "the validation changed the trained weights"
    return {"params": trained, "rand": torch.rand(3)}


def _fit_from_our_checkpoint(strategy, world: int) -> dict:
    """A model trained and saved, then a second model fine-tuned from its weights (pretrained= naming the
    strategy's own checkpoint directory; in one process: load_state_dict)."""
    first = MetaRegressor(cpu=True)
    trainer = quiet_trainer(TwoBPStrategy() if world > 1 else "auto", world, max_epochs=1)
    trainer.fit(first, regression_data(32))
    second = MetaRegressor(cpu=world == 1)
    if world == 1:
        second.load_state_dict(first.state_dict())
        return _fit_regressor(strategy, world, second)
    folder = [tempfile.mkdtemp(prefix="twobp-ours-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(folder)
    trainer.save_checkpoint(os.path.join(folder[0], "first.ckpt"))
    from_first = TwoBPStrategy(gather_full_model=True, pretrained=os.path.join(folder[0], "first.ckpt"))
    return _fit_regressor(from_first, world, second)


def _lightning_file() -> str:
    """A Lightning checkpoint file of a one-process run (the Regressor's weights plus one, an optimizer's
    state beside them), written on global rank 0 and named to the others."""
    ranks = dist.is_initialized()
    folder = [tempfile.mkdtemp(prefix="twobp-ckpt-") if not ranks or dist.get_rank() == 0 else None]
    if folder[0] is not None:
        with torch.random.fork_rng():
            trained = MetaRegressor(cpu=True)
        weights = {k: v + 1.0 for k, v in trained.state_dict().items()}
        adam = torch.optim.AdamW(trained.parameters()).state_dict()
        saved = {"state_dict": weights, "optimizer_states": [adam], "epoch": 3, "pytorch-lightning_version": "2.6.0"}
        torch.save(saved, os.path.join(folder[0], "last.ckpt"))
    if ranks:
        dist.broadcast_object_list(folder)
    return os.path.join(str(folder[0]), "last.ckpt")


def _fit_from_a_lightning_file(strategy, world: int) -> dict:
    """Fine-tuned from a one-process run's ``.ckpt`` (pretrained= naming the file; in one process:
    load_state_dict of its state dict)."""
    model = MetaRegressor(cpu=world == 1)
    if world == 1:
        model.load_state_dict(torch.load(_lightning_file(), weights_only=True)["state_dict"])
    return _fit_regressor(strategy, world, model)


FITS = {
    "regressor-1f1b": (_fit_regressor, {}),
    "regressor-zb-v": (_fit_regressor, {"schedule": "zb-v"}),
    "hf-gpt2-tied": (_fit_gpt2, {}),
    "refused-then-fitted": (_fit_after_a_refused_setup, {}),
    # the layers timed one at a time, each made for its run and put back (layer_runs.placed): the cut from
    # the times, then the rank's share made as one process makes it
    "regressor-time": (_fit_regressor, {"balance": "time", "schedule": "zb-h1"}),
    "hf-gpt2-auto": (_fit_gpt2, {"schedule": "auto", "memory_limit": "1f1b"}),
    "pretrained-hf-llama": (_fit_pretrained_llama, {"pretrained": _saved_llama}),
    "pretrained-hf-mixtral-experts": (
        functools.partial(_fit_pretrained_llama, mixtral=True),
        {"pretrained": functools.partial(_saved_llama, mixtral=True), "schedule": "zb-v"},
    ),
    "pretrained-our-checkpoint": (_fit_from_our_checkpoint, {}),
    "pretrained-lightning-file": (_fit_from_a_lightning_file, {"pretrained": _lightning_file, "schedule": "zb-v"}),
}


def _pipelined(rank: int, world: int, case: str) -> dict:
    lightning_env(rank, world)
    fit, options = FITS[case]
    options = {k: v() if callable(v) else v for k, v in options.items()}  # a file each rank writes itself
    return fit(TwoBPStrategy(gather_full_model=True, **options), world)


@pytest.mark.dist
@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", sorted(FITS))
def test_a_model_built_on_meta_trains_as_one_process_built_it(two_ranks, request, case, no_leftover_process_group):
    """Every rank made only its stages, yet after fit (weights gathered) each holds one process's weights,
    and the random state is one process's (the loader shuffled alike)."""
    fit, _ = FITS[case]
    ref = fit("auto", 1)
    for out in two_ranks[request.node.name]:
        torch.testing.assert_close(out["rand"], ref["rand"], rtol=0, atol=0)
        assert out["params"].keys() == ref["params"].keys()
        for n, value in out["params"].items():
            torch.testing.assert_close(value, ref["params"][n], rtol=1e-5, atol=1e-6, msg=n)
            assert math.isfinite(float(value.abs().sum()))


@pytest.fixture(scope="module")
def two_ranks(request) -> conftest.Launch:
    cases = {f"test_a_model_built_on_meta_trains_as_one_process_built_it[{k}]": (_pipelined, (k,)) for k in FITS}
    return launch(request, 2, cases, timeout=540)
