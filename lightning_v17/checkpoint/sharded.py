"""Sharded, atomic, checksummed checkpoints that reshard on load (Lightning-free engine).

Layout of a checkpoint directory ``CKPT/``::

    CKPT/model/          torch.distributed.checkpoint (DCP) files: every rank writes its own ``__<rank>_*.distcp``
    CKPT/optim/          the same for the optimizer state (torch.distributed.checkpoint.state_dict FQN layout)
    CKPT/trainer_state   everything else (Lightning loops, callbacks, lr schedulers, ...), torch.save by rank 0
    CKPT/meta.json       written LAST: world size, mesh, zero stage, versions, step, and sha256 + size of every file

Why this shape:

- *Parallel I/O.* DCP lets each rank write only the shards it owns; each rank also hashes only the files it wrote,
  and the digests are gathered to rank 0 (one small ``gather_object``), so neither writing nor hashing funnels
  through rank 0.
- *Atomicity.* Everything is written into ``.CKPT.v17-partial`` next to the target. Only after every rank's
  files are on disk (fsync) does rank 0 write ``meta.json`` (fsync) and rename the directory into place. When CKPT
  already exists (ModelCheckpoint's ``last.ckpt``) the old one is first renamed aside to ``.CKPT.v17-old``, the
  new one renamed in, then the old one deleted; a crash between the two renames is repaired by the loader, which
  moves the aside copy back. So at every instant a complete old or a complete new checkpoint exists.
- *Verification before loading.* :func:`load_sharded` checks ``meta.json`` and every file's size and sha256
  (split across ranks) before DCP reads a byte into the live state, so a truncated/corrupt shard raises
  :class:`CheckpointCorruptError` naming the file and nothing is half-loaded.
- *Safe unpickling.* ``trainer_state`` is read with ``torch.load(weights_only=True)`` by default (torch >= 2.6's
  default), with only the extra types our own trainer states hold allow-listed (:data:`TRAINER_STATE_SAFE_GLOBALS`).
  A checkpoint carrying anything else is refused with :class:`UnsafeCheckpointError` before any state is touched;
  ``weights_only=False`` loads a trusted one. DCP's own pickles (the ``.metadata`` index, non-tensor entries) are
  checked with restricted unpicklers first (:func:`check_dcp_pickles`); DCP then reads them unrestricted (README).
- *Reshard on load.* DCP loads by global tensor coordinates, so a checkpoint written at one world size / ZeRO stage
  (DTensor ``Shard(0)``) loads into another layout (plain replicated tensors, another mesh, or one process with no
  process group).

The asynchronous variant used by the ``AsyncCheckpoint`` callback lives in ``checkpoint_async.py`` and reuses the
helpers here.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import os
import shutil
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

FORMAT = "lightning_v17.sharded/1"
META_FILE = "meta.json"
TRAINER_STATE_FILE = "trainer_state"
COMPONENTS = ("model", "optim")
_PARTIAL_SUFFIX = ".v17-partial"
_ASIDE_SUFFIX = ".v17-old"
_HASH_CHUNK_BYTES = 8 << 20

__all__ = [
    "FORMAT",
    "TRAINER_STATE_SAFE_GLOBALS",
    "CheckpointCorruptError",
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
    "verify_checkpoint",
]


from lightning_v17.checkpoint.safe_load import (
    TRAINER_STATE_SAFE_GLOBALS,
    UnsafeCheckpointError,
    check_dcp_pickles,
    load_trainer_state,
)


class CheckpointCorruptError(RuntimeError):
    """A checkpoint file is missing, truncated or does not match the checksum recorded in ``meta.json``."""


# ----------------------------------------------------------------------------------------------------------------
# small helpers
# ----------------------------------------------------------------------------------------------------------------
def partial_path(target: str | os.PathLike) -> Path:
    """The temporary directory a save of ``target`` writes into before it is published (ignored by loaders)."""
    target = Path(target)
    return target.parent / f".{target.name}{_PARTIAL_SUFFIX}"


def _aside_path(target: Path) -> Path:
    return target.parent / f".{target.name}{_ASIDE_SUFFIX}"


def _dist_on() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank_world(pg: Any) -> tuple[int, int]:
    if not _dist_on():
        return 0, 1
    return dist.get_rank(pg), dist.get_world_size(pg)


def _barrier(pg: Any) -> None:
    if _dist_on():
        dist.barrier(group=pg)


def _collective_device(pg: Any) -> torch.device:
    """Device for tiny tensor collectives on ``pg``: NCCL groups need CUDA tensors, gloo takes CPU ones."""
    backend = str(dist.get_backend(pg)).lower()
    if "nccl" in backend and "gloo" not in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@contextlib.contextmanager
def _quiet_single_process(no_dist: bool):
    """DCP warns on every no_dist call that it "assumes a single process"; here that is the documented intent."""
    if not no_dist:
        yield
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def _fsync_dir(path: Path) -> None:
    # A rename is durable only once the directory holding the entry is fsynced (POSIX); best effort elsewhere.
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def file_digest(path: str | os.PathLike) -> dict[str, Any]:
    """``{"sha256": hex, "bytes": size}`` of one file. hashlib releases the GIL, so this overlaps with training."""
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK_BYTES):
            h.update(chunk)
            size += len(chunk)
    return {"sha256": h.hexdigest(), "bytes": size}


def _write_bytes_durably(path: Path, payload: bytes) -> None:
    with open(path, "wb") as f:
        f.write(payload)
        f.flush()
        os.fsync(f.fileno())


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {"torch": torch.__version__}
    try:  # read from the installed metadata: the engine does not import Lightning
        out["lightning"] = version("lightning")
    except PackageNotFoundError:  # pragma: no cover - lightning is a dependency, but the engine does not need it
        pass
    from lightning_v17 import __version__

    out["lightning_v17"] = __version__
    return out


def hash_own_files(tmp: Path, component: str, rank: int, *, coordinator: bool) -> dict[str, dict[str, Any]]:
    """Digests of the DCP files this rank wrote under ``tmp/component`` (DCP names them ``__<rank>_<n>.distcp``),
    plus DCP's ``.metadata`` on the coordinator. Keys are paths relative to the checkpoint root."""
    sub = tmp / component
    out: dict[str, dict[str, Any]] = {}
    names = sorted(p.name for p in sub.iterdir() if p.name.startswith(f"__{rank}_") and p.suffix == ".distcp")
    if coordinator:
        names.append(".metadata")
    for name in names:
        out[f"{component}/{name}"] = file_digest(sub / name)
    return out


