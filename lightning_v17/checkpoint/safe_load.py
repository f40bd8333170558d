"""Safe checkpoint loading (part of :mod:`lightning_v17.checkpoint.sharded`, which re-exports it): ``trainer_state``
with ``weights_only=True`` and a minimal allow-list, DCP's own pickles checked before DCP reads them.
"""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path
from typing import Any

import torch


class UnsafeCheckpointError(pickle.UnpicklingError):
    """A checkpoint's pickles (``trainer_state``, DCP's ``.metadata`` index or a non-tensor DCP entry) name objects
    that are not allow-listed for ``weights_only=True`` loading; nothing was executed or loaded.

    Subclasses :class:`pickle.UnpicklingError`, which is what ``torch.load(weights_only=True)`` itself raises.
    """


def _numpy_rng_globals() -> list[Any]:
    """What ``numpy.random.get_state()`` pickles as: ``('MT19937', uint32[624] ndarray, int, int, float)``.

    ``AsyncCheckpoint`` stores every rank's numpy RNG state (``v17_rng_states``). Only the uint32 dtype is allowed,
    so an object-dtype array (which would unpickle arbitrary items) is still refused. numpy 2 renamed
    ``numpy.core`` to ``numpy._core``; the old name is accepted too, for checkpoints written under numpy 1.x.
    """
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy is a dependency
        return []
    core = getattr(np, "_core", None) or np.core
    reconstruct = core.multiarray._reconstruct
    return [
        reconstruct,
        (reconstruct, "numpy.core.multiarray._reconstruct"),
        np.ndarray,
        np.dtype,
        type(np.dtype(np.uint32)),  # numpy.dtypes.UInt32DType (numpy >= 1.25), the dtype instance being built
    ]


TRAINER_STATE_SAFE_GLOBALS: list[Any] = _numpy_rng_globals()
"""Types allow-listed (scoped, with ``torch.serialization.safe_globals``) when ``trainer_state`` is loaded with
``weights_only=True``, beyond torch's defaults (tensors, dicts, lists, tuples, ``OrderedDict``, primitives). Measured
from the checkpoints ``V17Strategy``, ``ModelCheckpoint`` and ``AsyncCheckpoint`` write: Lightning's loops, callback
and lr scheduler states and our trackers' states are all primitives and tensors; only the numpy RNG state is not."""


def _weights_only_detail(err: BaseException) -> str:
    """The one line of torch's weights-only refusal that names the offending global."""
    text = str(err)
    for line in text.splitlines():
        if "WeightsUnpickler error:" in line:
            detail = line.split("WeightsUnpickler error:", 1)[1].split(" Please use", 1)[0].strip().rstrip(".")
            if detail:
                return detail
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[0] if lines else type(err).__name__


def _refusal(name: Any, detail: str) -> str:
    return (
        f"refused to load {name}: the checkpoint contains objects that are not allow-listed for safe loading "
        f"(weights_only=True): {detail}. Nothing from it was executed or loaded. If you trust this checkpoint, "
        "allow-list exactly the named types with torch.serialization.add_safe_globals([...]) before loading, or load "
        "it with weights_only=False: trainer.fit(model, ckpt_path=..., weights_only=False) (also validate/test/"
        "predict), load_sharded(..., weights_only=False) or `v17 consolidate --no-weights-only`"
    )


def _safe_torch_load(src: str | os.PathLike | io.BytesIO, name: Any) -> Any:
    try:
        # Scoped (not add_safe_globals): the allow-list must not leak into the user's own torch.load calls.
        with torch.serialization.safe_globals(TRAINER_STATE_SAFE_GLOBALS):
            return torch.load(src, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        raise UnsafeCheckpointError(_refusal(name, _weights_only_detail(err))) from err


def load_trainer_state(path: str | os.PathLike | io.BytesIO, *, weights_only: bool | None = None) -> Any:
    """``torch.load`` of a checkpoint's ``trainer_state`` on CPU, safely unless told otherwise.

    Args:
        path: the ``trainer_state`` file (or an in-memory buffer).
        weights_only: ``None`` or ``True``: restricted unpickling (torch's default since 2.6) with
            :data:`TRAINER_STATE_SAFE_GLOBALS` allow-listed for this call only; ``False``: full pickle, which runs
            whatever code the file names, so only for a checkpoint from a trusted source.

    Raises:
        UnsafeCheckpointError: the file holds an object that is not allow-listed; it names the file, the object and
            the fix. Nothing in the file was executed.
    """
    if weights_only is not None and not weights_only:
        return torch.load(path, map_location="cpu", weights_only=False)
    name = path if isinstance(path, (str, os.PathLike)) else "<trainer_state buffer>"
    return _safe_torch_load(path, name)


# DCP reads a directory's ``.metadata`` index with a plain ``pickle.load`` (FileSystemReader.read_metadata) and its
# non-tensor entries with ``torch.load(weights_only=False)`` (DefaultLoadPlanner.load_bytes); tensors themselves are
# read with weights_only=True. These are the globals a DCP index of torch 2.13 names (measured on our checkpoints).
_DCP_METADATA_GLOBALS = frozenset(
    [("torch.distributed.checkpoint.metadata", n) for n in (
        "Metadata", "StorageMeta", "MetadataIndex", "TensorStorageMetadata", "BytesStorageMetadata",
        "ChunkStorageMetadata", "TensorProperties", "_MEM_FORMAT_ENCODING",
    )]
    + [("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch.serialization", "_get_layout"),
       ("torch", "Size"), ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath")]
)  # fmt: skip


class _DcpMetadataUnpickler(pickle.Unpickler):
    """Python's "restricting globals" recipe (docs.python.org/3/library/pickle.html#restricting-globals): every
    class or callable a pickle names goes through ``find_class``, so refusing there refuses any code to run.
    (torch's weights-only unpickler cannot read DCP's index: it is pickle protocol 4, whose FRAME opcode it lacks.)"""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _DCP_METADATA_GLOBALS or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        ):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"Unsupported global: {module}.{name}")


def check_dcp_pickles(path: str | os.PathLike, components: list[str]) -> None:
    """Refuse a checkpoint whose DCP pickles name anything but DCP's own metadata types, before DCP reads them.

    Checks each component's ``.metadata`` with a restricted unpickler and every non-tensor entry it indexes (in the
    ``.distcp`` files) with ``torch.load(weights_only=True)``. DCP then reads the same checksummed bytes with its own
    unrestricted loaders, which can only rebuild what passed here.

    Raises:
        UnsafeCheckpointError: naming the file (and entry) that holds a global outside the allow-lists.
    """
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    target = Path(path).absolute()
    for comp in components:
        md_path = target / comp / ".metadata"
        try:
            with open(md_path, "rb") as f:
                md = _DcpMetadataUnpickler(f).load()
        except pickle.UnpicklingError as err:
            raise UnsafeCheckpointError(_refusal(md_path, str(err))) from err
        byte_fqns = {fqn for fqn, item in md.state_dict_metadata.items() if isinstance(item, BytesStorageMetadata)}
        for index, info in (md.storage_data or {}).items():
            if index.fqn not in byte_fqns:
                continue
            where = f"{target / comp / info.relative_path} (entry {index.fqn!r})"
            if getattr(info, "transform_descriptors", None):
                raise UnsafeCheckpointError(_refusal(where, "DCP storage transforms, which safe loading cannot read"))
            with open(target / comp / info.relative_path, "rb") as f:
                f.seek(info.offset)
                payload = io.BytesIO(f.read(info.length))
            _safe_torch_load(payload, where)
