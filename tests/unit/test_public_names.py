"""Every public name (a module's ``__all__``) that was importable before the layout moved into one folder per axis is
importable still: from its module if the module stayed, else from the package its module moved into (whose
``__init__`` re-exports it). The lists were read from the tree before the move."""

from __future__ import annotations

import importlib

import pytest

BEFORE: dict[str, list[str]] = {
    "lightning_v17": [
        "FP8Policy",
        "LossScalePolicy",
        "MeshSpec",
        "OffloadPolicy",
        "PipelinePolicy",
        "Precision",
        "Recompute",
        "Schedule",
        "TPPolicy",
        "TrainingPolicy",
        "V17ConfigError",
        "V17FabricStrategy",
        "V17Strategy",
        "ZeroPolicy",
        "__version__"
    ],
    "lightning_v17.config": [
        "Axis",
        "FP8Backend",
        "FP8Policy",
        "FP8Recipe",
        "HostMemory",
        "LossScalePolicy",
        "MeshSpec",
        "OffloadPolicy",
        "OptimizerKind",
        "PipelinePolicy",
        "Precision",
        "Recompute",
        "Schedule",
        "TPPolicy",
        "Tier",
        "TrainingPolicy",
        "V17ConfigError",
        "ZeroPolicy",
        "check_tp_divides",
        "divisors",
        "parse_enum"
    ],
    "lightning_v17.config_errors": [
        "V17ConfigError",
        "parse_enum"
    ],
    "lightning_v17.config_rules": [
        "Layout",
        "RULES",
        "Rule",
        "check",
        "violations"
    ],
    "lightning_v17.data": [
        "ByteTokenizer",
        "DocumentSource",
        "IGNORE_INDEX",
        "PAD_DOC_ID",
        "PackedDataModule",
        "PackedRowSampler",
        "PackingMode",
        "PackingPlan",
        "Segment",
        "StdlibCorpus",
        "collate_rows",
        "length_stats",
        "materialize_row",
        "pack",
        "padding_fraction"
    ],
    "lightning_v17.deepspeed_config": [
        "DEEPSPEED_NO_EFFECT_KEYS",
        "DEEPSPEED_SUPPORTED_KEYS",
        "from_deepspeed_config"
    ],
    "lightning_v17.engine.checkpoint": [
        "CheckpointCorruptError",
        "FORMAT",
        "TRAINER_STATE_SAFE_GLOBALS",
        "UnsafeCheckpointError",
        "check_dcp_pickles",
        "consolidate",
        "consolidate_main",
        "is_sharded_checkpoint",
        "load_full_state_dict",
        "load_sharded",
        "load_trainer_state",
        "partial_path",
        "save_sharded",
        "verify_checkpoint"
    ],
    "lightning_v17.engine.checkpoint_async": [
        "AsyncSaveError",
        "AsyncShardedSaver",
        "PreallocatedStager",
        "SaveResult"
    ],
    "lightning_v17.engine.clip": [
        "clip_grad_norm_",
        "global_grad_norm"
    ],
    "lightning_v17.engine.collectives": [
        "DeferredReduceScatters",
        "FSDPAllToAllAllGather",
        "FSDPAllToAllReduceScatter",
        "PendingReduceScatter",
        "all_gather",
        "install_fsdp_comms",
        "is_cpu_gloo",
        "map_all_gathers",
        "map_gradient_buffers",
        "reduce_scatter",
        "use_all_to_all"
    ],
    "lightning_v17.engine.elastic": [
        "agree_on_generation",
        "elastic_attempt",
        "init_elastic_process_group"
    ],
    "lightning_v17.engine.fp8": [
        "FP8Runtime",
        "FP8Selection",
        "FP8_DIM_MULTIPLE",
        "apply_fp8",
        "float8_tp_plan",
        "resolve_fp8_backend",
        "select_fp8_linears",
        "transformer_engine_status"
    ],
    "lightning_v17.engine.fp8_delayed": [
        "DEFAULT_AMAX_HISTORY_LEN",
        "DelayedFloat8Linear",
        "convert_to_delayed",
        "update_scales"
    ],
    "lightning_v17.engine.fsdp": [
        "after_optimizer_step",
        "apply_fsdp",
        "deferred_init",
        "find_wrap_units",
        "fsdp_root",
        "has_meta",
        "materialize_meta_module",
        "optimizer_steps_inside",
        "run_as_forward",
        "set_cpu_prefetch",
        "set_requires_gradient_sync"
    ],
    "lightning_v17.engine.host_buffers": [
        "AfterWrite",
        "BufferPool",
        "HEAP_MMAP_THRESHOLD",
        "PooledRead",
        "fix_mmap_threshold",
        "mapped_empty",
        "own_mappings",
        "sole_owner",
        "trim_heap",
        "user_mmap_threshold"
    ],
    "lightning_v17.engine.nvme": [
        "NvmeFileSet",
        "ThreadPoolIO",
        "check_nvme_path",
        "free_margin_bytes",
        "host_buffer",
        "open_io",
        "submit_io"
    ],
    "lightning_v17.engine.nvme_aio": [
        "AioIO",
        "aio_backend_or_reason",
        "prebuild"
    ],
    "lightning_v17.engine.offload": [
        "OptimizerOffload",
        "attach_offload",
        "materialized",
        "offload_of",
        "own_mappings",
        "planned_state_bytes"
    ],
    "lightning_v17.engine.owner_step": [
        "OwnerStep",
        "StepPlan",
        "attach_owner_steps",
        "owner_step_of",
        "plan_step"
    ],
    "lightning_v17.engine.parallelize": [
        "Parallelized",
        "apply_zero_stage",
        "check_composition",
        "parallelize",
        "parallelized",
        "sync_replicas"
    ],
    "lightning_v17.engine.param_offload": [
        "ParamOffload",
        "ReleasedShard"
    ],
    "lightning_v17.engine.param_store": [
        "ReleasedShard",
        "SLOT_ALIGN"
    ],
    "lightning_v17.engine.pipeline": [
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
        "split_model"
    ],
    "lightning_v17.engine.recompute": [
        "SAVED_OPS",
        "apply_activation_checkpointing",
        "selective_policy"
    ],
    "lightning_v17.engine.state_dict": [
        "get_model_state",
        "get_state_dicts",
        "merge_optim",
        "param_group_lists",
        "restore_param_group_lists",
        "set_state_dicts"
    ],
    "lightning_v17.engine.tensor_parallel": [
        "PARALLEL_STYLES",
        "SegmentedColwiseParallel",
        "TPPlan",
        "apply_tensor_parallel",
        "check_tensor_parallel",
        "expand_plan",
        "find_llama_modules",
        "llama_tp_plan",
        "loss_parallel_context",
        "parallel_style"
    ],
    "lightning_v17.engine.trackers.bad_steps": [
        "BadStepError",
        "BadStepTracker",
        "BadStepVerdict"
    ],
    "lightning_v17.engine.trackers.goodput": [
        "GoodputBreakdown",
        "GoodputTracker"
    ],
    "lightning_v17.engine.trackers.loss_scale": [
        "LossScaleError",
        "LossScaleTracker",
        "ShardedLossScaler",
        "optimizer_grads"
    ],
    "lightning_v17.engine.trackers.memory": [
        "MeasuredBytes",
        "StorageCounter",
        "bar_chart",
        "measure_model_state",
        "optimizer_state_tensors",
        "peak_rss_bytes",
        "reset_peak_rss",
        "rss_bytes"
    ],
    "lightning_v17.engine.trackers.straggler": [
        "MAD_TO_SIGMA",
        "RankWindowStats",
        "StragglerReport",
        "StragglerTracker",
        "mad",
        "median",
        "quantile"
    ],
    "lightning_v17.engine.trackers.throughput": [
        "StepSample",
        "ThroughputStats",
        "ThroughputTracker",
        "mfu",
        "probe_peak_flops_per_s"
    ],
    "lightning_v17.engine.watchdog": [
        "HANG_EXIT_CODE",
        "StepWatchdog",
        "current_collective"
    ],
    "lightning_v17.engine.zero": [
        "ZeroEngine",
        "apply_zero",
        "broadcast_module",
        "chunk_rows",
        "is_elementwise_optimizer"
    ],
    "lightning_v17.engine.zero_backend": [
        "ZeroBackend"
    ],
    "lightning_v17.engine.zero_comm": [
        "gather_bucket",
        "pack_grad",
        "pack_rows"
    ],
    "lightning_v17.engine.zero_layout": [
        "PARTITIONS",
        "ShardParameter",
        "chunk_rows",
        "is_elementwise_optimizer",
        "shard_view"
    ],
    "lightning_v17.fp8_policy": [
        "FP8Backend",
        "FP8Policy",
        "FP8Recipe"
    ],
    "lightning_v17.models": [
        "Attention",
        "AttentionBackend",
        "BLOCK_TP_PLAN",
        "FeedForward",
        "Llama",
        "LlamaLM",
        "ModelConfig",
        "RMSNorm",
        "TOP_TP_PLAN",
        "TransformerBlock",
        "cu_seqlens_from_position_ids",
        "varlen_attention"
    ],
    "lightning_v17.models.pp_layouts": [
        "model_pipeline_layout"
    ],
    "lightning_v17.models.tp_plans": [
        "LitGPTAttentionParallel",
        "ModelTPPlan",
        "hf_tp_plan",
        "litgpt_tp_plan",
        "llama_default_roles",
        "model_tp_plan",
        "resolve_tp_plan"
    ],
    "lightning_v17.optim": [
        "Adafactor",
        "Adam8bit",
        "AdamW",
        "CPUAdam",
        "Lion",
        "Lion8bit",
        "LocalShardStep",
        "OptimizerName",
        "build_optimizer",
        "cpu_adam_cached",
        "cpu_adam_unavailable",
        "local_shards",
        "optimizer_class",
        "optimizer_kind_of"
    ],
    "lightning_v17.optim.adafactor": [
        "Adafactor"
    ],
    "lightning_v17.optim.factory": [
        "OptimizerName",
        "bitsandbytes_optimizer_base",
        "build_optimizer",
        "optimizer_class",
        "optimizer_kind_of",
        "planner_kind_of"
    ],
    "lightning_v17.optim.library": [
        "Adam8bit",
        "AdamW",
        "CPUAdam",
        "Lion",
        "Lion8bit",
        "cpu_adam_cached",
        "cpu_adam_unavailable"
    ],
    "lightning_v17.optim.local_shards": [
        "ELEMENTWISE_TORCH_OPTIMIZERS",
        "LocalShardStep",
        "enable_local_step",
        "has_dtensor_params",
        "is_elementwise_optimizer",
        "is_torch_elementwise",
        "local_grad",
        "local_shards",
        "replace_step",
        "step_on_local_shards"
    ],
    "lightning_v17.planner": [
        "ACCELERATORS",
        "Accelerator",
        "Arch",
        "ClusterSpec",
        "ModelShape",
        "ModelSpec",
        "ModelStateBytes",
        "PRESETS",
        "Plan",
        "TrainSpec",
        "activation_bytes_per_layer",
        "daly_interval_s",
        "flops_per_token",
        "get_accelerator",
        "get_preset",
        "make_plan",
        "max_model",
        "model_state_bytes_per_rank",
        "optimizer_bytes_per_param",
        "young_interval_s"
    ],
    "lightning_v17.planner.comm": [
        "Collective",
        "cp_comm_bytes_per_layer",
        "dp_comm_bytes",
        "pp_comm_bytes_per_microbatch",
        "ring_fraction",
        "tp_comm_bytes_per_layer"
    ],
    "lightning_v17.planner.emit": [
        "COMMAND_PREFIX",
        "EmittedConfig",
        "STRATEGY_CLASS",
        "emit_config",
        "recorded_command",
        "write_config"
    ],
    "lightning_v17.planner.hardware": [
        "ACCELERATORS",
        "Accelerator",
        "GB",
        "get_accelerator"
    ],
    "lightning_v17.planner.memory": [
        "ModelStateBytes",
        "activation_bytes_first_stage",
        "activation_bytes_per_layer",
        "activation_bytes_per_layer_of",
        "fp8_activation_delta_bytes_per_layer",
        "fp8_gathered_params",
        "grad_bucket_bytes",
        "grad_bytes_per_param",
        "llama_activation_bytes_per_layer",
        "logits_bytes",
        "microbatches_in_flight",
        "model_state_bytes_per_rank",
        "optimizer_bytes_per_param",
        "optimizer_state_components",
        "param_bytes_per_param",
        "zero3_gather_bytes",
        "zero_of"
    ],
    "lightning_v17.planner.model": [
        "Arch",
        "ModelShape",
        "PRESETS",
        "get_preset",
        "with_overrides"
    ],
    "lightning_v17.planner.model_search": [
        "MaxModel",
        "max_model"
    ],
    "lightning_v17.planner.offload": [
        "OffloadTraffic",
        "TierBytes",
        "offload_traffic_bytes",
        "offload_transfer_s",
        "tier_bytes"
    ],
    "lightning_v17.planner.pipeline": [
        "OpTimes",
        "bubble_fraction"
    ],
    "lightning_v17.planner.plan": [
        "ClusterSpec",
        "Layout",
        "Memory",
        "ModelSpec",
        "Plan",
        "TrainSpec",
        "make_plan",
        "memory_for"
    ],
    "lightning_v17.planner.plot": [
        "BUCKET_COLOURS",
        "MISSING_MATPLOTLIB",
        "PlotDependencyError",
        "bucket_tier_bytes",
        "write_plot"
    ],
    "lightning_v17.planner.recipes": [
        "Recommendation",
        "anti_pattern_warnings",
        "default_microbatches",
        "fit_warning",
        "largest_tp",
        "recommend",
        "rule_warnings"
    ],
    "lightning_v17.planner.report": [
        "bar",
        "bucket_rows",
        "fmt_bytes",
        "render_text",
        "to_dict"
    ],
    "lightning_v17.planner.resilience": [
        "checkpoint_write_s",
        "cluster_mtbf_s",
        "daly_interval_s",
        "expected_goodput",
        "young_interval_s"
    ],
    "lightning_v17.planner.schedules": [
        "Placement",
        "SCHEDULES",
        "ScheduleInfo",
        "schedule_info"
    ],
    "lightning_v17.planner.simulate": [
        "Action",
        "OpTimes",
        "Timeline",
        "dependency",
        "sample_bubbles",
        "schedule_actions",
        "simulate",
        "simulate_schedule",
        "splits_backward"
    ],
    "lightning_v17.planner.throughput": [
        "compute_time_s",
        "flops_per_token",
        "flops_per_token_from_params",
        "mfu_from_step_time"
    ]
}

