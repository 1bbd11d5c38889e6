"""The layers twobp-plan measures on the meta device (plan_layers.py) and what the meta device is made to do as
a device does (meta_forward.py): every layer's bytes on meta equal those the same layer saves on the CPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hydra.errors import InstantiationException
from torch import nn

from lightning_twobp.meta_forward import attention_fused
from lightning_twobp.plan import _footprint
from lightning_twobp.plan_layers import planned_layers

transformers = pytest.importorskip("transformers")


class _CausalLM(nn.Module):
    """A Hugging Face causal LM called as a recipe's model is, ``self(ids)``; ``mask``: it passes an attention
    mask of its own (all ones: the usual `(ids != pad).long()` of an unpadded batch)."""

    def __init__(self, config: object, cls: str, mask: bool = False) -> None:
        super().__init__()
        self.model = getattr(transformers, cls)(config)
        self.mask = mask

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids, attention_mask=torch.ones_like(ids) if self.mask else None).logits

    def sample_input(self, b: int) -> torch.Tensor:
        return torch.zeros(b, 16, dtype=torch.long, device=self.model.lm_head.weight.device)


_TINY = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4}
_TINY |= {"num_attention_heads": 4, "max_position_embeddings": 16, "use_cache": False}
_MODELS = {
    # no dropout: with it the CPU's attention takes the math path (a GPU's flash kernel does not; the plan's)
    "gpt2": lambda: _CausalLM(
        transformers.GPT2Config(
            vocab_size=64, n_embd=32, n_layer=4, n_head=4, attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0,
            bos_token_id=0, eos_token_id=0,
        ),
        "GPT2LMHeadModel",
    ),
    "llama": lambda: _CausalLM(transformers.LlamaConfig(**_TINY), "LlamaForCausalLM"),
    # every other block attends within a window of 4: those get a mask, the others none (identical blocks
    # whose bytes differ by what the loop hands them)
    "qwen2-sliding": lambda: _CausalLM(
        transformers.Qwen2Config(
            **_TINY, num_key_value_heads=2, use_sliding_window=True, sliding_window=4,
            layer_types=["sliding_attention", "full_attention"] * 2,
        ),
        "Qwen2ForCausalLM",
    ),
    "llama-masked": lambda: _CausalLM(transformers.LlamaConfig(**_TINY), "LlamaForCausalLM", mask=True),
}  # fmt: skip


def _built(name: str, device: str) -> nn.Module:
    torch.manual_seed(0)
    with torch.device(device):
        model = _MODELS[name]()
    model.model.config.attn_implementation = "sdpa"
    return model.train()


def _layer_bytes(lm: nn.Module, ac: str | None = None) -> tuple[list, dict]:
    """Each layer's (saved in F, held from B to W, graph kept) as the plan measures it (its cache of footprints
    included), the middle layers run checkpointed in mode ``ac``; and the mask checks answered on meta."""
    cache: dict = {}
    with planned_layers(lm, None, 4, torch.float32) as layers:
        x, rows = layers.x, []
        for i in range(len(layers.calls)):
            mode = ac if 0 < i < len(layers.calls) - 1 else None
            fp = _footprint(layers, i, x, x.is_floating_point() and i > 0, cache, mode)
            rows.append((fp.activation_bytes, fp.held_bytes, fp.graph_kept))
            x = fp.output
        return rows, dict(layers.answered)


@pytest.mark.parametrize("name", list(_MODELS))
def test_a_hugging_face_model_is_planned_as_its_layers_save_on_the_cpu(name):
    """The ModuleList contract on meta: every layer (run through the model's own forward) saves and holds what
    the same layer does on the CPU, plain and checkpointed, to the byte. Attention takes the flash kernel's
    saved tensors (on meta SDPA took the math path: every head's T x T probabilities); the mask code's checks
    are answered as the CPU answers them for an unpadded batch, the model's own mask too; Qwen2's sliding
    blocks are measured apart from its full ones (one measurement served both)."""
    for ac in ("full", None):
        meta, answered = _layer_bytes(_built(name, "meta"), ac)
        cpu, none = _layer_bytes(_built(name, "cpu"), ac)
        assert meta == cpu, (ac, meta, cpu)
        assert answered and all(place.startswith("masking_utils.py:") for place in answered), answered
        assert not none  # the CPU holds values: nothing to answer
    if name == "qwen2-sliding":
        assert meta[1] != meta[2], meta  # plain, sliding and full blocks differ in what they save


def test_selective_counts_the_products_of_its_own_block_only():
    """A "selective" layer keeps its block's matrix products from F to B: not the head's, nor those of the other
    blocks' stand-ins its run goes through (which made each later layer count more, 2.7x per doubling)."""
    with planned_layers(_built("gpt2", "meta"), None, 4, torch.float32) as layers:
        x = layers.calls[0](layers.x)
        kept = [layers.kept_products(i, x) for i in (1, 2, 3)]
    assert kept[0] == kept[1] == kept[2] > 0, kept


class _Attends(nn.Module):
    """One SDPA call, as models make it (``how``)."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how

    def forward(self, q: torch.Tensor) -> torch.Tensor:
        k = v = q
        if self.how == "keywords":
            return F.scaled_dot_product_attention(query=q, key=k, value=v, is_causal=True)
        if self.how == "gqa":
            kv = q[:, :2]
            return F.scaled_dot_product_attention(q, kv, kv, is_causal=True, enable_gqa=True)
        if self.how == "bool mask":
            mask = torch.ones(q.shape[-2], q.shape[-2], dtype=torch.bool, device=q.device).tril()
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        if self.how == "3-d":
            return F.scaled_dot_product_attention(q[0], k[0], v[0], is_causal=True)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def _saved(module: nn.Module, device: str) -> int:
    saved: dict = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[id(t)] = t.numel() * t.element_size()
        return t

    q = torch.zeros(2, 4, 16, 8, device=device, requires_grad=True)
    with attention_fused([module]), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(q)
    return sum(saved.values())


@pytest.mark.parametrize("how", ["positional", "keywords", "gqa", "bool mask", "3-d"])
def test_attention_on_meta_saves_what_the_cpu_saves(how):
    """The CPU runs the flash kernel on 4-D attention and the math path on 3-D: meta saves the same (it took the
    math path for all, every head's probabilities; keywords-only raised an IndexError)."""
    assert _saved(_Attends(how), "meta") == _saved(_Attends(how), "cpu")


def test_attention_with_a_narrower_value_head_runs_as_a_gpu_runs_it():
    """DeepSeek's MLA: the value head is narrower than the query's, which the flash kernels do not take (the
    CPU flash op's meta form crashed the plan); the memory-efficient kernel does, on a GPU, and on meta now."""

    class Narrow(nn.Module):
        def forward(self, q: torch.Tensor) -> torch.Tensor:
            return F.scaled_dot_product_attention(q, q, q[..., :4], is_causal=True)

    q = torch.zeros(2, 4, 16, 8, device="meta", requires_grad=True)
    with attention_fused([block := Narrow()]):
        out = block(q)
    assert out.shape == (2, 4, 16, 4) and out.grad_fn.name() == "ScaledDotProductEfficientAttentionBackward0"


class _Reads(nn.Module):
    """A ModuleList model whose forward reads a value of its input: a length (``how="int"``), or whether a
    feature is present (``"any"``: answered False it would skip that compute silently)."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.embed = nn.Embedding(8, 4)
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        if self.how == "int":
            h = h[:, : int(ids.shape[1] - ids.max())]
        elif (ids == 3).any():
            h = h * 2
        for block in self.blocks:
            h = block(h)
        return h

    def sample_input(self, b: int) -> torch.Tensor:
        return torch.zeros(b, 3, dtype=torch.long, device=self.embed.weight.device)


@pytest.mark.parametrize("how", ["int", "any"])
def test_a_value_read_outside_the_mask_code_is_refused_naming_where_and_the_way_out(how):
    with torch.device("meta"):
        model = _Reads(how)
    with (
        pytest.raises(ValueError, match=r"reads a value at .*test_plan_layers.py:\d+ .*schedule='auto'"),
        planned_layers(model, "blocks", 2, torch.float32) as layers,
    ):
        layers.calls[0](layers.x)


def test_a_model_without_sample_input_is_told_what_to_define():
    with torch.device("meta"):
        model = nn.Module()
        model.layers = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    with (
        pytest.raises(ValueError, match=r"Module.sample_input\(batch_size\), which it does not define"),
        planned_layers(model, None, 2, torch.float32),
    ):
        pass


def test_a_layer_that_fails_on_meta_is_refused_in_one_line_naming_it():
    """A model error on meta (OPT's registration order, an expert matmul that takes bf16 only there) reaches the
    CLI as a refusal naming the layer, not a traceback."""

    class Fails(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise RuntimeError("no meta kernel here")

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.Sequential(nn.Linear(2, 2), Fails())

        def sample_input(self, b: int) -> torch.Tensor:
            return torch.zeros(b, 2, device="meta")

    with torch.device("meta"):
        model = Model()
    with planned_layers(model, None, 2, torch.float32) as layers, pytest.raises(ValueError) as e:
        _footprint(layers, 1, layers.x, True, {}, None)
    assert "does not run on the meta device (RuntimeError: no meta kernel here)" in str(e.value)
    assert str(e.value).startswith("layers[1] ")


def test_twobp_plan_plans_a_model_from_its_config_json(tmp_path):
    """A downloaded model's folder is planned from its config.json alone (HFCausalLM(config=...), no weights
    read): every parameter of the model the config describes, its blocks found without layers=."""
    from lightning_twobp.plan import plan_recipe

    config = transformers.MistralConfig(**_TINY, num_key_value_heads=2, tie_word_embeddings=False)
    config.save_pretrained(tmp_path)
    with torch.device("meta"):
        described = transformers.MistralForCausalLM(config)
    config_of = ["recipe=cpu-tiny-hf-gpt2", f"model.config={tmp_path}", "model.vocab_size=64"]
    p = plan_recipe([*config_of, "model.max_seq_len=16"])
    assert p.params == sum(q.numel() for q in described.parameters())
    assert [s.layers for s in p.stages] == [(0, 1), (2, 3)] and p.stages[1].held_bytes > 0
    with pytest.raises(InstantiationException, match="max_seq_len=32 is longer than the 16 positions"):
        plan_recipe([*config_of, "model.max_seq_len=32"])


def test_twobp_plan_places_opts_final_norm_where_its_forward_calls_it(tmp_path):
    """OPT registers its decoder's final_layer_norm before the layers and calls it after them: planned with the last
    layer (by the traced call order), where registration order put it with the first and the plan was refused."""
    from lightning_twobp.plan import plan_recipe

    config = transformers.OPTConfig(**_TINY, ffn_dim=64, word_embed_proj_dim=32, dropout=0.0)
    config.save_pretrained(tmp_path)
    sizes = ["model.vocab_size=64", "model.max_seq_len=16"]
    p = plan_recipe(["recipe=cpu-tiny-hf-gpt2", f"model.config={tmp_path}", *sizes])
    with torch.device("meta"):
        described = transformers.OPTForCausalLM(config)
    norm = sum(q.numel() for q in described.model.decoder.final_layer_norm.parameters())
    assert p.params == sum(q.numel() for q in described.parameters())
    assert [s.layers for s in p.stages] == [(0, 1), (2, 3)]
    last = sum(q.numel() for q in described.model.decoder.layers[2:].parameters()) + described.lm_head.weight.numel()
    assert p.stages[1].params == last + norm  # the head's copy of the tied embedding with the last stage


def test_another_architecture_is_built_from_the_sizes():
    from lightning_twobp.models import HFCausalLM

    with torch.device("meta"):
        lm = HFCausalLM(arch="qwen2", vocab_size=64, dim=32, n_layers=3, n_heads=4, n_kv_heads=2, max_seq_len=16)
    cfg = lm.model.config
    assert type(lm.model).__name__ == "Qwen2ForCausalLM" and len(lm.model.model.layers) == 3
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.vocab_size) == (32, 4, 2, 64)


def test_a_config_file_of_any_name_builds_in_the_default_dtype(tmp_path):
    """The file given is read (the folder's config.json was, another model's), the parameters made in fp32
    whatever the config's torch_dtype (from_config followed it: every downloaded config's bf16, its AdamW
    state too, whatever the Trainer's precision), and a data vocabulary the model cannot embed is refused."""
    from lightning_twobp.models import HFCausalLM

    transformers.GPT2Config(vocab_size=300, n_embd=32, n_layer=2, n_head=4).save_pretrained(tmp_path)
    config = transformers.MistralConfig(**(_TINY | {"vocab_size": 300}), num_key_value_heads=2, dtype="bfloat16")
    (tmp_path / "mistral.json").write_text(config.to_json_string())
    lm = HFCausalLM(config=str(tmp_path / "mistral.json"), max_seq_len=16)
    assert type(lm.model).__name__ == "MistralForCausalLM"
    assert {q.dtype for q in lm.parameters()} == {torch.float32}
    with pytest.raises(ValueError, match="vocab_size=512 .* larger than the 300 tokens"):
        HFCausalLM(config=str(tmp_path / "mistral.json"), max_seq_len=16, vocab_size=512)


def test_a_mixture_of_experts_is_planned_in_fp32_through_bf16():
    """HF's grouped expert matmul takes bf16 only on meta (as on a GPU): 32-true measures in bf16 and doubles
    the activations (it was refused), the same bytes as bf16-mixed's twice."""
    from lightning_twobp.plan import plan_recipe

    plans = {
        p: plan_recipe(["recipe=cpu-tiny-hf-gpt2", "model.arch=mixtral", f"trainer.precision={p}"])
        for p in ("32-true", "bf16-mixed")
    }
    assert any("activations measured in bf16" in n and "scaled by 2" in n for n in plans["32-true"].notes)
    loss = plans["32-true"].microbatch_size * 64 * 256 * 4  # the last stage's, counted in fp32 by both
    for s, (full, half) in enumerate(zip(plans["32-true"].stages, plans["bf16-mixed"].stages, strict=True)):
        own = loss if s == len(plans["32-true"].stages) - 1 else 0
        assert full.activation_bytes - own == 2 * (half.activation_bytes - own)
        assert full.held_bytes == 2 * half.held_bytes
        assert not full.graph_kept  # the experts' W by formula
