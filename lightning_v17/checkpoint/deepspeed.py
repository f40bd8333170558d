"""Read a DeepSpeed ZeRO-1/2/3 checkpoint directory into full (unsharded) tensors, without importing deepspeed.

What ``DeepSpeedEngine.save_checkpoint(save_dir)`` writes (raw DeepSpeed, or Lightning's ``DeepSpeedStrategy`` with
``tag="checkpoint"`` and Lightning's checkpoint dict as ``client_state``)::

    save_dir/latest                                   the tag of the newest save, e.g. "global_step4"
    save_dir/<tag>/mp_rank_00_model_states.pt         stages 0-2: the module state (bf16/fp32 weights), buffers,
                                                      param_shapes, lr_scheduler, step counters, client_state
    save_dir/<tag>/zero_pp_rank_R_mp_rank_00_model_states.pt   stage 3: the same, one per dp rank, with empty
                                                      placeholders for the partitioned weights
    save_dir/<tag>/[bf16_]zero_pp_rank_R_mp_rank_00_optim_states.pt   one per dp rank R: its flat partition of the
                                                      fp32 master weights and of the optimizer moments

Reconstruction follows DeepSpeed's own readers, so that the result is theirs exactly:

* stages 1-2 (``deepspeed/checkpoint/ds_to_universal.py`` ``extract_zero_shards``): each rank's partition of a
  param group's flat buffer holds consecutive fragments of the group's parameters; ``param_slice_mappings`` names
  each fragment's ``start``/``numel`` inside the partition (the alignment padding lies outside every fragment), and
  a parameter is the concatenation of its fragments in rank order. ``param_shapes`` gives its shape.
* stage 3 (``extract_zero_shards_stage3``, ``zero_to_fp32.zero3_partitioned_param_info``): every parameter is split
  on its own into ``ceil(numel / dp)`` elements per rank, the last rank padded; a rank's flat sub-group is its pieces
  of that sub-group's parameters (``param_shapes[i]``) back to back.

Safety: the optimizer files pickle four DeepSpeed classes, so ``torch.load(weights_only=True)`` alone refuses them.
They are read with ``weights_only=True`` and these names mapped to inert stand-ins (:data:`DEEPSPEED_SAFE_GLOBALS`):
plain attribute holders that run no code. Any other class a file names is refused with
:class:`~lightning_v17.checkpoint.safe_load.UnsafeCheckpointError` naming the file and the class, unless the caller
opts in (``safe_globals=[...]``, ``torch.serialization.add_safe_globals``, or ``weights_only=False``).
"""

from __future__ import annotations

import enum
import math
import pickle
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from lightning_v17.checkpoint.safe_load import UnsafeCheckpointError, _weights_only_detail
from lightning_v17.checkpoint.sharded import CheckpointCorruptError

__all__ = [
    "DEEPSPEED_SAFE_GLOBALS",
    "DeepSpeedState",
    "find_deepspeed_tag_dir",
    "is_deepspeed_checkpoint",
    "read_deepspeed_checkpoint",
]


# ----------------------------------------------------------------------------------------------------------------
# inert stand-ins for the DeepSpeed classes its checkpoints pickle
# ----------------------------------------------------------------------------------------------------------------
class LossScalerState:
    """Stand-in for ``deepspeed.runtime.fp16.loss_scaler.LossScaler`` / ``DynamicLossScaler``: unpickling fills its
    ``__dict__`` (``cur_scale``, ``dynamic``, and for the dynamic scaler ``cur_iter``, ``last_overflow_iter``,
    ``scale_factor``, ``scale_window``, ``min_scale``, ``delayed_shift``, ``cur_hysteresis``, ...) and nothing runs."""

    def state(self) -> dict[str, Any]:
        return dict(vars(self))


class ZeroStage(enum.IntEnum):
    """Stand-in for ``deepspeed.runtime.zero.config.ZeroStageEnum`` (pickled as ``ZeroStageEnum(value)``)."""

    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3
    max_stage = 4


