"""Data: packing (bin packing, cu_seqlens, position reset, loss masks), the data module, the stdlib corpus, tokenizer.

``PackedDataModule`` (Lightning) and ``StdlibCorpus`` are imported lazily.
"""

from __future__ import annotations

from typing import Any

from lightning_v17.data.packing import (
    IGNORE_INDEX,
    PAD_DOC_ID,
    PackedRowSampler,
    PackingMode,
    PackingPlan,
    Segment,
    collate_rows,
    materialize_row,
    pack,
    padding_fraction,
)
from lightning_v17.data.tokenizer import ByteTokenizer

_LAZY = {
    "PackedDataModule": "lightning_v17.data.datamodule",
    "DocumentSource": "lightning_v17.data.datamodule",
    "StdlibCorpus": "lightning_v17.data.corpus",
    "length_stats": "lightning_v17.data.corpus",
}

__all__ = [
    "IGNORE_INDEX",
    "PAD_DOC_ID",
    "ByteTokenizer",
    "DocumentSource",
    "PackedDataModule",
    "PackedRowSampler",
    "PackingMode",
    "PackingPlan",
    "Segment",
    "StdlibCorpus",
    "collate_rows",
    "length_stats",
    "materialize_row",
    "pack",
    "padding_fraction",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'lightning_v17.data' has no attribute {name!r}")
