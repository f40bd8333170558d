"""``V17Strategy(fault_tolerance=FTPolicy(...))``: the replica groups of ``dp_replicate`` on torchft.

Each replica group is its own job (``dp_shard`` ranks, ZeRO-3 inside, its own process group and store); the
replicate axis belongs to torchft (:class:`lightning_v17.resilience.ft.FTReplica`). The strategy's mesh is the
group's, ``dp_replicate=1``; this mixin adds the cross-replica part of each training step at Lightning's hooks:

* ``on_train_start``: the manager is created (it joins the lighthouse) and the optimizer's ``step`` becomes the
  commit: the closure (forward, backward) runs, then the inner step only if the group's vote commits the step;
* ``batch_to_device``: the step's quorum, then this rank's share of the step's samples, drawn from the train
  dataloader's dataset at the committed position (:func:`~lightning_v17.resilience.ft.step_samples`: the
  loader's own batches only count the steps), and the token normalization's divisor over the participating groups:
  ``T / (P D)``, ``T`` the targets of all ``P`` groups' ``D`` ranks, so the loss is one process's on the step's
  samples whatever ``P`` is;
* ``post_backward``: each local gradient shard averaged over the participating groups (before clipping, which then
  sees the step's whole gradient);
* ``on_exception``: the manager leaves at once (a failed group must stop answering its peers quickly);
  ``on_train_end``: it leaves.
"""

from __future__ import annotations

import types
from typing import Any

from lightning_v17.config import FTPolicy, OffloadPolicy, TrainingPolicy, V17ConfigError
from lightning_v17.engine.loss_norm import current_token_normalizer
from lightning_v17.resilience.ft import FTReplica, load_local_state, local_state, step_samples


def check_fault_tolerance(ft: FTPolicy | None, policy: TrainingPolicy, dp_replicate: int) -> int:
    """Refuse what fault-tolerant replica groups do not support; -> the ``dp_replicate`` of the strategy's own mesh
    (1 with ``ft``: torchft owns the replicate axis, each group is its own job)."""
    if ft is None:
        return dp_replicate
    if not isinstance(ft, FTPolicy):
        raise V17ConfigError(f"V17Strategy(fault_tolerance={ft!r}) takes an FTPolicy(...) or None")
    if dp_replicate < 2:
        raise V17ConfigError(
            f"V17Strategy(fault_tolerance=FTPolicy(...)) with dp_replicate={dp_replicate}: fault tolerance drops and "
            "re-adds replica groups, so it needs dp_replicate >= 2 (the number of replica groups launched)"
        )
    refused = {
        "pp": policy.pipeline.size > 1, "tp": policy.tensor_parallel.size > 1, "cp": policy.context.size > 1,
        "ep": policy.expert.size > 1, "offload": policy.offload != OffloadPolicy(), "fp8": policy.fp8 is not None,
        f"zero_stage={policy.zero.stage}": not policy.zero.shards_params,  # ZeRO-3: FSDP2's gradient shards
    }  # fmt: skip
    bad = [name for name, on in refused.items() if on]
    if bad:
        raise V17ConfigError(
            f"V17Strategy(fault_tolerance=FTPolicy(...)) supports ZeRO-3 replica groups over dp_shard only; "
            f"{', '.join(bad)} is not supported with it yet"
        )
    return 1


