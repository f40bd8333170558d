"""The expert-parallel engine alone (``engine/ep/``), on a small MoE network of its own (4 experts, top-2, the
experts a per-expert loop so that nothing but the dispatch is under test), against one process on the whole batch:

* both dispatchers (all-to-all, all-gather) give the expert outputs, the input gradients and the expert weight
  gradients of one process bit for bit, with uneven splits (every row of one rank routed to the other's experts);
* ZeRO stages 0-3 with ep=2 on 2 ranks, ep=2 x edp=2 and ep=4 on 4 ranks, and HSDP on 8 ranks (dp_replicate=2 x
  dp_shard=4, ep=2: efsdp=2, so ZeRO 1-3 partition the experts over efsdp and reduce them over the replicas too,
  on 8-row batches), and at ep=2 x edp=2 also with the optimizer state on the nvme tier
  (``OffloadPolicy(optimizer="nvme")``, every expert's state included): 4 steps of plain SGD (a gradient off by a
  constant factor moves the parameters: pytorch#160285) and of AdamW with global-norm clipping at 0.1 (one norm per
  mesh, combined), losses within 1e-6 and parameters within 1e-5 of one process.
"""

from __future__ import annotations

import pytest

from tests._dist import spawn

#: the compositions this file checks against one process (docs/gen_layouts.py builds docs/layouts.md from them)
COMPOSES = (("ep", "zero1"), ("ep", "zero2"), ("ep", "zero3"), ("ep", "dp_replicate", "zero1"),
            ("ep", "dp_replicate", "zero2"), ("ep", "dp_replicate", "zero3"),
            ("ep", "offload_optimizer", "zero1"), ("ep", "offload_optimizer", "zero2"),
            ("ep", "offload_optimizer", "zero3"))  # fmt: skip

E, H, INTER, TOPK, VOCAB = 4, 16, 8, 2, 32
CASES = [(opt, stage) for opt in ("sgd", "adamw_clip") for stage in (0, 1, 2, 3)]
#: (optimizer, stage, tier) with the optimizer state offloaded, run in the ep=2 x edp=2 spawn
OFFLOAD_CASES = [(opt, stage, "nvme") for opt in ("sgd", "adamw_clip") for stage in (1, 2, 3)]



def _over_ep(p) -> bool:
    """Sharded over ep: marked by engine/ep, or (ZeRO-3 over efsdp) an FSDP2 DTensor whose mesh has the ep axis."""
    return hasattr(p, "_v17_expert") or "ep" in (getattr(getattr(p, "device_mesh", None), "mesh_dim_names", None) or ())

def _net():
    import torch
    import torch.nn.functional as F
    from torch import nn

    from lightning_v17.engine._dtensor import local

    class Experts(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gate_up_proj = nn.Parameter(torch.randn(E, 2 * INTER, H) * 0.1)
            self.down_proj = nn.Parameter(torch.randn(E, H, INTER) * 0.1)

        def forward(self, x, counts):
            gu, dn = local(self.gate_up_proj), local(self.down_proj)
            outs, start = [], 0
            for e, c in enumerate(counts.tolist()):
                g, u = (x[start : start + c] @ gu[e].T).chunk(2, -1)
                outs.append((F.silu(g) * u) @ dn[e].T)
                start += c
            return torch.cat(outs)

    class MoE(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.num_experts, self.dispatcher = E, None
            self.router, self.experts = nn.Linear(H, E, bias=False), Experts()

        def forward(self, x):
            flat = x.reshape(-1, H)
            w, idx = torch.topk(self.router(flat).softmax(-1), TOPK, -1)
            token = torch.arange(flat.shape[0]).repeat_interleave(TOPK)
            expert = idx.reshape(-1)
            if self.dispatcher is None:
                order = torch.argsort(expert, stable=True)
                y = self.experts(flat[token][order], torch.bincount(expert, minlength=E))[torch.argsort(order)]
            else:
                y = self.dispatcher(flat[token], expert, self.experts)
            mixed = torch.zeros_like(flat).index_add(0, token, y * (w / w.sum(-1, keepdim=True)).reshape(-1, 1))
            return x + mixed.view_as(x)

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm, self.moe = nn.LayerNorm(H), MoE()

        def forward(self, x):
            return self.moe(self.norm(x))

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.emb, self.layers, self.head = nn.Embedding(VOCAB, H), nn.ModuleList([Block(), Block()]), nn.Linear(H, VOCAB)

        def forward(self, t):
            h = self.emb(t)
            for layer in self.layers:
                h = layer(h)
            return self.head(h)

    return Net()


def _batches(rows: int = 4):
    import torch

    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, VOCAB, (rows, 9), generator=g) for _ in range(4)]


