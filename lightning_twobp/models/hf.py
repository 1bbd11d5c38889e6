"""A Hugging Face causal LM, random init, as a LightningModule: GPT-2 or Llama from a few sizes, any other
architecture ``transformers`` has a causal LM for (``arch="mistral"``, ``"qwen2"``, ...), or the one a
``config.json`` describes (``config=PATH``: a downloaded model's folder, its weights not read).

The model is ``transformers``' own (``GPT2LMHeadModel``, ``LlamaForCausalLM``, ...), unchanged: its blocks
are an ``nn.ModuleList`` (``model.transformer.h``, ``model.model.layers``), which the model's forward
calls in a loop with an attention mask and position ids (and rotary position embeddings).
``strategy="twobp"`` pipelines that loop as it is (the ModuleList contract, docs/strategy.md), and
``twobp-plan`` plans it on the meta device. Nothing is downloaded: the weights are a random
initialisation from ``seed``.

``transformers`` is optional (``pip install transformers``, or the ``test`` extra); it is imported
when the model is built.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from typing_extensions import Unpack, override

from lightning_twobp.models.base import LanguageModel, Training, training_arguments

__all__ = ["HFCausalLM"]


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
    """A ``transformers`` causal LM, random init, trained on next-token cross-entropy.

    ``arch``: ``"gpt2"`` or ``"llama"`` from the sizes given; another model type with a causal LM
    (``"mistral"``, ``"qwen2"``, ``"mixtral"``, ...) from the same sizes under its config's standard names
    (``hidden_size``, ``num_hidden_layers``, ``num_attention_heads``, ``num_key_value_heads``,
    ``intermediate_size`` = 4 x ``dim``), its other fields at their defaults (``dropout`` sets only their
    ``attention_dropout``). ``config``: a directory holding a Hugging Face ``config.json`` (or the file), read
    locally; it replaces ``arch``, every size, ``tie_embeddings`` and ``dropout`` (the config's own); the
    parameters are made in the default dtype (the Trainer's precision casts them), ``max_seq_len`` stays the
    training sequence length (at most the config's positions) and ``vocab_size`` the largest token id the
    data may draw (at most the config's vocabulary).

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
        config: str | None = None,
        **training: Unpack[Training],
    ) -> None:
        training = training_arguments(training, lr=3e-3)  # all five, for save_hyperparameters()
        super().__init__(**training)
        self.save_hyperparameters()
        self.max_seq_len = max_seq_len
        if config is not None:
            self.model = _from_file(config, max_seq_len, vocab_size)
            return
        _check_arch(arch)
        self.model = _build(arch, vocab_size, dim, n_layers, n_heads, n_kv_heads, max_seq_len, tie_embeddings, dropout)

    @override
    def forward(self, ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        # use_cache=False: training keeps no key/value cache (HF's default builds one every call)
        return self.model(input_ids=ids, attention_mask=attention_mask, use_cache=False).logits  # (B, T, V)

    @override
    def model_output(self, batch: Any) -> torch.Tensor:
        return self(batch[0], batch[2] if len(batch) > 2 else None)  # (ids, targets[, attention_mask])


def _causal_types() -> Any:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return MODEL_FOR_CAUSAL_LM_MAPPING_NAMES


def _check_arch(arch: str) -> None:
    _transformers()
    if arch not in _causal_types():
        raise ValueError(
            f"arch={arch!r}: not a model type transformers has a causal LM for; choose gpt2, llama or another "
            f"(mistral, qwen2, mixtral, gemma, ...), or config=PATH to a folder with the model's config.json"
        )


def _from_file(path: str, seq: int, vocab: int) -> torch.nn.Module:
    """The causal LM the config at ``path`` describes (a folder's ``config.json``, or the file), random init in
    the default dtype (the Trainer's precision casts it: a downloaded config's ``torch_dtype`` would otherwise
    make every parameter bf16 and the optimizer's state with it), no cache."""
    transformers = _transformers()
    if not os.path.exists(path):
        raise ValueError(
            f"config={path!r} does not exist: give a folder holding a Hugging Face config.json, or the file"
        )
    if os.path.isdir(path) and not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"config={path!r}: no config.json in that folder")
    cfg = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
    cfg.use_cache = False
    positions = getattr(cfg, "max_position_embeddings", None)
    if positions is not None and seq > positions:
        raise ValueError(
            f"max_seq_len={seq} is longer than the {positions} positions of {path}'s config: set "
            f"max_seq_len <= {positions}"
        )
    if cfg.vocab_size < vocab:
        raise ValueError(
            f"vocab_size={vocab} (the token ids the recipe's data draws) is larger than the {cfg.vocab_size} "
            f"tokens of {path}'s config: set vocab_size <= {cfg.vocab_size}"
        )
    return transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.get_default_dtype())


def _build(
    arch: str, vocab: int, dim: int, n_layers: int, n_heads: int, n_kv: int | None, seq: int, tie: bool, dropout: float
) -> torch.nn.Module:
    transformers = _transformers()
    # Every architecture: the vocabulary, token 0 to begin and end a text, the head's tying, no key/value cache
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
    # Llama and every other architecture: the sizes under the standard names each config maps to its own
    cfg = transformers.AutoConfig.for_model(
        arch,
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
    return transformers.AutoModelForCausalLM.from_config(cfg)
