"""Saved-activation bytes per rank under context parallelism, counted in a run, against cp = 1 and the planner.

Two gloo ranks run the blocks of the reference Llama (``lightning_v17.models.Llama``: 2 blocks, h = 128, 8 query
and 4 KV heads, SwiGLU 384, fp32) on one row of S = 1024 tokens: once whole (cp = 1, no context), then under the
engine's context parallelism as ``strategies/_context.py`` runs it (``shard_batch`` with head-tail chunks,
``CPContext`` made current with ``use_cp_context``, the model's attention reading ``current_cp_context()``), in
both schemes. ``torch.autograd.graph.saved_tensors_hooks`` sees every tensor autograd saves during the forward;
the bytes of the distinct non-parameter storages are the peak saved-activation bytes of the rank (nothing saved is
freed before backward). At S = 1024 the attention's tensors and the per-token activations are what is saved (the
shape has no embedding or logits in the count).

Asserted:

* ulysses and allgather at cp = 2 each keep <= 0.55x of cp = 1's bytes on every rank;
* allgather saves no float tensor with a dim of the whole row's S tokens: it keeps only the local q, k, v, and the
  gathered K/V and the ``[1, 1, S/2, S]`` mask are rebuilt in backward;
* every run agrees with the planner's per-rank prediction for the same shape
  (``planner.memory.activation_bytes_per_layer_of(..., cp=, cp_mode=)`` x layers) within 15%, in absolute bytes.
"""

from __future__ import annotations

import pytest

from tests._dist import spawn

SEQ, LAYERS = 1024, 2
SHAPE = {"vocab_size": 64, "hidden": 128, "layers": LAYERS, "heads": 8, "kv_heads": 4, "ffn": 384}
TOL = 0.15


def _saved_bytes(rank: int, world: int) -> dict[str, int]:
    import torch
    import torch.distributed as dist

    from lightning_v17.engine.cp import CPContext, shard_batch, use_cp_context
    from lightning_v17.models.config import ModelConfig
    from lightning_v17.models.llama import Llama

    torch.manual_seed(0)
    model = Llama(ModelConfig(max_seq_len=SEQ, **SHAPE)).train()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    full = {"input_ids": torch.zeros(1, SEQ, dtype=torch.long)}
    out: dict[str, int] = {}
    for name, cp, mode in (("cp1", 1, None), ("ulysses", 2, "ulysses"), ("allgather", 2, "allgather")):
        part = shard_batch(full, cp=cp, rank=rank if cp > 1 else 0, balance="head_tail")
        ctx = CPContext.from_batch(part, mode=mode, group=dist.group.WORLD) if cp > 1 else None
        x = torch.randn(1, SEQ // cp, SHAPE["hidden"], requires_grad=True)
        seen: dict[int, int] = {}
        whole: dict[int, int] = {}  # saved float tensors with a dim of the whole row's S tokens

        def pack(t: torch.Tensor, seen=seen, whole=whole) -> torch.Tensor:
            storage = t.untyped_storage()
            if storage.data_ptr() not in params:
                seen[storage.data_ptr()] = storage.nbytes()
                if t.is_floating_point() and SEQ in t.shape:
                    whole[storage.data_ptr()] = storage.nbytes()
            return t

        with use_cp_context(ctx):
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                h = x.clone()  # not a leaf: saved by the first block like an embedding output
                for block in model.layers.values():
                    h = block(h, part.local["position_ids"])
            h.square().sum().backward()  # the graph is whole: every cp collective's backward runs
        out[name] = sum(seen.values())
        out[f"{name}-whole-row"] = sum(whole.values())
    return out


@pytest.fixture(scope="module")
def measured() -> list[dict[str, int]]:
    return spawn(_saved_bytes, world_size=2, timeout=180)


def _planned(cp: int, mode: str | None) -> int:
    from lightning_v17.models.config import ModelConfig
    from lightning_v17.planner.memory import activation_bytes_per_layer_of

    shape = ModelConfig(max_seq_len=SEQ, **SHAPE).to_shape(SEQ)
    per_layer = activation_bytes_per_layer_of(shape, seq=SEQ, micro_batch=1, cp=cp, cp_mode=mode, element_bytes=4)
    return per_layer * LAYERS


@pytest.mark.parametrize("name", ["ulysses", "allgather"])
def test_cp2_halves_the_saved_activations(measured, name) -> None:
    for rank, got in enumerate(measured):
        assert got[name] <= 0.55 * got["cp1"], (name, rank, got[name] / got["cp1"])


@pytest.mark.parametrize(("name", "cp", "mode"), [("cp1", 1, None), ("ulysses", 2, "ulysses"),
                                                  ("allgather", 2, "allgather")])
def test_saved_bytes_per_rank_match_the_planner(measured, name, cp, mode) -> None:
    planned = _planned(cp, mode)
    for rank, got in enumerate(measured):
        assert abs(got[name] / planned - 1) <= TOL, (name, rank, got[name], planned)


def test_allgather_keeps_nothing_of_the_whole_row(measured) -> None:
    for rank, got in enumerate(measured):
        assert got["ulysses-whole-row"] > 0  # the probe sees ulysses' whole-row tensors of H/cp heads
        assert got["allgather-whole-row"] == 0, (rank, got["allgather-whole-row"])