def prepare_partial(target: Path, pg: Any) -> Path:
    """Rank 0 clears a stale partial directory of an earlier crashed save and creates a fresh one; all ranks wait."""
    tmp = partial_path(target)
    rank, _ = _rank_world(pg)
    if rank == 0:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    _barrier(pg)
    return tmp


def build_meta(
    meta: dict[str, Any], *, world_size: int, components: list[str], files: dict[str, dict[str, Any]], step: Any
) -> dict[str, Any]:
    return {
        **meta,
        "format": FORMAT,
        "world_size": world_size,
        "step": meta.get("step", step),
        "components": components,
        "versions": _versions(),
        "saved_unix_s": time.time(),
        "files": dict(sorted(files.items())),
    }


def publish(tmp: Path, target: Path, full_meta: dict[str, Any]) -> None:
    """Rank 0 only: write ``meta.json`` last (fsync), then swap ``tmp`` into ``target`` without a window in which
    neither a complete old nor a complete new checkpoint exists."""
    _write_bytes_durably(tmp / META_FILE, json.dumps(full_meta, indent=1).encode())
    _fsync_dir(tmp)
    aside = _aside_path(target)
    if aside.exists():  # left by a crash after the new one was renamed in: `target` is complete, this is garbage
        _recover(target)
    if target.exists():
        os.replace(target, aside)
    os.replace(tmp, target)
    _fsync_dir(target.parent)
    _remove(aside)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists() or path.is_symlink():
        path.unlink()


def _recover(target: Path) -> None:
    """Repair an interrupted :func:`publish` (rank 0 / single process only)."""
    aside = _aside_path(target)
    if not aside.exists():
        return
    if (target / META_FILE).exists():
        _remove(aside)  # the new checkpoint is in place; the old one is obsolete
    elif not target.exists():
        os.replace(aside, target)  # crashed between the two renames: put the old complete checkpoint back
        _fsync_dir(target.parent)


def is_sharded_checkpoint(path: str | os.PathLike) -> bool:
    """Whether ``path`` is (or, after repairing an interrupted overwrite, will be) a v17 sharded checkpoint."""
    p = Path(path)
    for cand in (p, _aside_path(p)):
        meta = cand / META_FILE
        if cand.is_dir() and meta.is_file():
            try:
                return json.loads(meta.read_text()).get("format") == FORMAT
            except (OSError, ValueError):
                return True  # ours but damaged: let the loader name the broken file
    return False


