"""Data index build time, side by side with megatron-core's helpers on the same lengths in the same invocation.

1. ``blend``: ``--corpora`` token files of ``--docs`` documents each (seeded log-normal lengths, mean ``--mean``
   tokens; the ``.idx`` files are real, the ``.bin`` files sparse, so no token is stored), blended with equal weights
   at ``--seq-len``. Ours: :class:`lightning_v17.data.blend.BlendedTokens` timed from opening the files to the
   first global batch. Megatron's (megatron-core 0.16.1, from ``.venv/megatron-target``): what its ``GPTDataset``
   and ``BlendedDataset`` build for the same job, one epoch per corpus -- open the ``IndexedDataset``,
   ``_build_document_index`` (the document shuffle), ``helpers.build_sample_idx``, ``_build_shuffle_index``, then
   ``helpers.build_blending_indices`` over all samples. Peak memory of ours is the RSS growth of a fresh process,
   per document.
2. ``ffd``: ``--ffd-docs`` documents (same distribution) packed at ``--ffd-seq-len``: today's ``pack()`` (pure Python)
   against :func:`lightning_v17.data.ffd.pack_ffd`, which gives the same rows.
3. ``loader``: tokens/s of reading every sample of one token file (``--loader-docs`` documents) once, shuffled, on
   one process, against litdata's ``StreamingDataset`` with ``TokensLoader`` (1-D blocks of ``--seq-len`` tokens)
   over the same documents. Ours are the batches of 8 rows a training step gets (input_ids, position ids reset per
   document, labels, doc ids, cu_seqlens at document boundaries): from the dataset's batch path (``__getitems__`` and
   ``collate_rows``) against litdata's dataset iterated directly (``loader_ours/litdata``), and through
   ``PackedDataModule.train_dataloader()`` against litdata's ``StreamingDataLoader`` with ``batch_size=8``
   (``loader_datamodule/litdata_dataloader``), both with no worker processes. ``--loader-rounds`` alternate the two
   sides; each keeps its best round. litdata is installed only into ``.venv/litdata-target`` (``pip install --target
   .venv/litdata-target litdata boto3 requests``) and read from a child process with that on its path.
   ``ours_tokens_per_s_at_blend_scale``: our batch path over the ``blend`` section's corpora (``--docs`` documents
   each), where the document search is the cost.

Usage: ``python bench/data.py [--corpora 10] [--docs 2960000] [--json-out bench/results/data.json]``
"""

from __future__ import annotations

import argparse
import os
import struct
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common as C  # after the path insert, so the script runs from anywhere

ROOT = Path(__file__).resolve().parents[1]


def lengths_of(n: int, mean: float, seed: int) -> np.ndarray:
    """Log-normal document lengths (sigma 1) with the given mean, at least 1 token, int32."""
    rng = np.random.default_rng(seed)
    return np.maximum(rng.lognormal(np.log(mean) - 0.5, 1.0, n), 1).astype(np.int32)


