"""Pipeline parallelism (pp=2) on third-party decoders against a single-process run of the same model and seed.

2 gloo ranks, fp32, tiny random models, nothing downloaded, no Lightning (the engine is tested alone):
Hugging Face ``LlamaForCausalLM`` and ``Qwen2ForCausalLM`` (sdpa) and litgpt ``GPT`` (LLaMAMLP, RMSNorm, embedding
scaling and logit soft-capping on), each under gpipe, 1f1b and interleaved_1f1b (4 layers, virtual_stages=2), with
the layout found by ``model_pipeline_layout`` and no split points. 3 SGD steps; the reference loss is Hugging Face's
own ``model(input_ids, labels=labels).loss`` (``use_cache=False`` where packed ``position_ids`` are given, which is
when HF builds per-document masks) and cross-entropy of litgpt's logits against pre-shifted labels.

Tolerance: 1e-5 relative on each step's loss and on every updated parameter (||a - b|| / ||b||); the parameter
*updates* (final - initial) are compared too, within 1e-4 relative, which a wrong gradient misses by orders of
magnitude while fp32 reduction-order noise over micro-batches stays well below it.

Also on HF Llama: explicit split points, a ``loss_fn`` hook, ``(inputs, labels)`` tuple batches, a 2-D padding
``attention_mask``, a ragged batch (5 rows with 4 micro-batches, padded), the refusal of a larger batch / another
sequence length, and a failing stage (its peer must end within seconds, naming the first error).
"""

from __future__ import annotations

import copy
import datetime
import json
import os
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests._dist import spawn
from tests._models import hf_causal_lm, litgpt_gpt

pytest.importorskip("transformers")
pytest.importorskip("litgpt")

RTOL = 1e-5
# the update (final - initial) of the parameter whose update is smallest: 3.3e-4 relative for litgpt on an Intel Xeon
# (AVX512/AMX kernels; under 1e-4 on AVX2), while its losses and parameters agree to 1e-7
DELTA_RTOL = 1e-3
STEPS = 3
LR = 0.5
ROWS, SEQ, VOCAB = 8, 16, 128
SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2)]


# ------------------------------------------------------------------------------------------------------- models


def litgpt_softcapped() -> torch.nn.Module:
    """litgpt with embedding scaling and logit soft-capping on, initialized by litgpt's own ``_init_weights``."""
    return litgpt_gpt(init_weights=True, scale_embeddings=True, final_logit_softcapping=30.0).train()


# ------------------------------------------------------------------------------------------------------ batches


def hf_batch(seed: int, rows: int = ROWS, *, packed: bool = True) -> dict[str, torch.Tensor]:
    """HF convention: labels are the input ids (the model shifts them); two documents per row when packed."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (rows, SEQ), generator=g)
    out = {"input_ids": ids, "labels": ids.clone()}
    if packed:
        pos = torch.zeros(rows, SEQ, dtype=torch.long)
        for r in range(rows):
            cut = int(torch.randint(3, SEQ - 3, (1,), generator=g))
            pos[r, :cut], pos[r, cut:] = torch.arange(cut), torch.arange(SEQ - cut)
        out["position_ids"] = pos
    return out


def litgpt_batch(seed: int, rows: int = ROWS) -> dict[str, torch.Tensor]:
    """Pre-shifted labels (litgpt's convention): labels[t] = ids[t + 1], -100 at the end."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (rows, SEQ + 1), generator=g)
    return {"input_ids": ids[:, :-1].contiguous(), "labels": ids[:, 1:].contiguous()}


def hf_loss(model, b) -> torch.Tensor:
    if isinstance(b, (tuple, list)):
        return model(input_ids=b[0], labels=b[1]).loss
    kw = {k: b[k] for k in ("position_ids", "attention_mask") if k in b}
    return model(input_ids=b["input_ids"], labels=b["labels"], use_cache=False, **kw).loss


def litgpt_loss(model, b) -> torch.Tensor:
    return F.cross_entropy(model(b["input_ids"]).flatten(0, 1), b["labels"].flatten(), ignore_index=-100)


def reference(base, batches, loss_of) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = copy.deepcopy(base)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for b in batches:
        opt.zero_grad()
        loss = loss_of(model, b)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses, {k: v.detach().clone() for k, v in model.named_parameters()}


# ----------------------------------------------------------------------------------------------------- pipeline


def pipeline_run(base, batches, pp_mesh, *, schedule="1f1b", v=1, m=4, split_points=None, loss_fn=None):
    from lightning_v17.config import PipelinePolicy
    from lightning_v17.engine.pipeline.runtime import build_schedule, pipeline_step, split_model
    from lightning_v17.models.pp_layouts import model_pipeline_layout

    policy = PipelinePolicy(schedule=schedule, microbatches=m, virtual_stages=v, split_points=split_points)
    model = copy.deepcopy(base)
    layout = model_pipeline_layout(model)
    stages, ids = split_model(model, layout=layout, pp_rank=pp_mesh.get_local_rank(), pp=2, policy=policy)
    runtime = build_schedule(stages, stage_ids=ids, pp_mesh=pp_mesh, policy=policy, device="cpu", loss_fn=loss_fn)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for b in batches:
        opt.zero_grad()
        losses.append(float(pipeline_step(runtime, b)))
        opt.step()
    return model, runtime, losses, {"blocks": [list(s.blocks) for s in stages]}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def compare(base, model, losses, ref_losses, ref_params) -> dict:
    params = dict(model.named_parameters())
    init = dict(base.named_parameters())
    assert params and set(params) <= set(ref_params), sorted(set(params) - set(ref_params))[:3]
    names = sorted(params)
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, names)
    union = [n for part in gathered for n in part]
    return {
        "loss_rel": max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses, strict=True)),
        "param_rel": max(rel_err(params[k].detach(), ref_params[k]) for k in names),
        "delta_rel": max(
            rel_err(params[k].detach() - init[k].detach(), ref_params[k] - init[k].detach()) for k in names
        ),
        "fqns_partition": len(union) == len(set(union)) and set(union) == set(ref_params),
    }


