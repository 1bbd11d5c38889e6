"""BERT for masked-language modelling as one ``nn.Sequential``: embeddings, N encoder blocks, MLM head.

The 2BP paper's BERT-Large: 24 post-LN encoder blocks, 1024 wide, 16 heads, FFN 4096, vocab 30522,
sequences of 512. Blocks follow the original BERT: learned absolute positions, bidirectional attention,
biases everywhere, exact (erf) GELU, LayerNorm after each residual add (eps 1e-12).

Differences from the reference checkpoint (``bert-large-uncased``, 335,141,888 parameters in BertModel):

* The MLM decoder has its own weight. The reference ties it to the token embedding, but the embedding
  sits on the first pipeline stage and the decoder on the last; a tied weight would need its gradient
  summed across the two ranks every step and both copies kept in sync, which this pipeline does not do.
  Untying adds ``vocab_size x dim`` (31.3M at BERT-Large size).
* No pooler (it serves next-sentence prediction, which MLM pre-training here does not use).
* The token-type (segment) embedding is off by default: batches carry no segment ids. With
  ``type_vocab_size=2`` every token gets segment 0's embedding, which is what single-segment inputs get.

Every element of the Sequential takes and returns one tensor, so any contiguous slice is a stage.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from typing_extensions import Unpack

from lightning_twobp.models.base import LanguageModel, Training, training_arguments

__all__ = ["BertEmbeddings", "BertLayer", "BertMLM", "MLMHead", "build_bert"]

_LN_EPS = 1e-12  # BERT's LayerNorm epsilon


class Linear(nn.Linear):
    """BERT's initialization, in the module's own ``reset_parameters`` (its constructor calls it, and so
    does the setup of a model built on the meta device): normal(0, 0.02) weight, zero bias."""

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=0.02)
        nn.init.zeros_(self.bias)


class Embedding(nn.Embedding):
    """normal(0, 0.02), as BERT."""

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=0.02)


class BertEmbeddings(nn.Module):
    """Token ids ``(B, T)`` -> ``(B, T, C)``: token + learned position (+ segment 0), LayerNorm, dropout."""

    def __init__(
        self, vocab_size: int, dim: int, max_seq_len: int, type_vocab_size: int = 0, dropout: float = 0.0
    ) -> None:
        super().__init__()
        self.tokens = Embedding(vocab_size, dim)
        self.positions = Embedding(max_seq_len, dim)
        self.token_types = Embedding(type_vocab_size, dim) if type_vocab_size else None
        self.norm = nn.LayerNorm(dim, eps=_LN_EPS)
        self.dropout = nn.Dropout(dropout)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        t = ids.shape[1]
        if t > self.positions.num_embeddings:
            raise ValueError(
                f"sequence length {t} exceeds max_seq_len {self.positions.num_embeddings}: shorten the "
                f"sequences or build the model with max_seq_len >= {t}"
            )
        x = self.tokens(ids) + self.positions.weight[:t]  # (B, T, C) + (T, C)
        if self.token_types is not None:
            x = x + self.token_types.weight[0]  # every token is in segment 0
        return self.dropout(self.norm(x))


class BertLayer(nn.Module):
    """A post-LN encoder block: ``x = LN(x + attn(x)); x = LN(x + ffn(x))``, ``(B, T, C) -> (B, T, C)``."""

    def __init__(self, dim: int, n_heads: int, ffn_hidden: int, dropout: float = 0.0) -> None:
        super().__init__()
        if dim % n_heads:
            raise ValueError(f"dim {dim} must divide by n_heads {n_heads}")
        self.n_heads, self.head_dim, self.p = n_heads, dim // n_heads, dropout
        self.qkv = Linear(dim, 3 * dim)
        self.proj = Linear(dim, dim)
        self.attn_norm = nn.LayerNorm(dim, eps=_LN_EPS)
        self.fc1 = Linear(dim, ffn_hidden)
        self.fc2 = Linear(ffn_hidden, dim)
        self.ffn_norm = nn.LayerNorm(dim, eps=_LN_EPS)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.n_heads, self.head_dim).permute(2, 0, 3, 1, 4)  # 3 x (B, H, T, D)
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.p if self.training else 0.0)  # bidirectional
        x = self.attn_norm(x + self.dropout(self.proj(y.transpose(1, 2).reshape(b, t, c))))
        return self.ffn_norm(x + self.dropout(self.fc2(F.gelu(self.fc1(x)))))


class MLMHead(nn.Module):
    """``(B, T, C) -> (B, T, V)`` logits: dense + GELU + LayerNorm, then the (untied) decoder with bias."""

    def __init__(self, dim: int, vocab_size: int) -> None:
        super().__init__()
        self.dense = Linear(dim, dim)
        self.norm = nn.LayerNorm(dim, eps=_LN_EPS)
        # Untied from the token embedding: tied weights cannot span pipeline stages (module docstring).
        self.decoder = Linear(dim, vocab_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.norm(F.gelu(self.dense(x))))


def build_bert(
    vocab_size: int,
    dim: int,
    n_layers: int,
    n_heads: int,
    ffn_hidden: int,
    max_seq_len: int,
    type_vocab_size: int = 0,
    dropout: float = 0.0,
) -> nn.Sequential:
    """Embeddings, ``n_layers`` blocks and the MLM head as one Sequential of ``n_layers + 2`` layers,
    initialised as BERT: normal(0, 0.02) weights, zero biases, unit LayerNorms."""
    layers: list[nn.Module] = [BertEmbeddings(vocab_size, dim, max_seq_len, type_vocab_size, dropout)]
    layers += [BertLayer(dim, n_heads, ffn_hidden, dropout) for _ in range(n_layers)]
    layers.append(MLMHead(dim, vocab_size))
    return nn.Sequential(*layers)


class BertMLM(LanguageModel):
    """BERT masked-language modelling as a LightningModule.

    Batches are ``(ids, labels)``, both ``(B, T)`` int64, with ``labels == -100`` at the positions that
    were not masked; the loss is the cross-entropy over the masked positions. Under micro-batching the
    step's loss is the mean of the micro-batches' means (as with gradient accumulation): it equals the
    whole batch's mean when every micro-batch holds the same number of masked tokens, and weighs the
    tokens slightly differently otherwise; a micro-batch without any masked token has no loss (NaN), so
    mask at least one token per sequence.

    BERT-Large: ``vocab_size=30522, dim=1024, n_layers=24, n_heads=16, ffn_hidden=4096, max_seq_len=512``
    (366,426,938 parameters with the untied decoder; 335,141,888 in the reference BertModel).
    ``**training``: the optimizer and seed arguments, :class:`~lightning_twobp.models.base.Training`
    (``lr=1e-3`` by default).
    """

    def __init__(
        self,
        vocab_size: int = 256,
        dim: int = 128,
        n_layers: int = 4,
        n_heads: int = 4,
        ffn_hidden: int | None = None,  # None: 4 * dim, as BERT
        max_seq_len: int = 128,
        type_vocab_size: int = 0,
        dropout: float = 0.0,
        **training: Unpack[Training],
    ) -> None:
        training = training_arguments(training, lr=1e-3)  # all five, for save_hyperparameters()
        super().__init__(**training)
        self.save_hyperparameters()
        self.max_seq_len = max_seq_len
        self.layers = build_bert(
            vocab_size, dim, n_layers, n_heads, ffn_hidden or 4 * dim, max_seq_len, type_vocab_size, dropout
        )
