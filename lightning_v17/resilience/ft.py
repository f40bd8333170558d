"""Fault-tolerant replica groups on torchft: a failed group is dropped at the step it fails, a replacement heals from
a live peer. Lightning-free; ``strategies/_fault.py`` adapts it to ``V17Strategy``.

Each replica group (its data-parallel shard ranks, with any ZeRO stage inside) is its own job with its own process
group. torchft owns the replicate axis (Lightning-free torchft 0.2.0, Meta's "fault tolerant HSDP"): every rank runs
a ``torchft.Manager`` whose group rank 0 serves the group to the lighthouse; at each step the manager asks the
lighthouse for a quorum of the live groups and reconfigures a gloo process group over the same shard rank of every
participating group. A step then

1. starts the quorum before the batch is chosen (synchronously: a replacement heals there, before its forward);
2. trains this group's share of the step's samples (:func:`step_samples`: the position is the count of committed
   batches, part of torchft's own state, so a replacement receives it with the weights);
3. averages each local gradient shard over the participating groups (:meth:`FTReplica.average_gradients`);
4. steps the optimizer only when every rank of the group votes to commit (``Manager.should_commit``): an error in a
   cross-replica collective (a peer died) makes the vote fail, the step is not committed anywhere it failed, and
   the next step's quorum leaves the dead group out. Its samples are re-drawn from the committed position, so every
   sample is trained once and the survivors' global batch shrinks to their share.

A replacement started under a failed group's ``replica_id`` joins at the next quorum: torchft sends it the live
peer's state (this module's :func:`local_state`: the local parameter and optimizer-state shards, the optimizer's
hyperparameters, the schedulers) through its HTTP checkpoint transport, from memory, and it trains in lockstep from
that step on.
"""

from __future__ import annotations

import collections
import functools
import importlib
import time
from collections.abc import Callable, Iterable, Sequence
from datetime import timedelta
from typing import Any

import torch
from torch import nn

from lightning_v17.config.fault import FTPolicy

__all__ = ["FTReplica", "load_local_state", "local_state", "start_lighthouse", "step_samples"]