# ------------------------------------------------------------------------------------------------------ workers


def _families_worker(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    pp_mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))["pp"]
    out: dict = {}
    families = {
        "hf_llama": (hf_causal_lm("llama").train(), [hf_batch(10 + s) for s in range(STEPS)], hf_loss),
        "hf_qwen2": (hf_causal_lm("qwen2").train(), [hf_batch(20 + s) for s in range(STEPS)], hf_loss),
        "litgpt": (litgpt_softcapped(), [litgpt_batch(30 + s) for s in range(STEPS)], litgpt_loss),
    }
    for name, (base, batches, loss_of) in families.items():
        ref_losses, ref_params = reference(base, batches, loss_of)
        for schedule, v in SCHEDULES:
            model, _, losses, info = pipeline_run(base, batches, pp_mesh, schedule=schedule, v=v)
            out[f"{name}/{schedule}"] = {**compare(base, model, losses, ref_losses, ref_params), **info}
    return out


def _hf_features_worker(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_v17.config import V17ConfigError
    from lightning_v17.engine.pipeline.runtime import pipeline_eval, pipeline_step

    torch.set_num_threads(1)
    pp_mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))["pp"]
    base = hf_causal_lm("llama").train()
    out: dict = {}

    # explicit split points: stage 0 = block 0 + embedding, stage 1 = blocks 1..3 + norm + head
    batches = [hf_batch(40 + s) for s in range(STEPS)]
    ref = reference(base, batches, hf_loss)
    model, _, losses, info = pipeline_run(base, batches, pp_mesh, split_points=("model.layers.1",))
    out["split_points"] = {**compare(base, model, losses, *ref), **info}

    # a loss_fn hook: each micro-batch's mean CE with HF's shift; every row has the same number of valid tokens, so
    # the row-weighted mean over micro-batches is the whole batch's mean, i.e. HF's loss. It must see its own rows.
    seen_rows: list[int] = []

    def loss_fn(logits: torch.Tensor, mb: dict) -> torch.Tensor:
        assert mb["input_ids"].shape[0] == logits.shape[0] and "cu_seqlens" not in mb
        seen_rows.append(int(logits.shape[0]))
        labels = F.pad(mb["labels"][:, 1:], (0, 1), value=-100)
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100)

    batches = [hf_batch(50 + s) for s in range(STEPS)]
    ref = reference(base, batches, hf_loss)
    model, _, losses, _ = pipeline_run(base, batches, pp_mesh, schedule="gpipe", loss_fn=loss_fn)
    out["loss_fn"] = {**compare(base, model, losses, *ref), "seen_rows": list(seen_rows)}

    # (inputs, labels) tuples, no position ids: HF's default positions
    batches = [tuple(hf_batch(60 + s, packed=False).values()) for s in range(STEPS)]
    ref = reference(base, batches, hf_loss)
    model, _, losses, _ = pipeline_run(base, batches, pp_mesh)
    out["tuple"] = compare(base, model, losses, *ref)

    # a 2-D padding attention_mask (left padding, labels -100 there: right padding would be invisible to a causal
    # model), built into the causal mask like HF does
    batches = []
    for s in range(STEPS):
        b = hf_batch(70 + s, packed=False)
        b["attention_mask"] = torch.ones_like(b["input_ids"])
        b["attention_mask"][::2, :5] = 0
        b["labels"][::2, :5] = -100
        batches.append(b)
    ref = reference(base, batches, hf_loss)
    model, _, losses, _ = pipeline_run(base, batches, pp_mesh, schedule="interleaved_1f1b", v=2)
    out["attention_mask"] = compare(base, model, losses, *ref)

    # a ragged last batch: 8, 8, then 5 rows with 4 micro-batches (padded to 8), for the token mean and a loss_fn
    batches = [hf_batch(80), hf_batch(81), hf_batch(82, rows=5)]
    ref = reference(base, batches, hf_loss)
    model, runtime, losses, _ = pipeline_run(base, batches, pp_mesh)
    out["ragged"] = compare(base, model, losses, *ref)
    # torch sized the P2P buffers for 8 rows of 16 tokens at the first training step: more rows, or another
    # length, is refused before any communication (an eval in between would re-infer the shapes)
    errors = {}
    for label, bad in (("rows", hf_batch(84, rows=12)), ("seq", {k: v[:, :8] for k, v in hf_batch(85).items()})):
        try:
            pipeline_step(runtime, bad)
        except V17ConfigError as err:
            errors[label] = str(err)
    out["ragged"]["errors"] = errors
    with torch.no_grad():
        ref_model = copy.deepcopy(base)
        ref_model.load_state_dict(ref[1], strict=False)
        ev = hf_batch(83, rows=3)  # ragged eval: padded to 4 rows
        ref_eval = float(hf_loss(ref_model, ev))
    out["ragged"]["eval_rel"] = abs(float(pipeline_eval(runtime, ev)) - ref_eval) / ref_eval
    seen_rows.clear()
    model, _, losses, _ = pipeline_run(base, batches, pp_mesh, loss_fn=loss_fn)
    out["ragged_loss_fn"] = {**compare(base, model, losses, *ref), "seen_rows": list(seen_rows)}
    return out


