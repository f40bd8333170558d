"""Byte-level tokenizer: 256 byte values plus BOS/EOS/PAD, vocabulary padded to a multiple for the embedding.

Byte-level means no training, no file to download and no unknown tokens: every UTF-8 text round-trips exactly.
"""

from __future__ import annotations

from collections.abc import Sequence


class ByteTokenizer:
    """Bytes 0..255 are their own ids; BOS=256, EOS=257, PAD=258.

    Args:
        vocab_size: the model's embedding rows (``>= 259``). The tiny preset uses 320: the ids 259..319 are never
            produced; they only round the embedding up to a multiple of 64 for efficient matmuls.
    """

    BYTES = 256
    BOS = 256
    EOS = 257
    PAD = 258
    NUM_SPECIAL = 3

    def __init__(self, vocab_size: int = 320) -> None:
        if vocab_size < self.BYTES + self.NUM_SPECIAL:
            raise ValueError(f"vocab_size={vocab_size} is too small for a byte tokenizer; use vocab_size >= 259")
        self.vocab_size = vocab_size

    @property
    def bos_id(self) -> int:
        return self.BOS

    @property
    def eos_id(self) -> int:
        return self.EOS

    @property
    def pad_id(self) -> int:
        return self.PAD

    def encode(self, text: str | bytes, *, bos: bool = True, eos: bool = True) -> list[int]:
        """Text (str is UTF-8 encoded) -> ids, optionally wrapped in BOS ... EOS."""
        data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
        return ([self.BOS] if bos else []) + list(data) + ([self.EOS] if eos else [])

    def decode(self, ids: Sequence[int], *, errors: str = "replace") -> str:
        """ids -> text; special and out-of-byte-range ids are dropped."""
        return bytes(int(i) for i in ids if 0 <= int(i) < self.BYTES).decode("utf-8", errors=errors)

    def __call__(self, text: str | bytes) -> list[int]:
        return self.encode(text)
