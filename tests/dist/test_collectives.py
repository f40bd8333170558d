"""engine/collectives.py on 2 gloo ranks: the all-to-all reduce-scatter / all-gather equal the native collectives
(exactly: the same two addends), FSDP2 really uses them, and ZeRO-3 gradients with them equal the native ones."""

from __future__ import annotations

import torch

from lightning_v17.engine.state import state_of
from tests._dist import spawn


def _collectives(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from lightning_v17.engine.collectives import all_gather, reduce_scatter, use_all_to_all

    out: dict = {"use": use_all_to_all(dist.group.WORLD)}
    g = torch.Generator().manual_seed(100 + rank)
    for n in (1, 7, 1000):
        x = torch.randn(world * n, generator=g, dtype=torch.float64)
        native = torch.empty(n, dtype=x.dtype)
        dist.reduce_scatter_tensor(native, x.clone())
        ours = torch.empty(n, dtype=x.dtype)
        reduce_scatter(ours, x, group=dist.group.WORLD)
        out[f"rs{n}"] = torch.equal(ours, native)
        avg = torch.empty(n, dtype=x.dtype)
        reduce_scatter(avg, x, group=dist.group.WORLD, average=True, async_op=True).wait()
        out[f"avg{n}"] = torch.allclose(avg, native / world, rtol=0, atol=1e-15)
        gathered, ref = torch.empty(world * n, dtype=x.dtype), torch.empty(world * n, dtype=x.dtype)
        all_gather(gathered, ours, group=dist.group.WORLD)
        dist.all_gather_into_tensor(ref, ours)
        out[f"ag{n}"] = torch.equal(gathered, ref)
    return out


def test_all_to_all_collectives_equal_native_on_gloo() -> None:
    for res in spawn(_collectives, world_size=2):
        assert res.pop("use") is True
        assert res and all(res.values()), res


def _own_mapping(t: torch.Tensor) -> bool:
    """Whether ``t``'s storage starts a mapping of its own in /proc/self/maps (glibc's chunks, heap or mmapped, start
    after a header: never at a page boundary that begins a mapping)."""
    start = t.untyped_storage().data_ptr()
    with open("/proc/self/maps") as f:
        return any(int(line.split("-", 1)[0], 16) == start for line in f)


def _fsdp_grads(rank: int, world: int, native: bool, mapped: bool = False) -> dict:
    import os

    if native:
        os.environ["LIGHTNING_V17_NATIVE_COLLECTIVES"] = "1"
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_v17.engine.collectives import (
        FSDPAllToAllAllGather,
        FSDPAllToAllReduceScatter,
        map_gradient_buffers,
    )
    from lightning_v17.engine.zero.fsdp import apply_fsdp

    torch.manual_seed(0)
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(
                [nn.Sequential(nn.Linear(16, 33), nn.Tanh(), nn.Linear(33, 16)) for _ in range(3)]
            )
            self.head = nn.Linear(16, 5)

        def forward(self, h: torch.Tensor) -> torch.Tensor:
            for blk in self.blocks:
                h = blk(h)
            return self.head(h)

    net = Net()  # the shape the strategy sees: root (LightningModule) -> net -> blocks + head
    root = nn.Module()
    root.net = net
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
    units = apply_fsdp(root, mesh=mesh, wrap_classes=("Sequential",))
    model = net
    groups = [pg for u in units for pg in u._get_fsdp_state()._fsdp_param_groups]
    installed = [
        isinstance(pg._reduce_scatter_comm, FSDPAllToAllReduceScatter)
        and isinstance(pg._all_gather_comm, FSDPAllToAllAllGather)
        for pg in groups
    ]
    n_mapped = map_gradient_buffers(root, min_bytes=1) if mapped else 0
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(rank))
    for _ in range(2):  # second step: the reduce-scatter accumulates into existing sharded grads
        model(x).square().mean().backward()
    grads = {n: p.grad.full_tensor() for n, p in root.named_parameters()}
    own = [_own_mapping(p.grad.to_local()) for p in root.parameters()]
    mapped_buffers = sum(state_of(m).reduce_scatter.mapped for m in root.modules() if state_of(m).reduce_scatter)
    return {"installed": installed, "grads": grads, "n_mapped": n_mapped, "own_mapping": own,
            "mapped_buffers": mapped_buffers}  # fmt: skip


def test_fsdp_uses_all_to_all_comms_and_matches_native() -> None:
    ours = spawn(_fsdp_grads, world_size=2, args=(False,))
    native = spawn(_fsdp_grads, world_size=2, args=(True,))
    assert ours[0]["installed"] and all(ours[0]["installed"]), ours[0]["installed"]
    assert not any(native[0]["installed"]), "LIGHTNING_V17_NATIVE_COLLECTIVES=1 must keep FSDP2's own comms"
    for name, g in native[0]["grads"].items():
        torch.testing.assert_close(ours[0]["grads"][name], g, rtol=1e-6, atol=1e-7, msg=name)
        assert g.abs().sum() > 0, name


def test_gradient_buffers_can_be_their_own_mappings_and_stay_exact() -> None:
    """map_gradient_buffers (the nvme tier's host_memory="recycle"): every sharded gradient is its own anonymous
    mapping (outside glibc's heap), the reduce-scatter inputs are not, and the gradients are bitwise those of the same
    collectives into heap buffers."""
    mapped = spawn(_fsdp_grads, world_size=2, args=(False, True))
    heap = spawn(_fsdp_grads, world_size=2, args=(False, False))
    for res in mapped:
        assert res["n_mapped"] == 4, res["n_mapped"]  # 3 blocks + the root
        assert all(res["own_mapping"]), res["own_mapping"]
        # only the outputs (4 units x 2 backward passes), not the inputs, which are freed when the call returns
        assert res["mapped_buffers"] == 8, res["mapped_buffers"]
    assert not any(heap[0]["own_mapping"]), heap[0]["own_mapping"]
    for name, g in heap[0]["grads"].items():
        torch.testing.assert_close(mapped[0]["grads"][name], g, rtol=0, atol=0, msg=name)
