"""A DeepSpeed checkpoint (read by :mod:`lightning_v17.checkpoint.deepspeed`) into a running V17 layout, or into a
V17 sharded checkpoint once (``v17 convert-deepspeed DIR OUT``).

Loading goes through the same FQN-keyed templates as a V17 resume (``engine/zero/state_dict.get_state_dicts``): every
template entry takes its value from the full DeepSpeed tensor, cut to the template's layout. A ``DTensor`` entry
(ZeRO-3 parameters, ZeRO-1/2 optimizer shards, tensor-parallel pieces) is cut with ``distribute_tensor(...,
src_data_rank=None)``, i.e. every rank keeps its own chunk of the tensor it already holds, with no communication and
the same chunking DCP's reshard-on-load produces; a plain entry takes the whole tensor. Then
``set_state_dicts`` loads the filled templates exactly as it loads what ``dcp.load`` filled in.

Names: raw DeepSpeed saves the FQNs of the module it was given (``0.weight`` for a bare ``nn.Sequential``); Lightning's
DeepSpeedStrategy gives it the LightningModule (``model.0.weight``), as V17 does. :func:`match_names` finds the one
prefix that maps every V17 name onto a DeepSpeed one (``""``, ``"model."``, ...) and refuses anything ambiguous.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

from lightning_v17.checkpoint.deepspeed import DeepSpeedState, read_deepspeed_checkpoint
from lightning_v17.checkpoint.safe_load import UnsafeCheckpointError
from lightning_v17.checkpoint.sharded import CheckpointCorruptError, save_sharded

__all__ = [
    "convert_deepspeed",
    "convert_deepspeed_main",
    "fill_app_state",
    "loss_scale_from_deepspeed",
    "match_names",
    "trainer_state_from_deepspeed",
]


class DeepSpeedMismatchError(ValueError):
    """The DeepSpeed checkpoint does not fit the model or optimizer being loaded (names, shapes, groups, state)."""


def match_names(ours: list[str], theirs: set[str]) -> tuple[str, str]:
    """``(strip, add)``: our name ``n`` is DeepSpeed's ``add + n.removeprefix(strip)``, for every name in ``ours``.

    Tried in order: identical names; ours with a prefix DeepSpeed lacks (V17 holds the LightningModule, raw DeepSpeed
    was given its ``self.model``); DeepSpeed's with a prefix ours lack.
    """
    if not ours:
        return "", ""
    probe = ours[0]
    candidates: list[tuple[str, str]] = [("", "")]
    for t in sorted(theirs):
        if probe.endswith("." + t):
            candidates.append((probe[: -len(t)], ""))
        if t.endswith("." + probe):
            candidates.append(("", t[: -len(probe)]))
    fits = [(s, a) for s, a in dict.fromkeys(candidates) if all(
        n.startswith(s) and a + n[len(s):] in theirs for n in ours)]  # fmt: skip
    if len(fits) == 1 or (fits and fits[0] == ("", "")):
        return fits[0]
    if not fits:
        missing = [n for n in ours if n not in theirs][:4]
        raise DeepSpeedMismatchError(
            f"the DeepSpeed checkpoint's parameter names do not match the model's: e.g. {missing} are not among "
            f"{sorted(theirs)[:4]} (no common prefix maps them); load it into the same module DeepSpeed trained"
        )
    raise DeepSpeedMismatchError(f"the model's names map onto the DeepSpeed checkpoint in several ways: {fits}")


def _cut_like(template: Any, full: torch.Tensor, what: str) -> Any:
    """``full`` in the layout of ``template``: this rank's DTensor chunk, or the whole tensor."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if not torch.is_tensor(template):
        return full.item() if torch.is_tensor(full) and full.numel() == 1 else full
    full = full.detach() if torch.is_tensor(full) else torch.tensor(full)
    if tuple(template.shape) != tuple(full.shape):
        if template.dim() == 0 and full.numel() == 1:
            full = full.reshape(())
        else:
            raise DeepSpeedMismatchError(
                f"{what}: the DeepSpeed checkpoint holds shape {tuple(full.shape)}, the model {tuple(template.shape)}"
            )
    if isinstance(template, DTensor):
        full = full.to(dtype=template.dtype, device=template.device_mesh.device_type)
        # this rank's chunk, a view of ``full`` (with mmap=True, of the mapped file): set_state_dicts copies it into the
        # model's and optimizer's own storage (tests/dist/test_deepspeed_ckpt.py checks that no state aliases it)
        return distribute_tensor(full, template.device_mesh, template.placements, src_data_rank=None)
    # a copy: DeepSpeed keeps one step per flat group, and optimizers step each parameter's own counter in place
    return full.to(dtype=template.dtype, device=template.device, copy=True)


def _optim_states(optim: dict[str, Any]) -> list[dict[str, Any]]:
    return [optim] if "param_groups" in optim else [optim[k] for k in sorted(optim)]


