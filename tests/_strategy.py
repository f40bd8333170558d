"""The tests' shorthand for V17Strategy: ``v17(**flat)`` takes the flat option names and builds the policies.

Many tests describe a strategy as one dict of options (``{"pp": 2, "zero_stage": 1, "microbatches": 4}``), a
table row. ``v17`` translates the flat names into the policy objects ``V17Strategy`` takes, and passes every other
argument (the axis sizes, ``zero_stage``, ``activation_checkpointing``, ``config``, ``timeout``, ...) as it is:

* ``bucket_mb``, ``wrap_classes``, ``reshard_after_forward``, ``overlap_comm``, ``prefetch_units``,
  ``optimizer_partition``, ``meta_init`` -> ``zero=ZeroPolicy(...)``, with ``zero_stage`` as its ``stage`` (default 3);
  ``zero_stage`` alone stays the shortcut, so that a DeepSpeed ``config=``'s ZeRO section still applies;
* ``offload_optimizer``, ``offload_params``, ``nvme_path``, ``offload_optimizer_ratio`` -> ``offload=OffloadPolicy``;
* ``pp_schedule``, ``microbatches``, ``virtual_stages``, ``pp_split_points`` -> ``pp=PipelinePolicy(size=pp, ...)``;
* ``tp_plan``, ``sequence_parallel``, ``vocab_parallel``, ``loss_parallel`` -> ``tp=TPPolicy(size=tp, ...)``;
* ``fp8`` (the recipe) with ``fp8_backend``, ``fp8_skip``, ``fp8_all_gather``, ``fp8_amax_history_len`` ->
  ``fp8=FP8Policy.from_options(...)``, which also refuses those options without a recipe.

Code outside the tests writes the policies itself (README, ``docs/``).

The Trainer runs that tests compare against one process share their scaffolding here too: :func:`fit_packed` (the
dense tiny LlamaLM on packed documents: ``tests/dist/test_cp_tp.py``, ``test_cp_pp.py``) and :func:`fit_moe` (the
MoE LlamaLM on fixed rows: ``tests/dist/test_ep_tp.py``, ``test_ep_pp.py``). Each returns what its tests assert on.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

ZERO = {"bucket_mb": "bucket_mb", "wrap_classes": "wrap_classes", "reshard_after_forward": "reshard_after_forward",
        "overlap_comm": "overlap_comm", "prefetch_units": "prefetch_units", "optimizer_partition": "optimizer_partition",
        "meta_init": "meta_init"}  # fmt: skip
OFFLOAD = {"offload_optimizer": "optimizer", "offload_params": "params", "nvme_path": "nvme_path",
           "offload_optimizer_ratio": "optimizer_ratio"}  # fmt: skip
PIPELINE = {"pp_schedule": "schedule", "microbatches": "microbatches", "virtual_stages": "virtual_stages",
            "pp_split_points": "split_points"}  # fmt: skip
TP = {"tp_plan": "plan", "sequence_parallel": "sequence_parallel", "vocab_parallel": "vocab_parallel",
      "loss_parallel": "loss_parallel"}  # fmt: skip
FP8 = ("fp8_backend", "fp8_skip", "fp8_all_gather", "fp8_amax_history_len")


def policies(**flat: Any) -> dict[str, Any]:
    """The ``V17Strategy`` keyword arguments for ``flat`` (see the module docstring)."""
    from lightning_v17.config import FP8Policy, OffloadPolicy, PipelinePolicy, TPPolicy, ZeroPolicy

    kw = dict(flat)

    def take(names: dict[str, str], into: str) -> dict[str, Any]:
        picked = {field: kw.pop(name) for name, field in names.items() if name in kw}
        if picked and into in kw:
            raise TypeError(f"v17(): give {sorted(picked)} or {into}=, not both")
        return picked

    zero = take(ZERO, "zero")
    if zero:  # a None field means "not given", as the flat arguments had it
        stage = kw.pop("zero_stage", None)
        zero = {k: v for k, v in zero.items() if v is not None} | ({} if stage is None else {"stage": stage})
        kw["zero"] = ZeroPolicy(**zero)
    fields = take(OFFLOAD, "offload")
    if fields:
        kw["offload"] = OffloadPolicy(**fields)
    for names, axis, cls in ((PIPELINE, "pp", PipelinePolicy), (TP, "tp", TPPolicy)):
        fields = {field: kw.pop(name) for name, field in names.items() if name in kw}
        if fields:
            kw[axis] = cls(size=kw.get(axis, 1), **fields)
    if any(n in kw for n in FP8):
        options = {n[len("fp8_") :]: kw.pop(n) for n in FP8 if n in kw}
        kw["fp8"] = FP8Policy.from_options(kw.pop("fp8", None), **options)
    return kw


def v17(**flat: Any) -> Any:
    """``V17Strategy(**policies(**flat))``."""
    from lightning_v17 import V17Strategy

    return V17Strategy(**policies(**flat))


# ---- Trainer runs compared against one process -----------------------------------------------------------------------
STEPS = 5  # optimizer steps of every run below


def full(t: torch.Tensor) -> torch.Tensor:
    """A detached copy of ``t``, gathered whole when it is a DTensor."""
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def _trainer(devices: int, strategy: Any, clip: float | None, callbacks: list, **extra: Any) -> Any:
    import lightning as L

    return L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=STEPS, gradient_clip_val=clip,
                     logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                     callbacks=callbacks, **extra)  # fmt: skip


# The dense tiny LlamaLM (2 blocks) on packed rows of several documents each, trained with plain SGD (a gradient off
# by a constant factor moves the weights off the reference) or AdamW clipped at PACKED_CLIP.
PACKED_CLIP = 0.5
# AdamW as tests/dist/test_tp.py runs it (lr 1e-3, eps 1e-5): Adam's lr * m / (sqrt(v) + eps) turns the fp32
# reduction-order noise of near-zero gradients (~1e-8) into lr-sized steps of either sign at the default eps (measured:
# tp=2 alone moves an embedding entry by 1.7e-3 at lr 1e-2, eps 1e-8); eps=1e-5 sits above that noise floor, and a
# wrong gradient still moves parameters by ~lr.
PACKED_ADAMW = {"lr": 1e-3, "eps": 1e-5, "weight_decay": 0.1}


def packed_docs(n: int) -> list[list[int]]:
    """``n`` documents of 5 to 29 random token ids (seed 7): the same on every rank."""
    import torch

    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, 320, (int(k),), generator=g).tolist() for k in torch.randint(5, 30, (n,), generator=g)]


def fit_packed(world: int, strategy: dict[str, Any], opt: str, docs: list[list[int]], *, batch_size: int,
               grad_norm: Callable[[Any, int], float], pipeline_loss: Callable | None = None) -> dict:  # fmt: skip
    """One Trainer run of ``V17Strategy(**strategy)`` with ``opt`` ("sgd" or "adamw"), ``world`` ranks: each step's
    loss of the whole rows (the cp ranks' token means combined), the pre-clip gradient norm ``grad_norm(module,
    world)`` measures, and the parameters after (gathered whole). ``pipeline_loss`` becomes the module's own."""
    import lightning as L
    import torch
    from lightning_v17.strategies import V17Strategy

    from lightning_v17.data import PackedDataModule
    from lightning_v17.models import LlamaLM

    torch.set_num_threads(1)
    L.seed_everything(0, verbose=False)
    losses: list[float] = []
    norms: list[float] = []

    class Module(LlamaLM):
        def configure_optimizers(self):
            if opt == "sgd":
                return torch.optim.SGD(self.parameters(), lr=0.5)
            return torch.optim.AdamW(self.parameters(), **PACKED_ADAMW)

        def on_before_optimizer_step(self, optimizer) -> None:  # before Lightning clips
            norms.append(grad_norm(self, world))

    if pipeline_loss is not None:
        Module.pipeline_loss = pipeline_loss

    class Losses(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            loss = outputs["loss"].detach().double()
            if trainer.strategy.token_normalized():  # each rank's share of the step's global token mean
                num = torch.stack([loss, torch.ones_like(loss)])
                for axis in ("cp", "dp") if world > 1 else ():
                    torch.distributed.all_reduce(num, group=trainer.strategy.mesh.group(axis))
            else:  # the rows' token mean from the cp ranks' own: sum(mean_r * targets_r) / sum(targets_r)
                w = (batch["labels"] != -100).sum().double()
                num = torch.stack([loss * w, w])
                if world > 1:
                    torch.distributed.all_reduce(num, group=trainer.strategy.mesh.group("cp"))
            losses.append(float(num[0] / num[1]))

    module = Module(model="tiny", model_overrides={"layers": 2})
    trainer = _trainer(world, V17Strategy(**strategy), PACKED_CLIP if opt == "adamw" else None, [Losses()],
                       num_sanity_val_steps=0, limit_val_batches=0)  # fmt: skip
    trainer.fit(module, datamodule=PackedDataModule(docs, seq_len=32, batch_size=batch_size, seed=0, packing="ffd"))
    return {"losses": losses, "norms": norms, "weights": {n: full(p) for n, p in module.named_parameters()}}


# The MoE LlamaLM ("tiny-moe") on fixed rows of MOE_SEQ random tokens, MOE_ROWS a step: plain SGD, or AdamW with
# gradient clipping that clips at every step (the tests assert the reference's unclipped norm exceeds MOE_CLIP).
MOE_SEQ, MOE_ROWS, MOE_CLIP = 16, 4, 0.05
MOE_OPTIMIZERS = {"sgd": None, "adamw_clip": MOE_CLIP}  # name -> gradient_clip_val


def _moe_rows() -> Any:
    import torch
    from torch.utils.data import Dataset

    class Rows(Dataset):
        def __len__(self) -> int:
            return MOE_ROWS * STEPS

        def __getitem__(self, i: int) -> dict:
            ids = torch.randint(0, 320, (MOE_SEQ + 1,), generator=torch.Generator().manual_seed(i))
            return {"input_ids": ids[:-1], "labels": ids[1:], "position_ids": torch.arange(MOE_SEQ)}

    return Rows()


def _moe_loader(devices: int, dp_rank: int, dp: int = 2) -> Any:
    """One process: batches of 4 rows; ``dp`` data-parallel ranks: dp rank r gets rows ``4/dp`` x r ... of each 4, so
    one process's batch is all dp ranks' together, and every row is full: the mean of their token means is its."""
    from torch.utils.data import DataLoader, Subset

    if devices == 1:
        return DataLoader(_moe_rows(), batch_size=MOE_ROWS, shuffle=False)
    per = MOE_ROWS // dp
    rows = [s * MOE_ROWS + per * dp_rank + i for s in range(STEPS) for i in range(per)]
    return DataLoader(Subset(_moe_rows(), rows), batch_size=per, shuffle=False)


def fit_moe(opt_name: str, devices: int, strategy: Any, *, overrides: dict, dp_axis_stride: int = 2,
            stage_ranks: tuple[int, ...] = (), dp: int = 2, perturb_odd: bool = True) -> dict:  # fmt: skip
    """Train the MoE LlamaLM (``model_overrides=overrides``) with ``MOE_OPTIMIZERS[opt_name]``; with ``devices`` > 1
    this rank's dp rank is ``RANK // dp_axis_stride % dp``, odd ranks start from other random weights (unless not
    ``perturb_odd``: ZeRO-3 shards rather than broadcasts over dp_shard), and, under pp,
    the global gradient norm adds the squared norms of ``stage_ranks`` (one rank per stage). Returns each step's loss
    (the mean over one process's batch), unclipped gradient norm and the norm the strategy's clipping computed, the
    parameters gathered whole, the names of the ep-sharded and the tp-sharded ones, and the expert biases (after
    each step and at the end)."""
    import lightning as L
    import lightning_v17.strategies._precision as precision
    import torch

    from lightning_v17.engine.offload.handles import offload_of
    from lightning_v17.models import LlamaLM, moe_layers

    losses, norms, clip_norms, bias_steps, offloaded = [], [], [], [], []

    class Rec(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            loss = outputs["loss"].detach().clone()
            if devices > 1:  # the dp ranks' means (tp ranks hold the same): the mean over one process's batch
                torch.distributed.all_reduce(loss)
                loss /= devices
            losses.append(float(loss))
            bias_steps.append([m.expert_bias.clone() for m in moe_layers(pl_module.model)])

        def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
            offloaded.append(offload_of(optimizer) is not None)  # its state on an offload tier (closed at teardown)
            # before Lightning clips: the unclipped norm, from every parameter's gradient gathered whole
            grads = [full(p.grad).double() for p in pl_module.parameters() if p.grad is not None]
            if not grads:  # ZeRO-2: only the partitions' gradients exist (the clipping's norm is recorded below)
                norms.append(float("nan"))
                return
            squares = torch.stack([g.pow(2).sum() for g in grads]).sum()
            if stage_ranks:  # each pp rank holds its stage's parameters only
                every = [torch.zeros_like(squares) for _ in range(devices)]
                torch.distributed.all_gather(every, squares)
                squares = sum(every[r] for r in stage_ranks)
            norms.append(float(squares.sqrt()))

    class LM(LlamaLM):
        def configure_model(self) -> None:
            super().configure_model()
            if perturb_odd and devices > 1 and int(os.environ["RANK"]) % 2:  # odd ranks (tp rank 1; dp rank 1 under pp) draw other
                with torch.no_grad():  # initial weights: the strategy hands them those of the others (experts too)
                    for p in self.model.parameters():
                        p.add_(torch.randn_like(p), alpha=0.01)

        def configure_optimizers(self):
            cls = torch.optim.SGD if opt_name == "sgd" else torch.optim.AdamW
            return cls(self.parameters(), lr=0.05 if opt_name == "sgd" else 2e-3)

    record = precision.clip_grad_norm_

    def clip_and_record(*args, **kwargs):  # the norm the strategy's clipping computed
        total = record(*args, **kwargs)
        clip_norms.append(float(total))
        return total

    precision.clip_grad_norm_ = clip_and_record
    try:
        module = LM(model="tiny-moe", model_overrides=overrides, warmup_steps=0, max_steps=STEPS)
        trainer = _trainer(devices, strategy, MOE_OPTIMIZERS[opt_name], [Rec()], use_distributed_sampler=False)
        dp_rank = int(os.environ.get("RANK", "0")) // dp_axis_stride % dp  # the Trainer initializes the group in fit
        trainer.fit(module, _moe_loader(devices, dp_rank, dp))
    finally:
        precision.clip_grad_norm_ = record
    model = module.model
    names = {id(p): n for n, p in model.named_parameters()}
    opt = trainer.optimizers[0]
    expert_q = [q for g in opt.param_groups for q in g["params"]
                if ".experts." in names.get(id(getattr(q, "_v17_param", q)), "")]  # fmt: skip
    return {
        "losses": losses, "norms": norms, "clip_norms": clip_norms,
        "params": {n: full(p) for n, p in model.named_parameters()},
        "experts": sorted(n for n, p in model.named_parameters() if hasattr(p, "_v17_expert")),
        "tp_sharded": sorted(n for n, p in model.named_parameters() if "tp" in str(getattr(p, "device_mesh", ""))),
        "biases": [m.expert_bias.clone() for m in moe_layers(model)], "bias_steps": bias_steps,
        # what this rank stores of each routed-expert weight, and over which mesh axes
        "expert_storage": {n: ((p.to_local() if hasattr(p, "to_local") else p).numel(),
                               getattr(getattr(p, "device_mesh", None), "mesh_dim_names", None))
                           for n, p in model.named_parameters() if ".experts." in n},
        # what the optimizer steps of each of them (a ZeRO-1/2 shard views its parameter: ``_v17_param``)
        "expert_stepped": {names[id(getattr(q, "_v17_param", q))]: (q.to_local() if hasattr(q, "to_local") else q).numel()
                           for q in expert_q},
        # the optimizer state this rank stores for them (AdamW's moments; the step counter is a scalar), from storage
        "expert_optimizer_bytes": sum((t.to_local() if hasattr(t, "to_local") else t).untyped_storage().nbytes()
                                      for q in expert_q for t in opt.state.get(q, {}).values()
                                      if torch.is_tensor(t) and t.dim() > 0),
        "optimizer_offloaded": offloaded,  # per step: the optimizer's state on an offload tier (engine/offload)
        "expert_param_bytes": sum((p.to_local() if hasattr(p, "to_local") else p).untyped_storage().nbytes()
                                  for n, p in model.named_parameters() if ".experts." in n),
    }  # fmt: skip
