"""MoE balance terms inside pipeline stages (DeepSeek-V3's PP x EP x ZeRO-1 with both balance terms): the MoE LlamaLM
(``tiny-moe``, 2 MoE blocks: one per stage, 2 micro-batches per step) with the sequence-wise balance loss, the router
z-loss and the aux-loss-free expert bias, against one process on the concatenated batch, 5 steps:

* ``V17Strategy(pp=2, ep=2, zero_stage=1)`` on 4 ranks (each stage on a dp = 2 pair whose ep group dispatches its
  tokens; dp rank 1 starts from other random weights; the 1F1B schedule) and ``V17Strategy(pp=2)`` on 2 ranks (2 rows
  a micro-batch) under ZB-H1, whose backward runs the input and the weight gradients apart, and under 1F1B with
  ``accumulate_grad_batches=2`` (each step's rows in 2 batches: the aux gradient takes Lightning's 1/2 too), all in
  one spawn of 4 ranks (ranks 0-1 run the 2-rank jobs in a process group of their own, then all 4 the other);
* plain SGD and AdamW with gradient clipping that clips at every step: each step's cross-entropy, each layer's aux
  loss (the micro-batches' weighted 1/M each, averaged over dp), the unclipped global gradient norm and every final
  parameter within 1e-5 of one process, and every expert bias after every step equal to one process's bit for bit.
  The balance losses reach the schedule's backward through each MoE output (``engine/ep/balance.py``'s
  ``AuxLossScaler`` at the micro-batch loss's scale); dropped, or counted once per micro-batch without the ``1/M``,
  the router's gradient and the norm move;
* the expert load counted in step 1, summed over the stage's dp ranks, is the real routed load (one process's, and
  all 4 x 16 tokens x 2 experts a token): torch's shape inference runs an extra forward of micro-batch 0 that would
  add its tokens; and each real micro-batch forward (exactly M a step) carries the aux loss to the backward.

The references run in the test process. A MoE layer that does not declare ``pipeline_balance`` is still refused
(``test_pp_refuses_balance_terms_of_a_foreign_layer``).
"""

from __future__ import annotations

import os

import pytest
import torch

from tests._adamw_parity import assert_params_close, reference_with_amplification
from tests._dist import spawn
from tests._strategy import MOE_CLIP, MOE_OPTIMIZERS, MOE_ROWS, MOE_SEQ, _moe_loader, _moe_rows, _trainer, full, v17

#: the compositions this file checks against one process (docs/gen_layouts.py builds docs/layouts.md from them)
COMPOSES = (("pp", "ep", "zero1", "moe_balance"), ("pp", "moe_balance", "accumulation"))
#: the published layouts this file runs in miniature, name -> the miniature (optional)
PUBLISHED = {"DeepSeek-V3 PP x EP x ZeRO-1, both balance terms": (
    "pp2 x ep2 at ZeRO-1, the sequence-wise balance loss (aux_loss) and the aux-loss-free bias (expert_bias_rate)")}

TOL = 1e-5
MICRO = 2
OVERRIDES = {"layers": 2, "dense_layers": 0, "aux_loss_coef": 0.05, "z_loss_coef": 0.01, "expert_bias_rate": 0.01}
JOBS = {  # name -> (ranks, strategy options, dp, accumulate_grad_batches)
    "pp2_ep2_zero1": (4, {"pp": 2, "ep": 2, "zero_stage": 1, "microbatches": MICRO}, 2, 1),
    "pp2": (2, {"pp": 2, "microbatches": MICRO, "pp_schedule": "zb_h1"}, 1, 1),
    "pp2_accumulate2": (2, {"pp": 2, "microbatches": MICRO}, 1, 2),
}