@pytest.fixture(scope="module")
def families() -> list[dict]:
    return spawn(_families_worker, world_size=2, timeout=400)


@pytest.fixture(scope="module")
def hf_features() -> list[dict]:
    return spawn(_hf_features_worker, world_size=2, timeout=400)


def _check_parity(r: dict, what) -> None:
    assert r["loss_rel"] < RTOL, (what, r)
    assert r["param_rel"] < RTOL, (what, r)
    assert r["delta_rel"] < DELTA_RTOL, (what, r)
    assert r["fqns_partition"], (what, r)  # the two ranks hold every reference FQN exactly once


@pytest.mark.timeout(420)
@pytest.mark.parametrize("family", ["hf_llama", "hf_qwen2", "litgpt"])
@pytest.mark.parametrize("schedule", [s for s, _ in SCHEDULES])
def test_family_matches_single_process(families, family, schedule):
    for rank, out in enumerate(families):
        r = out[f"{family}/{schedule}"]
        _check_parity(r, (rank, family, schedule))
        # balanced by parameter count, no split points: 2 blocks per stage, or 1 per stage (2 stages) interleaved
        interleaved = [[str(rank)], [str(rank + 2)]]
        assert r["blocks"] == (interleaved if schedule == "interleaved_1f1b" else [[str(2 * rank), str(2 * rank + 1)]])


@pytest.mark.timeout(420)
def test_explicit_split_points(hf_features):
    for rank, out in enumerate(hf_features):
        _check_parity(out["split_points"], rank)
        assert out["split_points"]["blocks"] == ([["0"]] if rank == 0 else [["1", "2", "3"]])


@pytest.mark.timeout(420)
def test_loss_fn_hook_is_row_weighted_mean(hf_features):
    for rank, out in enumerate(hf_features):
        _check_parity(out["loss_fn"], rank)
    # only the last stage (rank 1) calls the loss: 4 micro-batches of 2 rows per step, plus one shape-inference call
    assert hf_features[1]["loss_fn"]["seen_rows"][1:] == [2] * 4 * STEPS
    assert hf_features[0]["loss_fn"]["seen_rows"] == []


