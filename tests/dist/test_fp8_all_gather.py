"""Float8 all-gather under ZeRO-3 (issue 12), 2 gloo ranks: FSDP2 gathers the converted weights in float8
(torchao's ``enable_fsdp_float8_all_gather``) with their scales precomputed after each optimizer step.

Two models: the tiny Hugging Face Llama (a block holds fp32 norm weights next to the float8 weights, so FSDP2 packs
the block's gather into one ``uint8`` buffer itself) and a model whose blocks hold only Linears (FSDP2's buffer is
then ``float8_e4m3fn``, which gloo refuses with "Invalid scalar type"; ``engine/collectives.all_gather`` moves it as
a ``uint8`` view).

* **Parity.** 5 SGD steps match the same recipe in one process within 1e-5 relative (losses and final parameters),
  the reference being the data-parallel recipe: each step runs the two ranks' rows as two micro-batches (dynamic
  scales depend on the tokens quantized; ``tests/dist/test_fp8.py`` explains it). Each weight's float8 scale is a
  function of the whole weight, so casting a shard with the precomputed scale equals casting the whole tensor.
* **1-byte data.** Every all-gather FSDP2 issues is recorded as it reaches ``torch.distributed.all_to_all_single``
  (our gloo all-gather): with float8 all-gather a block's gather moves ``1 B x float8 elements + 4 B x the rest``,
  without it ``4 B x all``; the bytes are ``uint8`` on the wire; the pure-Linear model's FSDP2 buffer is float8.
* **MemoryBuckets** counts the wrapped weights' fp32 shards (the wrapper itself has no storage).
* **Scales after the step.** After every optimizer step each converted weight carries the scale
  ``float8_max / amax(whole weight)`` of its new values (``FP8Runtime.after_optimizer_step`` =
  ``precompute_float8_dynamic_scale_for_fsdp``), bitwise.

``rowwise`` has no float8 all-gather (torchao: "enable_fsdp_float8_all_gather only supports tensorwise scaling
granularity"; a rowwise weight is quantized along a different dim for each GEMM): ``fp8_all_gather=True`` with it
is refused (``tests/unit/test_fp8.py``) and rowwise at ZeRO-3 gathers fp32 (``tests/dist/test_fp8.py``).
"""

from __future__ import annotations

import pytest

from tests._dist import spawn

#: the compositions this file checks against one process (docs/gen_layouts.py builds docs/layouts.md from them)
COMPOSES = (("fp8", "zero3"),)

pytest.importorskip("transformers")
pytest.importorskip("torchao")

RTOL = 1e-5
STEPS = 5
ROWS = 8  # per step, 4 per rank
LAYERS = 2
DIM = 32


