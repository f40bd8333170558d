"""The embedded stdlib corpus: one document per top-level def/class plus module remainder, deterministic split,
byte tokenizer round trip, cache, and the size/length statistics the issue quotes."""

from __future__ import annotations

import sys
import textwrap

import pytest

from lightning_v17.data.corpus import (
    MODULE_DOC,
    StdlibCorpus,
    length_stats,
    load_stdlib_documents,
    parse_stdlib,
    split_of,
)
from lightning_v17.data.tokenizer import ByteTokenizer

SOURCE = textwrap.dedent('''\
    """Module docstring."""
    import os

    X = 1


    @decorator
    def f(a):
        return a


    class C:
        def m(self):
            pass


    if __name__ == "__main__":
        f(X)
    ''')


def test_documents_per_definition_plus_module_rest(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "mod.py").write_text(SOURCE)
    (tmp_path / "test").mkdir()  # test packages are skipped
    (tmp_path / "test" / "test_x.py").write_text("def t(): pass\n")
    (tmp_path / "bad.py").write_text("print 'python 2'\n")  # unparsable files are skipped
    docs = parse_stdlib(tmp_path)
    assert [(d.path, d.name) for d in docs] == [("pkg/mod.py", "f"), ("pkg/mod.py", "C"), ("pkg/mod.py", MODULE_DOC)]
    assert docs[0].text == "@decorator\ndef f(a):\n    return a\n"
    assert docs[1].text.startswith("class C:") and "def m" in docs[1].text
    rest = docs[2].text
    assert "import os" in rest and "X = 1" in rest and '__name__ == "__main__"' in rest and "def f" not in rest
    # Nothing lost: every source line is in exactly one document.
    assert sorted(line for d in docs for line in d.text.splitlines()) == sorted(SOURCE.splitlines())


def test_split_is_a_deterministic_hash_of_path_and_name():
    assert split_of("a/b.py", "f", 0.05) == split_of("a/b.py", "f", 0.05)
    splits = [split_of("m.py", f"f{i}", 0.1) for i in range(2000)]
    assert 0.07 < splits.count("val") / len(splits) < 0.13
    assert split_of("m.py", "f", 0.0) == "train" and split_of("m.py", "f", 1.0) == "val"


def test_byte_tokenizer_round_trips():
    tok = ByteTokenizer()
    text = "def ñ(x):\n    return '€'\n"
    ids = tok.encode(text)
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id and max(ids) < tok.vocab_size == 320
    assert tok.decode(ids) == text
    with pytest.raises(ValueError, match="vocab_size"):
        ByteTokenizer(100)


def test_stdlib_corpus_size_and_stats():
    train, val = StdlibCorpus("train"), StdlibCorpus("val")
    n = len(train) + len(val)
    stats = length_stats(train.lengths() + val.lengths(), seq_len=2048)
    total_bytes = train.stats()["bytes"] + val.stats()["bytes"]
    # The issue quotes ~7,000 documents, ~10 MB, median ~400 bytes for CPython's stdlib.
    if sys.version_info[:2] == (3, 11):
        assert 5_000 < n < 9_000 and 8e6 < total_bytes < 16e6 and 250 < stats["median_tokens"] < 700
    assert 0.02 < len(val) / n < 0.08
    assert stats["max_tokens"] > 10 * stats["median_tokens"]  # the long tail packing exists for
    assert 0 < stats["mean_over_max"] < 1 and stats["split_documents"] > 0
    doc = train[0]
    assert doc[0] == ByteTokenizer.BOS and doc[-1] == ByteTokenizer.EOS and len(doc) == train.lengths()[0]
    assert ByteTokenizer().decode(doc.tolist()) == train.documents[0].text


def test_cache_is_reused_and_rebuildable(tmp_path, monkeypatch):
    from lightning_v17.data import corpus

    calls = []
    real = corpus.parse_stdlib
    monkeypatch.setattr(corpus, "parse_stdlib", lambda **kw: calls.append(kw) or real(root=_small_root(tmp_path), **kw))
    first = load_stdlib_documents(cache_dir=tmp_path / "cache")
    second = load_stdlib_documents(cache_dir=tmp_path / "cache")
    assert first == second and len(calls) == 1  # the second load came from the cache file
    (next((tmp_path / "cache").glob("*.json"))).write_text("{corrupt")
    assert load_stdlib_documents(cache_dir=tmp_path / "cache") == first and len(calls) == 2
    load_stdlib_documents(cache_dir=tmp_path / "cache", rebuild=True)
    assert len(calls) == 3


def _small_root(tmp_path):
    root = tmp_path / "lib"
    root.mkdir(exist_ok=True)
    (root / "mod.py").write_text(SOURCE)
    return root