def _torchft(module: str = "torchft") -> Any:
    """``import module`` from torchft, or an error that names the extra that installs it."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as err:
        if err.name != "torchft":
            raise
        raise ModuleNotFoundError(
            "V17Strategy(fault_tolerance=FTPolicy(...)) needs torchft, which is not installed; install it with "
            "pip install 'lightning-v17[ft]'", name="torchft",
        ) from err  # fmt: skip


def start_lighthouse(
    *, min_replicas: int = 1, join_timeout_ms: int = 60_000, heartbeat_timeout_ms: int = 1000, quorum_tick_ms: int = 50
) -> Any:
    """A torchft lighthouse in this process (``torchft_lighthouse`` runs the same server as its own program).

    ``heartbeat_timeout_ms``: how long a silent group stays a member; it bounds the time from a failure to the
    survivors' next step. ``join_timeout_ms``: how long a quorum waits for a live group that has not asked yet; keep
    it above the longest step, or a group still stepping is left out, steps alone and heals later.
    Returns the server; ``server.address()`` is what ``FTPolicy(lighthouse=...)`` takes, ``server.shutdown()`` ends it.
    """
    return _torchft("torchft._torchft").LighthouseServer(bind="[::]:0", min_replicas=min_replicas, join_timeout_ms=join_timeout_ms,
                            quorum_tick_ms=quorum_tick_ms, heartbeat_timeout_ms=heartbeat_timeout_ms)  # fmt: skip


def step_samples(
    position: int, *, replica_rank: int, dp_rank: int, dp_size: int, per_rank: int, num_samples: int
) -> list[int]:
    """The dataset indices one rank trains at a step: the step's samples start at ``position`` (samples committed
    so far) and are dealt ``per_rank`` to each rank, participating replica group by group (``replica_rank``) and
    shard rank by shard rank inside it; an index past the dataset wraps into the next epoch."""
    start = position + (replica_rank * dp_size + dp_rank) * per_rank
    return [(start + j) % num_samples for j in range(per_rank)]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def local_state(module: nn.Module, optimizers: Sequence[torch.optim.Optimizer], schedulers: Sequence[Any]) -> dict:
    """This rank's training state as plain tensors (the local shards of DTensors), for torchft's transport."""
    return {
        "params": {n: _local(p.detach()).clone() for n, p in module.named_parameters()},
        "optimizers": [
            {
                "groups": [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups],
                "state": [
                    {k: (_local(v).clone() if isinstance(v, torch.Tensor) else v) for k, v in opt.state[p].items()}
                    for g in opt.param_groups
                    for p in g["params"]
                ],
            }
            for opt in optimizers
        ],
        "schedulers": [{k: v for k, v in s.state_dict().items() if not callable(v)} for s in schedulers],
    }


def _init_state(opt: torch.optim.Optimizer, step: Callable[[], Any]) -> None:
    """Create an optimizer's state where it has none yet (a replacement that never stepped): one step of zero
    gradients at lr 0, as ``torch.distributed.checkpoint.state_dict`` does before loading into a fresh optimizer."""
    params = [p for g in opt.param_groups for p in g["params"] if p.requires_grad]
    if any(opt.state.get(p) for p in params):
        return
    saved = [p.grad for p in params]
    lrs = [g["lr"] for g in opt.param_groups]
    for p in params:
        p.grad = torch.zeros_like(p)
    for g in opt.param_groups:
        g["lr"] = 0.0
    step()
    for g, lr in zip(opt.param_groups, lrs):
        g["lr"] = lr
    for p, grad in zip(params, saved):
        p.grad = grad


def load_local_state(
    state: dict,
    module: nn.Module,
    optimizers: Sequence[torch.optim.Optimizer],
    schedulers: Sequence[Any],
    inner_steps: Sequence[Callable[[], Any]],
) -> None:
    """Copy a peer's :func:`local_state` into this rank's shards, in place (the same layout on both)."""
    with torch.no_grad():
        mine = dict(module.named_parameters())
        if set(mine) != set(state["params"]):
            raise RuntimeError("the live peer's parameters differ from this replica's: the same model is required")
        for name, p in mine.items():
            _local(p).copy_(state["params"][name])
        for opt, got, step in zip(optimizers, state["optimizers"], inner_steps):
            _init_state(opt, step)
            for g, hyper in zip(opt.param_groups, got["groups"]):
                g.update(hyper)
            params = [p for g in opt.param_groups for p in g["params"]]
            for p, entries in zip(params, got["state"]):
                for k, v in entries.items():
                    cur = opt.state[p].get(k)
                    if isinstance(cur, torch.Tensor) and isinstance(v, torch.Tensor):
                        _local(cur).copy_(v)
                    else:
                        opt.state[p][k] = v
    for sched, sd in zip(schedulers, state["schedulers"]):
        sched.load_state_dict(sd)


class FTReplica:
    """One rank's torchft ``Manager`` and what a step asks of it (module docstring).

    Args:
        policy: the :class:`~lightning_v17.config.FTPolicy`.
        group_rank: this rank in its replica group; group_world_size: the group's size.
        store_addr, store_port: the group's own TCPStore (its ``MASTER_ADDR``/``MASTER_PORT``).
        state_dict, load_state_dict: this rank's state for a replacement, and how to take a peer's.
    """

    def __init__(
        self,
        policy: FTPolicy,
        *,
        group_rank: int,
        group_world_size: int,
        store_addr: str,
        store_port: int,
        state_dict: Callable[[], dict],
        load_state_dict: Callable[[dict], None],
    ) -> None:
        torchft = _torchft()
        Manager, ProcessGroupGloo = torchft.Manager, torchft.ProcessGroupGloo
        self._healed = False

        def load(state: dict) -> None:
            load_state_dict(state)
            self._healed = True

        timeout = timedelta(seconds=policy.timeout)
        self.pg = ProcessGroupGloo(timeout=timeout)
        self.manager = Manager(
            pg=self.pg, load_state_dict=load, state_dict=state_dict, min_replica_size=policy.min_replicas,
            use_async_quorum=False, timeout=timeout, quorum_timeout=timedelta(seconds=policy.quorum_timeout),
            connect_timeout=timedelta(seconds=policy.connect_timeout), rank=group_rank, world_size=group_world_size,
            store_addr=store_addr, store_port=store_port, lighthouse_addr=policy.lighthouse_address(),
            replica_id=policy.replica_name(), heartbeat_interval=timedelta(seconds=policy.heartbeat_interval),
            init_sync=policy.init_sync,
        )  # fmt: skip
        #: the last 1000 step attempts: quorum time, participants, replica rank, position, committed, healed
        self.history: collections.deque[dict[str, Any]] = collections.deque(maxlen=1000)
        self.committed = True  # the last step's vote (schedulers advance only on committed steps)

    # ------------------------------------------------------------------ a step
    def begin_step(self) -> tuple[int, int]:
        """Start the step's quorum (a replacement heals here) -> (replica rank among the participants, count)."""
        self._healed = False
        self.manager.start_quorum()
        rank = self.manager.participating_rank()
        n = self.manager.num_participants()
        self.history.append({
            "quorum_time": time.time(), "participants": n, "replica_rank": rank, "position": self.position_batches(),
            "step": self.manager.current_step(), "committed": None, "healed": self._healed,
        })  # fmt: skip
        return (0 if rank is None else rank), n

    def position_batches(self) -> int:
        """Replica-group batches committed so far (torchft's ``batches_committed``: participants summed over steps)."""
        return self.manager.batches_committed()

    def allreduce_sum(self, value: float) -> float:
        """``value`` summed over the participating groups (unchanged if the collective failed: the step will not
        commit)."""
        from torch.distributed import ReduceOp

        t = torch.tensor([value], dtype=torch.float64)
        self.manager.allreduce(t, reduce_op=ReduceOp.SUM).wait()
        return float(t[0])

    def average_gradients(self, params: Iterable[nn.Parameter]) -> None:
        """Each local gradient shard averaged over the participating groups, in one flat collective."""
        grads = [_local(p.grad) for p in params if p.grad is not None]
        if not grads:
            return
        dtype = functools.reduce(torch.promote_types, (g.dtype for g in grads), torch.float32)  # bf16 sums in fp32
        flat = torch.cat([g.reshape(-1).to(dtype) for g in grads])
        self.manager.allreduce(flat).wait()
        offset = 0
        with torch.no_grad():
            for g in grads:
                n = g.numel()
                g.copy_(flat[offset : offset + n].view_as(g))
                offset += n

    def should_commit(self) -> bool:
        """The group's vote: True only when every rank of this group finished the step's collectives."""
        self.committed = bool(self.manager.should_commit())
        if self.history:
            self.history[-1]["committed"] = self.committed
        return self.committed

    def shutdown(self) -> None:
        """Stop serving the group (its heartbeats end: the lighthouse drops it) and leave the replica group."""
        try:
            self.pg.abort()
        finally:
            self.manager.shutdown(wait=False)
