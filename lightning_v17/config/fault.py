"""The fault-tolerance policy: replica groups that keep training when one of them fails (torch-free).

``V17Strategy(dp_replicate=R, dp_shard=S, fault_tolerance=FTPolicy(...))`` runs each of the ``R`` replica groups as
its own job of ``S`` ranks; torchft's lighthouse and per-rank ``Manager`` own the replicate axis, so that a failed
group is dropped from the step's quorum instead of ending the run (``lightning_v17/resilience/ft.py``,
``docs/resilience.md``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from lightning_v17.config.errors import V17ConfigError

__all__ = ["FTPolicy"]

LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"
REPLICA_ID_ENV = "REPLICA_GROUP_ID"


@dataclass(frozen=True)
class FTPolicy:
    """Fault-tolerant replica groups on torchft (Manager, lighthouse and its reconfigurable gloo process group).

    Args:
        min_replicas: the fewest replica groups a step may commit with; below it the step is not committed and the
            survivors wait for a replacement (torchft's ``min_replica_size``).
        lighthouse: the lighthouse's address, ``http://host:port``; None: the ``TORCHFT_LIGHTHOUSE`` environment
            variable where the job runs. Start it with ``torchft_lighthouse --min_replicas 1 --join_timeout_ms ...``.
        replica_id: this replica group's name, the same on each of its ranks and different between groups; a
            replacement takes the name of the group it replaces. None: the ``REPLICA_GROUP_ID`` environment
            variable.
        timeout: seconds for the cross-replica collectives, the commit vote and the state transfer to a replacement
            (torchft's ``timeout``); a peer that stops answering for longer is dropped at that step.
        quorum_timeout: seconds a step waits for its quorum (longer than a step; ``quorum_timeout``).
        connect_timeout: seconds to reach the lighthouse and the group's manager server (``connect_timeout``).
        heartbeat_interval: seconds between a group's heartbeats to the lighthouse; the lighthouse drops a group
            silent for its ``--heartbeat_timeout_ms``.
        init_sync: the replicas copy the first step's weights from one of them before training (torchft's
            ``init_sync``); False when every replica seeds its weights identically.
    """

    min_replicas: int = 1
    lighthouse: str | None = None
    replica_id: str | None = None
    timeout: float = 30.0
    quorum_timeout: float = 120.0
    connect_timeout: float = 30.0
    heartbeat_interval: float = 0.1
    init_sync: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.min_replicas, int) or self.min_replicas < 1:
            raise V17ConfigError(f"FTPolicy(min_replicas={self.min_replicas!r}) must be an int >= 1")
        for name in ("timeout", "quorum_timeout", "connect_timeout", "heartbeat_interval"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or value <= 0:
                raise V17ConfigError(f"FTPolicy({name}={value!r}) must be a positive number of seconds")

    def lighthouse_address(self) -> str:
        """The lighthouse address, from the field or ``TORCHFT_LIGHTHOUSE``; raises when neither is set."""
        addr = self.lighthouse or os.environ.get(LIGHTHOUSE_ENV)
        if not addr:
            raise V17ConfigError(
                f"FTPolicy(lighthouse=None) and {LIGHTHOUSE_ENV} is not set: start `torchft_lighthouse` and pass its "
                f"address (http://host:port) as FTPolicy(lighthouse=...) or in {LIGHTHOUSE_ENV}"
            )
        return addr

    def replica_name(self) -> str:
        """This replica group's name, from the field or ``REPLICA_GROUP_ID``; raises when neither is set."""
        name = self.replica_id if self.replica_id is not None else os.environ.get(REPLICA_ID_ENV)
        if name is None or str(name) == "":
            raise V17ConfigError(
                f"FTPolicy(replica_id=None) and {REPLICA_ID_ENV} is not set: give each replica group its own name "
                f"(the same on all of its ranks), e.g. {REPLICA_ID_ENV}=0 for the first group"
            )
        return str(name)