# ----------------------------------------------------------------------------------------------------------------
# save
# ----------------------------------------------------------------------------------------------------------------
def gather_file_digests(files: dict[str, dict[str, Any]], *, process_group: Any = None) -> dict[str, dict[str, Any]]:
    """Every rank's ``{relative path: digest}`` merged on rank 0 (other ranks get ``{}``); each rank hashed its own.

    Args:
        files: the digests of the files this rank wrote (``hash_own_files``).
        process_group: group to gather over (None: the default group; single process without one).
    """
    if not _dist_on():
        return dict(files)
    rank, world = _rank_world(process_group)
    gathered: list[Any] | None = [None] * world if rank == 0 else None
    dist.gather_object(files, gathered, group=process_group, group_dst=0)
    merged: dict[str, dict[str, Any]] = {}
    for part in gathered or []:
        merged.update(part)
    return merged


def save_sharded(
    path: str | os.PathLike,
    *,
    app_state: dict[str, Any],
    trainer_state: dict[str, Any],
    meta: dict[str, Any],
    process_group: Any = None,
) -> Path:
    """Write a sharded checkpoint atomically; collective over ``process_group`` (or the default group).

    Args:
        path: the checkpoint directory to create or replace.
        app_state: ``{"model": state_dict, "optim": state_dict}`` (either may be absent), with FQN keys and plain
            tensors or DTensors, e.g. from ``torch.distributed.checkpoint.state_dict.get_state_dict``.
        trainer_state: everything else; written once by rank 0 with ``torch.save``.
        meta: JSON-serializable facts recorded in ``meta.json`` (mesh, zero stage, step, ...).
        process_group: the group of ranks that hold the state; ``None`` = default group, or a single process
            when torch.distributed is not initialized.

    Returns:
        The published checkpoint path.
    """
    target = Path(path).absolute()
    use_dist = _dist_on()
    rank, world = _rank_world(process_group)
    components = [c for c in COMPONENTS if c in app_state]
    unknown = sorted(set(app_state) - set(COMPONENTS))
    if unknown:
        raise ValueError(f"save_sharded(app_state=...) takes the keys {COMPONENTS}; got unknown keys {unknown}")
    tmp = prepare_partial(target, process_group)
    files: dict[str, dict[str, Any]] = {}
    for comp in components:
        with _quiet_single_process(not use_dist):
            dcp.save(
                app_state[comp],
                storage_writer=dcp.FileSystemWriter(tmp / comp, sync_files=True),
                process_group=process_group,
                no_dist=not use_dist,
            )
        files.update(hash_own_files(tmp, comp, rank, coordinator=rank == 0))
    if rank == 0:
        buf = io.BytesIO()
        torch.save(trainer_state, buf)
        _write_bytes_durably(tmp / TRAINER_STATE_FILE, buf.getvalue())
        files[TRAINER_STATE_FILE] = file_digest(tmp / TRAINER_STATE_FILE)
    all_files = gather_file_digests(files, process_group=process_group)
    if rank == 0:
        full = build_meta(
            meta, world_size=world, components=components, files=all_files, step=trainer_state.get("global_step")
        )
        publish(tmp, target, full)
    _barrier(process_group)
    return target


# ----------------------------------------------------------------------------------------------------------------
# verify + load
# ----------------------------------------------------------------------------------------------------------------
def _read_meta(target: Path) -> dict[str, Any]:
    meta_path = target / META_FILE
    if not target.is_dir():
        raise FileNotFoundError(f"checkpoint {target} does not exist (or is not a directory)")
    try:
        meta = json.loads(meta_path.read_text())
    except FileNotFoundError:
        raise CheckpointCorruptError(
            f"{meta_path} is missing: {target} is not a complete v17 sharded checkpoint (an interrupted save?)"
        ) from None
    except (OSError, ValueError) as err:
        raise CheckpointCorruptError(f"{meta_path} is unreadable or truncated: {err}") from err
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or not isinstance(meta.get("files"), dict):
        raise CheckpointCorruptError(f"{meta_path} is not a {FORMAT} manifest (format={meta.get('format')!r})")
    return meta


def _check_file(target: Path, rel: str, want: dict[str, Any]) -> str | None:
    p = target / rel
    if not p.is_file():
        return f"{p}: missing"
    size = p.stat().st_size
    if size != want.get("bytes"):
        return f"{p}: truncated or resized ({size} bytes on disk, {want.get('bytes')} recorded)"
    if file_digest(p)["sha256"] != want.get("sha256"):
        return f"{p}: checksum mismatch (sha256 differs from meta.json: corrupt)"
    return None