class FaultSteps:
    """The fault-tolerance part of V17Strategy (module docstring)."""

    _ft_policy: FTPolicy | None = None
    _ft: FTReplica | None = None  # while fitting
    _ft_last: FTReplica | None = None  # the last fit's, after it ended
    _ft_last_samples: list[int] | None = None

    def ft_replicate(self, fault_tolerance: FTPolicy | None, dp_replicate: int) -> int:
        """Keep the policy; -> the strategy mesh's ``dp_replicate`` (:func:`check_fault_tolerance`)."""
        self._ft_policy = fault_tolerance
        return check_fault_tolerance(fault_tolerance, self.policy, dp_replicate)  # type: ignore[attr-defined]

    @property
    def ft(self) -> FTReplica | None:
        """This rank's torchft replica with ``fault_tolerance`` (``history``, ``manager``), during and after a fit."""
        return self._ft or self._ft_last

    def on_train_start(self) -> None:
        super().on_train_start()  # type: ignore[misc]
        if self._ft_policy is None or self._ft is not None:
            return
        module = self.lightning_module  # type: ignore[attr-defined]
        trainer = module.trainer
        if int(trainer.accumulate_grad_batches) != 1 or not module.automatic_optimization:
            raise V17ConfigError(
                "V17Strategy(fault_tolerance=FTPolicy(...)) commits one optimizer step per batch: it needs "
                "accumulate_grad_batches=1 and automatic optimization"
            )
        optimizers = list(self.optimizers)  # type: ignore[attr-defined]
        if len(optimizers) != 1:
            raise V17ConfigError("V17Strategy(fault_tolerance=FTPolicy(...)) supports one optimizer")
        schedulers = [c.scheduler for c in self.lr_scheduler_configs]  # type: ignore[attr-defined]
        opt = optimizers[0]
        inner = opt.__dict__.get("step") or types.MethodType(type(opt).step, opt)  # an instance-level step stays
        env = self.cluster_environment  # type: ignore[attr-defined]
        self._ft = ft = FTReplica(
            self._ft_policy, group_rank=self.global_rank, group_world_size=self.world_size,  # type: ignore[attr-defined]
            store_addr=env.main_address, store_port=env.main_port,
            state_dict=lambda: local_state(module, optimizers, schedulers),
            load_state_dict=lambda state: load_local_state(state, module, optimizers, schedulers, [inner]),
        )  # fmt: skip

        def step(closure: Any = None, **kwargs: Any) -> Any:
            loss = closure() if closure is not None else None
            if ft.should_commit():
                inner(**kwargs)
            return loss

        opt.step = step
        for sched in schedulers:  # an uncommitted step is not a step of the schedule
            sched_step = sched.step
            sched.step = lambda *a, _s=sched_step, **k: _s(*a, **k) if ft.committed else None

    def batch_to_device(self, batch: Any, device: Any = None, dataloader_idx: int = 0) -> Any:
        module = getattr(self, "_lightning_module", None)
        trainer = getattr(module, "_trainer", None)
        ft = self._ft
        if ft is None or trainer is None or not trainer.training or trainer.sanity_checking:
            return super().batch_to_device(batch, device, dataloader_idx)  # type: ignore[misc]
        replica_rank, participants = ft.begin_step()
        batch = self._ft_batch(trainer, ft, replica_rank)
        out = super().batch_to_device(batch, device, dataloader_idx)  # type: ignore[misc]
        norm = current_token_normalizer()
        if norm is not None:  # T_group / D from TokenSteps -> T / (P D) over the participating groups
            d = self.mesh.spec.dp  # type: ignore[attr-defined]
            norm.divisor = ft.allreduce_sum(norm.divisor * d) / (participants * d)
        ft.history[-1]["samples"] = self._ft_last_samples
        return out

    def _ft_batch(self, trainer: Any, ft: FTReplica, replica_rank: int) -> Any:
        loader = trainer.train_dataloader
        dataset, collate, per_rank = (getattr(loader, n, None) for n in ("dataset", "collate_fn", "batch_size"))
        if dataset is None or collate is None or not per_rank or not hasattr(dataset, "__len__"):
            raise V17ConfigError(
                "V17Strategy(fault_tolerance=FTPolicy(...)) draws each step's samples from the train DataLoader's "
                "dataset: it needs one DataLoader over a map-style dataset (with __len__) and a batch_size"
            )
        dp = self.mesh["dp"]  # type: ignore[attr-defined]
        idx = step_samples(ft.position_batches() * dp.size() * per_rank, replica_rank=replica_rank,
                           dp_rank=dp.get_local_rank(), dp_size=dp.size(), per_rank=per_rank,
                           num_samples=len(dataset))  # fmt: skip
        self._ft_last_samples = idx
        return collate([dataset[i] for i in idx])

    def post_backward(self, closure_loss: Any) -> None:
        super().post_backward(closure_loss)  # type: ignore[misc]
        if self._ft is not None:
            self._ft.average_gradients(self.lightning_module.parameters())  # type: ignore[attr-defined]

    def on_exception(self, exception: BaseException) -> None:
        self._ft_leave()
        super().on_exception(exception)  # type: ignore[misc]

    def on_train_end(self) -> None:
        super().on_train_end()  # type: ignore[misc]
        self._ft_leave()

    def _ft_leave(self) -> None:
        ft, self._ft = self._ft, None
        if ft is not None:
            self._ft_last = ft
            ft.shutdown()
