"""Data: packing (bin packing, cu_seqlens, position reset, loss masks), the data module, the stdlib corpus, tokenizer,
Megatron token files (``.bin/.idx``), Hugging Face ``datasets`` Arrow columns and ``v17 preprocess``.

Everything but the tokenizer is imported lazily (on first use of its name).
"""

from __future__ import annotations

from typing import Any

from lightning_v17.data.tokenizer import ByteTokenizer

# Lazy, so that torch-free users (``v17 preprocess``, the token-file reader) do not pay for importing torch.
_LAZY = {
    **dict.fromkeys(
        ("IGNORE_INDEX", "PAD_DOC_ID", "PackedRowSampler", "PackingMode", "PackingPlan", "Segment", "collate_rows",
         "materialize_row", "pack", "padding_fraction"),
        "lightning_v17.data.packing",
    ),
    "PackedDataModule": "lightning_v17.data.datamodule",
    "DocumentSource": "lightning_v17.data.datamodule",
    "StdlibCorpus": "lightning_v17.data.corpus",
    "ArrowTokens": "lightning_v17.data.hf_arrow",
    "length_stats": "lightning_v17.data.corpus",
    "IndexedReader": "lightning_v17.data.indexed",
    "IndexedWriter": "lightning_v17.data.indexed",
    "TokenFileDataset": "lightning_v17.data.indexed",
    "TokenFileError": "lightning_v17.data.indexed",
    "write_indexed": "lightning_v17.data.indexed",
    "preprocess": "lightning_v17.data.preprocess",
}

__all__ = [
    "IGNORE_INDEX",
    "PAD_DOC_ID",
    "ArrowTokens",
    "ByteTokenizer",
    "DocumentSource",
    "IndexedReader",
    "IndexedWriter",
    "PackedDataModule",
    "PackedRowSampler",
    "PackingMode",
    "PackingPlan",
    "Segment",
    "StdlibCorpus",
    "TokenFileDataset",
    "TokenFileError",
    "collate_rows",
    "length_stats",
    "materialize_row",
    "pack",
    "padding_fraction",
    "preprocess",
    "write_indexed",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'lightning_v17.data' has no attribute {name!r}")
