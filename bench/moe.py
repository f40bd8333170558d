"""Mixture-of-experts side by side, one invocation (fp32, CPU):

1. ``grouped``: the reference model's grouped experts (one ``torch._grouped_mm`` per projection,
   ``lightning_v17.models.moe.GroupedExperts``) against the per-expert Python loop of Hugging Face's eager MoE
   (``MixtralExperts`` of the installed transformers, its own forward), on the same weights and tokens, forward +
   backward; the median of interleaved repetitions, ratio loop / grouped (> 1: grouped is faster).
2. ``ep``: the MoE Llama on 2 gloo ranks at the same global batch, ZeRO-0 (so that ep=1 holds every expert whole
   on both ranks), AdamW, through ``engine.parallelize``: ep=2 (experts sharded, all-to-all dispatch) against ep=1;
   tokens/s between barriers after warm-up, peak RSS per rank, and the expert bytes per rank counted from tensor
   storage (parameters, gradients, optimizer state) against the planner's (``planner/moe.py``).
3. ``dispatch``: the same ep=2 run with the all-gather dispatcher against the all-to-all one.
4. ``hf``: transformers' own expert-parallel training (``from_pretrained(distributed_config=DistributedConfig(
   fsdp_size=2, ep_size=2, enable_expert_parallel=True))``) against ours (the same Hugging Face Mixtral, adapted,
   ep=2 at ZeRO-3) on the same weights and batches, 2 gloo ranks, AdamW: tokens/s and the per-step losses.

Usage::

    .venv/bin/python bench/moe.py [--steps 8] [--json-out bench/results/moe.json]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common as C  # after the path insert, so the script runs from anywhere (spawned ranks re-import it too)

E, TOPK = 8, 2
SEQ, PER_RANK = 256, 4


def _model_config():
    from lightning_v17.models import ModelConfig

    return ModelConfig(vocab_size=1024, hidden=256, layers=4, heads=8, kv_heads=4, ffn=512, max_seq_len=SEQ,
                       num_experts=E, experts_per_token=TOPK, expert_ffn=512)  # fmt: skip


# -------------------------------------------------------------------------------------------- 1. grouped vs loop
def bench_grouped(tokens: int, hidden: int, inter: int, reps: int) -> dict:
    import torch
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    from lightning_v17.models.moe import GroupedExperts, LocalDispatch

    torch.manual_seed(0)
    cfg = MixtralConfig(hidden_size=hidden, intermediate_size=inter, num_local_experts=E, num_experts_per_tok=TOPK)
    hf = MixtralExperts(cfg)
    ours = GroupedExperts(E, hidden, inter)
    with torch.no_grad():
        ours.gate_up_proj.normal_(0, 0.02)
        ours.down_proj.normal_(0, 0.02)
        hf.gate_up_proj.copy_(ours.gate_up_proj)
        hf.down_proj.copy_(ours.down_proj)
    x = torch.randn(tokens, hidden)
    logits = torch.randn(tokens, E)
    w, idx = torch.topk(logits.softmax(-1), TOPK, dim=-1)
    w = w / w.sum(-1, keepdim=True)
    grad = torch.randn(tokens, hidden)

    def run_hf() -> torch.Tensor:
        xi = x.clone().requires_grad_()
        y = hf(xi, idx, w)
        y.backward(grad)
        return y.detach()

    def run_ours() -> torch.Tensor:
        xi = x.clone().requires_grad_()
        token_of = torch.arange(tokens).repeat_interleave(TOPK)
        rows = LocalDispatch()(xi[token_of], idx.reshape(-1), ours)
        y = torch.zeros_like(xi).index_add(0, token_of, rows * w.reshape(-1, 1))
        y.backward(grad)
        return y.detach()

    diff = float((run_hf() - run_ours()).abs().max())
    times: dict[str, list[float]] = {"hf_eager_loop": [], "grouped": []}
    for _ in range(reps):
        for name, fn in (("hf_eager_loop", run_hf), ("grouped", run_ours)):
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    ms = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    return {"tokens": tokens, "hidden": hidden, "expert_ffn": inter, "experts": E, "top_k": TOPK,
            "ms_fwd_bwd": {k: round(v, 2) for k, v in ms.items()}, "max_abs_diff": diff,
            "loop/grouped": round(ms["hf_eager_loop"] / ms["grouped"], 2)}  # fmt: skip


# -------------------------------------------------------------------------------------------- 2./3. ep runs
def _ep_worker(rank: int, port: int, ep: int, dispatcher: str, steps: int, warmup: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        from lightning_v17.config import MeshSpec, TrainingPolicy, ZeroPolicy
        from lightning_v17.engine.ep import find_moe_layers, make_dispatcher
        from lightning_v17.engine.parallelize import parallelize
        from lightning_v17.mesh import MeshRuntime, build_device_mesh
        from lightning_v17.models import Llama
        from lightning_v17.models.moe import moe_layers
        from lightning_v17.trackers import StorageCounter

        spec = MeshSpec(dp_shard=2, ep=ep)
        mesh = MeshRuntime(spec, build_device_mesh(spec, device_type="cpu"))
        cfg = _model_config()
        model = Llama(cfg, init_seed=0)
        done = parallelize(model, mesh=mesh, policy=TrainingPolicy(zero=ZeroPolicy(stage=0)), device="cpu")
        if ep > 1 and dispatcher != "alltoall":
            for _, layer in find_moe_layers(model):
                layer.dispatcher = make_dispatcher(dispatcher, mesh.group("ep"), layer.num_experts)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        done.zero.prepare_optimizers([opt])
        g = torch.Generator().manual_seed(rank)
        batches = [torch.randint(0, cfg.vocab_size, (PER_RANK, SEQ + 1), generator=g) for _ in range(steps + warmup)]
        t0 = 0.0
        for i, rows in enumerate(batches):
            if i == warmup:
                dist.barrier()
                t0 = time.perf_counter()
            logits = model(rows[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, cfg.vocab_size), rows[:, 1:].reshape(-1))
            loss = loss + sum(m.aux_loss for m in moe_layers(model))
            loss.backward()
            done.zero.finish_grad_sync()
            opt.step()
            done.zero.after_optimizer_step(opt)
            opt.zero_grad(set_to_none=False)
        dist.barrier()
        wall = time.perf_counter() - t0
        counter = StorageCounter()
        names = {id(p): n for n, p in model.named_parameters()}
        engine = done.zero.engine
        if engine is not None:  # ZeRO-1/2 step row shards: name each by its parameter
            names.update({k: e.fqn for k, e in engine.by_shard.items()})
        experts = [p for n, p in model.named_parameters() if ".experts." in n]
        tensors = [*experts, *(p.grad for p in experts if p.grad is not None)]
        tensors += [v for q, st in opt.state.items() if ".experts." in names.get(id(q), "")
                    for v in st.values() if torch.is_tensor(v) and v.dim() > 0]  # fmt: skip
        expert_bytes = counter.add([t.to_local() if hasattr(t, "to_local") else t for t in tensors])
        queue.put((rank, {"wall_s": wall, "tokens": 2 * PER_RANK * SEQ * steps, "peak_rss_mb": C.peak_rss_mb(),
                          "expert_bytes": expert_bytes}))  # fmt: skip
    finally:
        dist.destroy_process_group()


def run_ep(ep: int, dispatcher: str, steps: int, warmup: int) -> dict:
    import torch.multiprocessing as mp

    port = C.free_port()
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    procs = [ctx.Process(target=_ep_worker, args=(r, port, ep, dispatcher, steps, warmup, queue)) for r in range(2)]
    for p in procs:
        p.start()
    res = dict(queue.get() for _ in procs)
    for p in procs:
        p.join()
    wall = max(r["wall_s"] for r in res.values())
    return {"ep": ep, "dispatcher": dispatcher, "tokens_per_s": round(res[0]["tokens"] / wall, 1),
            "peak_rss_mb": [round(res[r]["peak_rss_mb"], 1) for r in (0, 1)],
            "expert_bytes_per_rank": [res[r]["expert_bytes"] for r in (0, 1)]}  # fmt: skip


def _hf_mixtral():
    import torch
    from transformers import AutoModelForCausalLM, MixtralConfig

    cfg = MixtralConfig(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                        num_attention_heads=8, num_key_value_heads=4, num_local_experts=E, num_experts_per_tok=TOPK,
                        max_position_embeddings=SEQ, attn_implementation="eager")  # fmt: skip
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg)


def _hf_worker(rank: int, port: int, side: str, path: str, steps: int, warmup: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank))  # fmt: skip
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        from transformers import AutoModelForCausalLM

        if side == "hf":
            from transformers.distributed import DistributedConfig

            model = AutoModelForCausalLM.from_pretrained(
                path, distributed_config=DistributedConfig(fsdp_size=2, ep_size=2, enable_expert_parallel=True))
            step_done = None
        else:
            from lightning_v17.config import MeshSpec, TrainingPolicy, ZeroPolicy
            from lightning_v17.engine.parallelize import parallelize
            from lightning_v17.mesh import MeshRuntime, build_device_mesh
            from lightning_v17.models.hf_moe import adapt_hf_moe

            model = AutoModelForCausalLM.from_pretrained(path)
            adapt_hf_moe(model)
            spec = MeshSpec(dp_shard=2, ep=2)
            mesh = MeshRuntime(spec, build_device_mesh(spec, device_type="cpu"))
            step_done = parallelize(model, mesh=mesh, policy=TrainingPolicy(zero=ZeroPolicy(stage=3)), device="cpu")
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        if step_done is not None:
            step_done.zero.prepare_optimizers([opt])
        g = torch.Generator().manual_seed(rank)
        batches = [torch.randint(0, 1024, (PER_RANK, SEQ), generator=g) for _ in range(steps + warmup)]
        losses, t0 = [], 0.0
        for i, ids in enumerate(batches):
            if i == warmup:
                dist.barrier()
                t0 = time.perf_counter()
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            if step_done is not None:
                step_done.zero.finish_grad_sync()
            opt.step()
            if step_done is not None:
                step_done.zero.after_optimizer_step(opt)
            opt.zero_grad()
            total = loss.detach().clone()
            dist.all_reduce(total)
            losses.append(float(total) / 2)
        dist.barrier()
        queue.put((rank, {"wall_s": time.perf_counter() - t0, "losses": losses, "peak_rss_mb": C.peak_rss_mb()}))
    except Exception as err:  # noqa: BLE001 - reported in the JSON, not hidden
        queue.put((rank, {"error": repr(err)[:500]}))
    finally:
        dist.destroy_process_group()


def hf_expert_parallel(steps: int, warmup: int) -> dict:
    """Hugging Face's own EP training loop against ours on the same Mixtral, weights and batches."""
    import tempfile

    import torch.multiprocessing as mp

    out: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        _hf_mixtral().save_pretrained(tmp)
        for side in ("hf", "v17"):
            port = C.free_port()
            ctx = mp.get_context("spawn")
            queue = ctx.SimpleQueue()
            procs = [ctx.Process(target=_hf_worker, args=(r, port, side, tmp, steps, warmup, queue)) for r in (0, 1)]
            for p in procs:
                p.start()
            res = dict(queue.get() for _ in procs)
            for p in procs:
                p.join()
            if "error" in res[0]:
                return {"ran": False, "side": side, "reason": res[0]["error"]}
            wall = max(r["wall_s"] for r in res.values())
            out[side] = {"tokens_per_s": round(2 * PER_RANK * SEQ * steps / wall, 1), "losses": res[0]["losses"],
                         "peak_rss_mb": [round(res[r]["peak_rss_mb"], 1) for r in (0, 1)]}  # fmt: skip
    out["ran"] = True
    out["v17/hf_tokens_per_s"] = round(out["v17"]["tokens_per_s"] / out["hf"]["tokens_per_s"], 3)
    out["max_loss_diff"] = max(abs(a - b) for a, b in zip(out["v17"]["losses"], out["hf"]["losses"]))
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args(argv)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from lightning_v17.planner.model import ModelShape  # noqa: F401 - the planner is importable (torch-free)

    grouped = bench_grouped(tokens=2 * PER_RANK * SEQ * TOPK // TOPK, hidden=256, inter=512, reps=args.reps)
    ep1 = run_ep(1, "alltoall", args.steps, args.warmup)
    ep2 = run_ep(2, "alltoall", args.steps, args.warmup)
    ep2_ag = run_ep(2, "allgather", args.steps, args.warmup)
    from lightning_v17.planner.moe import moe_report

    shape = _model_config().to_shape(SEQ)
    planned = {ep: moe_report(shape, ep=ep, dp=2, tokens_per_rank=PER_RANK * SEQ, activation_bytes=4,
                              state_bytes_per_param=16).expert_state_bytes_per_rank for ep in (1, 2)}  # fmt: skip
    report = {
        "bench": "moe",
        "dtype": "fp32",
        "world_size": 2,
        "grouped": grouped,
        "ep": {"ep1": ep1, "ep2": ep2, "ep2/ep1_tokens_per_s": round(ep2["tokens_per_s"] / ep1["tokens_per_s"], 3),
               "ep2/ep1_expert_bytes": round(ep2["expert_bytes_per_rank"][0] / ep1["expert_bytes_per_rank"][0], 4),
               "planned_expert_bytes_per_rank": {"ep1": planned[1], "ep2": planned[2]},
               "measured/planned_ep2": round(ep2["expert_bytes_per_rank"][0] / planned[2], 4)},
        "dispatch": {"allgather": ep2_ag,
                     "alltoall/allgather_tokens_per_s": round(ep2["tokens_per_s"] / ep2_ag["tokens_per_s"], 3)},
        "hf": hf_expert_parallel(args.steps, args.warmup),
        "host": C.host_info(),
    }  # fmt: skip
    C.emit_json(report, args.json_out)
    return report


if __name__ == "__main__":
    main()