@dataclass
class FragmentAddress:
    """Stand-in for ``deepspeed.utils.tensor_fragment.fragment_address``: where one parameter's fragment lies in a
    rank's flat partition (``start`` and ``numel``, in elements)."""

    numel: int = 0
    start: int = 0


DEEPSPEED_SAFE_GLOBALS: list[Any] = [
    (LossScalerState, "deepspeed.runtime.fp16.loss_scaler.LossScaler"),
    (LossScalerState, "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"),
    (ZeroStage, "deepspeed.runtime.zero.config.ZeroStageEnum"),
    (FragmentAddress, "deepspeed.utils.tensor_fragment.fragment_address"),
]
"""The DeepSpeed names admitted by :func:`read_deepspeed_checkpoint`'s ``weights_only`` load, each mapped to an inert
stand-in (measured on the files DeepSpeed 0.19 writes at ZeRO-1/2/3, fp32 and bf16, torch AdamW and
DeepSpeedCPUAdam). They are scoped to that load (``torch.serialization.safe_globals``), never added globally."""

# model-states keys that DeepSpeed itself writes (``DeepSpeedEngine._common_checkpoint_state``); the rest is the
# client_state the caller passed to save_checkpoint (Lightning's checkpoint dict under DeepSpeedStrategy)
_ENGINE_KEYS = frozenset((
    "module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
    "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd", "skipped_steps", "global_steps",
    "global_samples", "dp_world_size", "mp_world_size", "checkpoint_parallel_dimensions", "ds_config", "ds_version",
    "universal_checkpoint_info",
))  # fmt: skip
_OPTIM_RE = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
_MODEL3_RE = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt$")
_MODEL_RE = re.compile(r"^mp_rank_(\d+)_model_states\.pt$")


@dataclass
class DeepSpeedState:
    """A DeepSpeed checkpoint as full tensors, keyed by the parameter names DeepSpeed saved (``module`` FQNs).

    Attributes:
        source: the tag directory that was read (``save_dir/<tag>``).
        saved_stage: the ZeRO stage DeepSpeed wrote, 1, 2 or 3 (0: no ZeRO optimizer files; then only ``weights``
            is filled).
        dp_world_size: the data-parallel size that wrote it (the number of optimizer files).
        bf16: whether DeepSpeed ran bf16 (``bf16_`` optimizer files).
        weights: the module state as DeepSpeed saved it (model dtype): parameters, frozen parameters, buffers;
            at stage 3, where the module file holds only placeholders, the fp32 master cast to the model dtype.
        fp32: the fp32 master weight of every trainable parameter, full shape.
        optim: per trainable parameter the optimizer state: element-wise tensors (``exp_avg``, ``exp_avg_sq``) in
            full shape, scalars (``step``) as saved for its group.
        param_groups: the optimizer's param groups: hyperparameters and ``params`` (the parameter names).
        loss_scaler: ``cur_scale``, ``dynamic`` (and the dynamic scaler's counters), ``dynamic_loss_scale``,
            ``overflow``, as DeepSpeed saved them (rank 0's file).
        lr_scheduler: the scheduler state DeepSpeed saved (None when it managed none, e.g. under Lightning).
        client_state: the ``client_state`` given to ``save_checkpoint`` (Lightning's keys under DeepSpeedStrategy).
        global_steps, skipped_steps, global_samples: DeepSpeed's counters.
        ds_version: the DeepSpeed version that wrote it.
    """

    source: Path
    saved_stage: int
    dp_world_size: int
    bf16: bool
    weights: dict[str, torch.Tensor] = field(default_factory=dict)
    fp32: dict[str, torch.Tensor] = field(default_factory=dict)
    optim: dict[str, dict[str, Any]] = field(default_factory=dict)
    param_groups: list[dict[str, Any]] = field(default_factory=list)
    loss_scaler: dict[str, Any] = field(default_factory=dict)
    lr_scheduler: Any = None
    client_state: dict[str, Any] = field(default_factory=dict)
    global_steps: int = 0
    skipped_steps: int = 0
    global_samples: int = 0
    ds_version: str = ""

    @property
    def written_by_lightning(self) -> bool:
        """Whether Lightning's DeepSpeedStrategy wrote it (its checkpoint dict is the client_state)."""
        return "loops" in self.client_state and "pytorch-lightning_version" in self.client_state


