"""Pipeline parallelism (Narayanan 2021, Qi 2023): cutting a model into stages (``split``), the schedule runtime
(``runtime``), the last stage's loss (``loss``) and per-action timing (``timing``)."""

from lightning_v17.engine.pipeline.loss import PipelineLoss
from lightning_v17.engine.pipeline.runtime import (
    BubbleTimer,
    PeerFailureWatch,
    PipelineLayout,
    PipelineRuntime,
    StageModule,
    balanced_split_points,
    build_schedule,
    pipeline_eval,
    pipeline_step,
    replay_actions,
    split_model,
)

__all__ = [
    "BubbleTimer",
    "PeerFailureWatch",
    "PipelineLayout",
    "PipelineLoss",
    "PipelineRuntime",
    "StageModule",
    "balanced_split_points",
    "build_schedule",
    "pipeline_eval",
    "pipeline_step",
    "replay_actions",
    "split_model",
]
