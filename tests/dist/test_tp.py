"""Tensor parallel (Megatron column/row, sequence parallel, vocab/loss parallel) against a single-process reference.

2 gloo ranks, tiny Llama in fp32, dropout 0, 5 AdamW steps applied the same way. Tolerance: 1e-5 relative on every
step's loss and on every final parameter (||a - b|| / ||b||), gathered by FQN with ``DTensor.full_tensor()``.
Also counted: the collectives per forward/backward (one all-reduce each per sublayer without SP; all-gather +
reduce-scatter with SP), via ``CommDebugMode``.

The helpers here (tiny model, packed batches, reference run) are shared by tests/dist/test_pp.py and test_pp_3d.py.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from tests._dist import spawn

#: the compositions this file checks against one process (docs/gen_layouts.py builds docs/layouts.md from them)
COMPOSES = (("sp", "loss_parallel"),)

RTOL = 1e-5  # fp32 parity tolerance (DESIGN.md: "about 1e-5 relative")
STEPS = 5
LR = 1e-3
# Adam's update is lr * m / (sqrt(v) + eps): for gradients near zero, fp32 reduction-order noise (~1e-8 absolute,
# different for a sharded matmul, a vocab-parallel softmax or a micro-batched sum) changes the direction of an
# lr-sized step. eps=1e-5 sits well above that noise floor, so the parameter comparison measures the parallelism, not
# Adam's sign of zero; a wrong gradient still moves parameters by ~lr (param_rel ~1e-2). Used identically by every run.
EPS = 1e-5


def make_optimizer(params):
    return torch.optim.AdamW(params, lr=LR, eps=EPS)


# ------------------------------------------------------------------------------------------------ shared helpers
def tiny_config(**overrides):
    from lightning_v17.models import ModelConfig

    kw = {
        "vocab_size": 320,
        "hidden": 64,
        "layers": 4,
        "heads": 4,
        "kv_heads": 2,
        "ffn": 128,
        "max_seq_len": 64,
        "dropout": 0.0,
    }
    kw.update(overrides)
    return ModelConfig(**kw)


def tiny_model(seed: int = 0, **overrides):
    from lightning_v17.models import Llama

    torch.manual_seed(seed)
    return Llama(tiny_config(**overrides))


def packed_batch(seed: int, batch: int = 4, seq: int = 16, vocab: int = 320) -> dict[str, torch.Tensor]:
    """Two documents per row at a random cut: position_ids restart at 0, labels shifted within each document and
    -100 at each document's last token (the packed-batch contract)."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (batch, seq), generator=g)
    pos = torch.zeros(batch, seq, dtype=torch.long)
    labels = torch.full((batch, seq), -100, dtype=torch.long)
    for b in range(batch):
        cut = int(torch.randint(3, seq - 3, (1,), generator=g))
        for a, e in ((0, cut), (cut, seq)):
            pos[b, a:e] = torch.arange(e - a)
            labels[b, a : e - 1] = tokens[b, a + 1 : e]
    return {"input_ids": tokens, "position_ids": pos, "labels": labels}


def token_mean_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100)


