"""Hugging Face MoE models (Mixtral, Qwen3-MoE, DeepSeek-V3 of the installed transformers; tiny random configs: 2
layers, hidden 32, 4 experts, top-2, fp32, eager attention) adapted by ``lightning_v17.models.hf_moe.adapt_hf_moe``.

One process (ep=1, no ranks), against transformers' own experts implementations on the same weights and tokens:

* ``grouped_mm``: logits, loss and every gradient bit for bit, when its sort by expert keeps token order within an
  expert as the adapter's does (transformers calls ``torch.sort`` unstable, which on CPU reorders ties past 16 rows;
  unpatched, only the experts' weight gradients differ, by the fp32 summation order: within 1e-8);
* ``eager`` (the per-expert loop): within 1e-6, also at an intermediate size the grouped GEMM cannot take (14: the
  adapter's per-expert fallback);
* parameters, FQNs and the state dict unchanged; a deep copy dispatches through its own block; unsplittable layouts
  refused by name.

Two gloo ranks (ep=2 folded out of dp_shard=2) through ``engine.parallelize``, ZeRO-1 and ZeRO-3 over the dense
part, and four at ZeRO-3 (ep=2 x efsdp=2: FSDP2 splits each ep rank's experts over the two ranks that hold them): 6 SGD steps of transformers' own loss (labels = input_ids, no router aux loss: ``output_router_logits`` is off
on both sides), per-step losses within 1e-4 and every parameter within 1e-5 of one process on the concatenated
batch, with rows crossing ranks in every MoE layer. One spawn for all cases.
"""

from __future__ import annotations

import contextlib
import copy
import functools
from unittest import mock

import pytest
import torch
from torch import nn

from tests._dist import spawn
from tests._models import HF_MOE_FAMILIES, stable_sort

#: the compositions this file checks against one process (docs/gen_layouts.py builds docs/layouts.md from them)
COMPOSES = (("ep", "zero1"), ("ep", "zero3"))

pytest.importorskip("transformers")

STEPS, LR = 6, 0.5
CASES = [(family, stage) for family in HF_MOE_FAMILIES for stage in (1, 3)]


def _batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(0, 64, (4, 12), generator=g) for _ in range(STEPS)]


# ---------------------------------------------------------------------------------------------- one process, ep=1