def write_index_only(prefix: Path, lengths: np.ndarray) -> None:
    """A real ``.idx`` (uint16 tokens, one sequence per document) and a sparse ``.bin`` of the size it indexes."""
    ptr = np.zeros(lengths.size, dtype=np.int64)
    np.cumsum(lengths[:-1].astype(np.int64) * 2, out=ptr[1:])
    with open(f"{prefix}.idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, 8, lengths.size, lengths.size + 1))
        f.write(lengths.astype(np.int32).tobytes())
        f.write(ptr.tobytes())
        f.write(np.arange(lengths.size + 1, dtype=np.int64).tobytes())
    with open(f"{prefix}.bin", "wb") as f:
        f.truncate(int(lengths.astype(np.int64).sum()) * 2)


def ours(paths: list[str], seq_len: int, batch: int) -> tuple[float, int]:
    from lightning_v17.data.blend import BlendedTokens

    t = time.perf_counter()
    ds = BlendedTokens(paths, weights=[1.0] * len(paths), seq_len=seq_len, seed=0)
    rows = [ds[i] for i in range(batch)]
    assert all(r["input_ids"].numel() == seq_len for r in rows)
    return time.perf_counter() - t, len(ds)


def megatron(paths: list[str], seq_len: int) -> dict:
    target = ROOT / ".venv" / "megatron-target"
    sys.path.append(str(target))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets import helpers
        from megatron.core.datasets.gpt_dataset import _build_document_index, _build_shuffle_index
        from megatron.core.datasets.indexed_dataset import IndexedDataset
    parts = {"document_index": 0.0, "sample_index": 0.0, "shuffle_index": 0.0, "blending": 0.0, "open": 0.0}
    samples = []
    for path in paths:
        t = time.perf_counter()
        ds = IndexedDataset(path)
        sizes = ds.sequence_lengths.copy()
        parts["open"] += time.perf_counter() - t
        rs = np.random.RandomState(0)
        t = time.perf_counter()
        doc_index = _build_document_index(np.arange(len(ds), dtype=np.int32), 1, rs, False)
        parts["document_index"] += time.perf_counter() - t
        t = time.perf_counter()
        sample_index = helpers.build_sample_idx(sizes, doc_index, seq_len, 1, int(sizes.sum(dtype=np.int64)), True,
                                                True)  # fmt: skip
        parts["sample_index"] += time.perf_counter() - t
        t = time.perf_counter()
        _build_shuffle_index(sample_index.shape[0] - 1, sample_index.shape[0] - 1, rs)
        parts["shuffle_index"] += time.perf_counter() - t
        samples.append(sample_index.shape[0] - 1)
    size = int(sum(samples))
    t = time.perf_counter()
    dataset_index = np.zeros(size, dtype=np.int16)
    dataset_sample_index = np.zeros(size, dtype=np.int64)
    weights = [1.0 / len(paths)] * len(paths)
    helpers.build_blending_indices(dataset_index, dataset_sample_index, weights, len(paths), size, False)
    parts["blending"] = time.perf_counter() - t
    return {"seconds": round(sum(parts.values()), 3), "parts_s": {k: round(v, 3) for k, v in parts.items()},
            "samples": size}  # fmt: skip


def rss_child(paths: list[str], seq_len: int) -> None:
    """In a fresh process: the resident-set growth (KB) of building our index and reading the first batch (page-cache
    pages of the memory maps it touched included)."""
    import torch  # noqa: F401 - imported before the baseline: it is the loader's, not the index's

    import lightning_v17.data.blend  # noqa: F401

    before = _rss_kb()
    ours(paths, seq_len, 8)
    print(_rss_kb() - before)


def _rss_kb() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def _prefix_docs(prefix: str):
    from lightning_v17.data.indexed import IndexedReader

    reader = IndexedReader(prefix)
    return [reader[i] for i in range(len(reader))]


def _litdata_doc(doc):
    import torch

    yield torch.from_numpy(doc.astype(np.int64))  # TokensLoader's items: one 1-D token tensor per document


def litdata_child(prefix: str, seq_len: int, work: str) -> None:
    """In a process with litdata on its path: ``optimize`` the token file's documents once (not timed), then read
    every block of ``seq_len`` tokens through ``StreamingDataset(item_loader=TokensLoader)``, shuffled, and again
    through its ``StreamingDataLoader`` in batches of 8 (stacked, no worker processes); prints both tokens/s and the
    block count."""
    from litdata import StreamingDataLoader, StreamingDataset, optimize
    from litdata.streaming.item_loader import TokensLoader

    out = os.path.join(work, "litdata")
    if not os.path.isfile(os.path.join(out, "index.json")):
        optimize(fn=_litdata_doc, inputs=_prefix_docs(prefix), output_dir=out, chunk_size=(seq_len + 1) * 1024,
                 item_loader=TokensLoader(), num_workers=1, verbose=False)  # fmt: skip

    def dataset() -> StreamingDataset:
        return StreamingDataset(input_dir=out, item_loader=TokensLoader(block_size=seq_len), shuffle=True,
                                drop_last=True)  # fmt: skip

    ds = dataset()
    t = time.perf_counter()
    tokens = blocks = 0
    for x in ds:
        tokens, blocks = tokens + int(x.numel()), blocks + 1
    direct = tokens / (time.perf_counter() - t)
    loader = StreamingDataLoader(dataset(), batch_size=8)
    t = time.perf_counter()
    tokens = sum(int(x.numel()) for x in loader)
    print(direct, tokens / (time.perf_counter() - t), blocks)


def loader_tokens_per_s(prefix: str, seq_len: int, batch: int = 8) -> tuple[float, int]:
    """Our batches as training gets them (input_ids, positions, labels, doc ids, cu_seqlens at document boundaries)
    of one token file, every sample once in the index's shuffled order, batches of ``batch``, on this process, from
    the dataset's batch path (``__getitems__`` + ``collate_rows``): (tokens/s, rows)."""
    from lightning_v17.data.blend import BlendedTokens
    from lightning_v17.data.packing import collate_rows

    ds = BlendedTokens([prefix], seq_len=seq_len, seed=0)
    t = time.perf_counter()
    tokens = rows = 0
    for i in range(0, len(ds), batch):
        ids = collate_rows(ds.__getitems__(range(i, min(i + batch, len(ds)))))["input_ids"]
        tokens, rows = tokens + int(ids.numel()), rows + int(ids.shape[0])
    assert rows == len(ds), "every sample once"
    return tokens / (time.perf_counter() - t), rows


def datamodule_tokens_per_s(prefix: str, seq_len: int, batch: int = 8) -> tuple[float, int]:
    """The same batches through what the Trainer iterates: ``PackedDataModule(paths=[prefix]).train_dataloader()``
    (its sampler, the DataLoader's batch sampler and fetcher, ``__getitems__``, the collate), on this process
    (``num_workers=0``, ``prefetch_batches=0``): (tokens/s, rows)."""
    from lightning_v17.data.datamodule import PackedDataModule

    dm = PackedDataModule(paths=[prefix], seq_len=seq_len, batch_size=batch, prefetch_batches=0)
    dm.setup("fit")
    loader = dm.train_dataloader()
    t = time.perf_counter()
    tokens = rows = 0
    for b in loader:
        tokens, rows = tokens + int(b["input_ids"].numel()), rows + int(b["input_ids"].shape[0])
    assert rows == len(dm.train_rows), "every sample once"
    return tokens / (time.perf_counter() - t), rows


def at_scale_tokens_per_s(paths: list[str], seq_len: int, batch: int = 8, batches: int = 500) -> float:
    """Our batch path over the blend's corpora (millions of documents each, sparse ``.bin``: the tokens read are
    zeros, the document boundaries are real): the per-batch cost of the index at pretraining scale."""
    from lightning_v17.data.blend import BlendedTokens
    from lightning_v17.data.packing import collate_rows

    ds = BlendedTokens(paths, weights=[1.0] * len(paths), seq_len=seq_len, seed=0)
    for _ in range(2):  # the first pass faults the sparse file's pages in; the second reads them from the page
        t = time.perf_counter()  # cache, as the loader section reads its just-written file
        tokens = sum(int(collate_rows(ds.__getitems__(range(i, i + batch)))["input_ids"].numel())
                     for i in range(0, batches * batch, batch))  # fmt: skip
        seconds = time.perf_counter() - t
    return tokens / seconds


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--corpora", type=int, default=10)
    p.add_argument("--docs", type=int, default=2_960_000, help="documents per corpus")
    p.add_argument("--mean", type=float, default=700.0, help="mean document length in tokens")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--batch", type=int, default=8, help="rows of the first global batch")
    p.add_argument("--ffd-docs", type=int, default=1_000_000)
    p.add_argument("--ffd-seq-len", type=int, default=4096)
    p.add_argument("--json-out", default=None, help="also write the JSON here")
    p.add_argument("--loader-docs", type=int, default=20_000, help="documents of the loader comparison")
    p.add_argument("--loader-rounds", type=int, default=3, help="alternating rounds of ours and litdata (best kept)")
    p.add_argument("--_rss", nargs="+", default=None, help=argparse.SUPPRESS)
    p.add_argument("--_litdata", nargs=2, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args._rss:
        rss_child(args._rss, args.seq_len)
        return {}
    if args._litdata:
        litdata_child(args._litdata[0], args.seq_len, args._litdata[1])
        return {}

    out: dict = {"bench": "data", "corpora": args.corpora, "docs_per_corpus": args.docs, "mean_tokens": args.mean,
                 "seq_len": args.seq_len}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="v17bench_data_") as tmp:
        paths = []
        for c in range(args.corpora):
            write_index_only(Path(tmp) / f"c{c}", lengths_of(args.docs, args.mean, seed=c))
            paths.append(str(Path(tmp) / f"c{c}"))
        ours_s, ours_samples = ours(paths, args.seq_len, args.batch)
        rss_kb = int(subprocess.run([sys.executable, __file__, "--seq-len", str(args.seq_len), "--_rss", *paths],
                                    capture_output=True, text=True, check=True).stdout.split()[-1])  # fmt: skip
        ref = megatron(paths, args.seq_len)
        scale_tps = at_scale_tokens_per_s(paths, args.seq_len)
    docs = args.corpora * args.docs
    out["blend"] = {
        "ours_s": round(ours_s, 4),
        "ours_samples": ours_samples,
        "ours_rss_bytes_per_document": round(rss_kb * 1024 / docs, 3),
        "megatron": ref,
        "megatron_over_ours": round(ref["seconds"] / ours_s, 1),
    }

    from lightning_v17.data.ffd import _compiled, pack_ffd
    from lightning_v17.data.packing import pack

    lengths = lengths_of(args.ffd_docs, args.mean, seed=100)
    _compiled()  # the one-time build of the C helper is not part of a plan's cost
    t = time.perf_counter()
    new = pack_ffd(lengths, args.ffd_seq_len)
    new_s = time.perf_counter() - t
    t = time.perf_counter()
    old = pack(lengths.tolist(), args.ffd_seq_len, mode="ffd")
    old_s = time.perf_counter() - t
    out["ffd"] = {
        "documents": args.ffd_docs,
        "seq_len": args.ffd_seq_len,
        "pack_ffd_s": round(new_s, 3),
        "pack_s": round(old_s, 3),
        "rows": new.num_rows,
        "same_rows": new.num_rows == old.num_rows and all(new.rows[i] == old.rows[i] for i in range(0, old.num_rows,
                                                                                                     997)),
        "padding_fraction": round(new.padding_fraction(), 6),
        "pack_padding_fraction": round(old.padding_fraction(), 6),
    }
    out["ratios"] = {"megatron_index/ours": out["blend"]["megatron_over_ours"],
                     "pack/pack_ffd": round(old_s / new_s, 1)}  # fmt: skip

    from lightning_v17.data.indexed import write_indexed

    with tempfile.TemporaryDirectory(prefix="v17bench_loader_") as tmp:
        rng = np.random.default_rng(7)
        prefix = os.path.join(tmp, "tokens")
        write_indexed(prefix, (rng.integers(0, 50_000, int(n)) for n in lengths_of(args.loader_docs, args.mean, 9)))
        env = {**os.environ, "PYTHONPATH": str(ROOT / ".venv" / "litdata-target")}
        rounds: dict[str, list[float]] = {"ours": [], "ours_batch_path": [], "litdata": [], "litdata_loader": []}
        lit_error = None
        # Rounds alternate ours and litdata, and each side keeps its best: on a shared host the load changes
        # within a run, and a side measured only in a quiet or a busy moment would decide the ratio by luck.
        for _ in range(args.loader_rounds):
            batch_tps, ours_rows = loader_tokens_per_s(prefix, args.seq_len)
            ours_tps, dm_rows = datamodule_tokens_per_s(prefix, args.seq_len)
            assert dm_rows == ours_rows
            rounds["ours_batch_path"].append(batch_tps)
            rounds["ours"].append(ours_tps)
            lit = subprocess.run([sys.executable, __file__, "--seq-len", str(args.seq_len), "--_litdata", prefix,
                                  tmp], capture_output=True, text=True, env=env, timeout=600, check=False)  # fmt: skip
            if lit.returncode != 0:  # litdata is installed only into .venv/litdata-target (see the docstring)
                lit_error = (lit.stderr.strip().splitlines() or ["?"])[-1]
                break
            direct, loader, lit_blocks = (float(x) for x in lit.stdout.split()[-3:])
            rounds["litdata"].append(direct)
            rounds["litdata_loader"].append(loader)
    best = {k: max(v) for k, v in rounds.items() if v}
    out["loader"] = {"documents": args.loader_docs, "batch": 8, "ours_rows": ours_rows, "rounds": args.loader_rounds,
                     "ours_tokens_per_s": round(best["ours_batch_path"]),
                     "ours_datamodule_loader_tokens_per_s": round(best["ours"]),
                     "ours_tokens_per_s_at_blend_scale": round(scale_tps),
                     "blend_scale_documents_per_corpus": args.docs,
                     "per_round_tokens_per_s": {k: [round(x) for x in v] for k, v in rounds.items()}}  # fmt: skip
    if lit_error is None:
        out["loader"]["litdata_tokens_loader_tokens_per_s"] = round(best["litdata"])
        out["loader"]["litdata_streaming_dataloader_tokens_per_s"] = round(best["litdata_loader"])
        out["loader"]["litdata_blocks"] = int(lit_blocks)
        out["ratios"]["loader_ours/litdata"] = round(best["ours_batch_path"] / best["litdata"], 2)
        out["ratios"]["loader_datamodule/litdata_dataloader"] = round(best["ours"] / best["litdata_loader"], 2)
    else:
        out["loader"]["litdata_error"] = lit_error
    C.emit_json(out, args.json_out)
    return out


if __name__ == "__main__":
    main()