def _optimizer(name, params):
    import torch

    return (torch.optim.SGD if name == "sgd" else torch.optim.AdamW)(params, lr=0.05)


def _loss(model, rows):
    import torch.nn.functional as F

    return F.cross_entropy(model(rows[:, :-1]).reshape(-1, VOCAB), rows[:, 1:].reshape(-1))


def _reference(opt_name: str, rows: int = 4) -> tuple[list[float], dict]:
    import torch

    model = _net()
    opt = _optimizer(opt_name, model.parameters())
    losses = []
    for batch in _batches(rows):
        loss = _loss(model, batch)
        loss.backward()
        if opt_name == "adamw_clip":
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def _train_worker(rank: int, world: int, ep: int, replicate: int = 1) -> dict:
    import tempfile

    import torch.distributed as dist

    from lightning_v17.config import MeshSpec, OffloadPolicy, TrainingPolicy, ZeroPolicy
    from lightning_v17.engine.offload.handles import offload_of
    from lightning_v17.engine.parallelize import parallelize
    from lightning_v17.engine.precision import clip_grad_norm_
    from lightning_v17.mesh import MeshRuntime, build_device_mesh

    spec = MeshSpec(dp_replicate=replicate, dp_shard=world // replicate, ep=ep)
    mesh = MeshRuntime(spec, build_device_mesh(spec, device_type="cpu"))
    rows = max(4, world)
    per, out = rows // world, {}
    folder = tempfile.mkdtemp(prefix="v17_ep_offload_")
    offload_cases = OFFLOAD_CASES if (world, ep, replicate) == (4, 2, 1) else []
    for opt_name, stage, tier in [(o, s, "none") for o, s in CASES] + offload_cases:
        model = _net()
        policy = TrainingPolicy(zero=ZeroPolicy(stage=stage), offload=OffloadPolicy(
            optimizer=tier, nvme_path=folder if tier == "nvme" else None))  # fmt: skip
        done = parallelize(model, mesh=mesh, policy=policy, device="cpu")
        opt = _optimizer(opt_name, model.parameters())
        done.zero.prepare_optimizers([opt], offload=policy.offload)
        off = offload_of(opt)
        # the tier holds every parameter the optimizer steps, the experts' included
        on_tier = sorted({n for n, p in model.named_parameters() for q in (off.params if off else ())
                          if getattr(q, "_v17_param", q) is p or q is p})  # fmt: skip
        losses = []
        for batch in _batches(rows):
            loss = _loss(model, batch[per * rank : per * (rank + 1)])
            loss.backward()
            done.zero.finish_grad_sync()
            if opt_name == "adamw_clip":
                params = [p for g in opt.param_groups for p in g["params"]]
                clip_grad_norm_(params, 0.1, group=mesh.group("dp_shard"), sharded=done.zero.grad_norm_over_shards)
            opt.step()
            done.zero.after_optimizer_step(opt)
            opt.zero_grad()
            total = loss.detach().clone()
            dist.all_reduce(total)
            losses.append(float(total) / world)
        params = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
                  for n, p in model.named_parameters()}  # fmt: skip
        experts = done.zero.engine.expert_engine if done.zero.engine is not None else None
        # who holds the experts: the expert ZeRO engine's (shard ranks, replicas) at stages 1-2, else the experts'
        # FSDP2 mesh (stage 3) or None (ZeRO-0, efsdp = 1: ExpertGradSync)
        held = ((experts.world, experts.replicas) if experts is not None else
                getattr(getattr(model.layers[0].moe.experts.down_proj, "device_mesh", None), "mesh_dim_names", None))
        if off is not None:
            off.close()
        key = (opt_name, stage) if tier == "none" else (opt_name, stage, tier)
        out[key] = {"losses": losses, "params": params, "held": held, "on_tier": on_tier,
                                  "sharded": sorted(n for n, p in model.named_parameters() if _over_ep(p))}
    return out