def _mlp_blocks():
    """Embedding -> 2 residual blocks of only Linears (32 -> 64 -> 32) -> head: FSDP2's block buffer is pure float8."""
    import torch
    from torch import nn

    from tests._models import VOCAB

    class Blocks(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(VOCAB, DIM)
            self.layers = nn.ModuleList(
                nn.Sequential(nn.Linear(DIM, 2 * DIM, bias=False), nn.GELU(), nn.Linear(2 * DIM, DIM, bias=False))
                for _ in range(LAYERS)
            )
            self.head = nn.Linear(DIM, VOCAB, bias=False)

        def forward(self, input_ids, labels):
            h = self.emb(input_ids)
            for layer in self.layers:
                h = h + layer(h)
            logits = self.head(h)[:, :-1]
            loss = nn.functional.cross_entropy(logits.flatten(0, 1), labels[:, 1:].flatten())
            return type("Out", (), {"loss": loss})()

    torch.manual_seed(0)
    return Blocks()


def _build(kind: str):
    from tests._models import hf_llama

    return hf_llama(layers=LAYERS) if kind == "hf_llama" else _mlp_blocks()


def _batches():
    import torch

    from tests._models import token_dataset

    rows = token_dataset("hf_llama", rows=ROWS * STEPS)
    return [torch.stack([r["input_ids"] for r in rows[ROWS * s : ROWS * s + ROWS]]) for s in range(STEPS)]


def _reference(kind: str):
    """Tensorwise in one process: per step the two ranks' 4-row halves as micro-batches, gradients averaged."""
    import torch

    from lightning_v17.config import FP8Policy
    from lightning_v17.engine.fp8.convert import apply_fp8
    from lightning_v17.engine.zero.fsdp import find_wrap_units

    model = _build(kind)
    apply_fp8(model, policy=FP8Policy("tensorwise"), units=find_wrap_units(model), device="cpu")
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for ids in _batches():
        total = 0.0
        for part in (ids[: ROWS // 2], ids[ROWS // 2 :]):
            loss = model(input_ids=part, labels=part).loss / 2
            loss.backward()
            total += loss.item()
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def _expected_scale(full_weight):
    """torchao's tensorwise weight scale for the whole weight (float8_utils.amax_to_scale, in float64 then fp32)."""
    import torch
    from torchao.float8.float8_utils import EPS

    amax = full_weight.detach().abs().max().clamp(min=EPS).to(torch.float64)
    return (torch.finfo(torch.float8_e4m3fn).max / amax).to(torch.float32)


def _worker(rank: int, world: int) -> dict:
    import torch
    import torch.distributed as dist
    from torchao.float8.float8_linear import Float8Linear

    from lightning_v17.config import FP8Policy, MeshSpec, TrainingPolicy, ZeroPolicy
    from lightning_v17.engine import collectives
    from lightning_v17.engine.parallelize import parallelize
    from lightning_v17.trackers.memory import measure_model_state
    from lightning_v17.mesh import MeshRuntime, build_device_mesh

    spec = MeshSpec(dp_shard=2)
    mesh = MeshRuntime(spec, build_device_mesh(spec, device_type="cpu"))

    # record each FSDP2 all-gather: the dtype FSDP2 hands over, and the dtype/bytes that reach the gloo collective
    gathers: list[dict] = []
    inside = []
    orig_call = collectives.FSDPAllToAllAllGather.__call__
    orig_a2a = dist.all_to_all_single

    def call(self, output_tensor, input_tensor, group, async_op=False):
        inside.append({"fsdp_dtype": output_tensor.dtype})
        try:
            return orig_call(self, output_tensor, input_tensor, group, async_op)
        finally:
            gathers.append(inside.pop())

    def a2a(output, input, *args, **kwargs):
        if inside:
            inside[-1].update(wire_dtype=input.dtype, bytes=output.numel() * output.element_size())
        return orig_a2a(output, input, *args, **kwargs)

    collectives.FSDPAllToAllAllGather.__call__ = call
    dist.all_to_all_single = a2a
    out = {}
    for kind in ("hf_llama", "mlp"):
        for gather8 in (True, False):
            model = _build(kind)
            policy = TrainingPolicy(zero=ZeroPolicy(stage=3), fp8=FP8Policy("tensorwise", all_gather=gather8))
            done = parallelize(model, mesh=mesh, policy=policy, device="cpu")
            assert done.fp8 is not None and done.fp8.float8_all_gather is gather8
            opt = torch.optim.SGD(model.parameters(), lr=0.5)
            losses, scales_ok = [], []
            gathers.clear()
            for ids in _batches():
                mine = ids[rank * ROWS // 2 : (rank + 1) * ROWS // 2]
                loss = model(input_ids=mine, labels=mine).loss
                loss.backward()
                opt.step()
                done.fp8.after_optimizer_step()  # what V17Strategy.optimizer_step calls
                opt.zero_grad()
                total = loss.detach().clone()
                dist.all_reduce(total)
                losses.append(float(total) / world)
                if gather8:
                    for m in model.modules():
                        if isinstance(m, Float8Linear):
                            got = getattr(m.weight._local_tensor, "_precomputed_scale", None)
                            want = _expected_scale(m.weight.full_tensor())
                            scales_ok.append(got is not None and bool(torch.equal(got, want)))
            measured = measure_model_state(model, [opt])  # what MemoryBuckets counts (storage of the shards)
            shard_bytes = sum(p.to_local().numel() * 4 for p in model.parameters())
            params = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
            f8_numel = {}  # per FSDP unit: elements of converted weights, and of everything else
            for unit in done.units:
                conv = sum(m.weight.numel() for m in unit.modules() if isinstance(m, Float8Linear))
                f8_numel[conv] = sum(p.numel() for p in unit.parameters()) - conv
            out[(kind, gather8)] = {
                "losses": losses, "params": params, "scales_ok": scales_ok, "gathers": list(gathers),
                "units": f8_numel, "layers": len(done.fp8_layers), "param_bytes": (measured.param, shard_bytes),
            }  # fmt: skip
    return out


@pytest.fixture(scope="module")
def results():
    return spawn(_worker, world_size=2, timeout=200)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("kind", ["hf_llama", "mlp"])
def test_float8_all_gather_zero3_matches_the_same_recipe_single_process(results, kind):
    ref_losses, ref_params = _reference(kind)
    for rank, r in enumerate(results):
        for gather8 in (True, False):
            got = r[(kind, gather8)]
            where = f"{kind} fp8_all_gather={gather8} rank {rank}"
            assert got["losses"] == pytest.approx(ref_losses, rel=RTOL), where
            for n, ref in ref_params.items():
                err = float((got["params"][n] - ref).norm() / ref.norm().clamp_min(1e-12))
                assert err < RTOL, f"{where}: {n} differs by {err:.2e} relative"


@pytest.mark.timeout(240)
@pytest.mark.parametrize("kind", ["hf_llama", "mlp"])
def test_the_all_gather_moves_one_byte_per_float8_weight_element(results, kind):
    import torch

    for r in results:
        on, off = r[(kind, True)], r[(kind, False)]
        ((f8, rest),) = on["units"].items()  # every block has the same shapes
        assert f8 > 0
        block_on, block_off = f8 * 1 + rest * 4, (f8 + rest) * 4
        sizes_on = [g["bytes"] for g in on["gathers"]]
        sizes_off = [g["bytes"] for g in off["gathers"]]
        assert len(sizes_on) == len(sizes_off) and sizes_on, (sizes_on, sizes_off)
        # the same all-gathers in the same order; each block's shrinks by 3 B per float8 element, the rest is equal
        assert [b for b in sizes_on if b != block_on] == [b for b in sizes_off if b != block_off]
        n_blocks = sizes_on.count(block_on)
        assert n_blocks >= LAYERS * STEPS and sizes_off.count(block_off) == n_blocks, (sizes_on, sizes_off)
        assert {g["wire_dtype"] for g in on["gathers"] if g["bytes"] == block_on} == {torch.uint8}
        if kind == "mlp":  # FSDP2 handed over a pure float8 buffer: our gloo all-gather moved it as uint8
            assert {g["fsdp_dtype"] for g in on["gathers"] if g["bytes"] == block_on} == {torch.float8_e4m3fn}


@pytest.mark.timeout(240)
def test_scales_are_recomputed_from_the_new_weights_after_every_optimizer_step(results):
    for r in results:
        for kind in ("hf_llama", "mlp"):
            got = r[(kind, True)]
            assert len(got["scales_ok"]) == got["layers"] * STEPS and all(got["scales_ok"]), (kind, got["scales_ok"])


@pytest.mark.timeout(240)
def test_memory_buckets_count_the_float8_all_gather_weights_like_plain_ones(results):
    """MemoryBuckets' parameter bytes (``measure_model_state``) see through torchao's float8 all-gather weight
    wrapper (it has no storage of its own; reading one raised "invalid python storage"): each rank holds its fp32
    shards, 4 B per element, with float8 all-gather on or off."""
    for r in results:
        for kind in ("hf_llama", "mlp"):
            measured, shards = r[(kind, True)]["param_bytes"]
            assert measured == shards == r[(kind, False)]["param_bytes"][0], (kind, measured, shards)