def verify_checkpoint(path: str | os.PathLike, *, process_group: Any = None, no_dist: bool = False) -> dict:
    """Check ``meta.json`` and every recorded file (size and sha256) before anything is loaded.

    With a process group the files are split across ranks and the problems all-gathered, so every rank raises the
    same :class:`CheckpointCorruptError`, naming the first bad file. Returns the parsed ``meta.json``.
    """
    target = Path(path).absolute()
    use_dist = _dist_on() and not no_dist
    rank, world = _rank_world(process_group) if use_dist else (0, 1)
    problem: str | None = None
    meta: dict[str, Any] = {}
    try:
        meta = _read_meta(target)
    except (CheckpointCorruptError, FileNotFoundError) as err:
        problem = f"{type(err).__name__}: {err}"
    bad: list[str] = []
    if problem is None:
        rels = sorted(meta["files"])
        for rel in rels[rank::world]:
            if (msg := _check_file(target, rel, meta["files"][rel])) is not None:
                bad.append(msg)
        for comp in meta.get("components", []):  # DCP's own index must be covered by the manifest
            if f"{comp}/.metadata" not in meta["files"] and rank == 0:
                bad.append(f"{target / comp / '.metadata'}: not recorded in meta.json")
    else:
        bad.append(problem)
    if use_dist:
        everyone: list[Any] = [None] * world
        dist.all_gather_object(everyone, bad, group=process_group)
        bad = [m for part in everyone for m in part]
    if bad:
        first = bad[0]
        if first.startswith("FileNotFoundError: "):
            raise FileNotFoundError(first.removeprefix("FileNotFoundError: "))
        first = first.removeprefix("CheckpointCorruptError: ")
        more = f" (and {len(bad) - 1} more problem(s): {bad[1:4]})" if len(bad) > 1 else ""
        raise CheckpointCorruptError(f"corrupt checkpoint {target}: {first}{more}; nothing was loaded")
    return meta