# ----------------------------------------------------------------------------------------------------------------
# finding the files
# ----------------------------------------------------------------------------------------------------------------
def _has_model_states(d: Path) -> bool:
    return d.is_dir() and any(_MODEL_RE.match(p.name) or _MODEL3_RE.match(p.name) for p in d.iterdir())


def is_deepspeed_checkpoint(path: str | Any) -> bool:
    """Whether ``path`` looks like a DeepSpeed checkpoint: a tag directory holding ``*_model_states.pt``, or a
    ``save_dir`` holding DeepSpeed's ``zero_to_fp32.py`` (copied there at every save) or a ``latest`` file that names
    such a tag directory (``AsyncCheckpoint``'s own ``latest`` names V17 checkpoints, which are not this)."""
    p = Path(path)
    if not p.is_dir():
        return False
    if _has_model_states(p) or (p / "zero_to_fp32.py").is_file():
        return True
    latest = p / "latest"
    try:
        return latest.is_file() and _has_model_states(p / latest.read_text().strip())
    except (OSError, UnicodeDecodeError):
        return False


def find_deepspeed_tag_dir(path: str | Any, tag: str | None = None) -> Path:
    """The tag directory to read: ``path/<tag>``, ``path/<content of latest>``, or ``path`` itself."""
    p = Path(path).absolute()
    if tag is not None:
        d = p / tag
        if not _has_model_states(d):
            raise CheckpointCorruptError(f"{d} holds no *_model_states.pt: tag={tag!r} is not a save under {p}")
        return d
    if _has_model_states(p):
        return p
    latest = p / "latest"
    tags = sorted(c.name for c in p.iterdir() if _has_model_states(c)) if p.is_dir() else []
    if not latest.is_file():
        hint = f"; it holds the saves {tags}: give one of them, e.g. {p / tags[-1]}" if tags else ""
        raise CheckpointCorruptError(f"{p} has no 'latest' file naming the DeepSpeed save to read{hint}")
    name = latest.read_text().strip()
    d = p / name
    if not _has_model_states(d):
        raise CheckpointCorruptError(
            f"{latest} names the save {name!r}, but {d} holds no *_model_states.pt (an interrupted or partial "
            f"save?); the complete saves there are {tags}"
        )
    return d


# ----------------------------------------------------------------------------------------------------------------
# loading one file safely
# ----------------------------------------------------------------------------------------------------------------
def _refusal(path: Path, detail: str) -> str:
    return (
        f"refused to load {path}: it pickles an object that is not one of the DeepSpeed classes read with inert "
        f"stand-ins (LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address) nor a torch default: {detail}. "
        "Nothing from it was executed or loaded. If you trust this checkpoint, allow-list exactly that class: "
        "read_deepspeed_checkpoint(..., safe_globals=[TheClass]) or `v17 convert-deepspeed --safe-global "
        "module.Class`; under trainer.fit, torch.serialization.add_safe_globals([TheClass]) before fit. "
        "weights_only=False (or `--no-weights-only`) trusts the file fully and needs deepspeed installed"
    )