def fit(opt_name: str, devices: int, strategy, *, dp: int = 1, accumulate: int = 1, group=None) -> dict:
    """One run of the MoE LlamaLM; ``devices`` > 1: ranks = pp x dp (dp innermost), this rank's rows those of its
    dp rank. Returns per step the cross-entropy (mean over the dp ranks), each local MoE layer's aux loss and the
    unclipped gradient norm, the layers' load counted in step 1 (summed over dp), the biases after each step, the
    final parameters gathered whole, and how many forwards carried their aux loss to the backward each step.
    ``accumulate`` > 1 (dp = 1): each step's rows in that many batches, the step's cross-entropy their mean."""
    import lightning as L
    from torch.utils.data import DataLoader

    from lightning_v17.models import LlamaLM, moe_layers

    rank = int(os.environ.get("RANK", "0"))
    dp_rank = rank % dp
    losses, norms, aux_steps, bias_steps, attached_steps, first_load = [], [], [], [], [], {}
    aux_now: dict[str, list[torch.Tensor]] = {}
    window: list[torch.Tensor] = []
    attached_now: dict[str, int] = {}

    def names(pl_module) -> dict:
        return {m: n for n, m in pl_module.model.named_modules() if m in moe_layers(pl_module.model)}

    def dp_sum(t: torch.Tensor, trainer) -> torch.Tensor:
        t = t.detach().double().clone()
        if devices > 1 and dp > 1:
            torch.distributed.all_reduce(t, group=trainer.strategy.mesh.group("dp"))
        return t

    class Rec(L.Callback):
        def on_train_start(self, trainer, pl_module) -> None:
            for m, n in names(pl_module).items():

                def hook(mod, args, out, n=n):  # every training forward; which carried the aux loss (pp)
                    if not mod.training:
                        return
                    carried = type(out.grad_fn).__name__.startswith("AuxLossScaler")
                    if devices == 1 or carried:
                        aux_now.setdefault(n, []).append(mod.aux_loss.detach().double().clone())
                    attached_now[n] = attached_now.get(n, 0) + int(carried)

                m.register_forward_hook(hook)

        def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
            grads = [full(p.grad).double() for p in pl_module.parameters() if p.grad is not None]
            squares = torch.stack([g.pow(2).sum() for g in grads]).sum()
            if devices > 1:  # each pp rank holds its stage's parameters: add one rank per stage
                every = [torch.zeros_like(squares) for _ in range(devices)]
                torch.distributed.all_gather(every, squares, group=group)
                squares = sum(every[r] for r in (0, devices // 2))
            norms.append(float(squares.sqrt()))
            if not first_load:
                first_load.update({n: dp_sum(m.expert_load, trainer) for m, n in names(pl_module).items()})

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            window.append(torch.as_tensor(trainer.callback_metrics["train_loss"]).double())
            if len(window) < accumulate:
                return
            losses.append(float(dp_sum(torch.stack(window).mean(), trainer) / dp))
            window.clear()
            # the micro-batches' aux losses weighted 1/M each (one process: its one forward), averaged over dp
            aux_steps.append({n: float(dp_sum(torch.stack(v).mean(), trainer) / dp) for n, v in aux_now.items()})
            attached_steps.append(dict(attached_now))
            aux_now.clear()
            attached_now.clear()
            bias_steps.append({n: m.expert_bias.clone() for m, n in names(pl_module).items()})

    class LM(LlamaLM):
        def configure_model(self) -> None:
            super().configure_model()
            if dp > 1 and dp_rank == 1:  # other initial weights: the strategy hands over those of dp rank 0
                with torch.no_grad():
                    for p in self.model.parameters():
                        p.add_(torch.randn_like(p), alpha=0.01)

        def configure_optimizers(self):
            cls = torch.optim.SGD if opt_name == "sgd" else torch.optim.AdamW
            return cls(self.parameters(), lr=0.05 if opt_name == "sgd" else 2e-3)

    L.seed_everything(0, verbose=False)
    module = LM(model="tiny-moe", model_overrides=OVERRIDES, warmup_steps=0, max_steps=5)
    trainer = _trainer(devices, strategy, MOE_OPTIMIZERS[opt_name], [Rec()], use_distributed_sampler=False,
                       accumulate_grad_batches=accumulate)  # fmt: skip
    if accumulate > 1:
        loader = DataLoader(_moe_rows(), batch_size=MOE_ROWS // accumulate, shuffle=False)
    else:
        loader = _moe_loader(devices, dp_rank, dp)
    trainer.fit(module, loader)
    return {"losses": losses, "norms": norms, "aux": aux_steps, "biases": bias_steps, "attached": attached_steps,
            "first_load": first_load, "params": {n: full(p) for n, p in module.model.named_parameters()}}  # fmt: skip


def _worker(rank: int, world: int) -> dict:
    import warnings

    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    out: dict = {}
    # the 2-rank jobs on ranks 0-1, in a process group (and a store) of their own
    if rank < 2:
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["SUB_PORT"]), 2, rank == 0)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
        os.environ["WORLD_SIZE"] = os.environ["LOCAL_WORLD_SIZE"] = "2"
    for job, (ranks, options, dp, accumulate) in JOBS.items():
        if ranks == 2 and rank < 2:
            out[job] = {name: fit(name, ranks, v17(**options), dp=dp, accumulate=accumulate) for name in MOE_OPTIMIZERS}
    if rank < 2:
        dist.destroy_process_group()
        os.environ["WORLD_SIZE"] = os.environ["LOCAL_WORLD_SIZE"] = str(world)
    for job, (ranks, options, dp, accumulate) in JOBS.items():
        if ranks == world:
            out[job] = {name: fit(name, ranks, v17(**options), dp=dp, accumulate=accumulate) for name in MOE_OPTIMIZERS}
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    from tests._dist import free_port

    os.environ["SUB_PORT"] = str(free_port())
    try:
        return spawn(_worker, world_size=4, timeout=400, init_process_group=False)
    finally:
        del os.environ["SUB_PORT"]


@pytest.fixture(scope="module")
def references() -> dict:
    import warnings

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    return {name: reference_with_amplification(lambda name=name: fit(name, 1, "auto")) for name in MOE_OPTIMIZERS}


@pytest.mark.timeout(400)
@pytest.mark.parametrize("job", list(JOBS))
@pytest.mark.parametrize("opt_name", list(MOE_OPTIMIZERS))
def test_balance_terms_inside_pp_match_one_process(results, references, job, opt_name) -> None:
    ref = references[opt_name]
    ranks = JOBS[job][0]
    if MOE_OPTIMIZERS[opt_name] is not None:  # the clipping clips at every step
        assert min(ref["norms"]) > 2 * MOE_CLIP, ref["norms"]
    assert all(a > 0 for step in ref["aux"] for a in step.values()), ref["aux"]
    assert any(bool(b.abs().sum() > 0) for b in ref["biases"][-1].values()), "the expert bias never moved"
    params: dict[str, torch.Tensor] = {}
    for rank, got in enumerate(results[:ranks]):
        got = got[job][opt_name]
        stage = rank // (ranks // 2)
        layer = f"layers.{stage}.feed_forward"
        load = got["first_load"][layer]
        assert float(load.sum()) == MOE_ROWS * MOE_SEQ * 2, (rank, load)  # all tokens, 2 experts each, counted once
        assert torch.equal(load, ref["first_load"][layer]), (rank, load, ref["first_load"][layer])
        assert got["losses"] == pytest.approx(ref["losses"], rel=TOL, abs=TOL), (rank, got["losses"], ref["losses"])
        assert got["norms"] == pytest.approx(ref["norms"], rel=TOL), (rank, got["norms"], ref["norms"])
        assert_params_close(got["params"], ref, tol=TOL, msg=f"{job} rank {rank}")  # AdamW: tests/_adamw_parity.py
        for step, (b, want) in enumerate(zip(got["biases"], ref["biases"])):
            assert torch.equal(b[layer], want[layer]), (rank, step, b[layer], want[layer])
        # every real micro-batch forward, and no shape-inference forward, carries the aux loss to the backward
        assert got["attached"] == [{layer: MICRO * JOBS[job][3]}] * 5, (rank, got["attached"])
        for step, (a, want) in enumerate(zip(got["aux"], ref["aux"])):
            assert a[layer] == pytest.approx(want[layer], rel=TOL, abs=1e-7), (rank, step, a, want)
        params.update(got["params"])
    assert params.keys() == ref["params"].keys()  # the two stages hold the whole model between them


def test_pp_refuses_balance_terms_of_a_foreign_layer() -> None:
    """A MoE layer that does not attach its aux loss to its output (no ``pipeline_balance``) is refused under pp,
    naming the option; the reference MoE with every term passes."""
    from lightning_v17.config import V17ConfigError
    from lightning_v17.engine.ep import check_pipeline_moe
    from lightning_v17.models import Llama
    from lightning_v17.models.config import ModelConfig

    model = Llama(ModelConfig.from_preset("tiny-moe", **OVERRIDES))
    check_pipeline_moe(model, pp=2)

    class Foreign(torch.nn.Module):  # found by what it has (dispatcher, experts, num_experts), not its class
        def __init__(self, **terms) -> None:
            super().__init__()
            self.experts, self.dispatcher, self.num_experts = torch.nn.Linear(2, 2), None, 4
            self.__dict__.update(terms)

    for term in ("aux_loss_coef", "z_loss_coef", "expert_bias_rate"):
        foreign = torch.nn.Sequential(Foreign(**{term: 0.01}))
        check_pipeline_moe(foreign, pp=1)
        with pytest.raises(V17ConfigError, match=rf"pp=2 with {term}=0.01 in the MoE layer 0 \(Foreign\)"):
            check_pipeline_moe(foreign, pp=2)
    check_pipeline_moe(torch.nn.Sequential(Foreign()), pp=2)  # no balance term: nothing to lose


def test_attached_aux_loss_gets_the_step_scale_and_shape_inference_counts_nothing() -> None:
    """One layer, no ranks: inside a pipeline step the output carries ``scale * aux`` into backward (the router's
    gradient equals that of ``loss + scale * aux`` by hand), outside one nothing is attached; a forward inside
    ``shape_inference()`` leaves the load and the aux loss as they were."""
    from lightning_v17.engine.ep.balance import pipeline_balance_step, shape_inference
    from lightning_v17.models.config import ModelConfig
    from lightning_v17.models.moe import MoE

    torch.manual_seed(0)
    layer = MoE(ModelConfig.from_preset("tiny-moe", **OVERRIDES)).train()
    x = torch.randn(2, 8, layer.router.in_features)
    scale = 0.375

    def router_grad(step: bool) -> torch.Tensor:
        layer.zero_grad()
        if step:
            with pipeline_balance_step(scale):
                out = layer(x)
            assert type(out.grad_fn).__name__.startswith("AuxLossScaler")
            out.pow(2).mean().backward()
        else:
            out = layer(x)
            assert not type(out.grad_fn).__name__.startswith("AuxLossScaler")
            (out.pow(2).mean() + scale * layer.aux_loss).backward()
        return layer.router.weight.grad.clone()

    torch.testing.assert_close(router_grad(True), router_grad(False), rtol=1e-6, atol=1e-9)
    load, aux = layer.expert_load.clone(), layer.aux_loss
    with shape_inference():
        layer(torch.randn_like(x))
    assert torch.equal(layer.expert_load, load) and layer.aux_loss is aux
