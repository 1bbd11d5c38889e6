"""Data for the paper's four model families, from synthetic tasks or local files (nothing is fetched).

Batch formats: next-token LM ``(ids (B, T), targets (B, T))``; masked LM ``(ids (B, T), labels (B, T))``
with -100 where unscored; images ``(float32 (B, 3, H, W), long (B,))``.
"""

from lightning_twobp.data.images import ImageFolder, ImageTensors
from lightning_twobp.data.modules import ImageDataModule, MaskedLMDataModule, TokenDataModule
from lightning_twobp.data.synthetic import (
    IGNORE_INDEX,
    CountingTokens,
    MaskedCountingTokens,
    MaskedTokens,
    SyntheticImages,
    bert_mask,
)
from lightning_twobp.data.tokens import BYTE_VOCAB_SIZE, EOT_ID, TokenFile, decode_bytes, encode_bytes, tokenize_files

__all__ = [
    "BYTE_VOCAB_SIZE",
    "EOT_ID",
    "IGNORE_INDEX",
    "CountingTokens",
    "ImageDataModule",
    "ImageFolder",
    "ImageTensors",
    "MaskedCountingTokens",
    "MaskedLMDataModule",
    "MaskedTokens",
    "SyntheticImages",
    "TokenDataModule",
    "TokenFile",
    "bert_mask",
    "decode_bytes",
    "encode_bytes",
    "tokenize_files",
]