def _load(path: Path, *, weights_only: bool | None, safe_globals: Iterable[Any], mmap: bool = False) -> Any:
    """``torch.load`` of one DeepSpeed file on CPU, refusing what is not allow-listed; a truncated or unreadable file
    raises :class:`CheckpointCorruptError` naming it. ``mmap``: map the tensor data instead of reading it."""
    if not path.is_file():
        raise CheckpointCorruptError(f"{path}: missing")
    try:
        if weights_only is not None and not weights_only:
            return torch.load(path, map_location="cpu", weights_only=False, mmap=mmap)
        with torch.serialization.safe_globals([*DEEPSPEED_SAFE_GLOBALS, *safe_globals]):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as err:
        raise UnsafeCheckpointError(_refusal(path, _weights_only_detail(err))) from err
    except (RuntimeError, EOFError, OSError, ValueError) as err:
        raise CheckpointCorruptError(
            f"{path}: unreadable or truncated ({str(err).splitlines()[0] if str(err) else type(err).__name__}); "
            f"it is {path.stat().st_size} bytes"
        ) from err


# ----------------------------------------------------------------------------------------------------------------
# reconstruction
# ----------------------------------------------------------------------------------------------------------------
def _numel(shape: Any) -> int:
    return int(math.prod(shape))


def _addr(a: Any) -> tuple[int, int]:
    """(start, numel) of a fragment_address (stand-in or, with weights_only=False, DeepSpeed's own)."""
    return int(a.start), int(a.numel)


def _group_of_state(param_groups: list[dict[str, Any]]) -> dict[int, int]:
    """The param group of each optimizer-state index (a flat group at stages 1-2, a sub-group at stage 3)."""
    return {int(i): g for g, group in enumerate(param_groups) for i in group["params"]}


def _cat_pieces(pieces: dict[str, dict[str, list[torch.Tensor]]], shapes: dict[str, Any], where: Path) -> Any:
    out: dict[str, dict[str, torch.Tensor]] = {}
    for name, by_key in pieces.items():
        shape = torch.Size(shapes[name])
        out[name] = {}
        for key, parts in by_key.items():
            # a parameter in one fragment stays a view of the loaded partition (no copy; with mmap, not even read
            # until touched); detached: DeepSpeed saves its flat fp32 groups as parameters (requires_grad)
            flat = (torch.cat(parts) if len(parts) > 1 else parts[0]).detach()
            if flat.numel() != _numel(shape):
                raise CheckpointCorruptError(
                    f"{where}: the fragments of {name!r} state {key!r} hold {flat.numel()} elements over all ranks, "
                    f"but param_shapes records {tuple(shape)} ({_numel(shape)}): a partial or mixed save"
                )
            out[name][key] = flat.view(shape)
    return out


def _partition_stage_1_2(optims: list[dict], shapes: list[dict[str, Any]], where: Path) -> tuple[dict, dict]:
    """Per parameter ``{"fp32": ..., state keys...}`` from stage 1/2 partitions (ds_to_universal's fragments)."""
    pieces: dict[str, dict[str, list[torch.Tensor]]] = {}
    scalars: dict[str, dict[str, Any]] = {}
    all_shapes = {n: s for group in shapes for n, s in group.items()}
    for osd in optims:
        base = osd["base_optimizer_state"]["state"]
        for g, mapping in enumerate(osd["param_slice_mappings"]):
            flats = {"fp32": osd["single_partition_of_fp32_groups"][g]}
            for key, value in base[g].items():
                if torch.is_tensor(value) and value.dim() > 0:
                    flats[key] = value
                else:  # one per group (``step``): every parameter gets its own copy
                    for name in mapping:
                        scalars.setdefault(name, {})[key] = value.clone() if torch.is_tensor(value) else value
            for name, a in mapping.items():
                start, numel = _addr(a)
                for key, flat in flats.items():
                    pieces.setdefault(name, {}).setdefault(key, []).append(flat.narrow(0, start, numel))
    missing = sorted(set(all_shapes) - set(pieces))
    if missing:
        raise CheckpointCorruptError(f"{where}: no optimizer fragments for {missing[:5]} (a partial save?)")
    return _cat_pieces(pieces, all_shapes, where), scalars