def _run(model: nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.logits.detach().clone(), out.loss.detach().clone(), grads


def _ids() -> torch.Tensor:
    return torch.randint(0, 64, (4, 12), generator=torch.Generator().manual_seed(0))  # 96 assignment rows


@pytest.mark.parametrize("family", HF_MOE_FAMILIES)
def test_adapted_experts_equal_transformers_grouped_mm_bit_for_bit(family) -> None:
    from lightning_v17.models.hf_moe import adapt_hf_moe
    from tests._models import hf_moe

    model = hf_moe(family)
    model.set_experts_implementation("grouped_mm")
    with stable_sort():
        want_logits, want_loss, want = _run(model, _ids())
    plain_logits, _, plain = _run(model, _ids())  # transformers' unstable sort
    assert adapt_hf_moe(model)
    logits, loss, got = _run(model, _ids())
    assert torch.equal(logits, want_logits) and torch.equal(loss, want_loss)
    assert got.keys() == want.keys() == dict(model.named_parameters()).keys()
    for name, g in got.items():
        assert torch.equal(g, want[name]), (name, float((g - want[name]).abs().max()))
    # transformers' own unstable sort orders an expert's rows differently: the same bits on AVX-512, ~1 ulp on AVX2
    torch.testing.assert_close(logits, plain_logits, rtol=0, atol=1e-6)
    for name, g in got.items():
        torch.testing.assert_close(g, plain[name], rtol=0, atol=1e-8, msg=name)


@pytest.mark.parametrize(
    ("family", "overrides"),
    [(family, {}) for family in HF_MOE_FAMILIES]
    + [("mixtral", {"intermediate_size": 14}), ("qwen3_moe", {"moe_intermediate_size": 14}),
       ("deepseek_v3", {"moe_intermediate_size": 14})],
)  # fmt: skip
def test_adapted_experts_match_transformers_eager_loop(family, overrides) -> None:
    from lightning_v17.models.hf_moe import adapt_hf_moe
    from tests._models import hf_moe_with

    model = hf_moe_with(family, **overrides)
    model.set_experts_implementation("eager")
    want_logits, want_loss, want = _run(model, _ids())
    assert adapt_hf_moe(model)
    logits, loss, got = _run(model, _ids())
    torch.testing.assert_close(logits, want_logits, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(loss, want_loss, rtol=1e-6, atol=1e-6)
    assert got.keys() == want.keys()
    for name, g in got.items():
        torch.testing.assert_close(g, want[name], rtol=1e-6, atol=1e-6, msg=name)


class _Recording:
    """A dispatcher that runs the rows on the local experts in one group (all experts local, sorted) and counts."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, x: torch.Tensor, expert_idx: torch.Tensor, experts) -> torch.Tensor:
        from lightning_v17.models.moe import LocalDispatch

        self.calls += 1
        return LocalDispatch()(x, expert_idx, experts)


def test_adapting_keeps_parameters_and_fqns_and_copies_dispatch_through_their_own_block() -> None:
    from lightning_v17.engine.ep.apply import find_moe_layers
    from lightning_v17.models.hf_moe import adapt_hf_moe
    from tests._models import hf_moe

    model = hf_moe("deepseek_v3")
    params = dict(model.named_parameters())
    keys = list(model.state_dict())
    adapted = adapt_hf_moe(model)
    assert adapted == ["model.layers.1.mlp"]  # first_k_dense_replace=1: layer 0 is dense
    assert [n for n, _ in find_moe_layers(model)] == adapted
    block = model.get_submodule(adapted[0])
    assert block.num_experts == 4 and block.dispatcher is None
    assert list(model.state_dict()) == keys
    now = dict(model.named_parameters())
    assert now.keys() == params.keys() and all(p is params[n] for n, p in now.items())
    assert adapt_hf_moe(model) == adapted  # idempotent
    assert "forward" not in vars(hf_moe("deepseek_v3").model.layers[1].mlp.experts)  # the class is untouched

    twin = copy.deepcopy(model)
    mine, theirs = _Recording(), _Recording()
    block.dispatcher, twin.get_submodule(adapted[0]).dispatcher = mine, theirs
    twin(input_ids=_ids())
    assert (mine.calls, theirs.calls) == (0, 1)
    assert adapt_hf_moe(twin) == adapted


def test_models_without_fused_experts_are_left_alone_or_refused_by_name() -> None:
    from lightning_v17.config import V17ConfigError
    from lightning_v17.models import Llama, ModelConfig
    from lightning_v17.models.hf_moe import adapt_hf_moe
    from tests._models import hf_llama, hf_moe

    assert adapt_hf_moe(hf_llama(layers=1)) == []  # no MoE
    reference = Llama(ModelConfig(vocab_size=64, hidden=32, layers=1, heads=4, kv_heads=2, ffn=64, max_seq_len=16,
                                  num_experts=4, experts_per_token=2, expert_ffn=32), init_seed=0)  # fmt: skip
    assert adapt_hf_moe(reference) == []  # an engine MoE layer already: its own dispatcher
    assert "forward" not in vars(reference.layers["0"].feed_forward.experts)

    class MixtralBlockSparseTop2MLP(nn.Module):  # transformers 4.57's per-expert MLP
        def __init__(self) -> None:
            super().__init__()
            self.w1, self.w2, self.w3 = nn.Linear(8, 4), nn.Linear(4, 8), nn.Linear(8, 4)

    class MixtralSparseMoeBlock(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.num_experts, self.gate = 4, nn.Linear(8, 4, bias=False)
            self.experts = nn.ModuleList([MixtralBlockSparseTop2MLP() for _ in range(4)])

    old = nn.Sequential(MixtralSparseMoeBlock())
    old.config = type("Cfg", (), {"model_type": "mixtral"})()
    with pytest.raises(V17ConfigError, match=r"mixtral: MixtralSparseMoeBlock \(0\) keeps its experts as a ModuleList"
                                             r".*ep > 1 needs fused 3-D experts"):  # fmt: skip
        adapt_hf_moe(old)

    biased = hf_moe("mixtral")
    biased.model.layers[1].mlp.experts.has_bias = True
    with pytest.raises(V17ConfigError, match=r"MixtralSparseMoeBlock \(model.layers.1.mlp\).*'has_bias': True"):
        adapt_hf_moe(biased)

    class UpOnlyExperts(nn.Module):  # 3-D experts without a gate: not the layout the adapter splits
        def __init__(self) -> None:
            super().__init__()
            self.up_proj = nn.Parameter(torch.zeros(4, 16, 8))

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.experts = UpOnlyExperts()

    with pytest.raises(V17ConfigError, match=r"Block \(0\).*UpOnlyExperts have 3-D weights.*use ep=1"):
        adapt_hf_moe(nn.Sequential(Block()))


# --------------------------------------------------------------------------------------------- two ranks, ep=2


@functools.cache
def _reference(family: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    """transformers' own model (its default experts implementation) on the whole batch, one process."""
    from tests._models import hf_moe

    model = hf_moe(family)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for ids in _batches():
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def _worker(rank: int, world: int, cases: list[tuple[str, int]] = CASES) -> dict:
    import torch.distributed as dist

    from lightning_v17.config import MeshSpec, TrainingPolicy, ZeroPolicy
    from lightning_v17.engine.parallelize import parallelize
    from lightning_v17.mesh import MeshRuntime, build_device_mesh
    from lightning_v17.models.hf_moe import adapt_hf_moe
    from tests._models import hf_moe

    spec = MeshSpec(dp_shard=world, ep=2)
    mesh = MeshRuntime(spec, build_device_mesh(spec, device_type="cpu"))
    per, ep_rank = 4 // world, rank % 2  # ep innermost: consecutive dp_shard ranks form an ep group
    out = {}
    for family, stage in cases:
        model = hf_moe(family)
        adapted = adapt_hf_moe(model)
        done = parallelize(model, mesh=mesh, policy=TrainingPolicy(zero=ZeroPolicy(stage=stage)), device="cpu")
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        done.zero.prepare_optimizers([opt])
        losses, crossed = [], []
        for ids in _batches():
            mine = ids[per * rank : per * (rank + 1)]
            loss = model(input_ids=mine, labels=mine).loss
            loss.backward()
            done.zero.finish_grad_sync()
            opt.step()
            done.zero.after_optimizer_step(opt)
            opt.zero_grad()
            total = loss.detach().clone()
            dist.all_reduce(total)
            losses.append(float(total) / world)
            # rows this rank's experts received from the other rank, per MoE layer ([source, local expert] counts)
            crossed.append([int(model.get_submodule(n).dispatcher.last_received.view(2, -1)[1 - ep_rank].sum())
                            for n in adapted])  # fmt: skip
        out[(family, stage)] = {
            "losses": losses, "adapted": adapted, "sharded": len(done.ep.params) if done.ep else 0, "crossed": crossed,
            "local_shape": tuple(model.get_submodule(adapted[0]).experts.gate_up_proj.to_local().shape),
            "mesh": model.get_submodule(adapted[0]).experts.gate_up_proj.device_mesh.mesh_dim_names,
            "params": {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
                       for n, p in model.named_parameters()},
        }  # fmt: skip
    return out


@pytest.fixture(scope="module")
def runs() -> list[dict]:
    return spawn(_worker, world_size=2, args=(), timeout=500)


@pytest.fixture(scope="module")
def runs_efsdp() -> list[dict]:
    """4 ranks at ZeRO-3: ep=2, and each ep rank's experts sharded over efsdp=2 by FSDP2."""
    return spawn(_worker, world_size=4, args=(EFSDP_CASES,), timeout=500)


EFSDP_CASES = [(family, 3) for family in HF_MOE_FAMILIES]


@pytest.mark.parametrize(("family", "stage"), CASES)
def test_hf_moe_at_ep2_matches_one_process(runs, family, stage) -> None:
    _check(runs, family, stage, local_shape=(2, 32, 32))  # 2 of the 4 experts per rank, [2I, H] each


@pytest.mark.parametrize(("family", "stage"), EFSDP_CASES)
def test_hf_moe_at_ep2_zero3_over_efsdp_matches_one_process(runs_efsdp, family, stage) -> None:
    _check(runs_efsdp, family, stage, local_shape=(1, 32, 32), mesh=("efsdp", "ep"), every_step=False)  # 1/4 each


def _check(runs: list[dict], family: str, stage: int, *, local_shape: tuple, mesh: tuple = ("ep",),
           every_step: bool = True) -> None:
    ref_losses, ref_params = _reference(family)
    for rank, res in enumerate(runs):
        got = res[(family, stage)]
        assert got["adapted"] and got["sharded"] == 2 * len(got["adapted"])  # gate_up_proj, down_proj per block
        assert got["local_shape"] == local_shape and got["mesh"] == mesh, (got["local_shape"], got["mesh"])
        if every_step:
            assert all(n > 0 for step in got["crossed"] for n in step), got["crossed"]
        else:  # one sequence per rank: rows crossed in every MoE layer, though not at every step
            assert all(n > 0 for n in torch.tensor(got["crossed"]).sum(0).tolist()), got["crossed"]
        assert got["losses"] == pytest.approx(ref_losses, rel=0, abs=1e-4), (rank, got["losses"], ref_losses)
        assert got["params"].keys() == ref_params.keys()
        for name, p in got["params"].items():
            torch.testing.assert_close(p, ref_params[name], rtol=1e-5, atol=1e-5, msg=f"{family} {stage} {name}")