def fill_app_state(app_state: dict[str, Any], ds: DeepSpeedState) -> None:
    """Replace every tensor of the V17 templates ``app_state`` (``get_state_dicts``) by DeepSpeed's, in place.

    Model entries take the fp32 master weight where DeepSpeed has one (the model's own dtype after the cast), else
    the saved weight (frozen parameters, buffers). Optimizer entries take DeepSpeed's state of the same name and key;
    the param groups' hyperparameters (lr, betas, eps, weight_decay, ...) come from DeepSpeed's groups by index.

    Raises:
        DeepSpeedMismatchError: a name, shape, state key or param group that does not fit, before anything is set.
    """
    model = app_state["model"]
    strip, add = match_names(sorted(model), set(ds.weights) | set(ds.fp32))

    def theirs(n: str) -> str:
        return add + n[len(strip) :]

    filled = {n: _cut_like(t, ds.fp32.get(theirs(n), ds.weights.get(theirs(n))), f"model entry {n!r}")
              for n, t in model.items()}  # fmt: skip
    optims = _optim_states(app_state["optim"]) if "optim" in app_state else []
    if len(optims) > 1:
        raise DeepSpeedMismatchError(
            f"configure_optimizers builds {len(optims)} optimizers; a DeepSpeed checkpoint holds one optimizer's state"
        )
    new_optims = []
    for osd in optims:
        state = {}
        for n, st in osd["state"].items():
            src = ds.optim.get(theirs(n))
            if src is None and not ds.optim:
                raise DeepSpeedMismatchError(
                    f"{ds.source} holds no ZeRO optimizer files (DeepSpeed ran without ZeRO): only ZeRO-1/2/3 "
                    "optimizer state is read; resume with the weights alone by loading them in the LightningModule"
                )
            if src is None:
                raise DeepSpeedMismatchError(f"the DeepSpeed checkpoint has no optimizer state for {theirs(n)!r} ({n})")
            lacking = sorted(set(st) - set(src))
            if lacking:
                raise DeepSpeedMismatchError(
                    f"optimizer state of {n!r}: the model's optimizer keeps {sorted(st)}, the DeepSpeed one saved "
                    f"{sorted(src)} (no {lacking}); use the same optimizer family (Adam/AdamW) as the DeepSpeed run"
                )
            state[n] = {k: _cut_like(v, src[k], f"optimizer state {n!r}[{k!r}]") for k, v in st.items()}
        groups = osd["param_groups"]
        if len(groups) != len(ds.param_groups):
            raise DeepSpeedMismatchError(
                f"the DeepSpeed optimizer has {len(ds.param_groups)} param groups, configure_optimizers builds "
                f"{len(groups)}; build the same param groups as the DeepSpeed run"
            )
        for i, (g, dg) in enumerate(zip(groups, ds.param_groups)):
            ours, theirs_ = {theirs(n) for n in g["params"]}, set(dg["params"])
            if not ours <= theirs_:
                raise DeepSpeedMismatchError(
                    f"param group {i}: {sorted(ours - theirs_)[:4]} are in another DeepSpeed param group; build the "
                    "same param groups as the DeepSpeed run"
                )
        new_groups = [{**g, **{k: v for k, v in dg.items() if k in g and k != "params"}}
                      for g, dg in zip(groups, ds.param_groups)]  # fmt: skip
        new_optims.append({"state": state, "param_groups": new_groups})
    app_state["model"] = filled
    if new_optims:
        optim = app_state["optim"]
        if "param_groups" in optim:
            app_state["optim"] = new_optims[0]
        else:
            app_state["optim"] = {min(optim): new_optims[0]}


def loss_scale_from_deepspeed(ds: DeepSpeedState) -> float | None:
    """The fp16 loss scale a DeepSpeed save carries over to V17's loss scaler, or None when it scaled nothing.

    Every optimizer file pickles DeepSpeed's scaler (``ds.loss_scaler``). fp32 and bf16 runs hold a static
    ``LossScaler`` with ``cur_scale=1.0``, ``dynamic=False`` (DeepSpeed creates one "for backwards compatibility"
    and scales nothing): the equivalent of V17's fp32/bf16 precision, which has no scaler, so nothing carries over.
    An fp16 run holds a ``DynamicLossScaler`` (``dynamic=True``, ``cur_scale`` the scale it had reached) or a static
    scale other than 1: that scale is returned. DeepSpeed's growth window and hysteresis counters are not mapped
    (``DynamicLossScaler`` grows ``scale_window`` steps after the step *following* an overflow and keeps a spent
    hysteresis until it grows, :class:`~lightning_v17.trackers.LossScaleTracker` counts both from the last change),
    so they restart from the V17 policy.
    """
    scale = ds.loss_scaler.get("cur_scale")
    if scale is None:
        return None
    dynamic = bool(ds.loss_scaler.get("dynamic") or ds.loss_scaler.get("dynamic_loss_scale"))
    return float(scale) if dynamic or float(scale) != 1.0 else None