#: where a moved module's names are importable now
MOVED_TO: dict[str, str | tuple[str, ...]] = {
    "lightning_v17.config_errors": "lightning_v17.config",
    "lightning_v17.config_rules": "lightning_v17.config.rules",
    "lightning_v17.deepspeed_config": "lightning_v17.config",
    "lightning_v17.engine.checkpoint": "lightning_v17.checkpoint",
    "lightning_v17.engine.checkpoint_async": "lightning_v17.checkpoint",
    "lightning_v17.engine.clip": "lightning_v17.engine.precision",
    "lightning_v17.engine.elastic": "lightning_v17.resilience",
    "lightning_v17.engine.fp8": "lightning_v17.engine.fp8",
    "lightning_v17.engine.fp8_delayed": "lightning_v17.engine.fp8",
    "lightning_v17.engine.fsdp": "lightning_v17.engine.zero",
    "lightning_v17.engine.host_buffers": "lightning_v17.engine.offload",
    "lightning_v17.engine.nvme": "lightning_v17.engine.offload",
    "lightning_v17.engine.nvme_aio": "lightning_v17.engine.offload",
    "lightning_v17.engine.offload": "lightning_v17.engine.offload",
    "lightning_v17.engine.owner_step": "lightning_v17.engine.zero",
    "lightning_v17.engine.param_offload": "lightning_v17.engine.offload",
    "lightning_v17.engine.param_store": "lightning_v17.engine.offload",
    "lightning_v17.engine.pipeline": "lightning_v17.engine.pipeline",
    "lightning_v17.engine.state_dict": "lightning_v17.engine.zero",
    "lightning_v17.engine.tensor_parallel": "lightning_v17.engine.tp",
    "lightning_v17.engine.trackers": "lightning_v17.trackers",
    "lightning_v17.engine.trackers.bad_steps": "lightning_v17.trackers",
    "lightning_v17.engine.trackers.goodput": "lightning_v17.trackers",
    "lightning_v17.engine.trackers.loss_scale": ("lightning_v17.trackers", "lightning_v17.engine.precision"),
    "lightning_v17.engine.trackers.memory": "lightning_v17.trackers",
    "lightning_v17.engine.trackers.straggler": "lightning_v17.trackers",
    "lightning_v17.engine.trackers.throughput": "lightning_v17.trackers",
    "lightning_v17.engine.watchdog": "lightning_v17.resilience",
    "lightning_v17.engine.zero": "lightning_v17.engine.zero",
    "lightning_v17.engine.zero_backend": "lightning_v17.engine.zero",
    "lightning_v17.engine.zero_comm": "lightning_v17.engine.zero",
    "lightning_v17.engine.zero_layout": "lightning_v17.engine.zero",
    "lightning_v17.fp8_policy": "lightning_v17.config",
    "lightning_v17.optim.local_shards": "lightning_v17.optim.local_step",
    "lightning_v17.planner.schedules": "lightning_v17.config.schedules"
}


@pytest.mark.parametrize("module", sorted(BEFORE))
def test_public_names_still_importable(module: str) -> None:
    dest = MOVED_TO.get(module, module)
    homes = [importlib.import_module(h) for h in ((dest,) if isinstance(dest, str) else dest)]
    missing = [n for n in BEFORE[module] if not any(hasattr(home, n) for home in homes)]
    assert not missing, f"{module} (now {dest}) lost {missing}"
