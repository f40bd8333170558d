"""Resilience: the step watchdog (``watchdog``), a failing peer ending the others (``peer_failure``) and elastic
restarts under torchrun (``elastic``)."""

from lightning_v17.resilience.elastic import agree_on_generation, elastic_attempt, init_elastic_process_group
from lightning_v17.resilience.peer_failure import PeerFailureWatch
from lightning_v17.resilience.watchdog import HANG_EXIT_CODE, StepWatchdog, current_collective

__all__ = [
    "HANG_EXIT_CODE",
    "PeerFailureWatch",
    "StepWatchdog",
    "agree_on_generation",
    "current_collective",
    "elastic_attempt",
    "init_elastic_process_group",
]