def reference_run(model, batches_per_step: list[list[dict]], *, steps: int = STEPS):
    """Single-process reference: each step averages the token-mean losses of the given (data-parallel) batches,
    back-propagates, and takes one AdamW step. Returns (losses, {fqn: final param})."""
    model = copy.deepcopy(model)
    opt = make_optimizer(model.parameters())
    losses = []
    for s in range(steps):
        opt.zero_grad()
        batches = batches_per_step[s]
        loss = sum(
            token_mean_loss(model(b["input_ids"], position_ids=b["position_ids"]), b["labels"]) for b in batches
        ) / len(batches)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses, {k: v.detach().clone() for k, v in model.named_parameters()}


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def compare_params(params: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    """Worst relative error over the given (possibly stage-local) params, by FQN."""
    assert params, "no parameters to compare"
    missing = set(params) - set(ref)
    assert not missing, f"FQNs not in the reference: {sorted(missing)[:5]}"
    return max(rel_err(full(v.detach()), ref[k]) for k, v in params.items())


def rel_loss(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


class CollectiveCounter:
    """Counts functional collectives (what DTensor issues) by op name, via a TorchDispatchMode."""

    def __enter__(self):
        from collections import Counter

        from torch.utils._python_dispatch import TorchDispatchMode

        counts = self.counts = Counter()

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if func.namespace == "_c10d_functional" and ("all_" in func.name() or "reduce" in func.name()):
                    counts[func.name().split("::")[-1].split(".")[0]] += 1
                return func(*args, **(kwargs or {}))

        self._mode = _Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        self._mode.__exit__(*exc)


# ---------------------------------------------------------------------------------------------------- TP worker
def _tp_worker(rank: int, world: int, tmp: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_v17.engine.tp.apply import apply_tensor_parallel, loss_parallel_context
    from lightning_v17.models.tp_plans import resolve_tp_plan

    torch.set_num_threads(1)
    tp_mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))["tp"]
    base = tiny_model(0)
    steps = [[packed_batch(10 + s)] for s in range(STEPS)]
    ref_losses, ref_params = reference_run(base, steps)
    out = {}
    for name, kw in {
        "tp": {},
        "tp_sp": {"sequence_parallel": True},
        "tp_sp_vocab_loss": {"sequence_parallel": True, "vocab_parallel": True, "loss_parallel": True},
        "tp_vocab_loss": {"vocab_parallel": True, "loss_parallel": True},
    }.items():
        model = copy.deepcopy(base)
        apply_tensor_parallel(model, tp_mesh=tp_mesh, plan=resolve_tp_plan(model, **kw))
        opt = make_optimizer(model.parameters())
        lp = kw.get("loss_parallel", False)
        losses, comms = [], {}
        for s in range(STEPS):
            b = steps[s][0]
            opt.zero_grad()
            with loss_parallel_context(lp):
                if s == 0:
                    with CollectiveCounter() as fwd:
                        logits = model(b["input_ids"], position_ids=b["position_ids"])
                    loss = token_mean_loss(logits, b["labels"])
                    with CollectiveCounter() as bwd:
                        loss.backward()
                    comms = {"fwd": dict(fwd.counts), "bwd": dict(bwd.counts)}
                else:
                    logits = model(b["input_ids"], position_ids=b["position_ids"])
                    loss = token_mean_loss(logits, b["labels"])
                    loss.backward()
            opt.step()
            losses.append(float(full(loss.detach())))
        sharded = sum(1 for p in model.parameters() if p.placements[0].is_shard())
        out[name] = {
            "loss_rel": rel_loss(losses, ref_losses),
            "param_rel": compare_params(dict(model.named_parameters()), ref_params),
            "all_dtensor": all(hasattr(p, "placements") for p in model.parameters()),
            "sharded_params": sharded,
            "fqns_equal": sorted(k for k, _ in model.named_parameters()) == sorted(ref_params),
            "comms": comms,
        }
        if name == "tp_sp_vocab_loss":
            out["ckpt"] = _tp_checkpoint_roundtrip(rank, tmp, model, base, ref_params, tp_mesh)
    return out


def _tp_checkpoint_roundtrip(rank, tmp, tp_model, base, ref_params, tp_mesh) -> dict:
    """tp=2 -> tp=1 and tp=1 -> tp=2 through the checkpoint engine (DCP reshards DTensors by FQN)."""
    import torch.distributed as dist

    from lightning_v17.checkpoint.sharded import load_full_state_dict, load_sharded, save_sharded
    from lightning_v17.engine.tp.apply import apply_tensor_parallel
    from lightning_v17.models.tp_plans import resolve_tp_plan

    path = f"{tmp}/tp2"
    save_sharded(path, app_state={"model": tp_model.state_dict()}, trainer_state={}, meta={"tp": 2})
    full_sd = load_full_state_dict(path)  # one process, plain tensors: the tp=1 view
    tp2_to_tp1 = compare_params(full_sd, ref_params) if sorted(full_sd) == sorted(ref_params) else float("inf")
    ref_model = copy.deepcopy(base)
    with torch.no_grad():
        for k, v in ref_model.named_parameters():
            v.copy_(ref_params[k])
    group0 = dist.new_group([0])  # collective over the world, used by rank 0 only
    if rank == 0:
        save_sharded(
            f"{tmp}/tp1",
            app_state={"model": ref_model.state_dict()},
            trainer_state={},
            meta={"tp": 1},
            process_group=group0,
        )
    dist.barrier()
    fresh = tiny_model(7)  # other weights, overwritten by the load
    plan = resolve_tp_plan(fresh, sequence_parallel=True, vocab_parallel=True, loss_parallel=True)
    apply_tensor_parallel(fresh, tp_mesh=tp_mesh, plan=plan)
    load_sharded(f"{tmp}/tp1", app_state={"model": fresh.state_dict()})
    tp1_to_tp2 = compare_params(dict(fresh.named_parameters()), ref_params)
    return {"tp2_to_tp1": tp2_to_tp1, "tp1_to_tp2": tp1_to_tp2}


@pytest.mark.timeout(180)
def test_tensor_parallel_parity_and_collectives(tmp_path):
    results = spawn(_tp_worker, world_size=2, args=(str(tmp_path),), timeout=170)
    print(
        {k: {m: v[m] for m in ("loss_rel", "param_rel", "comms")} for k, v in results[0].items() if k != "ckpt"},
        results[0]["ckpt"],
    )
    layers = tiny_config().layers
    for rank_out in results:
        ck = rank_out.pop("ckpt")
        assert ck["tp2_to_tp1"] < RTOL and ck["tp1_to_tp2"] == 0.0, ck
        for name, r in rank_out.items():
            assert r["loss_rel"] < RTOL, (name, r)
            assert r["param_rel"] < RTOL, (name, r)
            assert r["all_dtensor"] and r["fqns_equal"], (name, r)
            assert r["sharded_params"] >= 7 * layers, (name, r)  # wq wk wv wo w1 w2 w3 per block
        plain = rank_out["tp"]["comms"]
        # Megatron: one all-reduce per sublayer in forward (wo, w2) plus the head's all-gather of logits.
        fwd_ar = sum(v for k, v in plain["fwd"].items() if "all_reduce" in k)
        assert fwd_ar == 2 * layers, plain
        bwd_ar = sum(v for k, v in plain["bwd"].items() if "all_reduce" in k)
        # backward: one per sublayer (the shared input of wq/wk/wv, of w1/w3) plus one at the head's input
        assert bwd_ar == 2 * layers + 1, plain
        sp = rank_out["tp_sp"]["comms"]
        assert not any("all_reduce" in k for k in sp["fwd"]), sp  # SP replaces the all-reduce
        assert sum(v for k, v in sp["fwd"].items() if "reduce_scatter" in k) >= 2 * layers, sp
        assert sum(v for k, v in sp["fwd"].items() if "all_gather" in k) >= 2 * layers, sp
