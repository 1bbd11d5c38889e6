"""A Hugging Face causal LM (GPT-2 or Llama) from a tiny config, random init, as a LightningModule.

The model is ``transformers``' own ``GPT2LMHeadModel`` / ``LlamaForCausalLM``, unchanged: its blocks
are the ``nn.ModuleList`` ``model.transformer.h`` / ``model.model.layers``, which the model's forward
calls in a loop with an attention mask and position ids (and, for Llama, rotary position
embeddings). ``strategy="twobp"`` pipelines that loop as it is (the ModuleList contract,
docs/strategy.md). Nothing is downloaded: the weights are a random initialisation from ``seed``.

``transformers`` is optional (``pip install transformers``, or the ``test`` extra); it is imported
when the model is built.
"""

from __future__ import annotations

from typing import Any

import torch
from typing_extensions import Unpack, override

from lightning_twobp.models.base import LanguageModel, Training, training_arguments

__all__ = ["HFCausalLM"]

_ARCHS = ("gpt2", "llama")


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as e:
        raise ImportError(
            "HFCausalLM builds a Hugging Face model and needs the transformers package: pip install transformers "
            "(it is in lightning_twobp's test extra: pip install 'lightning_twobp[test]')"
        ) from e
    return transformers


class HFCausalLM(LanguageModel):
    """``transformers``' GPT-2 or Llama, random init, trained on next-token cross-entropy.

    Batches are ``(ids, targets)`` or ``(ids, targets, attention_mask)``, all ``(B, T)``; targets of
    -100 (padding) are ignored. ``tie_embeddings`` ties the LM head to the token embedding (GPT-2's
    default): the embedding then lives on the first stage and the head on the last, kept in sync.
    Dropout is off by default (``dropout``), so a pipelined run can be compared with one process.
    ``**training``: the optimizer and seed arguments, :class:`~lightning_twobp.models.base.Training`
    (``lr=3e-3`` by default).
    """

    def __init__(
        self,
        arch: str = "gpt2",
        vocab_size: int = 256,
        dim: int = 64,
        n_layers: int = 4,
        n_heads: int = 4,
        n_kv_heads: int | None = None,
        max_seq_len: int = 64,
        tie_embeddings: bool = True,
        dropout: float = 0.0,
        **training: Unpack[Training],
    ) -> None:
        training = training_arguments(training, lr=3e-3)  # all five, for save_hyperparameters()
        super().__init__(**training)
        self.save_hyperparameters()
        if arch not in _ARCHS:
            raise ValueError(f"arch={arch!r}: choose one of {', '.join(_ARCHS)}")
        self.max_seq_len = max_seq_len
        self.model = _build(arch, vocab_size, dim, n_layers, n_heads, n_kv_heads, max_seq_len, tie_embeddings, dropout)

    @override
    def forward(self, ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        # use_cache=False: training keeps no key/value cache (HF's default builds one every call)
        return self.model(input_ids=ids, attention_mask=attention_mask, use_cache=False).logits  # (B, T, V)

    @override
    def model_output(self, batch: Any) -> torch.Tensor:
        return self(batch[0], batch[2] if len(batch) > 2 else None)  # (ids, targets[, attention_mask])


def _build(
    arch: str, vocab: int, dim: int, n_layers: int, n_heads: int, n_kv: int | None, seq: int, tie: bool, dropout: float
) -> torch.nn.Module:
    transformers = _transformers()
    # Both architectures: the vocabulary, token 0 to begin and end a text, the head's tying, no key/value cache
    common = {"vocab_size": vocab, "bos_token_id": 0, "eos_token_id": 0, "tie_word_embeddings": tie, "use_cache": False}
    if arch == "gpt2":
        cfg = transformers.GPT2Config(
            n_embd=dim,
            n_layer=n_layers,
            n_head=n_heads,
            n_positions=seq,
            resid_pdrop=dropout,
            embd_pdrop=dropout,
            attn_pdrop=dropout,
            **common,
        )
        return transformers.GPT2LMHeadModel(cfg)
    cfg = transformers.LlamaConfig(
        hidden_size=dim,
        intermediate_size=4 * dim,
        num_hidden_layers=n_layers,
        num_attention_heads=n_heads,
        num_key_value_heads=n_kv or n_heads,
        max_position_embeddings=seq,
        pad_token_id=None,
        attention_dropout=dropout,
        **common,
    )
    return transformers.LlamaForCausalLM(cfg)
