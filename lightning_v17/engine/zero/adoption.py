"""Parameters that join a ZeRO-1/2 engine after setup, and the optimizer parameters that stand for them.

A parameter frozen at setup is outside the partition (:mod:`lightning_v17.engine.zero.stages_0_2`). When it becomes
trainable (Lightning's ``BaseFinetuning`` unfreezes a backbone at some epoch, then ``optimizer.add_param_group``),
one process steps it with its gradient from then on; DDP would not even reduce it (its reducer leaves out what was
frozen when it was built). Here it joins the reduction and the partition instead (:class:`LateParams`, mixed into
:class:`~lightning_v17.engine.zero.stages_0_2.ZeroEngine`, whose attributes it reads).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from lightning_v17.config import V17ConfigError
from lightning_v17.engine.zero.layout import ShardParameter, _Bucket, _local, _Param, shard_view

__all__ = ["LateParams"]


class LateParams:
    """Adopt parameters that become trainable after setup; what an optimizer holds for a parameter at each stage."""

    stage: int
    world: int
    rank: int
    owner_mode: bool
    params: list[_Param]
    by_param: dict[int, _Param]
    by_shard: dict[int, _Param]
    buckets: list[_Bucket]
    bucket_of: dict[int, int]
    frozen: dict[int, tuple[str, nn.Parameter]]
    dropped: dict[int, str]
    _hooks: list[Any]
    _stepped_by: dict[int, tuple[list[_Param], list[_Bucket]]]

    def _entry_of(self, fqn: str, p: nn.Parameter) -> _Param:
        raise NotImplementedError

    def _on_grad(self, p: torch.Tensor) -> None:
        raise NotImplementedError

    def adopt(self, params: Iterable[torch.Tensor]) -> list[_Param]:
        """Take trainable parameters of the module that this engine does not reduce yet into the partition: those
        frozen at setup and now trainable (``BaseFinetuning`` unfreezes a backbone, then ``add_param_group``).

        They form one new bucket, after the others (the same on every rank: every rank adopts the same parameters
        at the same point, since freezing is the same code on each), with their gradient hooks; with
        ``partition="params"`` each goes to the least-loaded rank. Returns the new entries."""
        new: list[_Param] = []
        for p in params:
            hit = self.frozen.get(id(p))
            if hit is None or not p.requires_grad:
                continue
            del self.frozen[id(p)]
            self.dropped.pop(id(p), None)
            new.append(self._entry_of(hit[0], p))
        if not new:
            return []
        if self.owner_mode:
            loads = [0] * self.world
            for e in self.params:
                loads[e.owner] += _local(e.param).numel()
            for e in new:
                e.owner = min(range(self.world), key=lambda k: (loads[k], k))
                loads[e.owner] += _local(e.param).numel()
        self.params.extend(new)
        self.by_param.update({id(e.param): e for e in new})
        self.buckets.append(_Bucket(list(reversed(new)), sum(e.seg_numel for e in new)))
        self.bucket_of.update({id(e.param): len(self.buckets) - 1 for e in new})
        self._hooks += [e.param.register_post_accumulate_grad_hook(self._on_grad) for e in new]
        return new

    def adopt_unfrozen(self) -> None:
        """At the end of every backward: a parameter frozen at setup that is trainable now is reduced from this
        step on (one process would step it with this step's gradient; DDP's reducer would leave it out). At stage 0
        the optimizer holds it as it is. At stages 1/2 an optimizer that listed it had it dropped (nothing could step
        it), and it cannot be put back into the groups from here, so that is refused, naming the parameter."""
        if not self.frozen:
            return
        unfrozen = [p for _, p in self.frozen.values() if p.requires_grad]
        if not unfrozen:
            return
        dropped = [self.dropped[id(p)] for p in unfrozen if id(p) in self.dropped]
        if dropped and self.stage > 0:
            raise V17ConfigError(
                f"{', '.join(dropped[:4])}{' ...' if len(dropped) > 4 else ''} became trainable after setup, but "
                f"zero_stage={self.stage} partitioned the optimizer when it was frozen and left it out (nothing could "
                "step it then), so no optimizer would step it now. Add it to the optimizer when you unfreeze it "
                "(optimizer.add_param_group({'params': [...]}), as BaseFinetuning.unfreeze_and_add_param_group does), "
                "or leave it trainable in configure_optimizers"
            )
        self.adopt(unfrozen)

    def optimizer_params(self, params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
        """What an optimizer holds for ``params`` at this stage: the parameters themselves at stage 0, else this
        rank's shards of this engine's parameters (:class:`ShardParameter`), the others as they are."""
        out = []
        for p in params:
            e = self.by_param.get(id(p))
            if self.stage == 0 or e is None:
                out.append(p)
                continue
            if self.owner_mode and e.owner == self.rank:
                e.shard = e.param
            elif e.shard is None:
                e.shard = ShardParameter(shard_view(e, empty=self.owner_mode), e.param)
            self.by_shard[id(e.shard)] = e
            out.append(e.shard)
        return out

    def _note_stepped(self, optimizer: torch.optim.Optimizer) -> list[_Param]:
        """Record which of this engine's parameters ``optimizer`` steps and the buckets :meth:`gather_params`
        refreshes after its step (again after ``add_param_group``); returns those entries."""
        entries = [e for g in optimizer.param_groups for p in g["params"] if (e := self.by_shard.get(id(p)))]
        held = {id(e.param) for e in entries}
        if held == set(self.by_param):
            buckets = self.buckets  # the common case, one optimizer over the whole model: the reduction's buckets
        else:  # the same buckets restricted to this optimizer's parameters: the same order on every rank
            buckets = []
            for b in self.buckets:
                mine = [e for e in b.params if id(e.param) in held]
                if mine:
                    buckets.append(_Bucket(mine, sum(e.seg_numel for e in mine)))
        self._stepped_by[id(optimizer)] = (entries, buckets)
        return entries

