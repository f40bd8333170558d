"""``v17 plan --config run.yaml``: the planner's inputs read from the Lightning CLI YAML that ``v17 fit`` trains.

Torch-free: the YAML is read with ``yaml.safe_load``, never instantiated. Several ``--config`` files merge the way
jsonargparse merges them (lightning_v17/trainer_cli.py is a ``LightningCLI``): later files override earlier ones key
by key inside mappings; a list, a scalar, or a ``class_path`` section whose class changes is replaced as a whole.

What is read (everything else, callbacks and loggers included, does not change the plan):

- ``trainer``: ``accelerator`` (cpu -> the ``cpu`` row of the accelerator table), ``devices`` x ``num_nodes`` (the
  world size; ``devices`` is the devices per node), ``precision``, ``accumulate_grad_batches``, and ``strategy``:
  ``V17Strategy``'s ``init_args`` (``zero_stage``/``zero``, ``activation_checkpointing``, ``dp_replicate``,
  ``dp_shard``, ``tp``/``pp``/``cp``/``ep`` as a size or a policy's fields, ``offload``, ``fp8``, ``config``), one of
  its registry aliases (``v17``, ``v17_zero1``/``2``/``3``, ``v17_zero3_offload``), or ``ddp`` (ZeRO-0).
- ``model`` (``LlamaLM``): the preset ``model`` and its ``model_overrides`` (``ModelConfig`` field names).
- ``data`` (``PackedDataModule``): ``seq_len`` and ``batch_size``, the rows per rank and micro-batch.

The batch follows V17Strategy: without a pipeline each rank's ``batch_size`` rows are one micro-batch and
``accumulate_grad_batches`` the micro-batches per step; with pp > 1 the schedule splits each rank's rows into
``pp.microbatches`` micro-batches (``emit.py`` writes the same mapping the other way).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

import yaml

from lightning_v17.config import (
    CPMode,
    CPPolicy,
    EPPolicy,
    OffloadPolicy,
    PipelinePolicy,
    Precision,
    Recompute,
    TPPolicy,
    TrainingPolicy,
    V17ConfigError,
    ZeroPolicy,
)
from lightning_v17.planner.model import get_preset, with_overrides
from lightning_v17.planner.specs import ClusterSpec, ModelSpec, TrainSpec

#: V17Strategy's class paths (the package re-exports it) and registry aliases -> the ``init_args`` each alias gives
STRATEGY_CLASSES = ("lightning_v17.strategies.V17Strategy", "lightning_v17.strategies.v17.V17Strategy",
                    "lightning_v17.V17Strategy")  # fmt: skip
STRATEGY_ALIASES: dict[str, dict[str, Any]] = {
    "v17": {"zero_stage": 3}, "v17_zero1": {"zero_stage": 1}, "v17_zero2": {"zero_stage": 2},
    "v17_zero3": {"zero_stage": 3}, "v17_zero3_offload": {"zero_stage": 3, "offload": {"params": "cpu"}},
    "ddp": {"zero_stage": 0}, "auto": {"zero_stage": 0},
}  # fmt: skip
#: ``LlamaLM(model_overrides=...)`` keys (``ModelConfig`` fields) -> the planner's ``ModelShape`` fields
_MODEL_CONFIG_TO_SHAPE = {"vocab_size": "vocab", "hidden": "hidden", "layers": "layers", "heads": "heads",
                          "kv_heads": "kv_heads", "ffn": "ffn", "max_seq_len": "seq", "rope_theta": "rope_theta",
                          "tie_embeddings": "tie_embeddings", "num_experts": "num_experts",
                          "experts_per_token": "experts_per_token", "expert_ffn": "expert_ffn",
                          "shared_experts": "shared_experts", "dense_layers": "dense_layers"}  # fmt: skip
#: ``PackedDataModule``'s defaults for what the plan reads (lightning_v17/data/datamodule.py)
DATA_DEFAULTS = {"seq_len": 512, "batch_size": 8}


def merge(base: Any, override: Any) -> Any:
    """``override`` applied over ``base`` as jsonargparse applies a later ``--config``: mappings merge key by key,
    a ``class_path`` section whose class changes is replaced, anything else (lists, scalars) is replaced."""
    if not (isinstance(base, Mapping) and isinstance(override, Mapping)):
        return override
    if "class_path" in override and "class_path" in base and override["class_path"] != base["class_path"]:
        return dict(override)
    out = dict(base)
    for key, value in override.items():
        out[key] = merge(out[key], value) if key in out else value
    return out


def load_configs(paths: Sequence[str | Path]) -> dict[str, Any]:
    """The merged document of ``paths`` (in order, later files win).

    Raises:
        V17ConfigError: a file that is missing, is not YAML, or whose top level is not a mapping.
    """
    doc: dict[str, Any] = {}
    for path in paths:
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise V17ConfigError(f"--config {path}: cannot read it ({exc.strerror or exc})") from None
        try:
            part = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise V17ConfigError(f"--config {path}: not valid YAML ({' '.join(str(exc).split())})") from None
        if part is None:
            continue
        if not isinstance(part, Mapping):
            raise V17ConfigError(f"--config {path}: the top level must be a mapping (trainer:, model:, data:), "
                                 f"not {type(part).__name__}")  # fmt: skip
        doc = merge(doc, part)
    return doc


def _section(doc: Mapping[str, Any], key: str, where: str) -> dict[str, Any]:
    """``doc[key]`` as a mapping of arguments: its ``init_args`` when written as ``class_path``/``init_args``."""
    value = doc.get(key)
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise V17ConfigError(f"{where}{key}: expected a mapping of arguments, got {value!r}")
    if "class_path" in value:
        return {**dict(value.get("init_args") or {}), **{k: v for k, v in value.items()
                                                         if k not in ("class_path", "init_args")}}  # fmt: skip
    return dict(value)


def _policy(value: Any, cls: type, option: str) -> Any:
    """A policy from the YAML mapping of its fields (what ``V17Strategy`` takes), or None when not given."""
    if value is None or isinstance(value, cls):
        return value
    if not isinstance(value, Mapping):
        raise V17ConfigError(f"strategy {option}={value!r} must be the mapping of {cls.__name__}'s fields")
    names = [f.name for f in fields(cls)]
    unknown = sorted(set(value) - set(names))
    if unknown:
        raise V17ConfigError(f"strategy {option}: {unknown} not fields of {cls.__name__}; its fields are {names}")
    return cls(**value)


def _axis(value: Any, cls: type, option: str) -> tuple[int, Any]:
    """An axis argument (a size, or its policy's fields with the size inside) -> (size, policy or None)."""
    if value is None:
        return 1, None
    if isinstance(value, int) and not isinstance(value, bool):
        return value, None
    policy = _policy(value, cls, option)
    return policy.size, policy


def _strategy_args(trainer: Mapping[str, Any]) -> dict[str, Any]:
    """``trainer.strategy`` as V17Strategy's ``init_args`` (an alias expanded to the arguments it stands for)."""
    strategy = trainer.get("strategy", "auto")
    if isinstance(strategy, str):
        key = strategy.strip().lower()
        if key not in STRATEGY_ALIASES:
            raise V17ConfigError(f"trainer.strategy: {strategy!r} cannot be planned; use V17Strategy "
                                 f"(class_path: {STRATEGY_CLASSES[0]}) or one of {', '.join(STRATEGY_ALIASES)}")
        return dict(STRATEGY_ALIASES[key])
    if not isinstance(strategy, Mapping):
        raise V17ConfigError(f"trainer.strategy: expected a name or class_path/init_args, got {strategy!r}")
    path = strategy.get("class_path")
    if path not in STRATEGY_CLASSES:
        raise V17ConfigError(f"trainer.strategy: class_path {path!r} cannot be planned; the planner reads "
                             f"{STRATEGY_CLASSES[0]}'s init_args")  # fmt: skip
    return dict(strategy.get("init_args") or {})


def _world(trainer: Mapping[str, Any]) -> tuple[int, int]:
    """(world size, devices per node) from ``trainer.devices`` x ``trainer.num_nodes``."""
    devices, nodes = trainer.get("devices", 1), trainer.get("num_nodes", 1)
    if isinstance(devices, (list, tuple)):
        devices = len(devices)
    if isinstance(devices, str) and devices.strip().isdigit():
        devices = int(devices)
    for name, value in (("devices", devices), ("num_nodes", nodes)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise V17ConfigError(f"trainer.{name}={value!r}: the planner needs a positive number of devices "
                                 f"(\"auto\" and -1 depend on the machine; write the count)")  # fmt: skip
    return devices * nodes, devices


def _model(model_args: Mapping[str, Any]) -> ModelSpec:
    name = model_args.get("model", "tiny")
    try:
        shape = get_preset(name)
    except V17ConfigError as exc:
        raise V17ConfigError(f"model.model: {exc}") from None
    overrides = dict(model_args.get("model_overrides") or {})
    unknown = sorted(set(overrides) - set(_MODEL_CONFIG_TO_SHAPE))
    if unknown:
        raise V17ConfigError(f"model.model_overrides: {unknown} are not planned; the planner reads "
                             f"{sorted(_MODEL_CONFIG_TO_SHAPE)}")  # fmt: skip
    shape = with_overrides(shape, **{_MODEL_CONFIG_TO_SHAPE[k]: v for k, v in overrides.items()})
    return ModelSpec(shape=shape, name=str(name).strip().lower() if not overrides else "custom")


def job_specs(doc: Mapping[str, Any], *, cluster: ClusterSpec | None = None,
              train: TrainSpec | None = None) -> tuple[ModelSpec, ClusterSpec, TrainSpec]:
    """The model, cluster and fully fixed layout of the job ``doc`` describes (a merged ``v17 fit`` config).

    Args:
        doc: the merged YAML (:func:`load_configs`).
        cluster: the cluster flags (link bandwidths, capacities); its ``gpu``, ``gpus`` and ``gpus_per_node`` are
            replaced by the config's unless the trainer runs on GPUs, whose model the YAML does not name.
        train: the training flags the YAML does not give (``mfu``, ``op_times``, ...); its layout sizes are replaced.

    Raises:
        V17ConfigError: what the planner cannot read, with the option's path in the YAML (``model.model: unknown
            model preset 'x'``, ``trainer.strategy: ...``), or a layout the world size does not divide.
    """
    cluster = cluster or ClusterSpec()
    train = train or TrainSpec()
    trainer = _section(doc, "trainer", "")
    args = _strategy_args(trainer)
    known = {"zero_stage", "activation_checkpointing", "dp_replicate", "dp_shard", "tp", "pp", "cp", "ep", "zero",
             "offload", "fp8", "config", "process_group_backend", "timeout", "hang_timeout", "loss_normalization"}
    unknown = sorted(set(args) - known)
    if unknown:
        raise V17ConfigError(f"trainer.strategy.init_args: {unknown} are not V17Strategy arguments")
    base = TrainingPolicy()
    if args.get("config") is not None:
        from lightning_v17.config.deepspeed import from_deepspeed_config

        base = from_deepspeed_config(args["config"])
    zero = _policy(args.get("zero"), ZeroPolicy, "zero")
    if zero is not None and args.get("zero_stage") is not None:
        raise V17ConfigError("trainer.strategy.init_args: zero_stage and zero both set the ZeRO stage; give it once")
    if zero is None:
        stage = args.get("zero_stage")
        zero = ZeroPolicy(stage=base.zero.stage if stage is None else stage)
    offload = _policy(args.get("offload"), OffloadPolicy, "offload") or base.offload
    tp, tp_policy = _axis(args.get("tp"), TPPolicy, "tp")
    pp, pp_policy = _axis(args.get("pp"), PipelinePolicy, "pp")
    cp, cp_policy = _axis(args.get("cp"), CPPolicy, "cp")
    ep, _ = _axis(args.get("ep"), EPPolicy, "ep")
    pipeline = pp_policy or base.pipeline
    checkpointing = args.get("activation_checkpointing")
    recompute = base.recompute if checkpointing is None else Recompute.parse(checkpointing)
    fp8 = args.get("fp8")
    fp8 = fp8.get("recipe", "tensorwise") if isinstance(fp8, Mapping) else (fp8 or None)

    world, per_node = _world(trainer)
    replicate = args.get("dp_replicate", 1)
    shard = args.get("dp_shard", "auto")
    dp = world // (tp * pp * cp) if world % (tp * pp * cp) == 0 else 0
    if dp == 0:
        raise V17ConfigError(f"trainer: {world} devices are not a multiple of tp x pp x cp = {tp * pp * cp}")
    if shard != "auto" and replicate * shard != dp:
        raise V17ConfigError(f"trainer.strategy.init_args: dp_replicate x dp_shard = {replicate} x {shard} != "
                             f"{dp}, the devices left by tp x pp x cp ({world} / {tp * pp * cp})")  # fmt: skip

    data = _section(doc, "data", "")
    seq = data.get("seq_len", DATA_DEFAULTS["seq_len"])
    rows = data.get("batch_size", DATA_DEFAULTS["batch_size"])
    accumulate = trainer.get("accumulate_grad_batches", 1) or 1
    if pp > 1:
        if rows % pipeline.microbatches:
            raise V17ConfigError(f"data.batch_size={rows} is not a multiple of the pipeline's microbatches="
                                 f"{pipeline.microbatches}")  # fmt: skip
        micro_batch, microbatches = rows // pipeline.microbatches, pipeline.microbatches * accumulate
    else:
        micro_batch, microbatches = rows, accumulate
    accelerator = str(trainer.get("accelerator", "auto")).strip().lower()
    if accelerator != "cpu" and cluster.gpu == "cpu":
        raise V17ConfigError(f"trainer: accelerator {accelerator!r} with --gpu cpu; name the GPU with --gpu "
                             f"(default {ClusterSpec().gpu}) or set accelerator: cpu")  # fmt: skip
    gpu = "cpu" if accelerator == "cpu" else cluster.gpu
    nvme_path = cluster.nvme_path if cluster.nvme_path != "." or not offload.nvme_path else offload.nvme_path
    precision = Precision.parse(trainer.get("precision", base.precision or "32-true"), "precision")

    model = _model(_section(doc, "model", ""))
    cluster = replace(cluster, gpu=gpu, gpus=world, gpus_per_node=per_node, nvme_path=nvme_path)
    train = replace(
        train, tp=tp, pp=pp, cp=cp, dp=dp, ep=ep, dp_replicate=replicate, sp=bool(tp_policy.sequence_parallel) if tp_policy else False,
        zero=zero, precision=precision, micro_batch=micro_batch, seq=seq, global_batch=None, microbatches=microbatches,
        recompute=recompute, schedule=pipeline.schedule, virtual_stages=pipeline.virtual_stages,
        offload_optimizer=offload.optimizer, offload_params=offload.params, offload_activations=offload.activations,
        resident_blocks=offload.resident_blocks, fp8=fp8,
        cp_mode=CPMode.parse(cp_policy.mode if cp_policy else "auto", "cp.mode"),
    )  # fmt: skip
    return model, cluster, train


__all__ = ["DATA_DEFAULTS", "STRATEGY_ALIASES", "STRATEGY_CLASSES", "job_specs", "load_configs", "merge"]
