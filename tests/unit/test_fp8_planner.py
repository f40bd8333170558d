"""The planner's FP8 terms against measured bytes (issue 12, "planner agreement for fp8").

What FP8 really changes in memory, measured here on the tiny reference Llama (CPU, one process):

* **Saved activations.** torchao's ``Float8Linear`` (``tensorwise``, ``rowwise``) saves the high-precision input and
  weight and casts again in backward: the per-block saved bytes are those of the plain model (measured equal).
  Delayed scaling (``engine/fp8/delayed.py``) saves the float8 casts: a 1-byte input copy per converted Linear and a
  1-byte copy of every converted weight, and frees the high-precision tensors only those Linears kept.
  :func:`planner.memory.fp8_activation_delta_bytes_per_layer` models the difference; it is held here against the
  measured difference (fp8 minus plain, same blocks and input) to the byte, fp32 and bf16 with recompute none, fp32
  with full recompute (delta 0: the block input only).
  Measurement: ``bench/activations.py``'s storage recorder (every storage an op creates during the forward that is
  still alive afterwards, parameters and module buffers excluded).
* **The ZeRO-3 all-gather.** With ``fp8_all_gather`` (tensorwise) the converted weights travel and land in float8:
  FSDP2's unsharded storages of a block hold 1 byte per converted weight element instead of 4. Measured by unsharding
  one block under FSDP2 (a 1-rank gloo group: the same pre/post all-gather path, with the real all-gather) and
  counting the storages it allocates; :func:`planner.memory.zero3_gather_bytes` with ``float8_params`` counts one
  gathered unit as ``(unit - float8) * 4 + float8`` bytes. Tolerance 0.1% (torchao keeps one fp32 scale per weight).
* Params, gradients and optimizer state are unchanged by FP8 here (fp32 master weights, float8 only inside the
  GEMMs): ``MemoryBuckets`` plans them from the parameters' real dtype, and the float8 all-gather weight wraps the
  fp32 shard (``tests/dist/test_fp8_all_gather.py`` checks the buckets).
"""

from __future__ import annotations

import gc
from dataclasses import replace

import pytest
import torch

from lightning_v17.config import FP8Policy
from lightning_v17.models.config import ModelConfig
from lightning_v17.planner.memory import (
    FP32_BYTES,
    activation_bytes_per_layer_of,
    fp8_activation_delta_bytes_per_layer,
    zero3_gather_bytes,
)

pytest.importorskip("torchao")

#: Tiny GQA shape: head_dim 16, kv_dim 64, SwiGLU 384; s = 64 tokens, b = 2 (test_activation_bytes.py's, one block).
TINY = ModelConfig(vocab_size=64, hidden=128, layers=1, heads=8, kv_heads=4, ffn=384, max_seq_len=64)
SEQ, BATCH = 64, 2
DTYPES = {"fp32": (torch.float32, 4), "bf16": (torch.bfloat16, 2)}


def _saved_bytes_per_layer(recipe: str | None, dtype: torch.dtype, recompute: str) -> float:
    from bench.activations import _blocks, _forward, _StorageRecorder
    from lightning_v17.engine.fp8.convert import apply_fp8

    model, blocks, _ = _blocks(TINY, recompute=recompute, dtype=dtype, device="cpu")
    if recipe is not None:
        apply_fp8(model, policy=FP8Policy(recipe), units=blocks, device="cpu")
    state = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
    recorder = _StorageRecorder()
    out = _forward(blocks, TINY, dtype=dtype, device="cpu", seq=SEQ, micro_batch=BATCH, context=lambda: recorder)
    # no gc.collect() (0.6 s on a loaded interpreter): the forward makes no reference cycles, storages die by refcount
    total = recorder.alive_bytes(state | {out.untyped_storage().data_ptr()})
    return total / TINY.layers


@pytest.mark.parametrize(("dtype_name", "recompute"), [("fp32", "none"), ("bf16", "none"), ("fp32", "full")])
def test_fp8_saved_activation_delta_matches_the_run(dtype_name, recompute):
    dtype, e = DTYPES[dtype_name]
    plain = _saved_bytes_per_layer(None, dtype, recompute)
    shape = TINY.to_shape(SEQ)
    kw = {"seq": SEQ, "micro_batch": BATCH, "recompute": recompute, "element_bytes": e}
    for recipe in ("tensorwise", "delayed"):
        measured = _saved_bytes_per_layer(recipe, dtype, recompute) - plain
        planned = fp8_activation_delta_bytes_per_layer(
            recipe, hidden=TINY.hidden, heads=TINY.heads, kv_heads=TINY.kv_heads, ffn=TINY.ffn, **kw
        )
        assert measured == planned, (recipe, dtype_name, recompute, measured, planned)
        # and through the per-block count the plan uses: the fp8 term on top of the plain llama count
        assert activation_bytes_per_layer_of(shape, fp8=recipe, **kw) - activation_bytes_per_layer_of(shape, **kw) == (
            planned
        )
    if recompute == "none":  # by hand, delayed, per token: 1-byte copies 6h + f, freed e(2h + f); per block w8, scales
        h, f, kv = TINY.hidden, TINY.ffn, 64
        tokens = SEQ * BATCH
        by_hand = tokens * (6 * h + f - e * (2 * h + f)) + h * (2 * h + 2 * kv) + 3 * h * f + 7 * 3 * FP32_BYTES
        assert fp8_activation_delta_bytes_per_layer("delayed", hidden=h, heads=8, kv_heads=4, ffn=f, **kw) == by_hand


