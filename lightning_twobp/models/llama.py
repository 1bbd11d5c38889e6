"""A LLaMa-like decoder as one ``nn.Sequential``: embedding, N blocks, norm + head.

RMSNorm, rotary position embeddings, SwiGLU feed-forward and causal scaled-dot-product attention with an
optional grouped-query layout, as in the 2BP paper's Transformer-7b (dim 4096, 32 layers, 32 heads).
Every element of the Sequential takes and returns one tensor, so any contiguous slice is a stage.
:class:`LlamaLM` is the LightningModule around it (next-token cross-entropy).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from typing_extensions import Unpack

from lightning_twobp.models.base import LanguageModel, Training, training_arguments


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int = 1024
    dim: int = 512
    n_layers: int = 8
    n_heads: int = 8
    n_kv_heads: int | None = None  # None: as many as n_heads (no grouping)
    ffn_hidden: int | None = None  # None: LLaMa's 2/3 * 4 * dim rounded up to a multiple of 64
    max_seq_len: int = 1024
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0

    @property
    def hidden(self) -> int:
        if self.ffn_hidden is not None:
            return self.ffn_hidden
        h = int(2 * 4 * self.dim / 3)
        return 64 * ((h + 63) // 64)


class Linear(nn.Linear):
    """A projection without bias, initialized as LLaMa's: normal, std 0.02. Each module initializes
    itself in ``reset_parameters`` (its constructor calls it), so a model built on the meta device is
    made with the same values at setup (:mod:`lightning_twobp.lightning.materialize`)."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__(in_features, out_features, bias=False)

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=0.02)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 for stability under bf16 autocast, as LLaMa does.
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: (B, H, T, D); rotate pairs (even, odd) by the position's angle.
    x1, x2 = x[..., ::2], x[..., 1::2]
    out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return out.flatten(-2)


class Attention(nn.Module):
    """Causal self-attention with rotary position embeddings: from its own cos/sin tables, or from
    ``cos``/``sin`` passed in (the loop form, :mod:`lightning_twobp.models.llama_loop`, makes them
    once before the loop, as Hugging Face's models do)."""

    cos: torch.Tensor  # buffers, with rope_tables
    sin: torch.Tensor

    def __init__(self, cfg: LlamaConfig, rope_tables: bool = True) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.n_kv = cfg.n_kv_heads or cfg.n_heads
        if cfg.dim % cfg.n_heads or cfg.n_heads % self.n_kv:
            raise ValueError(
                f"dim {cfg.dim} must divide by n_heads {cfg.n_heads}, and n_heads by n_kv_heads {self.n_kv}"
            )
        self.head_dim = cfg.dim // cfg.n_heads
        self.wq = Linear(cfg.dim, cfg.n_heads * self.head_dim)
        self.wk = Linear(cfg.dim, self.n_kv * self.head_dim)
        self.wv = Linear(cfg.dim, self.n_kv * self.head_dim)
        self.wo = Linear(cfg.n_heads * self.head_dim, cfg.dim)
        self.cfg = cfg
        if rope_tables:
            cos, sin = rope_tables_of(cfg)
            self.register_buffer("cos", cos, persistent=False)
            self.register_buffer("sin", sin, persistent=False)

    def reset_parameters(self) -> None:
        """The rotary tables again (a meta build has none): the projections initialize themselves."""
        if hasattr(self, "cos"):
            copy_rope_tables(self, self.cfg)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor | None = None, sin: torch.Tensor | None = None
    ) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)  # (B, H, T, D)
        k = self.wk(x).view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        if cos is None or sin is None:
            cos, sin = self.cos, self.sin
        cos, sin = cos[:t].to(q.dtype), sin[:t].to(q.dtype)
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        if self.n_kv != self.n_heads:
            rep = self.n_heads // self.n_kv
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


def rope_tables_of(cfg: LlamaConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary cos and sin tables, each (max_seq_len, head_dim / 2)."""
    head_dim = cfg.dim // cfg.n_heads
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, head_dim, 2).float() / head_dim))
    ang = torch.outer(torch.arange(cfg.max_seq_len).float(), inv)  # (T, D/2)
    return ang.cos(), ang.sin()


def copy_rope_tables(module: nn.Module, cfg: LlamaConfig) -> None:
    """``module``'s ``cos`` and ``sin`` buffers set to the tables, on their device."""
    for name, table in zip(("cos", "sin"), rope_tables_of(cfg), strict=True):
        buffer: torch.Tensor = getattr(module, name)
        with torch.no_grad():
            buffer.copy_(table)


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = Linear(dim, hidden)
        self.w2 = Linear(hidden, dim)
        self.w3 = Linear(dim, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))  # SwiGLU


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig, rope_tables: bool = True) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = Attention(cfg, rope_tables)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.ffn = FeedForward(cfg.dim, cfg.hidden)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor | None = None, sin: torch.Tensor | None = None
    ) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)  # (B, T, C) -> (B, T, C)
        return x + self.ffn(self.ffn_norm(x))


class Embedding(nn.Embedding):
    """Token ids (B, T) -> (B, T, C); a separate class so partitioners can name it. Normal, std 0.02."""

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=0.02)


class Head(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.out = Linear(cfg.dim, cfg.vocab_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, C) -> (B, T, V) logits
        return self.out(self.norm(x))


def build_llama(cfg: LlamaConfig = LlamaConfig()) -> nn.Sequential:
    """Embedding, ``n_layers`` blocks and the head as one ``nn.Sequential`` of ``n_layers + 2`` layers."""
    layers: list[nn.Module] = [Embedding(cfg.vocab_size, cfg.dim)]
    layers += [Block(cfg) for _ in range(cfg.n_layers)]
    layers.append(Head(cfg))
    return nn.Sequential(*layers)


class LlamaLM(LanguageModel):
    """A LLaMa-like causal LM as a LightningModule; ``self.layers`` is :func:`build_llama`'s Sequential.

    Batches are ``(ids, targets)``, both ``(B, T)`` int64 with ``T <= max_seq_len``; the loss is the
    cross-entropy of the logits against ``targets``. The 2BP paper's Transformer-7b is ``dim=4096,
    n_layers=32, n_heads=32, ffn_hidden=11008, vocab_size=32000, max_seq_len=1024`` (6.74e9 parameters).
    ``seed`` seeds the initialisation so every process builds the same weights.
    ``**training``: the optimizer and seed arguments, :class:`~lightning_twobp.models.base.Training`
    (``lr=3e-3`` by default).
    """

    def __init__(
        self,
        vocab_size: int = 256,
        dim: int = 128,
        n_layers: int = 4,
        n_heads: int = 4,
        n_kv_heads: int | None = None,
        ffn_hidden: int | None = None,
        max_seq_len: int = 64,
        **training: Unpack[Training],
    ) -> None:
        training = training_arguments(training, lr=3e-3)  # all five, for save_hyperparameters()
        super().__init__(**training)
        self.save_hyperparameters()
        self.max_seq_len = max_seq_len
        self.config = LlamaConfig(
            vocab_size=vocab_size,
            dim=dim,
            n_layers=n_layers,
            n_heads=n_heads,
            n_kv_heads=n_kv_heads,
            ffn_hidden=ffn_hidden,
            max_seq_len=max_seq_len,
        )
        self._build()

    def _build(self) -> None:
        """The model, from the seeded RNG (a subclass may build another form of it)."""
        self.layers = build_llama(self.config)
