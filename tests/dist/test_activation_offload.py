"""Activation offload at ZeRO-3 on 2 gloo ranks, through the engine alone (``engine.parallelize.parallelize``).

The reference Llama (4 blocks) at ZeRO-3 over ``dp_shard=2``, without recompute and with selective recompute,
5 SGD steps on each rank's half of the batch: with :class:`ActivationOffload` on the blocks the losses, each rank's
local gradient shards at every step and its final parameter shards equal the same run without offload bit for bit.

The read-back buffer pool is really reused: over steps 2..5 reads happen every step while the pool's allocation
counter stays where step 1 left it (two buffers: the block being differentiated and the one read ahead) and no read
is served outside the pool, so three steps in a row and more run on recycled buffers, bit for bit.
FSDP2 frees and re-gathers the unsharded parameters the blocks save; they are never offloaded (a write of one would
be a copy FSDP2 cannot reshard), which the run checks from the tier's write log.
"""

from __future__ import annotations

import itertools

import pytest

from tests._dist import spawn

pytestmark = pytest.mark.timeout(240)

STEPS = 5


def _run(mode: str, nvme_path: str | None, rank: int) -> dict:
    import torch
    import torch.nn.functional as F

    from lightning_v17.config import MeshSpec, TrainingPolicy, ZeroPolicy
    from lightning_v17.engine.offload.activations import ActivationOffload
    from lightning_v17.engine.parallelize import parallelize
    from lightning_v17.mesh import MeshRuntime, build_device_mesh
    from lightning_v17.models import Llama, ModelConfig

    cfg = ModelConfig(vocab_size=128, hidden=64, layers=4, heads=4, kv_heads=2, ffn=160, max_seq_len=128)
    spec = MeshSpec(dp_shard=2)
    mesh = MeshRuntime(spec, build_device_mesh(spec, device_type="cpu"))
    model = Llama(cfg, init_seed=0)
    done = parallelize(model, mesh=mesh, policy=TrainingPolicy(zero=ZeroPolicy(stage=3), recompute=mode), device="cpu")
    off, written, current = None, [], [set()]
    for block in done.units:  # the unsharded parameters exist inside the block's forward (after FSDP2's unshard)
        block.register_forward_pre_hook(
            lambda mod, a: current.__setitem__(0, {p.untyped_storage().data_ptr() for p in mod.parameters()})
        )
    if nvme_path is not None:
        off = ActivationOffload(done.units, nvme_path=nvme_path, min_bytes=1024, resident_blocks=1, rank=rank)
        write = off.io.write

        def logged(path, t, *a, **kw):
            written.append(t.untyped_storage().data_ptr() in current[0])
            return write(path, t, *a, **kw)

        off.io.write = logged
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses, grads, pool = [], [], []
    for s in range(STEPS):
        ids = torch.randint(0, cfg.vocab_size, (4, 64), generator=torch.Generator().manual_seed(s))[2 * rank :][:2]
        loss = F.cross_entropy(model(ids).flatten(0, 1), ids.flatten())
        loss.backward()
        losses.append(loss.detach().clone())
        grads.append({n: p.grad.to_local().clone() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
        if off is not None:  # after each step: buffers allocated, requests served outside the pool, reads so far
            reads = off.stats["reads_ahead"] + off.stats["reads_on_demand"]
            pool.append((off.pool.allocations, off.pool.misses, off.pool.reuses, reads))
    params = {n: p.detach().to_local().clone() for n, p in model.named_parameters()}
    stats = dict(off.stats) if off is not None else {}
    if off is not None:
        off.close()
    return {"losses": losses, "grads": grads, "params": params, "stats": stats,
            "param_writes": sum(written), "writes": len(written), "pool": pool}  # fmt: skip


def _worker(rank: int, world: int, root: str) -> dict:
    out = {}
    for mode in ("none", "selective"):
        out[mode] = (_run(mode, None, rank), _run(mode, f"{root}", rank))
    return out


def test_zero3_two_ranks_offload_equals_no_offload_bit_for_bit(tmp_path):
    ranks = spawn(_worker, world_size=2, args=(str(tmp_path),), timeout=220)
    import torch

    for rank, r in enumerate(ranks):
        for mode, (ref, got) in r.items():
            assert got["stats"]["bytes_offloaded"] > 0 and got["stats"]["reads_on_demand"] == 0, got["stats"]
            assert got["writes"] > 0 and got["param_writes"] == 0, (rank, mode, got["param_writes"])
            for a, b in zip(ref["losses"], got["losses"]):
                assert torch.equal(a, b), (rank, mode, a, b)
            for step, (ga, gb) in enumerate(zip(ref["grads"], got["grads"])):
                for name in ga:
                    assert torch.equal(ga[name], gb[name]), (rank, mode, step, name)
            for name in ref["params"]:
                assert torch.equal(ref["params"][name], got["params"][name]), (rank, mode, name)
            allocs, misses, reuses, reads = zip(*got["pool"])
            assert allocs[0] == 2 and set(allocs) == {2}, (rank, mode, got["pool"])  # flat after step 1
            assert set(misses) == {0}, (rank, mode, got["pool"])  # no read outside the pool
            assert all(b > a for a, b in itertools.pairwise(reads)), (rank, mode, got["pool"])  # reads every step
            assert all(b > a for a, b in itertools.pairwise(reuses)), (rank, mode, got["pool"])  # from recycled buffers
    assert not any(tmp_path.iterdir()), list(tmp_path.iterdir())  # every rank's folder removed
