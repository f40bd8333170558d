"""Resilience: the step watchdog (``watchdog``), a failing peer ending the others (``peer_failure``), elastic
restarts under torchrun (``elastic``), fault-tolerant replica groups on torchft (``ft``) and the in-process restart
of the only replica (``inprocess``)."""

from lightning_v17.resilience.elastic import agree_on_generation, elastic_attempt, init_elastic_process_group
from lightning_v17.resilience.ft import FTReplica, load_local_state, local_state, start_lighthouse, step_samples
from lightning_v17.resilience.inprocess import InProcessContext, InProcessLauncher, run_in_process
from lightning_v17.resilience.peer_failure import PeerFailureWatch
from lightning_v17.resilience.watchdog import HANG_EXIT_CODE, StepWatchdog, current_collective

__all__ = [
    "HANG_EXIT_CODE",
    "FTReplica",
    "InProcessContext",
    "InProcessLauncher",
    "PeerFailureWatch",
    "StepWatchdog",
    "agree_on_generation",
    "current_collective",
    "elastic_attempt",
    "init_elastic_process_group",
    "load_local_state",
    "local_state",
    "run_in_process",
    "start_lighthouse",
    "step_samples",
]