def trainer_state_from_deepspeed(ds: DeepSpeedState, *, lightning_version: str) -> dict[str, Any]:
    """What ``Strategy.load_checkpoint`` returns to Lightning for a DeepSpeed checkpoint.

    Written by Lightning's DeepSpeedStrategy: its own checkpoint dict (loops, epoch, global step, callbacks with the
    data position, lr schedulers, hyperparameters), which DeepSpeed stored as client_state. Written by raw DeepSpeed:
    the scheduler DeepSpeed managed (if any) as Lightning's first scheduler; the loops start afresh (the optimizer's
    own step count, Adam's bias correction, is restored with its state).
    """
    if ds.written_by_lightning:
        return dict(ds.client_state)
    out: dict[str, Any] = {"pytorch-lightning_version": lightning_version, "lr_schedulers": []}
    if ds.lr_scheduler is not None:
        out["lr_schedulers"] = [ds.lr_scheduler]
    out["deepspeed"] = {"global_steps": ds.global_steps, "skipped_steps": ds.skipped_steps,
                        "global_samples": ds.global_samples, "loss_scaler": dict(ds.loss_scaler),
                        "client_state": dict(ds.client_state)}  # fmt: skip
    return out


def convert_deepspeed(
    path: str | Any, out: str | Any, *, tag: str | None = None, prefix: str = "", **read_kw: Any
) -> Path:
    """Write a DeepSpeed checkpoint as a V17 sharded checkpoint (``checkpoint/sharded.py``), once, offline.

    Args:
        path: DeepSpeed's ``save_dir`` (with ``latest``) or one tag directory.
        out: the V17 checkpoint directory to write (it loads with ``trainer.fit(ckpt_path=out)`` at any layout).
        tag: the DeepSpeed tag to read (default: ``latest``).
        prefix: put this before every DeepSpeed name, e.g. ``"model."`` when raw DeepSpeed trained the
            LightningModule's ``self.model`` (Lightning's DeepSpeedStrategy already saved the LightningModule's names).
        read_kw: ``weights_only`` / ``safe_globals`` for :func:`read_deepspeed_checkpoint`.
    """
    from importlib.metadata import version

    ds = read_deepspeed_checkpoint(path, tag=tag, **read_kw)
    model = {prefix + n: ds.fp32.get(n, w) for n, w in ds.weights.items()}
    app_state: dict[str, Any] = {"model": model}
    if ds.optim:
        app_state["optim"] = {
            "state": {prefix + n: dict(st) for n, st in ds.optim.items()},
            "param_groups": [{**g, "params": [prefix + n for n in g["params"]]} for g in ds.param_groups],
        }
    meta = {"world_size": 1, "zero_stage": ds.saved_stage, "step": ds.global_steps,
            "converted_from": {"format": "deepspeed", "path": str(ds.source), "dp_world_size": ds.dp_world_size,
                               "bf16": ds.bf16, "ds_version": ds.ds_version}}  # fmt: skip
    trainer_state = trainer_state_from_deepspeed(ds, lightning_version=version("lightning"))
    return save_sharded(out, app_state=app_state, trainer_state=trainer_state, meta=meta)


def _import_global(dotted: str) -> Any:
    module, _, name = dotted.rpartition(".")
    if not module:
        raise ValueError(f"--safe-global {dotted!r}: give module.Class")
    import importlib

    return getattr(importlib.import_module(module), name)


def convert_deepspeed_main(argv: list[str] | None = None) -> int:
    """``v17 convert-deepspeed DIR OUT [--tag T] [--prefix model.]``; exit status 2 with one line on bad input."""
    parser = argparse.ArgumentParser(
        prog="v17 convert-deepspeed",
        description="Write a DeepSpeed ZeRO-1/2/3 checkpoint (raw DeepSpeed or Lightning's DeepSpeedStrategy) as a "
        "V17 sharded checkpoint: fp32 master weights, optimizer state, step, lr scheduler, Lightning's trainer state.",
    )
    parser.add_argument("ckpt", help="DeepSpeed save_dir (holding 'latest') or one tag directory (global_stepN)")
    parser.add_argument("out", help="the V17 sharded checkpoint directory to write")
    parser.add_argument("--tag", default=None, help="the DeepSpeed tag to read (default: what 'latest' names)")
    parser.add_argument("--prefix", default="", help='prefix every name, e.g. "model." for a LightningModule.model')
    parser.add_argument("--safe-global", action="append", default=[], metavar="MODULE.CLASS",
                        help="admit this pickled class too (trusted checkpoints only); repeatable")  # fmt: skip
    parser.add_argument(
        "--weights-only",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="refuse pickled objects outside the allow-list (default); --no-weights-only only for a trusted checkpoint",
    )
    args = parser.parse_args(argv)
    try:
        if not Path(args.ckpt).is_dir():
            raise ValueError(f"{args.ckpt} is not a directory")
        safe = [_import_global(g) for g in args.safe_global]
        out = convert_deepspeed(args.ckpt, args.out, tag=args.tag, prefix=args.prefix,
                                weights_only=args.weights_only, safe_globals=safe)  # fmt: skip
    except (ValueError, CheckpointCorruptError, UnsafeCheckpointError, ImportError, AttributeError) as err:
        print(f"v17 convert-deepspeed: error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0