@pytest.mark.timeout(420)
def test_tuple_batches_and_attention_mask(hf_features):
    for rank, out in enumerate(hf_features):
        _check_parity(out["tuple"], (rank, "tuple"))
        _check_parity(out["attention_mask"], (rank, "attention_mask"))


@pytest.mark.timeout(420)
def test_ragged_batch_is_padded_exactly_and_growth_refused(hf_features):
    for rank, out in enumerate(hf_features):
        r = out["ragged"]
        _check_parity(r, (rank, "ragged"))
        assert r["eval_rel"] < RTOL, r
        assert "has 12 rows but the pipeline stages were sized for 8" in r["errors"]["rows"], r["errors"]
        assert "sequence length 8" in r["errors"]["seq"] and "sized for 16" in r["errors"]["seq"], r["errors"]
        _check_parity(out["ragged_loss_fn"], (rank, "ragged_loss_fn"))
    # the loss_fn sees only real rows: 2 + 2 + 1 (+ 0: the last micro-batch is all padding) for the 5-row batch
    assert hf_features[1]["ragged_loss_fn"]["seen_rows"][-3:] == [2, 2, 1], hf_features[1]["ragged_loss_fn"]


# -------------------------------------------------------------------------------------------------- failing stage

FAIL_PG_TIMEOUT_S = 30  # without the watchdog the peer would wait this long in its P2P receive


def _failing_stage_worker(rank: int, world: int, tmp: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_v17.config import PipelinePolicy
    from lightning_v17.engine.pipeline.runtime import build_schedule, pipeline_step, split_model
    from lightning_v17.models.pp_layouts import model_pipeline_layout

    torch.set_num_threads(1)
    # spawn leaves the group to us (init_process_group=False): a short timeout, set once (re-initializing races the
    # other rank's store server)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=FAIL_PG_TIMEOUT_S))
    if rank == 0:  # the peer's last words go to stderr: keep them
        err = os.open(f"{tmp}/rank0.stderr", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(err, 2)
    pp_mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))["pp"]
    model = litgpt_softcapped()
    policy = PipelinePolicy(schedule="1f1b", microbatches=4)
    stages, ids = split_model(model, layout=model_pipeline_layout(model), pp_rank=rank, pp=2, policy=policy)
    runtime = build_schedule(stages, stage_ids=ids, pp_mesh=pp_mesh, policy=policy, device="cpu")
    pipeline_step(runtime, litgpt_batch(1))  # one good step first
    if rank == 1:

        def boom(*args, **kwargs):
            raise RuntimeError("boom in block 3 on purpose")

        model.transformer.h["3"].forward = boom
    t_start = time.time()
    try:
        pipeline_step(runtime, litgpt_batch(2))
    except Exception as err:  # noqa: BLE001 - rank 1's own error, or rank 0's gloo timeout without a watchdog
        if rank == 0:
            return {"rank0_survived": True, "error": str(err)[:300], "after_s": time.time() - t_start}
        t_fail, error = time.time(), str(err)
    else:
        return {"no_error": rank}
    # Rank 1 stays alive (as a Lightning process would while it handles the exception) and measures when rank 0
    # ends: rank 0 hosts the TCP store, so store requests fail from then on.
    store = dist.distributed_c10d._get_default_store()
    t_gone = None
    while time.time() - t_fail < 2 * FAIL_PG_TIMEOUT_S:
        try:
            store.check(["alive?"])
        except Exception:  # noqa: BLE001
            t_gone = time.time()
            break
        time.sleep(0.05)
    result = {"error": error, "peer_gone_after_s": None if t_gone is None else t_gone - t_fail}
    with open(f"{tmp}/rank1.json", "w") as f:
        json.dump(result, f)
    return result


@pytest.mark.timeout(180)
def test_failing_stage_ends_its_peer_within_seconds(tmp_path):
    with pytest.raises(AssertionError, match=r"ranks \[0\] gave no result.*exit codes \{0: 1\}"):
        spawn(_failing_stage_worker, world_size=2, args=(str(tmp_path),), timeout=150, init_process_group=False)
    r1 = json.loads((tmp_path / "rank1.json").read_text())
    assert "boom in block 3 on purpose" in r1["error"] or "failed to run forward" in r1["error"], r1
    assert r1["peer_gone_after_s"] is not None and r1["peer_gone_after_s"] < 5.0, r1
    stderr = (tmp_path / "rank0.stderr").read_text()
    assert "pipeline peer failed" in stderr and "rank 1:" in stderr, stderr[-2000:]
    assert "boom in block 3 on purpose" in stderr, stderr[-2000:]
