"""Pure (Lightning-free) trackers behind the callbacks in ``lightning_v17.callbacks``.

One module per concern, each tested alone in tests/unit:

- :mod:`.loss_scale`: the dynamic loss-scale state machine (its tensor side is
  :class:`lightning_v17.engine.precision.ShardedLossScaler`).
- :mod:`.straggler`: windowed per-rank timing statistics (median / MAD) and patience-based flagging.
- :mod:`.throughput`: tokens/s, FLOP/s and MFU arithmetic, and the cached CPU matmul peak probe.
- :mod:`.moe`: per-expert load statistics of MoE layers and the router-collapse rule.
- :mod:`.memory`: storage-deduplicated byte counts of params, grads and optimizer state; RSS helpers.
"""

from lightning_v17.trackers.bad_steps import BadStepError, BadStepTracker, BadStepVerdict
from lightning_v17.trackers.goodput import GoodputBreakdown, GoodputTracker
from lightning_v17.trackers.loss_scale import LossScaleError, LossScaleTracker
from lightning_v17.trackers.memory import (
    MeasuredBytes,
    StorageCounter,
    bar_chart,
    measure_model_state,
    optimizer_state_tensors,
    peak_rss_bytes,
    reset_peak_rss,
    rss_bytes,
)
from lightning_v17.trackers.moe import CollapseEvent, ExpertLoadReport, ExpertLoadStats, ExpertLoadTracker, load_stats
from lightning_v17.trackers.straggler import (
    MAD_TO_SIGMA,
    RankWindowStats,
    StragglerReport,
    StragglerTracker,
    mad,
    median,
    quantile,
)
from lightning_v17.trackers.throughput import (
    StepSample,
    ThroughputStats,
    ThroughputTracker,
    mfu,
    probe_peak_flops_per_s,
)

__all__ = [
    "MAD_TO_SIGMA",
    "BadStepError",
    "BadStepTracker",
    "BadStepVerdict",
    "CollapseEvent",
    "ExpertLoadReport",
    "ExpertLoadStats",
    "ExpertLoadTracker",
    "GoodputBreakdown",
    "GoodputTracker",
    "LossScaleError",
    "LossScaleTracker",
    "MeasuredBytes",
    "RankWindowStats",
    "StepSample",
    "StorageCounter",
    "StragglerReport",
    "StragglerTracker",
    "ThroughputStats",
    "ThroughputTracker",
    "bar_chart",
    "load_stats",
    "mad",
    "measure_model_state",
    "median",
    "mfu",
    "optimizer_state_tensors",
    "peak_rss_bytes",
    "probe_peak_flops_per_s",
    "quantile",
    "reset_peak_rss",
    "rss_bytes",
]