def test_fp8_delayed_activations_refused_for_gpt_shapes():
    from lightning_v17.planner.model import get_preset

    gpt = get_preset("gpt3-175b")
    assert activation_bytes_per_layer_of(gpt, seq=64, micro_batch=1, fp8="tensorwise") == (
        activation_bytes_per_layer_of(gpt, seq=64, micro_batch=1)
    )
    with pytest.raises(ValueError, match="fp8='delayed' activation bytes are derived for the llama block"):
        activation_bytes_per_layer_of(gpt, seq=64, micro_batch=1, fp8="delayed")


def _unsharded_unit_bytes(float8_all_gather: bool) -> tuple[int, int, int]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torchao.float8.float8_linear import Float8Linear

    from bench.activations import _StorageRecorder
    from lightning_v17.engine.fp8.convert import apply_fp8
    from lightning_v17.models import Llama

    mesh = init_device_mesh("cpu", (1,))
    torch.manual_seed(0)
    model = Llama(replace(TINY, layers=2))
    blocks = model.recompute_units()
    apply_fp8(model, policy=FP8Policy("tensorwise"), units=blocks, device="cpu", float8_all_gather=float8_all_gather)
    for b in blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    unit = blocks[0]
    params = sum(p.numel() for p in unit.parameters())
    f8 = sum(m.weight.numel() for m in unit.modules() if isinstance(m, Float8Linear))
    recorder = _StorageRecorder()
    with recorder:
        unit.unshard()  # FSDP2's all-gather into the unit's unsharded parameters
    gc.collect()
    alive = recorder.alive_bytes(set())
    unit.reshard()
    return alive, params, f8


@pytest.fixture
def one_rank_group():
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.timeout(60)
def test_zero3_float8_all_gather_bytes_match_the_planner(one_rank_group):
    fp32_bytes, params, f8 = _unsharded_unit_bytes(False)
    fp8_bytes, _, _ = _unsharded_unit_bytes(True)
    assert f8 == 128 * (2 * 128 + 2 * 64) + 3 * 128 * 384  # wq, wo (h x h), wk, wv (kv x h), w1, w3, w2 (f x h)
    # one gathered unit and no prefetch, grads excluded: the planner's gathered-parameter term
    planned_fp32 = zero3_gather_bytes(params, param_bytes=4, grad_bytes=0, prefetch=0)
    planned_fp8 = zero3_gather_bytes(params, param_bytes=4, grad_bytes=0, prefetch=0, float8_params=f8)
    assert planned_fp8 == (params - f8) * 4 + f8  # by hand: the two norm weights in fp32, the rest 1 byte
    assert fp32_bytes == planned_fp32, (fp32_bytes, planned_fp32)
    assert abs(fp8_bytes / planned_fp8 - 1) <= 1e-3, (fp8_bytes, planned_fp8)


def test_v17_plan_carries_the_fp8_recipe_into_its_memory():
    """``v17 plan --precision fp8 [--fp8 recipe]``: the layout carries the recipe, and the plan's per-rank bytes use
    the two fp8 terms held against runs above: delayed scaling's saved float8 casts in the activations, and the
    float8 all-gather of a ZeRO-3 unit's Linear weights (tensorwise). Checked against the plan of the same layout
    without fp8, by hand from the shape."""
    from lightning_v17.planner.cli import build_parser, specs_from_args
    from lightning_v17.planner.plan import make_plan

    base = ["--model", "llama2-7b", "--gpus", "8", "--zero-stage", "3", "--recompute", "none", "--tp", "1"]

    def plan(*extra):
        return make_plan(*specs_from_args(build_parser().parse_args([*base, *extra])))

    bf16, fp8, delayed = plan(), plan("--precision", "fp8"), plan("--precision", "fp8", "--fp8", "delayed")
    assert bf16.layout.fp8 is None and fp8.layout.fp8.value == "tensorwise" and delayed.layout.fp8.value == "delayed"
    shape, lay = fp8.model.shape, fp8.layout
    # tensorwise: same activations; the gathered unit's Linear weights cost 1 B instead of 2 (block = largest unit)
    h, kv, f = shape.hidden, shape.kv_dim, shape.ffn
    linears = 2 * h * h + 2 * h * kv + 3 * h * f  # wq, wo; wk, wv; w1, w2, w3
    assert shape.block_params == shape.largest_unit_params
    assert fp8.memory.activation_per_layer == bf16.memory.activation_per_layer
    gathered_units = 1 + 1  # the unit and the one prefetched (zero3_gather_bytes' default prefetch=1)
    assert bf16.memory.temp - fp8.memory.temp == gathered_units * linears * (2 - 1)
    # delayed: the saved float8 casts, per block, on top of the plain count (the measured term above)
    delta = fp8_activation_delta_bytes_per_layer(
        "delayed", seq=lay.seq, micro_batch=lay.micro_batch, hidden=h, heads=shape.heads, kv_heads=shape.kv_heads,
        ffn=f, tp=lay.tp, recompute=lay.recompute, element_bytes=2,
    )  # fmt: skip
    assert delta > 0 and delayed.memory.activation_per_layer == bf16.memory.activation_per_layer + delta
    assert delayed.memory.temp == bf16.memory.temp  # delayed all-gathers in high precision
