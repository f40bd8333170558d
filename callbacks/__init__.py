"""V17 callbacks, installed as ``lightning_v17.callbacks`` (setuptools package-dir maps this folder there)."""

if __name__ != "lightning_v17.callbacks":  # pragma: no cover - guards against `import callbacks`
    raise ImportError(
        f"this folder must be imported as 'lightning_v17.callbacks', not {__name__!r}; "
        "install the package (`pip install -e .`) and import it absolutely"
    )

from lightning_v17.callbacks.async_checkpoint import AsyncCheckpoint
from lightning_v17.callbacks.bad_steps import BadStepError, BadStepGuard, BadStepRollback
from lightning_v17.callbacks.goodput import GoodputMonitor
from lightning_v17.callbacks.loss_scaling import DynamicLossScaling, LossScaleError
from lightning_v17.callbacks.memory import MemoryBuckets
from lightning_v17.callbacks.moe import ExpertLoadMonitor, RouterCollapseError, RouterCollapseWarning
from lightning_v17.callbacks.straggler import StragglerDetected, StragglerDetector
from lightning_v17.callbacks.throughput import ThroughputMonitor

__all__: list[str] = [
    "AsyncCheckpoint",
    "BadStepError",
    "BadStepGuard",
    "BadStepRollback",
    "DynamicLossScaling",
    "ExpertLoadMonitor",
    "GoodputMonitor",
    "LossScaleError",
    "MemoryBuckets",
    "RouterCollapseError",
    "RouterCollapseWarning",
    "StragglerDetected",
    "StragglerDetector",
    "ThroughputMonitor",
]
