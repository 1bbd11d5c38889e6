"""The ModuleList contract: models whose blocks sit in an nn.ModuleList called in a loop with keyword side
inputs, pipelined as they are. Hugging Face GPT-2 (tied embeddings), Llama, Qwen2-MoE and Bloom with
padding masks, a nanoGPT written here, and this package's LLaMa in the loop form, each against one
process with the same micro-batching (fp32, rtol 1e-5); then the errors for what the contract does not
support."""

from __future__ import annotations

import gc
import re
import warnings
from types import SimpleNamespace
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_twobp  # noqa: F401  (registers "twobp")
from lightning_twobp import TwoBPStrategy
from lightning_twobp.lightning.contract import ModuleListContract, SequentialContract, find_contract
from lightning_twobp.lightning.local_model import _Remote
from lightning_twobp.lightning.placeholders import Elsewhere, ElsewhereError, elsewhere, find_elsewhere
from lightning_twobp.models import LlamaLoopLM
from lightning_twobp.processes import run_distributed

import conftest
from conftest import launch, lightning_env, quiet_trainer, regression_data

VOCAB, SEQ, BATCH, M = 13, 8, 8, 4


def _trainer(strategy, devices: int, **kw) -> pl.Trainer:
    return quiet_trainer(strategy, devices, max_steps=kw.pop("max_steps", 3), num_sanity_val_steps=0, **kw)


def _padded_tokens(n: int = 4 * BATCH) -> TensorDataset:
    """Right-padded sequences of 3..SEQ tokens: (ids, targets, attention_mask); targets -100 on padding."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, VOCAB, (n, SEQ), generator=g)
    lengths = torch.randint(3, SEQ + 1, (n,), generator=g)
    mask = (torch.arange(SEQ)[None] < lengths[:, None]).long()
    targets = torch.where(mask.bool(), (ids + 1) % VOCAB, torch.full_like(ids, -100))
    return TensorDataset(ids * mask, targets, mask)


# ---------------------------------------------------------------------------------------------- models
class CausalLM(pl.LightningModule):
    """A LightningModule around a model called as ``self.model(ids, attention_mask)`` -> logits."""

    def __init__(self, name: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = MODELS[name]()

    def _loss(self, batch):
        ids, targets, mask = batch
        out = self.model(input_ids=ids, attention_mask=mask)
        logits = out.logits if hasattr(out, "logits") else out[0] if isinstance(out, tuple) else out
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)

    def training_step(self, batch, batch_idx):
        loss = self._loss(batch)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self._loss(batch))

    def predict_step(self, batch, batch_idx):
        out = self.model(input_ids=batch[0], attention_mask=batch[2])
        return out.logits if hasattr(out, "logits") else out[0] if isinstance(out, tuple) else out

    def configure_optimizers(self):
        # SGD, not Adam: attention's key bias has a zero gradient in exact arithmetic (softmax ignores a
        # constant over keys), and Adam turns that rounding noise into full-size steps whose sign flips
        # with the order of a sum (tied embeddings add two gradients), so no rtol could compare them
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def _hf(model: str, config: str, **kw) -> nn.Module:
    """transformers' ``model`` built from its ``config`` with ``kw``, token 0 as begin and end of text."""
    transformers = pytest.importorskip("transformers", reason="the Hugging Face models need transformers")
    return getattr(transformers, model)(getattr(transformers, config)(bos_token_id=0, eos_token_id=0, **kw))


def _hf_gpt2() -> nn.Module:
    # GPT-2's defaults otherwise: tied embeddings, use_cache=True
    drops = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = _hf(
        "GPT2LMHeadModel", "GPT2Config", n_layer=4, n_embd=16, n_head=2, vocab_size=VOCAB, n_positions=SEQ, **drops
    )
    assert model.lm_head.weight is model.transformer.wte.weight
    return model


def _hf_llama() -> nn.Module:
    heads = dict(num_attention_heads=4, num_key_value_heads=2)
    sizes = dict(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=4, max_position_embeddings=SEQ
    )
    return _hf("LlamaForCausalLM", "LlamaConfig", **sizes, **heads, pad_token_id=None, use_cache=False)


def _hf_qwen2_moe() -> nn.Module:
    # a mixture of experts: routing, top-k, a shared expert; its experts' grouped_mm does not run on the
    # meta device in fp32, so the rank of the last stage learns a skipped block's output otherwise
    experts = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16)
    sizes = dict(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=4, max_position_embeddings=SEQ)
    heads = dict(num_attention_heads=4, num_key_value_heads=2)
    return _hf("Qwen2MoeForCausalLM", "Qwen2MoeConfig", **sizes, **heads, **experts, pad_token_id=None, use_cache=False)


def _hf_bloom() -> nn.Module:
    # ALiBi built from the attention mask before the loop, blocks that return tuples, a layer norm on the
    # embeddings (the first stage), tied embeddings
    drops = dict(hidden_dropout=0.0, attention_dropout=0.0)
    return _hf(
        "BloomForCausalLM",
        "BloomConfig",
        vocab_size=VOCAB,
        hidden_size=16,
        n_layer=4,
        n_head=2,
        use_cache=False,
        **drops,
    )


def _hf_roberta() -> nn.Module:
    # its embeddings move a buffer to the input's device (`self.token_type_ids.to(position_ids.device)`): the
    # stand-in on stage 1 failed ("Cannot copy out of meta tensor") while its buffers were plain meta tensors
    drops = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    sizes = dict(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=4, num_attention_heads=2)
    return _hf(
        "RobertaForCausalLM",
        "RobertaConfig",
        **sizes,
        **drops,
        is_decoder=True,
        pad_token_id=0,
        max_position_embeddings=SEQ + 2,
    )


class NanoBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.c_attn, self.c_proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.n_head = 2

    def forward(self, x, attn_mask):  # (B, T, C), (B, 1, T, T) bool: True = attend
        b, t, c = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
        x = x + self.c_proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nn.Module):
    """nanoGPT's layout (transformer.{wte, wpe, drop, h, ln_f}, lm_head tied to wte), with a padding mask
    made before the loop and passed to every block by keyword."""

    def __init__(self, d: int = 16, n_layer: int = 4) -> None:
        super().__init__()
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(VOCAB, d),
                wpe=nn.Embedding(SEQ, d),
                drop=nn.Dropout(0.0),
                h=nn.ModuleList(NanoBlock(d) for _ in range(n_layer)),
                ln_f=nn.LayerNorm(d),
            )
        )
        self.lm_head = nn.Linear(d, VOCAB, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # nanoGPT ties this way round

    def forward(self, input_ids, attention_mask):
        t = input_ids.shape[1]
        pos = torch.arange(t, device=input_ids.device)
        x = self.transformer.drop(self.transformer.wte(input_ids) + self.transformer.wpe(pos))
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        mask = causal[None, None] & attention_mask.bool()[:, None, None, :]  # (B, 1, T, T)
        mask = mask | torch.eye(t, dtype=torch.bool, device=x.device)  # padded queries attend to themselves
        for block in self.transformer.h:
            x = block(x, attn_mask=mask)
        return self.lm_head(self.transformer.ln_f(x))


class CachingNanoGPT(NanoGPT):
    """nanoGPT that returns every block's output beside the logits while ``config.use_cache`` is on, as
    transformers 4.x's GPT-2 returns its per-block ``presents`` by default, in training too: values of
    blocks on other stages, which the pipeline cannot return. The strategy turns the cache off for the
    Trainer call (without that, the call was refused) and back on after."""

    def __init__(self) -> None:
        super().__init__()
        self.config = SimpleNamespace(use_cache=True)

    def forward(self, input_ids, attention_mask):
        t = input_ids.shape[1]
        x = self.transformer.wte(input_ids) + self.transformer.wpe(torch.arange(t, device=input_ids.device))
        mask = (
            torch.ones(t, t, dtype=torch.bool, device=x.device).tril()[None, None]
            & attention_mask.bool()[:, None, None]
        )
        mask = mask | torch.eye(t, dtype=torch.bool, device=x.device)
        presents = []
        for block in self.transformer.h:
            x = block(x, attn_mask=mask)
            presents.append(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        return (logits, tuple(presents)) if self.config.use_cache else logits


class CodebookNanoGPT(NanoGPT):
    """nanoGPT with an embedding per codebook in an nn.ModuleList before the blocks, indexed, sliced and iterated
    by the forward (MusicGen's decoder, Gemma3n's `altup_projections[i - 1]`): on the stages that hold it not,
    its placeholder was "not subscriptable". And a ModuleDict of position embeddings walked by ``items()`` and
    ``values()``, which hand the set-aside (meta) modules themselves to the loop on the other stage."""

    def __init__(self) -> None:
        super().__init__()
        self.transformer["wte"] = nn.ModuleList(nn.Embedding(VOCAB, 16) for _ in range(3))  # keeps its place
        self.transformer["wpe"] = nn.ModuleDict({"fine": nn.Embedding(SEQ, 16), "coarse": nn.Embedding(SEQ, 16)})

    def forward(self, input_ids, attention_mask):
        t = input_ids.shape[1]
        wte, wpe, pos = self.transformer.wte, self.transformer.wpe, torch.arange(t)
        x = wte[0](input_ids) + sum(e(input_ids.flip(-1)) for e in wte[1:])
        x = x + sum(e(pos if k == "fine" else pos // 4) for k, e in wpe.items()) + sum(e(pos) for e in wpe.values())
        mask = torch.ones(t, t, dtype=torch.bool).tril()[None, None] & attention_mask.bool()[:, None, None]
        mask = mask | torch.eye(t, dtype=torch.bool)
        for block in self.transformer.h:
            x = block(x, attn_mask=mask)
        return self.lm_head(self.transformer.ln_f(x))


class TorchEncoderLM(nn.Module):
    """A user's model on torch's ``nn.TransformerEncoder``, whose forward reads its first layer's attributes
    (``layers[0].self_attn.batch_first``, its weights: the fast path's checks) on every stage, and in
    evaluation with a padding mask would turn the hidden state into a nested tensor (the fast path)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 4, enable_nested_tensor=True)
        self.head = nn.Linear(16, VOCAB)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(input_ids), src_key_padding_mask=attention_mask == 0))


class ResidualBlock(nn.Module):
    """mamba_ssm's and flash-attn's block form: the residual stream is a second hidden state, added in the
    next block (``h, residual = block(h, residual)``), so two values pass between stages."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(16)
        self.mix = nn.Linear(16, 16)

    def forward(self, h: torch.Tensor, residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        residual = h if residual is None else h + residual
        return torch.tanh(self.mix(self.norm(residual))), residual


class ResidualStreamLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.layers = nn.ModuleList(ResidualBlock() for _ in range(4))
        self.norm_f = nn.LayerNorm(16)
        self.head = nn.Linear(16, VOCAB)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        h, residual = self.embed(input_ids), None
        for layer in self.layers:
            h, residual = layer(h, residual)
        return self.head(self.norm_f(h + residual))


class ModulatedBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mix, self.scale = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, hidden_states: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        return hidden_states + torch.tanh(self.mix(hidden_states)) * (1 + self.scale(temb))


class ModulatedLM(nn.Module):
    """diffusers' SD3 and Flux form: a conditioning vector made before the loop, given to every block and to the
    norm after it (``norm_out(h, temb)``): the last stage's norm gets the value sent beside the hidden state; and
    the blocks called by keywords alone, the hidden state by its parameter's name."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.cond = nn.Embedding(VOCAB, 16), nn.Sequential(nn.Linear(16, 16), nn.Tanh())
        self.layers = nn.ModuleList(ModulatedBlock() for _ in range(4))
        self.norm_out, self.head = nn.Linear(16, 32), nn.Linear(16, VOCAB)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids)
        temb = self.cond(h.mean(1, keepdim=True))  # a module's output: sent on (a value made outside one is not)
        for layer in self.layers:
            h = layer(hidden_states=h, temb=temb)
        shift, scale = self.norm_out(temb).chunk(2, -1)
        return self.head(F.layer_norm(h, (16,)) * (1 + scale) + shift)


class InPlaceLoopLM(nn.Module):
    """A loop whose second stage starts with nn.ReLU(inplace=True): its input, received, gets a copy."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(VOCAB, 16), nn.Linear(16, VOCAB)
        self.layers = nn.ModuleList([nn.Linear(16, 16), nn.Linear(16, 16), nn.ReLU(inplace=True), nn.Linear(16, 16)])

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


class MlpBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln, self.fc = nn.LayerNorm(d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(self.ln(x)))


class SequentialBlocksLM(nn.Module):
    """Blocks in one nn.Sequential that the forward calls whole between an embedding and a head (timm's ViT
    ``blocks``, ConvNeXt's ``stages``): pipelined as a loop's blocks, the embedding on the first stage, the norm
    and head on the last (the step's contract refused the embedding's parameters at the first step)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.blocks = nn.Sequential(*[MlpBlock(16) for _ in range(4)])
        self.norm, self.head = nn.LayerNorm(16), nn.Linear(16, VOCAB)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.blocks(self.embed(input_ids))))


class ConvEmbeddedLM(nn.Module):
    """A convolution before the loop (a ViT's patch embedding, ConvNeXt's stem): under bf16-mixed autocast casts
    its input where it runs, and its stand-in on the other stage must take the same cast."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.conv = nn.Embedding(VOCAB, 16), nn.Conv1d(16, 16, 3, padding=1)
        self.layers = nn.ModuleList([MlpBlock(16) for _ in range(4)])
        self.head = nn.Linear(16, VOCAB)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        h = self.conv(self.embed(input_ids).transpose(1, 2)).transpose(1, 2)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


class LooseTokensLM(nn.Module):
    """timm's ViT and DeiT: a class token and a position table the model holds directly, beside its blocks, used
    before the loop (the first stage's); and PixArt's ``scale_shift_table``, held directly too and used after it
    (the last stage's, as the call-order trace finds)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.cls_token = nn.Parameter(torch.randn(1, 1, 16) * 0.1)
        self.pos_embed = nn.Parameter(torch.randn(1, SEQ + 1, 16) * 0.1)
        self.layers = nn.ModuleList([MlpBlock(16) for _ in range(4)])
        self.norm = nn.LayerNorm(16)
        self.scale_shift_table = nn.Parameter(torch.randn(2, 16) * 0.1)
        self.head = nn.Linear(16, VOCAB)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids)
        h = torch.cat([self.cls_token.expand(h.shape[0], -1, -1), h], 1) + self.pos_embed[:, : h.shape[1] + 1]
        for layer in self.layers:
            h = layer(h)
        shift, scale = self.scale_shift_table.chunk(2)
        return self.head(self.norm(h)[:, 1:] * (1 + scale) + shift)


class TorchTransformerLM(nn.Module):
    """torch's ``nn.Transformer`` (Lightning's demo Transformer is one): the decoder's layers pipelined, the
    encoder whole on the first stage, its output (``memory``) read by every decoder layer on every stage."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.transformer = nn.Transformer(16, 2, 2, 4, 32, dropout=0.0, batch_first=True)
        self.head = nn.Linear(16, VOCAB)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        causal = nn.Transformer.generate_square_subsequent_mask(input_ids.shape[1])
        pad = attention_mask == 0
        return self.head(self.transformer(x, x, tgt_mask=causal, src_key_padding_mask=pad, memory_key_padding_mask=pad))


class HFSeq2Seq(nn.Module):
    """A Hugging Face encoder-decoder called as a causal LM: the ids into the encoder (padding masked) and,
    shifted by nothing, into the decoder; Whisper hears them as one-hot "mel" frames."""

    def __init__(self, model: str, config: str, **kw: Any) -> None:
        super().__init__()
        self.inner = _hf(model, config, vocab_size=VOCAB, **kw)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        if "Whisper" in type(self.inner).__name__:
            frames = F.one_hot(input_ids, VOCAB).float().transpose(1, 2)
            return self.inner(input_features=frames, decoder_input_ids=input_ids).logits
        return self.inner(input_ids=input_ids, attention_mask=attention_mask, decoder_input_ids=input_ids).logits


def _hf_t5() -> nn.Module:
    # the decoder's first block computes the position biases every later block takes (carried with the hidden
    # state); the encoder's stand-in reads its mask in Hugging Face's mask code and makes positions on its device
    sizes = dict(d_model=16, d_kv=8, d_ff=32, num_layers=2, num_decoder_layers=4, num_heads=2)
    return HFSeq2Seq("T5ForConditionalGeneration", "T5Config", **sizes, dropout_rate=0.0, decoder_start_token_id=0)


def _seq2seq_sizes() -> dict:
    return dict(
        d_model=16,
        encoder_layers=2,
        decoder_layers=4,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=32,
        decoder_ffn_dim=32,
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
        decoder_start_token_id=0,
    )


def _hf_bart() -> nn.Module:
    # the encoder's stand-in moves positions made from its meta weights to its input's device
    # the decoder registers layernorm_embedding after its layers and calls it before them: placed by the call order
    return HFSeq2Seq("BartForConditionalGeneration", "BartConfig", **_seq2seq_sizes(), max_position_embeddings=SEQ)


def _hf_whisper() -> nn.Module:
    # the model returns the encoder's output (encoder_last_hidden_state), which the last stage received
    positions = dict(num_mel_bins=VOCAB, max_source_positions=SEQ // 2, max_target_positions=SEQ, pad_token_id=1)
    return HFSeq2Seq("WhisperForConditionalGeneration", "WhisperConfig", **_seq2seq_sizes(), **positions)


MODELS = {
    "hf-gpt2": _hf_gpt2,
    "hf-llama": _hf_llama,
    "hf-qwen2-moe": _hf_qwen2_moe,
    "hf-bloom": _hf_bloom,
    "hf-roberta": _hf_roberta,
    "nanogpt": NanoGPT,
    "caching-nanogpt": CachingNanoGPT,
    "codebook-nanogpt": CodebookNanoGPT,
    "torch-encoder": TorchEncoderLM,
    "residual-stream": ResidualStreamLM,
    "modulated": ModulatedLM,
    "in-place-loop": InPlaceLoopLM,
    "sequential-blocks": SequentialBlocksLM,
    "conv-embedded": ConvEmbeddedLM,
    "loose-tokens": LooseTokensLM,
    "torch-transformer": TorchTransformerLM,
    "hf-t5": _hf_t5,
    "hf-bart": _hf_bart,
    "hf-whisper": _hf_whisper,
}


def _fit(model: pl.LightningModule, strategy, devices: int, batch_size: int, **kw) -> pl.Trainer:
    data = _padded_tokens() if not isinstance(model, LlamaLoopLM) else _counting()
    trainer = _trainer(strategy, devices, gradient_clip_val=0.5, **kw)
    trainer.fit(model, DataLoader(data, batch_size=batch_size))
    return trainer


def _counting() -> TensorDataset:
    g = torch.Generator().manual_seed(5)
    start = torch.randint(0, 64, (4 * BATCH, 1), generator=g)
    ids = (start + torch.arange(16)) % 64
    return TensorDataset(ids, (ids + 1) % 64)


def _make(name: str) -> pl.LightningModule:
    if name == "llama-loop":
        return LlamaLoopLM(vocab_size=64, dim=32, n_layers=4, n_heads=4, max_seq_len=16, lr=1e-2)
    return CausalLM(name)


def _again(model: pl.LightningModule, strategy, devices: int, batch_size: int, **kw) -> dict:
    """After a fit: validate, predict and fit again, each by a new Trainer (docs/strategy.md, "After a
    Trainer call"). Validation on micro-batches as the pipeline cuts them: a token mean over padded
    sequences is not a mean over samples, so the whole batch's value would differ. Python's collector runs first:
    what the fit's call left behind is freed before the next call, as it may be at any time (the part guarding a
    set-aside loose parameter was collected only sometimes, and validate then refused that parameter)."""
    gc.collect()
    val = DataLoader(_padded_tokens(2 * BATCH), batch_size=batch_size)
    out = {"val_loss": _trainer(strategy(), devices).validate(model, val, verbose=False)[0]["val_loss"]}
    preds = _trainer(strategy(), devices).predict(model, DataLoader(_padded_tokens(2 * BATCH), batch_size=BATCH))
    out["preds"] = None if preds is None or preds[0] is None else torch.cat(preds)
    _fit(model, strategy(), devices, batch_size, **kw)
    out["params"] = _own(model)
    return out


def _own(model: nn.Module) -> dict:
    """The weights on this rank: all of them, or without gather_full_model those of its own stages."""
    return {n: q.detach().clone() for n, q in model.named_parameters() if not q.is_meta}


def _reference(name: str, again: bool) -> dict:
    """One process, micro-batches of BATCH / M accumulated over M steps: the pipeline's micro-batching."""
    model = _make(name)
    _fit(model, "auto", 1, BATCH // M, accumulate_grad_batches=M)
    out = {"params": _own(model)}
    if again:
        out["again"] = _again(model, lambda: "auto", 1, BATCH // M, accumulate_grad_batches=M)
    return out


def _pipelined(rank: int, world: int, name: str, kw: dict, again: bool) -> dict:
    lightning_env(rank, world)
    model = _make(name)
    # Without gather_full_model the other stages' modules stay on the meta device after fit, and the
    # next Trainer calls stand in for them again (the meta twins of GPT-2's wte, Llama's embed_tokens).
    _fit(model, TwoBPStrategy(num_microbatches=M, gather_full_model=not again, **kw), world, BATCH)
    out = {"params": _own(model), "use_cache": getattr(getattr(model.model, "config", None), "use_cache", None)}
    if again:
        out["again"] = _again(model, lambda: TwoBPStrategy(num_microbatches=M, **kw), world, BATCH)
    return out


CASES = {
    # GPT-2's defaults: tied embeddings (wte on the first stage, lm_head on the last), use_cache=True (off for
    # the call: 4.x returned per-block presents); then validate, predict and fit again without gathering
    "hf-gpt2": ("hf-gpt2", dict(schedule="1f1b"), True),
    # the V: 4 stages on 2 ranks, so stages 1 and 2 re-run the step themselves; and the same again
    "hf-llama-zb-v": ("hf-llama", dict(schedule="zb-v"), True),
    "hf-qwen2-moe-zb-h1": ("hf-qwen2-moe", dict(schedule="zb-h1"), False),
    # the cut from each layer's time, measured through the model's own forward (lightning/layer_runs.py)
    "hf-gpt2-time": ("hf-gpt2", dict(schedule="zb-h1", balance="time"), False),
    "hf-bloom-zb-v": ("hf-bloom", dict(schedule="zb-v"), False),
    # a module of another stage whose forward moves its own buffer to its input's device
    "hf-roberta-zb-h1": ("hf-roberta", dict(schedule="zb-h1"), False),
    "nanogpt-zb-h1": ("nanogpt", dict(schedule="zb-h1", layers="model.transformer.h"), False),
    "caching-nanogpt": ("caching-nanogpt", dict(schedule="1f1b", layers="model.transformer.h"), False),
    # profiled as the call runs: the cache off (on, the last layer's run returned every block's output)
    "caching-nanogpt-auto": (
        "caching-nanogpt",
        dict(schedule="auto", memory_limit="4x1f1b", layers="model.transformer.h"),
        False,
    ),
    # a ModuleList of embeddings of stage 0 indexed and iterated on stage 1 (a placeholder there)
    "codebook-nanogpt": ("codebook-nanogpt", dict(schedule="1f1b", layers="model.transformer.h"), False),
    "llama-loop-interleaved": ("llama-loop", dict(schedule="interleaved-1f1b"), False),
    # attributes of blocks on another stage read by the model's code; then validate with a padding mask
    "torch-encoder": ("torch-encoder", dict(schedule="zb-h1"), True),
    # values passed between stages beside the hidden state (docs/strategy.md, "Values passed between stages"):
    # two hidden states, over the V's 4 stages (handed over on rank 1, sent between the ranks)
    "residual-stream-zb-v": ("residual-stream", dict(schedule="zb-v"), False),
    # the layers timed one by one with both hidden states between them
    "residual-stream-time": ("residual-stream", dict(schedule="1f1b", balance="time"), False),
    # a value made before the loop given to every block and to a module after it, on the V's last stage (rank 0)
    "modulated-zb-v": ("modulated", dict(schedule="zb-v", layers="model.layers"), False),
    "in-place-loop": ("in-place-loop", dict(schedule="1f1b", balance=[2, 2], layers="model.layers"), False),
    # parameters the model holds directly beside its blocks, on the side of the loop they are used on; then
    # validate, predict and fit again without gathering (set aside and put back again); and over the V
    "loose-tokens": ("loose-tokens", dict(schedule="1f1b"), True),
    "loose-tokens-zb-v": ("loose-tokens", dict(schedule="zb-v"), False),
    # an nn.Sequential of blocks the model's forward calls whole: found, and cut between its blocks over the V;
    # named, then validate, predict and fit again
    "sequential-blocks-zb-v": ("sequential-blocks", dict(schedule="zb-v"), False),
    "sequential-blocks": ("sequential-blocks", dict(schedule="1f1b", layers="model.blocks"), True),
    # an encoder's output read by every decoder layer; then validate, predict and fit again without gathering
    "torch-transformer": ("torch-transformer", dict(schedule="zb-h1", layers="model.transformer.decoder.layers"), True),
    "hf-t5": ("hf-t5", dict(schedule="1f1b", layers="model.inner.decoder.block"), False),
    "hf-bart": ("hf-bart", dict(schedule="zb-h1", layers="model.inner.model.decoder.layers"), False),
    "hf-whisper-zb-v": ("hf-whisper", dict(schedule="zb-v", layers="model.inner.model.decoder.layers"), False),
}


@pytest.mark.dist
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.timeout(900)
def test_modulelist_models_match_one_process(two_ranks, request, case):
    name, kw, again = CASES[case]
    ref = _reference(name, again)
    results = two_ranks[request.node.name]
    before = getattr(getattr(MODELS[name](), "config", None), "use_cache", None) if name in MODELS else None
    assert all(out["use_cache"] == before for out in results), results  # put back as it was
    if not again:  # gathered: every rank holds every weight
        assert all(set(out["params"]) == set(ref["params"]) for out in results)
    assert set().union(*(out["params"] for out in results)) == set(ref["params"])
    for out in results:
        for n, value in out["params"].items():
            torch.testing.assert_close(value, ref["params"][n], rtol=1e-5, atol=1e-6, msg=n)
    if again:
        assert [out["again"]["preds"] is not None for out in results].count(True) == 1
        for out in (r["again"] for r in results):
            assert out["val_loss"] == pytest.approx(ref["again"]["val_loss"], rel=1e-5)
            if out["preds"] is not None:
                # one process's nn.TransformerEncoder takes torch's fast path in evaluation, which writes
                # zeros at padded positions; the pipeline does not (fastpath_off): compare the real ones
                real = _padded_tokens(2 * BATCH).tensors[2].bool() if name == "torch-encoder" else ...
                torch.testing.assert_close(out["preds"][real], ref["again"]["preds"][real], rtol=1e-5, atol=1e-6)
            assert out["params"]
            for n, value in out["params"].items():
                torch.testing.assert_close(value, ref["again"]["params"][n], rtol=1e-5, atol=1e-6, msg=n)


class MaskedLM(CausalLM):
    """Masking drawn in the step before the model call, as a masked-LM step draws it: the first stage
    masks the inputs with it, the last stage the targets, the middle ones re-run it for the side inputs."""

    def __init__(self) -> None:
        super().__init__("hf-llama")
        self.masks: dict[int, list[list[bool]]] = {}  # global step -> each call's mask

    def training_step(self, batch, batch_idx):
        ids, targets, attention = batch
        hide = torch.rand(ids.shape) < 0.3
        if self.trainer.strategy._pipeline is not None:  # a step's, not the call-order trace's run before the cut
            self.masks.setdefault(self.trainer.global_step, []).append(hide.flatten().tolist())
        return self._loss((ids.masked_fill(hide, 1), targets.masked_fill(~hide, -100), attention))


def _masked(rank: int, world: int) -> dict:
    """ZB-V, ranks seeded apart: rank 0 runs the step for stage 0 (the inputs) and 3 (the targets), rank 1
    for stages 1 and 2; each rank's masks per step, as a set."""
    lightning_env(rank, world)
    pl.seed_everything(3 + rank, verbose=False)
    model = MaskedLM()
    _fit(model, TwoBPStrategy(num_microbatches=M, schedule="zb-v"), world, BATCH, max_steps=2)
    return {step: sorted(map(tuple, masks)) for step, masks in model.masks.items()}


def test_masking_drawn_in_the_step_is_the_same_on_every_stage(two_ranks, request):
    """The step's code before the model call runs on every stage; a mask drawn there is one mask: the
    first stage's masked inputs and the last stage's masked targets agree (they differed, silently but
    for a warning, each stage drawing from its own stream), per micro-batch and step."""
    first, second = two_ranks[request.node.name]
    assert sorted(first) == sorted(second) == [0, 1], (first, second)
    for step in (0, 1):
        assert len(set(first[step])) == M and set(first[step]) == set(second[step]), step
    assert not set(first[0]) & set(first[1])  # new draws each step


def _bf16(rank: int | None = None, world: int = 1, name: str = "hf-llama", precision: str = "bf16-true") -> dict:
    """HF Llama under precision="bf16-true" for 2 steps: in one process (``rank`` None, micro-batches
    accumulated) or pipelined with ZB-H1, the rank's own weights."""
    pipelined = rank is not None
    if pipelined:
        lightning_env(rank, world)
    model = _make(name)
    strategy = TwoBPStrategy(num_microbatches=M, schedule="zb-h1") if pipelined else "auto"
    kw = {} if pipelined else {"accumulate_grad_batches": M}
    _fit(model, strategy, world, BATCH if pipelined else BATCH // M, precision=precision, max_steps=2, **kw)
    return _own(model)


def test_bf16_mixed_stand_ins_take_autocasts_cast(two_ranks, request):
    """Under bf16-mixed a stand-in's weights sit on the device its inputs are on, so autocast casts both: on meta
    a convolution's stand-in met a bf16 input and fp32 weights, and the first forward of stage 1 failed (a
    trial's ViT, DINOv2 and ConvNeXt); a Linear's gave its output another dtype. Compared at bf16's resolution
    (the layer norms' biases differ most, 0.4%, relative)."""
    ref = _bf16(name="conv-embedded", precision="bf16-mixed")
    results = two_ranks[request.node.name]
    assert set().union(*results) == set(ref)
    for out in results:
        for n, value in out.items():
            torch.testing.assert_close(value, ref[n], rtol=0.05, atol=0.02, msg=n)


def test_bf16_true_stand_ins_carry_the_models_cast(two_ranks, request):
    """The meta twins of another stage's modules are made in the model's cast dtype: in fp32 they made the
    rotary embeddings of stage 1 fp32 (from the embedding's twin) against bf16 values, and its first
    forward failed ("Expected query, key, and value to have the same dtype"). bf16 rounds differently
    in the two runs' sums: compared at bf16's resolution."""
    ref = _bf16()
    results = two_ranks[request.node.name]
    assert set().union(*results) == set(ref)
    for out in results:
        for n, value in out.items():
            assert value.dtype == torch.bfloat16, n
            torch.testing.assert_close(value.float(), ref[n].float(), rtol=0.05, atol=0.02, msg=n)


class CrossLengths(pl.LightningModule):
    """Hugging Face T5 whose encoder reads 8 tokens in one batch and 6 in the next while its decoder reads 4:
    the cross-attention bias a decoder block returns (heads x 4 x S) changes with S alone. A skipped block's
    output shape was cached by its hidden state's shape, so the second batch reused S = 8 and the stage
    refused its own call."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = _hf_t5()

    def training_step(self, batch, batch_idx):
        ids, targets = batch
        logits = self.model.inner(input_ids=ids, decoder_input_ids=targets).logits
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def _cross_batches(split: int = 1) -> DataLoader:
    """Three batches of BATCH pairs, the encoder's input 8, 6 and 8 tokens long, in ``split`` parts each."""
    g = torch.Generator().manual_seed(7)
    batches = []
    for length in (8, 6, 8):
        ids, targets = (
            torch.randint(1, VOCAB, (BATCH, length), generator=g),
            torch.randint(1, VOCAB, (BATCH, 4), generator=g),
        )
        batches += list(zip(ids.chunk(split), targets.chunk(split), strict=True))
    return DataLoader(batches, batch_size=None)


def _cross_lengths(rank: int | None = None, world: int = 1) -> dict:
    """One process (``rank`` None: micro-batches accumulated) or 1F1B on 2 ranks, 3 steps: every weight."""
    pipelined = rank is not None
    if pipelined:
        lightning_env(rank, world)
    model = CrossLengths()
    if pipelined:
        strategy = TwoBPStrategy(num_microbatches=M, layers="model.inner.decoder.block", gather_full_model=True)
        _trainer(strategy, world).fit(model, _cross_batches())
    else:
        _trainer("auto", 1, accumulate_grad_batches=M).fit(model, _cross_batches(M))
    return _own(model)


def test_an_encoders_length_may_change_between_steps(two_ranks, request):
    ref = _cross_lengths()
    for out in two_ranks[request.node.name]:
        assert set(out) == set(ref)
        for n, value in out.items():
            torch.testing.assert_close(value, ref[n], rtol=1e-5, atol=1e-6, msg=n)


def _t5_checkpointed(rank: int, world: int) -> dict:
    """T5 with Hugging Face's own gradient checkpointing on, its decoder's blocks pipelined (ZB-H1, 2 ranks):
    this rank's weights and how often each of its encoder's layers ran per micro-batch."""
    lightning_env(rank, world)
    model = _make("hf-t5")
    inner = model.model.inner
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers 5 calls it a deprecated alias
        inner.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    calls = [0] * len(inner.encoder.block)
    for i, block in enumerate(inner.encoder.block):
        block.layer[0].register_forward_pre_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
    strategy = TwoBPStrategy(num_microbatches=M, schedule="zb-h1", layers="model.inner.decoder.block")
    _fit(model, strategy, world, BATCH)
    return {"params": _own(model), "encoder": [c / (3 * M) for c in calls], "rank": rank}


def test_an_encoders_own_checkpointing_is_taken_over_too(two_ranks, request):
    """Hugging Face's switch is off for the Trainer call and the pipeline checkpoints what it would have: the
    decoder's blocks, and the encoder's layers on the first stage (they ran plainly, holding every encoder
    activation one process recomputes). Exact against one process without checkpointing; each encoder layer
    runs twice per micro-batch (F, B's recompute), plus once per fit for the shapes the first stage sends."""
    ref = _reference("hf-t5", False)["params"]
    results = two_ranks[request.node.name]
    held = {n: v for out in results for n, v in out["params"].items()}
    assert set(held) == set(ref)
    for n, value in held.items():
        torch.testing.assert_close(value, ref[n], rtol=1e-5, atol=1e-6, msg=n)
    first = next(out for out in results if out["rank"] == 0)
    assert all(round(f - 2.0, 9) in (0.0, round(1 / (3 * M), 9)) for f in first["encoder"]), first["encoder"]


class Penalized(CausalLM):
    """nanoGPT with an L1 penalty of one weight in the loss: of the last stage's final norm (``ln_f``), or of the
    first stage's position embedding (``wpe``), a placeholder on the last stage, where the loss is computed."""

    def __init__(self, of: str) -> None:
        super().__init__("nanogpt")
        self.of = of

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return loss + 0.01 * getattr(self.model.transformer, self.of).weight.abs().sum()


def _penalized(rank: int | None = None, world: int = 1, of: str = "ln_f") -> dict:
    """3 steps, in one process (micro-batches accumulated) or pipelined: the weights, or the error raised."""
    if rank is not None:
        lightning_env(rank, world)
    model = Penalized(of)
    strategy: Any = "auto"
    if rank is not None:
        strategy = TwoBPStrategy(num_microbatches=M, layers="model.transformer.h", pipeline_timeout=60)
    try:
        _fit(
            model,
            strategy,
            world,
            BATCH if rank is not None else BATCH // M,
            accumulate_grad_batches=1 if rank is not None else M,
        )
    except Exception as e:  # noqa: BLE001 - what each rank raised is the result
        return {"error": f"{type(e).__name__}: {e}"}
    return _own(model)


def test_a_penalty_of_the_last_stages_weight_in_the_loss_matches_one_process(two_ranks, request):
    ref = _penalized()
    results = two_ranks[request.node.name]
    assert set().union(*results) == set(ref)
    for out in results:
        for n, value in out.items():
            torch.testing.assert_close(value, ref[n], rtol=1e-5, atol=1e-6, msg=n)


def test_a_penalty_of_another_stages_weight_in_the_loss_is_refused_naming_it(two_ranks, request):
    """The first stage's weight in the loss the last stage computes: every rank waited forever (the placeholder's
    backward made placeholder gradients, which the send to the first stage could not carry). Refused at the last
    stage's first forward, before any weight changes; the first stage names it (PeerFailed)."""
    first, last = (out["error"] for out in two_ranks[request.node.name])
    named = r"ElsewhereError: the loss training_step returned under strategy='twobp' uses model.transformer.wpe.weight"
    assert re.search(named + r" \(pipeline stage 0\).*on_after_backward", last), last
    assert first.startswith("PeerFailed: global rank 0") and re.search(named, first), first


@pytest.fixture(scope="module")
def two_ranks(request) -> conftest.Launch:
    """The models' cases, in one launch of 2 ranks: a test's first call may wait for all of them."""
    cases = {f"test_modulelist_models_match_one_process[{k}]": (_pipelined, args) for k, args in CASES.items()}
    cases["test_bf16_true_stand_ins_carry_the_models_cast"] = (_bf16, ())
    cases["test_bf16_mixed_stand_ins_take_autocasts_cast"] = (_bf16, ("conv-embedded", "bf16-mixed"))
    cases["test_masking_drawn_in_the_step_is_the_same_on_every_stage"] = (_masked, ())
    cases["test_an_encoders_length_may_change_between_steps"] = (_cross_lengths, ())
    cases["test_an_encoders_own_checkpointing_is_taken_over_too"] = (_t5_checkpointed, ())
    cases["test_a_penalty_of_the_last_stages_weight_in_the_loss_matches_one_process"] = (_penalized, ())
    # Last: an error of one rank's step closes the process group's links (the cases after it would not run).
    cases["test_a_penalty_of_another_stages_weight_in_the_loss_is_refused_naming_it"] = (_penalized, ("wpe",))
    return launch(request, 2, cases, timeout=840)


# ---------------------------------------------------------------------------------------------- errors
class Gate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, x, scale=None, residual=None, shared=None, bias=None, collect=None):
        y = torch.tanh(self.lin(x) if bias is None else self.lin(x) + bias)
        if collect is not None:  # an auxiliary loss per block, into a list every block is given
            collect.append(y.square().mean())
        y = y if scale is None else y * scale
        if shared is not None:  # the first block leaves its output to the later ones (Gemma4's KV sharing)
            y = y + shared["kv"] if "kv" in shared else shared.setdefault("kv", y)
        return y if residual is None else (y, residual + y)


class KeyedGate(Gate):
    """A block whose first call leaves a projection of a side input from the batch to the later blocks (keys
    and values shared across layers, computed from the conditioning): on a later stage, the meta twin of a
    block of another stage was handed the real side input, and its projection by meta weights came out as a
    real tensor of uninitialised memory (torch's matmul of a CPU tensor by a meta one), which the later blocks
    of this stage computed with, silently."""

    def __init__(self) -> None:
        super().__init__()
        self.kv = nn.Linear(6, 6, bias=False)

    def forward(self, x, cond=None, shared=None):
        assert shared is not None
        cond = shared["cond"] if cond is None else cond  # the side input itself in the dict: likewise
        return torch.tanh(self.lin(x)) + shared.setdefault("kv", self.kv(cond))


class EmbedWithPositions(nn.Module):
    """A module before the blocks that returns a value made from its input's shape alone beside the hidden
    state (integer positions: not sent, the next stage's stand-in makes them), or drawn at random
    (``drawn``: floating, sent, and the next stage's own draw replaced by it)."""

    def __init__(self, drawn: bool = False) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.drawn = drawn

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.drawn:
            return self.lin(x), torch.rand(x.shape[0], 1, device=x.device)
        return self.lin(x), torch.arange(x.shape[-1], device=x.device)


POSITIONS = ("positions", "drawn", "drawn-in-place")


class Loop(nn.Module):
    """A small loop model whose forward does one thing the contract does not support (``kind``)."""

    def __init__(self, kind: str = "") -> None:
        super().__init__()
        self.kind = kind
        if kind == "registered-late":
            self.blocks = nn.ModuleList(Gate() for _ in range(4))
            self.embed = nn.Linear(6, 6)  # registered after the blocks, but called before them
        else:
            self.embed = EmbedWithPositions(kind.startswith("drawn")) if kind in POSITIONS else nn.Linear(6, 6)
            if kind.startswith("registered-early"):
                self.norm = nn.LayerNorm(6)  # registered before the blocks, called after them (OPT's decoder)
            if kind == "in-place":
                self.cond = nn.Linear(6, 6)  # before the blocks: its output given to every block, then changed
            gate = KeyedGate if kind.startswith("shared-from-") else Gate
            self.blocks = nn.ModuleList(gate() for _ in range(1 if kind == "shared" else 4))
        if kind == "loose-both":  # a parameter the model holds directly, used before the loop and after it
            self.temperature = nn.Parameter(torch.ones(()))
        if kind in ("loose-inside", "loose-host", "loose-partial"):  # given to every block; after the loop, untraced
            # (placed before it, and said); before the loop, the trace stopped after the blocks (placed all the same)
            self.gate = nn.Parameter(torch.ones(6))
        if kind == "weighted-layer-sum":
            # Hugging Face's audio classifiers (Whisper, Wav2Vec2): every block's output, weighted by a parameter
            # the model holds directly; "put it in a module of its own" was the wrong fix for it
            self.config = SimpleNamespace(use_weighted_layer_sum=True)
            self.layer_weights = nn.Parameter(torch.ones(4) / 4)
        if kind == "layerdrop":
            # Wav2Vec2's default: each stage drew its own skips, and training stopped at a random step, by a
            # "called when block k was next", or by a misplaced-module error where every block was skipped
            self.config = SimpleNamespace(layerdrop=0.5)
        self.head = nn.Linear(6, 2)
        if kind == "tied-outside-tree":
            # torchtune's TiedLinear: a plain object (no nn.Module) holding the embedding module, whose weight the
            # head reads after the loop; no placeholder stands in for a module reached outside the module tree
            self.tied = SimpleNamespace(tied_module=self.embed)
        if kind in ("router-logits", "router-hook"):
            # Hugging Face's MoE collects every block's router logits by hooks inside the blocks and adds an
            # auxiliary loss of them: a block of another stage does not run its hook, and nothing says so;
            # "router-hook" is the user's own hooks, with no config flag to see
            if kind == "router-logits":
                self.config = SimpleNamespace(output_router_logits=True)
            self.collected: list[torch.Tensor] = []
            for block in self.blocks:
                block.lin.register_forward_hook(lambda _m, _a, out: self.collected.append(out))

    def forward(self, x, offset=0.0):
        if self.kind in ("router-logits", "router-hook"):
            self.collected.clear()
        if self.kind in POSITIONS:
            h, positions = self.embed(x)
            side = positions  # given to every block as it came out of the module
        else:
            h = self.embed(x) + offset
            side = (h.sum(-1, keepdim=True) > 0).float() if self.kind == "side-from-embedding" else None
        if self.kind == "loose-partial":
            h = h * self.gate
        if self.kind == "registered-early-both":  # on both sides of the loop: one stage cannot hold it
            h = self.norm(h)
        if self.kind == "loose-both":
            h = h * self.temperature
        if self.kind in ("registered-early-host", "loose-host"):  # a read on the host, which the trace cannot make
            h = h * (len(x[:, 0].tolist()) / x.shape[0])
        residual = torch.zeros_like(x) if self.kind == "residual" else None
        shared: dict[str, torch.Tensor] = {}
        hs: list[torch.Tensor] = []
        cond = self.cond(x) if self.kind == "in-place" else None
        collected: list[torch.Tensor] = []
        if self.kind == "shared":  # ALBERT: one layer group, called for every layer
            for _ in range(4):
                h = self.blocks[0](h)
        for i, block in enumerate([] if self.kind == "shared" else self.blocks):
            if self.kind == "skip" and i == 1:
                continue
            if self.kind == "layerdrop" and self.training and torch.rand([]) < self.config.layerdrop:
                continue
            if self.kind == "shared-state":
                h = block(h, shared=shared)
            elif self.kind == "shared-from-side-input":
                h = block(h, cond=x, shared=shared)
            elif self.kind == "shared-from-its-side-input":
                shared.setdefault("cond", x)
                h = block(h, shared=shared)
            elif self.kind == "in-place":
                h = block(h, bias=cond)
                cond.mul_(0.5)  # out of any block: on a stage that received it, the change would not reach it
            elif self.kind == "drawn-in-place":
                h = block(h, scale=side)
                side.mul_(0.5)  # the stage's own draw, replaced by the one received: the change would not reach it
            elif self.kind == "loose-inside":
                h = block(h, scale=self.gate)
            elif self.kind == "collect-list":
                h = block(h, collect=collected)
            elif residual is None:
                h = block(h, scale=side)
            else:
                h, residual = block(h, residual=residual)  # two hidden states between blocks
            hs.append(h)
            if self.kind == "control-flow" and h.abs().max() > 1e6:
                break
        if self.kind == "tied-outside-tree":
            h = F.linear(h, self.tied.tied_module.weight)
        if self.kind == "read-directly":  # a head tied by a read of the weight, in the model's forward
            h = h @ self.embed.weight.T
        out = self.head(self.norm(h) if self.kind.startswith("registered-early") else h)
        if self.kind == "loose-both":
            out = out / self.temperature
        if self.kind == "loose-host":
            out = out * self.gate[: out.shape[-1]]
        if self.kind == "loose-partial":  # Hugging Face's CTC loss after the blocks: no meta kernel (masked_select)
            out = out * (len(out[:, 0].tolist()) / out.shape[0])
        if collected:
            out = out + torch.stack(collected).sum()
        if self.kind in ("router-logits", "router-hook"):
            out = out + torch.stack([c.square().mean() for c in self.collected]).mean()
        return (out, hs) if self.kind == "collect" else out


class LoopRegressor(pl.LightningModule):
    def __init__(self, kind: str = "") -> None:
        super().__init__()
        torch.manual_seed(0)
        if kind == "embedded-in-step":
            self.embed = nn.Linear(6, 6)  # the step embeds, the model is given inputs_embeds
        self.model = Loop(kind)
        self.kind = kind

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.kind == "embedded-in-step":
            x = self.embed(x)
        out = self.model(x, offset=float(x[0, 0])) if self.kind == "data-flag" else self.model(x)
        if self.kind == "twice":
            out = out + self.model(x)
        out = out[0] if isinstance(out, tuple) else out
        return F.mse_loss(out, y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _regression() -> DataLoader:
    return regression_data(16)


def _errors(rank: int, world: int, kinds: list[str]) -> dict:
    """One process holding both stages of the V (zb-v, pipeline degree 1): every stage-to-stage rule
    applies, without a second process. A kind ending in "-auto" runs under schedule="auto", whose profile
    runs every layer as a stage of its own first."""
    lightning_env(rank, world)
    out = {}
    for kind in kinds:
        auto = kind.endswith("-auto")
        options = {"schedule": "auto", "memory_limit": "1f1b"} if auto else {"schedule": "zb-v"}
        try:
            _trainer(TwoBPStrategy(num_microbatches=2, **options), world, max_steps=1).fit(
                LoopRegressor(kind.removesuffix("-auto")), _regression()
            )
        except Exception as e:  # noqa: BLE001 - the message is what is tested
            out[kind] = f"{type(e).__name__}: {e}"
        else:
            out[kind] = "trained"
    return out


ERRORS = {
    "": "trained",
    "control-flow": r"read on the host.*control flow between the pipelined blocks that depends on the data",
    "side-from-embedding": r"an argument of it \(model.blocks\[2\]\) was computed by model.embed \(pipeline stage 0\)",
    "collect": r"model returned a value computed by model.blocks\[0\] \(pipeline stage 0\)",
    "skip": r"model.blocks\[2\] was called when block 1 was next",
    # placed where the model's forward calls them, traced before the cut (lightning/call_order.py)
    "registered-late": "trained",
    "registered-early": "trained",
    "registered-early-auto": "trained",
    "registered-early-both": (
        r"model.norm is called after model.blocks\[3\] .* registered before model.blocks, so it was placed on the "
        r"first pipeline stage .*the traced forward called it both before and after the loop.*give each side of the "
        r"loop a module of its own"
    ),
    "registered-early-host": (
        r"model.norm is called after model.blocks\[3\] .* registered before model.blocks, so it was placed on the "
        r"first pipeline stage .*the call order was not traced before the cut \(the model's forward did not run on "
        r"the meta device \(NotImplementedError: Cannot copy out of meta tensor.*"
        r"`m = self.model.norm; del self.model.norm; self.model.norm = m`"
    ),
    # two values between blocks: the layers are profiled one by one with both between them (auto refused it)
    "residual-auto": "trained",
    "router-logits": r"model is asked to collect values from every block \(output_router_logits=True in model.config\)",
    # the user's own hooks: the twins of other stages' blocks run their hooks, at every micro-batch (with both
    # stages of the V on this rank no twin ran, and the auxiliary loss took this stage's blocks only, silently)
    "router-hook": r"model returned a value computed by model.blocks\[0\].*values a forward hook collects",
    "loose-both": (
        r"ValueError: the model's forward uses model.temperature \(shape \(\)\), a parameter held directly by model, "
        r"both before and after model.blocks .* Give each side a module of its own holding it, tied"
    ),
    "loose-inside": (
        r"ValueError: the model's forward uses model.gate \(shape \(6,\)\), a parameter held directly by model, "
        r"between the blocks of model.blocks .* Make it the blocks' own"
    ),
    # untraced: placed before the loop, and said (a warning); used after it, the last stage's first step refuses it
    "loose-host": r"model.gate \(pipeline stage 0\) is used in the graph of this pipeline stage, but is not one of",
    "loose-partial": "trained",
    "weighted-layer-sum": (
        r"model mixes the hidden states of every block in model.blocks \(use_weighted_layer_sum=True in model.config, "
        r"weighted by its parameter layer_weights\).*set use_weighted_layer_sum=False"
    ),
    "layerdrop": (
        r"^ValueError: model drops blocks at random in training \(model.config.layerdrop=0.5: LayerDrop\).*"
        r"set self.model.config.layerdrop = 0.0 before fit"
    ),
    "shared-state": (
        r"an argument of it \(model.blocks\[2\]\) was computed by model.blocks\[0\] \(pipeline stage 0\)"
        r".*Not supported: blocks that hand values to later blocks through a side input"
    ),
    "shared-from-side-input": (
        r"an argument of it \(model.blocks\[2\]\) was computed by model.blocks\[0\] \(pipeline stage 0\)"
        r".*Not supported: blocks that hand values to later blocks through a side input"
    ),
    "shared-from-its-side-input": (
        r"an argument of it \(model.blocks\[2\]\) was computed by model.blocks\[0\] \(pipeline stage 0\)"
    ),
    "twice": r"the step called model a second time",
    # refused at setup by the call-order trace (test_a_head_tied_outside_the_module_tree_is_refused_at_setup...)
    "tied-outside-tree": (
        r"^ValueError: the model's forward uses model.embed.weight \(shape \(6, 6\)\) after model.blocks, outside "
        r"any call of model.embed .*torchtune's TiedLinear.*head.weight = embed.weight"
    ),
    "read-directly": (
        r"^ValueError: the model's forward uses model.embed.weight \(shape \(6, 6\)\) after model.blocks, outside "
        r"any call of model.embed .*`h @ embed.weight.T`"
    ),
    # Qwen3 given inputs_embeds the step computed: the message names the module's weight
    "embedded-in-step": r"an argument of model requires grad: a module with parameters runs before it in the step "
    r"\(computed from embed.bias, embed.weight\)",
    # two hidden states between blocks: both sent on (exact against one process: test_modulelist_models_match_...)
    "residual": "trained",
    # a module's output beside the hidden state that the next stage computes itself: sent, and used
    "positions": "trained",
    "in-place": r"ElsewhereWrite: .* changes in place a value computed by model.cond \(pipeline stage 0\), which this",
    # drawn before the blocks: sent, and used where the stage's stand-in drew its own
    "drawn": "trained",
    "drawn-in-place": r"ElsewhereWrite: a value this pipeline stage received from the previous one was changed",
    # each block's auxiliary loss into one list: the last stage summed its own blocks' alone, silently
    "collect-list": (
        r"an argument of it \(model.blocks\[2\]\) was computed by model.blocks\[0\] \(pipeline stage 0\).*"
        r"Not supported: blocks that hand values to later blocks through a side input they write into"
    ),
    "data-flag": r"the step calls model with .* in micro-batch 0 and .* in micro-batch 1",
    "shared": r"model.blocks holds 1 block\(s\), fewer than the 2 pipeline stages.*calls the same block several times",
}


@pytest.mark.dist
def test_what_the_contract_does_not_support_raises_before_a_silent_answer():
    results = run_distributed(_errors, 1, list(ERRORS), timeout=240)[0]
    for kind, match in ERRORS.items():
        if match == "trained":
            assert results[kind] == "trained", results[kind]
        else:
            assert results[kind] != "trained", f"{kind}: trained without an error"
            assert re.search(match, results[kind], re.S), f"{kind}: {results[kind]}"


class _TiedByReference:
    """torchtune's TiedLinear: not an nn.Module; it keeps the embedding module and reads its weight."""

    def __init__(self, tied_module: nn.Module) -> None:
        self.tied_module = tied_module

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.tied_module.weight)


class _TiedLoop(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 6)
        self.blocks = nn.ModuleList(nn.Linear(6, 6) for _ in range(4))
        self.output = _TiedByReference(self.embed)  # torchtune: `self.output = TiedLinear(self.tok_embeddings)`

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for block in self.blocks:
            h = torch.tanh(block(h))
        return self.output(h)


class _TiedLM(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = _TiedLoop()
        self.ran: list[str] = []  # real compute: a block's call (the trace's meta copy runs no hooks), a step
        for block in self.model.blocks:
            block.register_forward_hook(lambda *_: self.ran.append("block"))

    def training_step(self, batch, batch_idx):
        ids, targets = batch
        return F.cross_entropy(self.model(ids).flatten(0, 1), targets.flatten())

    def optimizer_step(self, *args, **kwargs):
        self.ran.append("optimizer step")
        super().optimizer_step(*args, **kwargs)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _tied_by_reference(rank: int, world: int) -> tuple[str, list[str], bool]:
    lightning_env(rank, world)
    lm = _TiedLM()
    before = [q.detach().clone() for q in lm.parameters()]
    ids = torch.randint(0, VOCAB, (4 * BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    try:
        _trainer(TwoBPStrategy(schedule="1f1b", num_microbatches=2), world, max_steps=1).fit(
            lm, DataLoader(TensorDataset(ids, (ids + 1) % VOCAB), batch_size=BATCH)
        )
    except Exception as e:  # noqa: BLE001 - the message is what is tested
        error = f"{type(e).__name__}: {e}"
    else:
        error = "trained"
    # a rank that set a layer aside may hold it on meta after a failure: its values are not compared
    now = zip(lm.parameters(), before, strict=True)
    untouched = all(q.grad is None and (q.is_meta or torch.equal(q, b)) for q, b in now)
    return error, lm.ran, untouched


@pytest.mark.dist
def test_a_head_tied_outside_the_module_tree_is_refused_at_setup_on_every_rank():
    """torchtune's TiedLinear (a plain object holding the embedding, whose weight the head reads after the loop) was
    refused at the first F, once stage 0 had run; the call-order trace sees the read now (the reference reaches the
    original embedding, traced as its meta copy), and every rank refuses it at setup, before any block ran, naming
    the weight, its shape and the fix."""
    results = run_distributed(_tied_by_reference, 2, timeout=240)
    for rank, (error, ran, untouched) in enumerate(results):
        assert re.search(
            r"^ValueError: the model's forward uses model.embed.weight \(shape \(13, 6\)\) after model.blocks, "
            r"outside any call of model.embed .*model.embed is on the first pipeline stage, and the last stage.*"
            r"torchtune's TiedLinear.*`head = nn.Linear\(dim, vocab, bias=False\); head.weight = embed.weight`",
            error,
            re.S,
        ), f"rank {rank}: {error}"
        assert ran == [] and untouched, f"rank {rank}: ran {ran}, parameters untouched {untouched}"


# ---------------------------------------------------------------------------------------------- units
def test_elsewhere_tensors_compute_shapes_and_refuse_reads():
    x = elsewhere(torch.randn(2, 3, 4), "embed (pipeline stage 0)")
    y = torch.nn.functional.layer_norm(x + torch.randn(4), (4,)).to(torch.float16)[:, 1:]
    assert type(y).__name__ == "Elsewhere" and y.shape == (2, 2, 4) and y.dtype == torch.float16
    assert y.device == torch.device("cpu") and "embed (pipeline stage 0)" in repr(y)
    real = torch.arange(x.shape[1], device=x.device)  # shapes and devices are real
    assert type(real) is torch.Tensor and real.tolist() == [0, 1, 2]
    with pytest.raises(ElsewhereError, match="read on the host"):
        bool(x.sum() > 0)
    with pytest.raises(ElsewhereError, match="read on the host"):
        x.max().item()
    with pytest.raises(ElsewhereError, match="writes a value computed by embed"):
        torch.zeros(2, 3, 4).add_(x)
    assert find_elsewhere({"a": (1, [torch.ones(1), y])}) is y and find_elsewhere((torch.ones(1), None)) is None


def test_hugging_face_models_are_found_and_placed():
    transformers = pytest.importorskip("transformers", reason="the Hugging Face models need transformers")
    lm = CausalLM("hf-gpt2")
    c = find_contract(lm)
    assert isinstance(c, ModuleListContract) and c.list_name == "model.transformer.h" and c.name == "model"
    groups = [g.paths for g in c.layers()]
    assert groups[0] == ["model.transformer.wte", "model.transformer.wpe", "model.transformer.h.0"]
    assert groups[-1] == ["model.transformer.h.3", "model.transformer.ln_f", "model.lm_head"]
    c = find_contract(CausalLM("hf-llama"))
    assert c.list_name == "model.model.layers"
    assert [g.paths for g in c.layers()][-1] == ["model.model.layers.3", "model.model.norm", "model.lm_head"]
    assert transformers  # the rotary embedding (buffers only) stays on every stage: in no group
    assert all("rotary" not in p for g in c.layers() for p in g.paths)


def test_discovery_and_its_errors():
    assert isinstance(find_contract(LoopRegressor()), ModuleListContract)
    seq = nn.Sequential(nn.Linear(2, 2))
    assert isinstance(find_contract(seq), SequentialContract)

    class Two(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.encoder = nn.ModuleList(nn.Linear(2, 2) for _ in range(2))
            self.decoder = nn.ModuleList(nn.Linear(2, 2) for _ in range(2))

    with pytest.raises(
        ValueError,
        match=r"holds 2 candidates for the pipeline \(decoder \(ModuleList, 2 layers\), encoder.*an encoder-decoder: "
        r"name the decoder's blocks, and the encoder runs whole on the first stage",
    ):
        find_contract(Two())
    assert find_contract(Two(), layers="encoder").list_name == "encoder"
    longer = Two()
    longer.decoder.extend(nn.Linear(2, 2) for _ in range(2))  # the example names the longest list, not the first
    with pytest.raises(ValueError, match=r"e\.g\. layers='decoder' for the blocks"):
        find_contract(longer)
    longer.decoder = nn.ModuleList([nn.Linear(2, 2)])
    with pytest.raises(ValueError, match=r"e\.g\. layers='encoder' for the blocks"):
        find_contract(longer)
    with_metrics = Two()
    del with_metrics.decoder
    with_metrics.metrics = nn.ModuleList(nn.Identity() for _ in range(2))  # no parameters: not a candidate
    assert find_contract(with_metrics).list_name == "encoder"
    normed = Two()
    del normed.decoder
    normed.conv = nn.utils.parametrizations.weight_norm(nn.Conv1d(2, 2, 3))  # Wav2Vec2's pos_conv_embed
    assert find_contract(normed).list_name == "encoder"  # its ParametrizationList is not a candidate
    with pytest.raises(ValueError, match="holds no nn.Sequential and no nn.ModuleList of blocks with parameters"):
        find_contract(nn.Linear(2, 2))
    # blocks of two classes (Jamba's Mamba and attention layers) are named, with the option that pipelines them
    hybrid = _holder(nn.ModuleList([nn.Linear(2, 2), nn.Conv1d(2, 2, 1), nn.Linear(2, 2)]))
    with pytest.raises(
        ValueError,
        match=r"different classes are not taken on their own: blocks \(3 blocks: Conv1d, Linear\); if its "
        r"forward loops over one, name it, e\.g\. layers='blocks'",
    ):
        find_contract(hybrid)
    assert find_contract(hybrid, layers="blocks").list_name == "blocks"
    # Zamba2: hybrid blocks of the mixed list each hold an adapter ModuleList: the mixed list is offered too, and is
    # the example (it was an adapter list)
    zamba = _holder(nn.ModuleList([nn.Linear(2, 2), nn.Module(), nn.Module()]))
    for hybrid in zamba.blocks[1:]:
        hybrid.adapters = nn.ModuleList(nn.Linear(2, 2) for _ in range(2))
    with pytest.raises(
        ValueError,
        match=r"holds 2 candidates for the pipeline \(blocks.1.adapters \(ModuleList, 2 layers\), blocks.2.adapters "
        r"\(ModuleList, 2 layers\); around them, blocks of different classes: blocks \(3 blocks: Linear, Module\)\)"
        r": name the one .* e\.g\. layers='blocks'",
    ):
        find_contract(zamba)
    # a backbone's blocks inside nn.ModuleList([backbone, head]) are found once: still the pipeline
    wrapper = _holder(nn.ModuleList([_holder(nn.ModuleList(nn.Linear(2, 2) for _ in range(2))), nn.Linear(2, 2)]))
    assert find_contract(wrapper).list_name == "blocks.0.blocks"
    # an encoder and a decoder in one list, each with its blocks: the example is still a list of blocks
    towers = _holder(nn.ModuleList([_holder(nn.ModuleList(nn.Linear(2, 2) for _ in range(3))), nn.Conv1d(2, 2, 1)]))
    towers.blocks[1].blocks = nn.ModuleList(nn.Linear(2, 2) for _ in range(3))
    with pytest.raises(ValueError, match=r"holds 2 candidates .* e\.g\. layers='blocks.0.blocks'.*encoder-decoder"):
        find_contract(towers)
    with pytest.raises(ValueError, match="not to an nn.Sequential or an nn.ModuleList"):
        find_contract(Two(), layers="encoder.0")
    with pytest.raises(ValueError, match="give one dotted path"):
        find_contract(Two(), layers=["encoder", "decoder"])
    shared = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="holds the same module more than once"):
        find_contract(_holder(nn.ModuleList([shared, shared])), layers="blocks")


def test_a_misplaced_module_beside_a_tower_names_the_tower_to_move():
    """CLIP pipelining its text tower's layers: the vision tower, registered after the text tower and called
    before it, is fixed by moving the text tower (the child of their parent), not its layers."""
    root = nn.Module()
    root.model = nn.Module()
    root.model.tower = _holder(nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)]))
    root.model.tower.norm = nn.LayerNorm(2)
    root.model.vision = nn.Linear(2, 2)
    contract = find_contract(root, layers="model.tower.blocks")
    assert contract.holding_blocks("model.vision") == "model.tower"
    assert contract.holding_blocks("model.tower.norm") == "model.tower.blocks"
    assert find_contract(_holder(nn.ModuleList([nn.Linear(2, 2)]))).holding_blocks("embed") == "blocks"


def test_a_module_the_step_calls_before_the_pipelined_call_is_told_to_call_it_after():
    """Knowledge distillation with the teacher called before the student (a trial on torchtune): the step's code
    before the pipelined call runs on the first stage and again on the last, so the teacher, on one of them, is
    refused on the other. "Register it before the blocks" and then "after them" sent the user round in a circle;
    the message now says to call it after the pipelined call (torchtune's recipe order, exact in the trial)."""
    root = nn.Module()
    root.model = Loop()
    root.teacher = nn.Linear(6, 2)  # registered after the blocks: the last stage
    contract = find_contract(root, layers="model.blocks")
    contract.place_by_calls({"model.embed": "before", "model.head": "after"}, None)  # traced: the step calls it
    hint = contract.registration_hint("teacher", before=False)
    assert (
        "the step calls it: if before the pipelined call (a teacher whose output the loss takes), call it after" in hint
    )
    assert "if it runs before the blocks, register it before them" in hint
    assert "call it after, where" not in contract.registration_hint("model.head", before=False)  # the model's call


def _holder(blocks: nn.ModuleList) -> nn.Module:
    m = nn.Module()
    m.blocks = blocks
    return m


def test_swap_puts_every_part_back():
    lm = CausalLM("nanogpt")
    before = dict(lm.named_modules())
    c = find_contract(lm)
    stand_in = nn.Identity()
    removed = c.swap({0: stand_in, 3: stand_in})
    assert lm.model.transformer.h[0] is stand_in and isinstance(lm.model.transformer.wte, nn.Identity)
    assert (
        lm.model.lm_head is not before["model.lm_head"]
        and lm.model.transformer.ln_f is not before["model.transformer.ln_f"]
    )
    c.swap(removed)
    assert dict(lm.named_modules()) == before


def test_a_set_aside_module_answers_attribute_reads_and_refuses_calls():
    """What a stage sees of a module another stage holds: its settings as they are, its submodules as
    placeholders, its tensors as Elsewhere values (shape, dtype after the model's casts, the rank's device);
    out of parameters() and state_dict; a call names the module and, outside the blocks, the fix."""
    lm = CausalLM("nanogpt")
    c = find_contract(lm)
    layer = c.layers()[0]  # block 0 with the embeddings registered before the blocks
    lm.to(torch.float64)  # before the split: the set-aside module keeps its own dtype
    removed = c.swap({0: _Remote(0, 0, c.parts(layer), torch.device("cpu"), c.describe(0))})
    for part in c.parts(layer):  # as the split sets them aside: on meta (a tensor a stage here uses would stay)
        part.to("meta")
    try:
        wpe, block = lm.model.transformer.wpe, lm.model.transformer.h[0]
        assert list(wpe.parameters()) == []  # nothing of it here
        assert isinstance(wpe, _Remote) and isinstance(block.mlp, _Remote) and block.n_head == 2
        weight = wpe.weight
        assert isinstance(weight, Elsewhere) and weight.shape == (SEQ, 16) and weight.dtype == torch.float64
        lm.to(torch.float32)  # a precision's cast after the split reaches the answers
        assert wpe.weight.dtype == torch.float32 and wpe.weight.device == torch.device("cpu")
        assert block.ln_1.weight.dtype == torch.float32  # a nested read knows the cast too
        with pytest.raises(ElsewhereError, match=r"model\.transformer\.wpe\.weight \(pipeline stage 0\)"):
            (torch.ones(2, 16) @ wpe.weight.T).sum().item()  # computes on meta; reading it raises
        held = {id(q) for q in lm.parameters()}
        assert not any(id(q) in held for q in layer.parts()[1].parameters())  # wpe's, set aside
        assert not any(k.startswith("model.transformer.wpe") for k in lm.state_dict())
        fix = r"registered before model\.transformer\.h, so it was placed on the first pipeline stage"
        with pytest.raises(RuntimeError, match=r"model\.transformer\.wpe belongs to pipeline stage 0.*" + fix):
            wpe(torch.zeros(1, dtype=torch.long))
        with pytest.raises(AttributeError):
            _ = wpe.no_such_attribute
    finally:
        c.swap(removed)
