"""Packed vs padded training on the stdlib corpus: real (non-pad) tokens per second, side by side.

Both arms train the same tiny model (same init) with AdamW on the *same* documents, so they process the same number
of real tokens:

- ``packed``: first-fit-decreasing rows of ``seq_len`` tokens with ``cu_seqlens`` (attention within documents);
- ``padded``: documents in random order, ``batch_size`` per batch, padded to the longest in the batch, plain causal
  attention (the usual unpacked baseline);
- ``length_grouped``: what a user of Hugging Face's Trainer turns on with ``group_by_length=True``
  (``LengthGroupedSampler``): random mega-batches of 50 x ``batch_size`` documents, each sorted by length
  (longest first), cut into batches padded to their longest document; plain causal attention.

The three arms run interleaved in ``--rounds`` slices so that a change in machine load hits both alike. Warm-up steps
(one per arm, on documents outside the measured set) are excluded. Prints one JSON object.

Attention FLOPs: one layer's QK^T and AV cost 4 * len^2 * hidden FLOPs forward for a sequence of ``len`` tokens
(2 matmuls, 2 FLOPs per multiply-add; Kaplan 2020 Table 1 with n_ctx = len), so a packed batch costs
4h * sum(len_i^2) per layer and a padded batch 4h * B * max_len^2.

Usage: ``python bench/packing.py [--seq-len 2048] [--real-tokens 60000] [--batch-size 8] [--threads 1]``
"""

from __future__ import annotations

import argparse
import itertools
import os
import random
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common as C  # after the path insert, so the script runs from anywhere

from lightning_v17.data.corpus import StdlibCorpus
from lightning_v17.data.packing import chunk_documents, collate_rows, materialize_row, pack
from lightning_v17.data.tokenizer import ByteTokenizer
from lightning_v17.models import Llama, ModelConfig
from lightning_v17.models.lightning import next_token_loss


def _batches(chunks: list[torch.Tensor], *, seq_len: int, batch_size: int, packed: bool) -> list[dict]:
    lengths = [len(c) for c in chunks]
    plan = pack(lengths, seq_len, mode="ffd" if packed else "none")
    rows = [
        materialize_row(r, chunks.__getitem__, pad_to=seq_len if packed else None, pad_id=ByteTokenizer.PAD)
        for r in plan.rows
    ]
    return [collate_rows(rows[i : i + batch_size], pad_id=ByteTokenizer.PAD) for i in range(0, len(rows), batch_size)]


def _length_grouped(chunks: list[torch.Tensor], *, batch_size: int, seed: int) -> list[torch.Tensor]:
    """Hugging Face ``LengthGroupedSampler``'s order (transformers ``trainer_pt_utils.get_length_grouped_indices``):
    a random permutation cut into mega-batches of ``50 * batch_size``, each sorted by length, longest first."""
    order = list(range(len(chunks)))
    random.Random(seed + 1).shuffle(order)
    mega = 50 * batch_size
    grouped = [
        i for k in range(0, len(order), mega) for i in sorted(order[k : k + mega], key=lambda j: -len(chunks[j]))
    ]
    return [chunks[i] for i in grouped]