def _partition_stage_3(optims: list[dict], shapes: list[dict[str, Any]], where: Path) -> tuple[dict, dict]:
    """The same from stage 3 partitions: every parameter split on its own, ``ceil(numel / dp)`` per rank."""
    dp = len(optims)
    pieces: dict[str, dict[str, list[torch.Tensor]]] = {}
    scalars: dict[str, dict[str, Any]] = {}
    all_shapes = {n: s for group in shapes for n, s in group.items()}
    for rank, osd in enumerate(optims):
        meta = osd.get("ds_zero_partition_groups") or []
        for idx, sub_shapes in enumerate(shapes):
            flats = {"fp32": osd["fp32_flat_groups"][idx]}
            for key, value in osd["optimizer_state_dict"]["state"][idx].items():
                if torch.is_tensor(value) and value.dim() > 0:
                    flats[key] = value
                else:
                    for name in sub_shapes:
                        scalars.setdefault(name, {})[key] = value.clone() if torch.is_tensor(value) else value
            count = meta[idx].get("partition_count", dp) if idx < len(meta) else dp
            part_rank = meta[idx].get("partition_rank", rank) if idx < len(meta) else rank
            offset = 0
            for name, shape in sub_shapes.items():
                numel = _numel(shape)
                part = math.ceil(numel / count)
                real = max(0, min(part, numel - part_rank * part))  # the last rank's piece ends in padding
                for key, flat in flats.items():
                    pieces.setdefault(name, {}).setdefault(key, []).append(flat.narrow(0, offset, real))
                offset += part
            for key, flat in flats.items():
                if flat.numel() != offset:
                    raise CheckpointCorruptError(
                        f"{where}: rank {rank}'s sub-group {idx} {key!r} holds {flat.numel()} elements, but its "
                        f"parameters' partitions take {offset}: the model-states and optimizer files disagree"
                    )
    return _cat_pieces(pieces, all_shapes, where), scalars


def _optim_files(tag_dir: Path) -> dict[int, Path]:
    found: dict[int, Path] = {}
    for p in tag_dir.iterdir():
        m = _OPTIM_RE.match(p.name)
        if m is None:
            continue
        if int(m.group(3)) != 0:
            raise CheckpointCorruptError(
                f"{p}: model-parallel rank {m.group(3)} (tensor/pipeline-parallel DeepSpeed or Megatron saves are not "
                "read; convert them with deepspeed.checkpoint.ds_to_universal first)"
            )
        found[int(m.group(2))] = p
    return found


