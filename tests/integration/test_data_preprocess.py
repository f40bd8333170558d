"""``v17 preprocess``: the stdlib corpus through the byte tokenizer and a directory of texts through a BPE trained here
(nothing downloaded) decode back to their inputs; a SIGKILL mid-way leaves no pair that looks complete."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from lightning_v17.data.corpus import load_stdlib_documents
from lightning_v17.data.indexed import IndexedReader, TokenFileDataset, TokenFileError
from lightning_v17.data.preprocess import preprocess
from lightning_v17.data.tokenizer import ByteTokenizer

ROOT = Path(__file__).resolve().parents[2]
V17 = [sys.executable, "-c", "import sys; from lightning_v17.cli import main; sys.exit(main())"]


def _run(args, **kw):
    return subprocess.run([*V17, *args], cwd=ROOT, capture_output=True, text=True, timeout=240, check=False, **kw)


def test_stdlib_corpus_round_trips_through_the_byte_tokenizer(tmp_path):
    docs = load_stdlib_documents()
    texts = [d.text for d in docs]
    src = tmp_path / "stdlib.jsonl"
    with open(src, "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"body": d.text, "path": d.path}) + "\n" for d in docs)
    out = tmp_path / "tok" / "stdlib"
    proc = _run(["preprocess", str(src), "--output", str(out), "--json-key", "body", "--workers", "2"])
    assert proc.returncode == 0, proc.stderr
    summary = proc.stderr.strip().splitlines()[-1]
    total_bytes = sum(len(t.encode("utf-8")) for t in texts)
    assert f"{len(texts)} documents, {total_bytes + len(texts)} tokens (uint16)" in summary, summary
    assert "MB/s" in summary
    ds = TokenFileDataset(out)
    assert len(ds) == len(texts)
    np.testing.assert_array_equal(ds.lengths(), [len(t.encode("utf-8")) + 1 for t in texts])  # + EOS
    tok = ByteTokenizer()
    for i, text in enumerate(texts):
        ids = ds[i]
        assert ids[-1] == tok.eos_id
        assert bytes(ids[:-1].astype(np.uint8)) == text.encode("utf-8"), docs[i].path


def test_a_missing_json_key_is_named(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"text": "x"}\n{"content": "y"}\n')
    proc = _run(["preprocess", str(tmp_path / "a.jsonl"), "--output", str(tmp_path / "o")])
    assert proc.returncode == 2
    assert "a.jsonl:2 has no key 'text' (it has ['content']); set --json-key" in proc.stderr
    assert not (tmp_path / "o.idx").exists() and not (tmp_path / "o.bin").exists()


def _train_bpe(texts: list[str], directory: Path) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    tok.train_from_iterator(texts, trainer)
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>").save_pretrained(directory)


def test_a_directory_through_a_local_bpe_tokenizer_round_trips(tmp_path):
    texts = [d.text for d in load_stdlib_documents()[:300]]
    texts[5] = ""  # an empty document becomes just its EOS
    tok_dir = tmp_path / "bpe"
    _train_bpe(texts, tok_dir)
    corpus = tmp_path / "corpus"
    (corpus / "sub").mkdir(parents=True)
    for i, text in enumerate(texts):  # names sort in document order; half of them one level down
        (corpus / ("sub" if i >= 150 else "") / f"doc{i:04d}.txt").write_text(text, encoding="utf-8")
    (corpus / ".hidden").write_text("skipped")
    summary = preprocess([corpus], tmp_path / "out", tokenizer=str(tok_dir), workers=2, batch_size=16, progress=False)
    assert summary.documents == len(texts)

    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(tok_dir)
    ds = TokenFileDataset(tmp_path / "out", expect_dtype=np.uint16)
    eos = ref.eos_token_id
    for i, text in enumerate(texts):
        ids = ds[i].tolist()
        assert ids[-1] == eos and eos not in ids[:-1]
        assert ids[:-1] == ref(text, add_special_tokens=False)["input_ids"]
        assert ref.decode(ids[:-1]) == text
    assert summary.tokens == int(ds.lengths().sum())


def test_sigkill_mid_way_leaves_no_complete_looking_pair(tmp_path):
    src = tmp_path / "big.jsonl"
    line = json.dumps({"text": "def f(x):\n    return x * 2\n" * 40}) + "\n"
    src.write_text(line * 60_000)  # ~70 MB: several seconds of work
    out = tmp_path / "out" / "corpus"
    proc = subprocess.Popen([*V17, "preprocess", str(src), "--output", str(out), "--batch-size", "8"], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # until tokens are being written to the temporary .bin
            written = list((tmp_path / "out").iterdir()) if (tmp_path / "out").is_dir() else []
            if any(p.stat().st_size > 4 << 20 for p in written):
                break
            assert proc.poll() is None, "preprocess finished before it could be interrupted; give it more input"
            time.sleep(0.01)
        else:
            pytest.fail("preprocess never started writing")
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    names = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert "corpus.bin" not in names and "corpus.idx" not in names, names
    assert all(n.endswith(".tmp") for n in names), names
    with pytest.raises(TokenFileError, match="no index file"):
        IndexedReader(out)


def test_the_embedded_corpus_split_as_input_is_what_the_main_job_trains_on(tmp_path):
    """``stdlib:val --bos`` (what make run preprocesses) holds the val split's documents as the in-memory corpus
    tokenizes them (BOS + bytes + EOS), and a ffd PackedDataModule plans train and validation rows from the files."""
    from lightning_v17.data import PackedDataModule
    from lightning_v17.data.corpus import StdlibCorpus

    out = tmp_path / "stdlib-val"
    proc = _run(["preprocess", "stdlib:val", "--output", str(out), "--bos", "--quiet"])
    assert proc.returncode == 0, proc.stderr
    ds, want = TokenFileDataset(out), StdlibCorpus("val")
    assert len(ds) == len(want) > 100
    for i in range(len(want)):
        np.testing.assert_array_equal(ds[i].astype(np.int64), want[i].numpy())
    dm = PackedDataModule(paths=[str(out)], val_paths=[str(out)], packing="ffd", seq_len=256, batch_size=2)
    dm.setup("fit")
    assert dm.val_rows is not None and len(dm.val_rows) == len(dm.train_rows) > 0
    with pytest.raises(ValueError, match="plans one validation file"):
        PackedDataModule(paths=[str(out)], val_paths=[str(out), str(out)], packing="ffd")