def load_sharded(
    path: str | os.PathLike,
    *,
    app_state: dict[str, Any],
    process_group: Any = None,
    weights_only: bool | None = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Verify, then load a sharded checkpoint into ``app_state`` in place, resharding to its current layout.

    Args:
        path: a directory written by :func:`save_sharded` (or the async saver).
        app_state: ``{"model": state_dict, "optim": state_dict}`` templates (either may be absent) whose tensors /
            DTensors are overwritten in place; their layout may differ from the one saved (world size, ZeRO stage).
        process_group: group to load over; ``None`` = default group, or a single process without torch.distributed.
        weights_only: how ``trainer_state`` is unpickled (:func:`load_trainer_state`); ``None`` means ``True``, as
            in ``torch.load``. ``False`` only for a trusted checkpoint.

    Returns:
        ``(trainer_state, meta)``.

    Raises:
        CheckpointCorruptError: ``meta.json`` or any data file is missing, truncated or corrupt (nothing loaded).
        UnsafeCheckpointError: ``trainer_state`` holds objects that are not allow-listed (nothing loaded).
    """
    target = Path(path).absolute()
    use_dist = _dist_on()
    rank, _ = _rank_world(process_group)
    if rank == 0:
        _recover(target)
    _barrier(process_group)
    meta = verify_checkpoint(target, process_group=process_group)
    for comp in app_state:
        if comp not in meta.get("components", []):
            raise KeyError(
                f"checkpoint {target} has no {comp!r} state (it holds {meta.get('components')}); "
                f"load it without app_state[{comp!r}]"
            )
    # Before DCP writes a byte into the live state: a refused checkpoint must leave nothing half-loaded. Every rank
    # reads the same verified files, so every rank raises the same error (no rank waits in a collective).
    if weights_only is None or weights_only:
        check_dcp_pickles(target, [c for c in COMPONENTS if c in app_state])
    trainer_state = load_trainer_state(target / TRAINER_STATE_FILE, weights_only=weights_only)
    for comp in COMPONENTS:
        if comp in app_state:
            with _quiet_single_process(not use_dist):
                dcp.load(
                    app_state[comp],
                    storage_reader=dcp.FileSystemReader(target / comp),
                    process_group=process_group,
                    no_dist=not use_dist,
                )
    return trainer_state, meta


def load_full_state_dict(
    path: str | os.PathLike, component: str = "model", *, verify: bool = True, weights_only: bool | None = None
) -> dict:
    """Read one component of a checkpoint as a full (unsharded) state dict in this process, without a template
    and without a process group (DCP ``_EmptyStateDictLoadPlanner``, as ``dcp_to_torch_save`` does).

    ``weights_only`` (``None`` means ``True``): first refuse DCP pickles that name anything but DCP's own types
    (:func:`check_dcp_pickles`); ``False`` only for a trusted checkpoint."""
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    target = Path(path).absolute()
    _recover(target)
    if verify:
        meta = verify_checkpoint(target, no_dist=True)
        if component not in meta.get("components", []):
            raise KeyError(f"checkpoint {target} has no {component!r} state (it holds {meta.get('components')})")
    if weights_only is None or weights_only:
        check_dcp_pickles(target, [component])
    out: dict[str, Any] = {}
    with _quiet_single_process(True):
        _load_state_dict(
            out,
            storage_reader=dcp.FileSystemReader(target / component),
            planner=_EmptyStateDictLoadPlanner(),
            no_dist=True,
        )
    return out


# ----------------------------------------------------------------------------------------------------------------
# consolidate
# ----------------------------------------------------------------------------------------------------------------
def consolidate(
    path: str | os.PathLike,
    out: str | os.PathLike,
    *,
    prefix_to_strip: str | None = None,
    weights_only: bool | None = None,
) -> Path:
    """Write the model of a sharded checkpoint as one full state dict, offline (no process group).

    Args:
        path: the sharded checkpoint directory.
        out: output file; ``*.safetensors`` is written with safetensors (tensors only), anything else with
            ``torch.save``.
        prefix_to_strip: remove this prefix from keys that have it, e.g. ``"model."`` for a LightningModule
            holding ``self.model``, so the file loads into the bare ``nn.Module``.
        weights_only: ``None``/``True``: refuse a checkpoint whose pickles name anything outside the allow-lists
            (:class:`UnsafeCheckpointError`); ``False``: trust it (full pickle).

    Returns:
        The output path.
    """
    out = Path(out).absolute()
    sd = load_full_state_dict(path, "model", weights_only=weights_only)
    if prefix_to_strip:
        if not any(k.startswith(prefix_to_strip) for k in sd):
            raise ValueError(
                f"prefix_to_strip={prefix_to_strip!r} matches no key of {path}; keys look like {sorted(sd)[:3]}"
            )
        sd = {k.removeprefix(prefix_to_strip): v for k, v in sd.items()}
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.v17-partial"
    if out.suffix == ".safetensors":
        try:
            from safetensors.torch import save_file
        except ImportError as err:
            raise ImportError(f"writing {out.name} needs `pip install safetensors`; or pick a .pt output") from err
        tensors = {k: v.contiguous() for k, v in sd.items() if isinstance(v, torch.Tensor)}
        dropped = sorted(set(sd) - set(tensors))
        if dropped:
            warnings.warn(f"safetensors holds tensors only; dropped non-tensor entries {dropped}", stacklevel=2)
        save_file(tensors, str(tmp), metadata={"format": "pt", "source": str(Path(path).absolute())})
    else:
        torch.save(sd, tmp)
    os.replace(tmp, out)
    return out


def consolidate_main(argv: list[str] | None = None) -> int:
    """``v17 consolidate CKPT OUT [--strip-prefix model.]``; exit status 2 with one line on bad input."""
    parser = argparse.ArgumentParser(
        prog="v17 consolidate",
        description="Merge a v17 sharded checkpoint into one full model state dict (torch file or .safetensors).",
    )
    parser.add_argument("ckpt", help="sharded checkpoint directory (contains meta.json)")
    parser.add_argument("out", help="output file; *.safetensors uses safetensors, anything else torch.save")
    parser.add_argument(
        "--strip-prefix", default=None, help='remove this key prefix, e.g. "model." for a LightningModule.model'
    )
    parser.add_argument(
        "--weights-only",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="refuse pickled objects outside the allow-lists (default); --no-weights-only only for a trusted checkpoint",
    )
    args = parser.parse_args(argv)
    ckpt = Path(args.ckpt)
    try:
        if not ckpt.exists() and not is_sharded_checkpoint(ckpt):
            raise ValueError(f"{ckpt} does not exist")
        if not is_sharded_checkpoint(ckpt):
            raise ValueError(f"{ckpt} is not a v17 sharded checkpoint (no {META_FILE} with format {FORMAT})")
        out = consolidate(ckpt, args.out, prefix_to_strip=args.strip_prefix, weights_only=args.weights_only)
    except (ValueError, KeyError, FileNotFoundError, CheckpointCorruptError, ImportError, UnsafeCheckpointError) as err:
        print(f"v17 consolidate: error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0