def _step(model: Llama, opt: torch.optim.Optimizer, batch: dict, packed: bool) -> None:
    if packed:
        logits = model(batch["input_ids"], batch["position_ids"], batch["cu_seqlens"], batch["max_seqlen"])
    else:
        logits = model(batch["input_ids"])  # plain causal attention over padded rows (pad only at the end)
    loss, _ = next_token_loss(logits, batch["labels"])
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--real-tokens", type=int, default=60_000, help="real tokens each arm trains on")
    p.add_argument("--batch-size", type=int, default=8, help="rows per batch (packed) / documents per batch (padded)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=4, help="interleaved slices per arm")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json-out", default=None, help="also write the JSON here")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    corpus = StdlibCorpus("train")
    chunk_specs, _ = chunk_documents(corpus.lengths(), args.seq_len)
    random.Random(args.seed).shuffle(chunk_specs)
    chunks, warm, total = [], [], 0
    for spec in chunk_specs:
        tokens = corpus[spec.doc][spec.start : spec.end]
        if len(warm) < 2 * args.batch_size:
            warm.append(tokens)
        elif total < args.real_tokens:
            chunks.append(tokens)
            total += len(tokens)
        else:
            break

    arms = {}
    grouped = _length_grouped(chunks, batch_size=args.batch_size, seed=args.seed)
    for name, packed, docs in (("packed", True, chunks), ("padded", False, chunks), ("length_grouped", False, grouped)):
        batches = _batches(docs, seq_len=args.seq_len, batch_size=args.batch_size, packed=packed)
        real = sum(int((b["doc_ids"] >= 0).sum()) for b in batches)
        numel = sum(b["doc_ids"].numel() for b in batches)
        if packed:
            seg = [int(n) for b in batches for n in (b["cu_seqlens"][1:] - b["cu_seqlens"][:-1]).tolist()]
            pad_segments = sum(int(n) for b in batches for n in _pad_segment_lengths(b))
            attn = sum(n * n for n in seg) - pad_segments  # documents only; padding segments are tiny
        else:
            attn = sum(b["input_ids"].shape[0] * b["input_ids"].shape[1] ** 2 for b in batches)
        torch.manual_seed(args.seed)
        model = Llama(ModelConfig.from_preset("tiny", max_seq_len=args.seq_len))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        warm_batch = _batches(warm, seq_len=args.seq_len, batch_size=args.batch_size, packed=packed)[0]
        _step(model, opt, warm_batch, packed)  # warm-up: allocator, thread pool, first-call overheads
        arms[name] = {
            "model": model,
            "opt": opt,
            "batches": batches,
            "packed": packed,
            "seconds": 0.0,
            "real_tokens": real,
            "padding_fraction": 1 - real / numel,
            "attn_len2": attn,
        }

    for r in range(args.rounds):
        for arm in arms.values():
            n = len(arm["batches"])
            for batch in arm["batches"][r * n // args.rounds : (r + 1) * n // args.rounds]:
                t0 = time.perf_counter()
                _step(arm["model"], arm["opt"], batch, arm["packed"])
                arm["seconds"] += time.perf_counter() - t0

    hidden, layers = 128, 4
    out = {
        "bench": "packing",
        "model": "tiny",
        "seq_len": args.seq_len,
        "batch_size": args.batch_size,
        "threads": args.threads,
        "load_avg_1m": os.getloadavg()[0],
        "cpus": os.cpu_count(),
    }
    for name, arm in arms.items():
        out[name] = {
            "real_tokens": arm["real_tokens"],
            "steps": len(arm["batches"]),
            "seconds": round(arm["seconds"], 3),
            "real_tokens_per_s": round(arm["real_tokens"] / arm["seconds"], 1),
            "padding_fraction": round(arm["padding_fraction"], 4),
            "attention_flops_fwd": 4 * hidden * layers * arm["attn_len2"],
        }
    assert out["packed"]["real_tokens"] == out["padded"]["real_tokens"] == out["length_grouped"]["real_tokens"]
    for base in ("padded", "length_grouped"):
        out[f"packed_over_{base}"] = round(out["packed"]["real_tokens_per_s"] / out[base]["real_tokens_per_s"], 3)
        out[f"attention_flops_saved_vs_{base}"] = round(
            1 - out["packed"]["attention_flops_fwd"] / out[base]["attention_flops_fwd"], 4
        )
    out["target_speedup"] = 2.0
    C.emit_json(out, args.json_out)
    return out


def _pad_segment_lengths(batch: dict) -> list[int]:
    """Lengths^2-relevant padding segments of a packed batch (segments whose doc id is -1)."""
    cu = batch["cu_seqlens"].tolist()
    flat = batch["doc_ids"].reshape(-1)
    return [(e - s) ** 2 for s, e in itertools.pairwise(cu) if flat[s] < 0]


if __name__ == "__main__":
    main(sys.argv[1:])