def read_deepspeed_checkpoint(
    path: str | Any,
    *,
    tag: str | None = None,
    weights_only: bool | None = None,
    safe_globals: Iterable[Any] = (),
    mmap: bool = False,
) -> DeepSpeedState:
    """Read a DeepSpeed ZeRO checkpoint into full tensors, in this process, without deepspeed.

    Args:
        path: DeepSpeed's ``save_dir`` (with ``latest``), or one tag directory (``save_dir/global_step4``).
        tag: the tag to read under ``path`` (default: what ``latest`` names).
        weights_only: ``None``/``True``: restricted unpickling with :data:`DEEPSPEED_SAFE_GLOBALS` as inert
            stand-ins; ``False``: full pickle (trusted files only; it imports deepspeed to rebuild its classes).
        safe_globals: further classes to admit, for a trusted checkpoint whose client_state holds them.
        mmap: map the files' tensor data (``torch.load(mmap=True)``) instead of reading it: a tensor's bytes are
            read from disk when it is first touched, so a caller that keeps only its shards reads little more than
            them (the online load does, and copies what it keeps). The tensors then must not outlive the files:
            copy them before the checkpoint is overwritten.

    Returns:
        a :class:`DeepSpeedState`; every file is read and checked before it returns, so a refused or partial
        checkpoint raises before anything is loaded anywhere.

    Raises:
        CheckpointCorruptError: a missing rank file, a truncated file, or files that disagree (naming the file).
        UnsafeCheckpointError: a file pickles a class outside the allow-list (naming the file and the class).
    """
    tag_dir = find_deepspeed_tag_dir(path, tag)
    files = sorted(p.name for p in tag_dir.iterdir())
    load = {"weights_only": weights_only, "safe_globals": tuple(safe_globals), "mmap": mmap}
    if any(n.startswith("layer_") for n in files) or any(_MODEL_RE.match(n) and n != "mp_rank_00_model_states.pt"
                                                         for n in files):  # fmt: skip
        raise CheckpointCorruptError(
            f"{tag_dir} is a pipeline-, tensor- or expert-parallel DeepSpeed save (layer_* / mp_rank_01 files); only "
            "ZeRO data-parallel saves are read; convert it with deepspeed.checkpoint.ds_to_universal first"
        )
    stage3_models = {int(m.group(1)): tag_dir / n for n in files if (m := _MODEL3_RE.match(n))}
    first_model = tag_dir / "mp_rank_00_model_states.pt" if not stage3_models else stage3_models.get(0)
    if first_model is None:
        raise CheckpointCorruptError(f"{tag_dir / 'zero_pp_rank_0_mp_rank_00_model_states.pt'}: missing")
    model = _load(first_model, **load)
    if not isinstance(model, dict) or "module" not in model:
        raise CheckpointCorruptError(f"{first_model} is not a DeepSpeed model-states file (no 'module' entry)")
    dp = int(model.get("dp_world_size") or 1)
    if int(model.get("mp_world_size") or 1) != 1:
        raise CheckpointCorruptError(
            f"{first_model}: mp_world_size={model['mp_world_size']}; tensor-parallel DeepSpeed saves are not read"
        )
    optim_paths = _optim_files(tag_dir)
    state = DeepSpeedState(source=tag_dir, saved_stage=0, dp_world_size=dp, bf16=False)
    state.ds_version = str(model.get("ds_version", ""))
    state.client_state = {k: v for k, v in model.items() if k not in _ENGINE_KEYS}
    state.lr_scheduler = model.get("lr_scheduler")
    for k in ("global_steps", "skipped_steps", "global_samples"):
        setattr(state, k, int(model.get(k) or 0))
    module = dict(model["module"] or {})
    buffer_names = set(model.get("buffer_names") or [])
    if not optim_paths:  # no ZeRO: a plain engine checkpoint; the optimizer (if any) is not partitioned
        state.weights = module
        return state
    expected = [tag_dir / n for n in _expected_names(optim_paths, dp)]
    missing = [str(p) for p in expected if not p.is_file()]
    if missing or len(optim_paths) != dp:
        extra = sorted(str(p) for r, p in optim_paths.items() if r >= dp)
        raise CheckpointCorruptError(
            f"{tag_dir}: the save was written at dp_world_size={dp} ({first_model.name}), so it needs {dp} optimizer "
            f"files; missing: {missing or 'none'}; unexpected (another run's or a stale save): {extra or 'none'}"
        )
    optims: list[dict] = []
    for p in expected:
        sd = _load(p, **load)
        osd = sd.get("optimizer_state_dict") if isinstance(sd, dict) else None
        if not isinstance(osd, dict) or "zero_stage" not in osd:
            raise CheckpointCorruptError(f"{p} is not a DeepSpeed ZeRO optimizer file (no optimizer_state_dict)")
        count = osd.get("partition_count")
        count = max(count) if isinstance(count, list) else int(count)
        if count != dp:
            raise CheckpointCorruptError(
                f"{p}: partition_count={count}, but {first_model.name} records dp_world_size={dp} and the directory "
                f"holds {len(optim_paths)} optimizer files: files of different saves are mixed"
            )
        optims.append(osd)
    stages = {int(o["zero_stage"]) for o in optims}
    if len(stages) != 1:
        raise CheckpointCorruptError(f"{tag_dir}: the optimizer files disagree on the ZeRO stage ({sorted(stages)})")
    state.saved_stage = stages.pop()
    state.bf16 = expected[0].name.startswith("bf16_")
    shapes = list(model.get("param_shapes") or [])
    # The layout is decided once, from what the files hold (not from the stage number): partitions per parameter
    # (fp32_flat_groups, with one model-states file per rank holding placeholders) or fragments of flat groups.
    per_param = "fp32_flat_groups" in optims[0]
    if per_param != bool(stage3_models):
        raise CheckpointCorruptError(
            f"{tag_dir}: the optimizer files hold {'per-parameter' if per_param else 'flat-group'} partitions but the "
            f"model-states files are {'per rank' if stage3_models else 'one'}: files of different saves are mixed"
        )
    if per_param:
        for r in range(1, dp):
            if r not in stage3_models:
                raise CheckpointCorruptError(f"{tag_dir / f'zero_pp_rank_{r}_mp_rank_00_model_states.pt'}: missing")
        per_param, scalars = _partition_stage_3(optims, shapes, tag_dir)
        frozen = _frozen_stage_3(model, stage3_models, dp, load)
        groups = optims[0]["optimizer_state_dict"]["param_groups"]
    else:
        per_param, scalars = _partition_stage_1_2(optims, shapes, tag_dir)
        frozen = dict(model.get("frozen_param_fragments") or {})
        groups = optims[0]["base_optimizer_state"]["param_groups"]
    state.fp32 = {name: st.pop("fp32") for name, st in per_param.items()}
    state.optim = {name: {**st, **scalars.get(name, {})} for name, st in per_param.items()}
    by_state = _group_of_state(groups)
    names_of: dict[int, list[str]] = {g: [] for g in range(len(groups))}
    for idx, sub in enumerate(shapes):
        names_of[by_state.get(idx, idx)].extend(sub)
    state.param_groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": names_of[i]}
                          for i, g in enumerate(groups)]  # fmt: skip
    if not per_param:  # the full module: trainable, frozen (stage 1 keeps them here) and buffers
        state.weights = {k: v for k, v in module.items() if k not in state.fp32}
    for name, master in state.fp32.items():
        saved = module.get(name)
        if not per_param and saved is not None and saved.shape == master.shape:
            state.weights[name] = saved
        else:  # stage 3 saves an empty placeholder of the model dtype
            state.weights[name] = master.to(saved.dtype if saved is not None else master.dtype)
    state.weights.update(frozen)
    for name in buffer_names:
        if name in module:
            state.weights[name] = module[name]
    for alias, src in (model.get("shared_params") or {}).items():  # tied weights are saved once
        if src in state.weights:
            state.weights[alias] = state.weights[src]
    scaler = optims[0].get("loss_scaler")
    state.loss_scaler = dict(vars(scaler)) if scaler is not None and hasattr(scaler, "__dict__") else {}
    state.loss_scaler.update({k: optims[0][k] for k in ("dynamic_loss_scale", "overflow") if k in optims[0]})
    return state


def _expected_names(found: dict[int, Path], dp: int) -> list[str]:
    prefix = "bf16_" if any(p.name.startswith("bf16_") for p in found.values()) else ""
    return [f"{prefix}zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(dp)]


def _frozen_stage_3(model: dict, files: dict[int, Path], dp: int, load: dict) -> dict[str, torch.Tensor]:
    """Frozen (not optimized) parameters at stage 3: each rank's file holds its partition of them
    (zero_to_fp32 ``_zero3_merge_frozen_params``)."""
    shapes = model.get("frozen_param_shapes") or {}
    if not shapes:
        return {}
    frags = [model.get("frozen_param_fragments") or {}]
    frags += [(_load(files[r], **load).get("frozen_param_fragments") or {}) for r in range(1, dp)]
    return {n: torch.cat([f[n].flatten() for f in frags])[: _numel(s)].view(torch.Size(s)) for n, s in shapes.items()}