def _dispatch_worker(rank: int, world: int) -> dict:
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_v17.engine.ep import apply_expert_parallel, make_dispatcher

    g = torch.Generator().manual_seed(1)
    sizes = (5, 9)
    xs = [torch.randn(n, H, generator=g) for n in sizes]
    ids = [torch.randint(0, E, (sizes[0],), generator=g), torch.tensor([0, 0, 0, 0, 1, 1, 1, 1, 0])]
    weight = torch.arange(sum(sizes) * H, dtype=torch.float32).view(-1, H) / 100  # a non-uniform output gradient
    net = _net()
    layer = net.layers[0].moe
    full = _net().layers[0].moe.experts  # the same initial weights, one process
    x_all = torch.cat(xs).requires_grad_()
    expert_all = torch.cat(ids)
    order = torch.argsort(expert_all, stable=True)
    y_all = full(x_all[order], torch.bincount(expert_all, minlength=E))[torch.argsort(order)]
    (y_all * weight).sum().backward()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    apply_expert_parallel(net, ep_mesh=mesh, edp_group=None, dp=1)
    out = {}
    lo, hi = sum(sizes[:rank]), sum(sizes[: rank + 1])
    for kind in ("alltoall", "allgather"):
        layer.dispatcher = make_dispatcher(kind, mesh.get_group(), E)
        for p in layer.experts.parameters():
            p.grad = None
        x = xs[rank].clone().requires_grad_()
        y = layer.dispatcher(x, ids[rank], layer.experts)
        (y * weight[lo:hi]).sum().backward()
        out[kind] = {
            "y": torch.equal(y, y_all[lo:hi].detach()),
            "x_grad": torch.equal(x.grad, x_all.grad[lo:hi]),
            "w_grad": all(torch.equal(p.grad.to_local(), q.grad.chunk(world)[rank])
                          for p, q in zip(layer.experts.parameters(), full.parameters())),
            "sent": layer.dispatcher.last_sent.tolist(),
            "received": layer.dispatcher.last_received.tolist(),
        }
    return out


@pytest.fixture(scope="module")
def references() -> dict:
    return {(name, rows): _reference(name, rows) for name in ("sgd", "adamw_clip") for rows in (4, 8)}


@pytest.fixture(scope="module", params=[(2, 2, 1), (4, 2, 1), (4, 4, 1), (8, 2, 2)],
                ids=["ep2", "ep2xedp2", "ep4", "hsdp2x4_ep2"])  # fmt: skip
def runs(request) -> tuple[int, list[dict]]:
    world, ep, replicate = request.param
    return world, spawn(_train_worker, world_size=world, args=(ep, replicate), timeout=600)


def test_both_dispatchers_equal_one_process_bitwise_with_uneven_splits() -> None:
    res = spawn(_dispatch_worker, world_size=2, args=(), timeout=200)
    for kind in ("alltoall", "allgather"):
        for rank in range(2):
            r = res[rank][kind]
            assert r["y"] and r["x_grad"] and r["w_grad"], (kind, rank, r)
        # rank 1's rows all go to rank 0's experts (0 and 1): the splits are uneven; what rank r receives from
        # source s per local expert is what s sent to r's experts
        assert res[1][kind]["sent"] == [5, 4, 0, 0], res[1][kind]["sent"]
        for dst in range(2):
            for src in range(2):
                assert res[dst][kind]["received"][2 * src : 2 * src + 2] == res[src][kind]["sent"][2 * dst : 2 * dst + 2]


@pytest.mark.parametrize(("opt_name", "stage"), CASES)
def test_ep_training_matches_one_process(runs, references, opt_name, stage) -> None:
    import torch

    world, results = runs
    ref_losses, ref_params = references[(opt_name, max(4, world))]
    for rank, res in enumerate(results):
        got = res[(opt_name, stage)]
        assert got["sharded"] == sorted(n for n in ref_params if ".experts." in n), got["sharded"]
        if world == 8:  # efsdp = 2 with 2 replicas: ZeRO 1-3 partition the experts over efsdp, across the replicas
            want = {0: ("ep",), 1: (2, 2), 2: (2, 2), 3: ("dp_replicate", "efsdp", "ep")}[stage]
            assert got["held"] == want, (stage, got["held"])
        assert got["losses"] == pytest.approx(ref_losses, rel=1e-6, abs=1e-6), (world, rank)
        for name, p in got["params"].items():
            torch.testing.assert_close(p, ref_params[name], rtol=1e-5, atol=1e-5, msg=f"{world} {rank} {name}")


@pytest.mark.parametrize("runs", [(4, 2, 1)], ids=["ep2xedp2"], indirect=True)
@pytest.mark.parametrize(("opt_name", "stage", "tier"), OFFLOAD_CASES)
def test_ep_training_with_the_optimizer_state_offloaded_matches_one_process(runs, references, opt_name, stage,
                                                                            tier) -> None:  # fmt: skip
    import torch

    _world, results = runs
    ref_losses, ref_params = references[(opt_name, 4)]
    for rank, res in enumerate(results):
        got = res[(opt_name, stage, tier)]
        assert got["on_tier"] == sorted(ref_params), (rank, got["on_tier"])  # the experts' state on the tier too
        assert got["losses"] == pytest.approx(ref_losses, rel=1e-6, abs=1e-6), (rank, stage)
        for name, p in got["params"].items():
            torch.testing.assert_close(p, ref_params[name], rtol=1e-5, atol=1e-5, msg=f"{rank} {stage} {name}")
