"""``PackedDataModule``: any dataset of token-id documents -> packed batches, for any strategy.

Documents (token-id sequences, texts with a tokenizer, or dicts with ``input_ids`` and an SFT ``loss_mask``) are
planned into rows once per ``setup`` (:func:`lightning_v17.data.packing.pack`, pure Python over lengths only); rows
are materialized on demand in the DataLoader workers. The train sampler is a :class:`PackedRowSampler`: shuffled by
(seed, epoch), sharded over the data-parallel ranks the trainer's strategy reports, and resumable: this module's
``state_dict()`` -- which Lightning stores in every checkpoint -- counts the batches actually trained on (not the
ones prefetched), and ``load_state_dict`` makes the next epoch iteration start exactly after them.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from functools import partial
from typing import Any

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset

from lightning_v17.data.packing import (
    PackedRowSampler,
    PackingMode,
    PackingPlan,
    collate_rows,
    materialize_row,
    pack,
)
from lightning_v17.data.tokenizer import ByteTokenizer


class DocumentSource:
    """Uniform random access to documents: ids (and optional loss masks) by index, lengths without re-reading.

    Map-style datasets are indexed lazily; iterable ones are read once into memory (packing needs all lengths).
    """

    def __init__(self, dataset: Any, tokenizer: Callable[[str], Sequence[int]] | None = None) -> None:
        self.tokenizer = tokenizer
        if isinstance(dataset, IterableDataset) or not hasattr(dataset, "__getitem__"):
            dataset = list(dataset)
        self.dataset = dataset
        lengths_fn = getattr(dataset, "lengths", None)
        if callable(lengths_fn):
            self.lengths = [int(n) for n in lengths_fn()]
            self.has_loss_mask = False
        else:
            self.lengths = []
            self.has_loss_mask = False
            for i in range(len(dataset)):
                item = dataset[i]
                self.has_loss_mask |= isinstance(item, Mapping) and "loss_mask" in item
                self.lengths.append(len(self._ids(item)))

    def _ids(self, item: Any) -> Any:
        if isinstance(item, Mapping):
            item = item["input_ids"]
        if isinstance(item, np.ndarray):  # a token file's memory-map view: copy this document only, as int64
            return torch.from_numpy(item.astype(np.int64))
        if isinstance(item, str | bytes):
            if self.tokenizer is None:
                raise ValueError("the dataset yields text but no tokenizer was given; pass tokenizer=ByteTokenizer()")
            return self.tokenizer(item)
        return item

    def tokens(self, index: int) -> Any:
        return self._ids(self.dataset[index])

    def loss_mask(self, index: int) -> Any:
        item = self.dataset[index]
        mask = item.get("loss_mask") if isinstance(item, Mapping) else None
        return torch.ones(self.lengths[index]) if mask is None else mask


class PackedRows(Dataset):
    """Map-style dataset of the rows of a plan: row index -> tensors from :func:`materialize_row`."""

    def __init__(self, source: DocumentSource, plan: PackingPlan, *, pad_id: int) -> None:
        self.source = source
        self.plan = plan
        self.pad_id = pad_id

    def __len__(self) -> int:
        return self.plan.num_rows

    def __getitem__(self, index: int) -> dict[str, Any]:
        return materialize_row(
            self.plan.rows[index],
            self.source.tokens,
            pad_to=self.plan.seq_len if self.plan.mode.packs else None,
            pad_id=self.pad_id,
            loss_mask_of=self.source.loss_mask if self.source.has_loss_mask else None,
        )


class _ThreadPrefetch(Iterator):
    """Runs ``it`` on a daemon thread, up to ``depth`` batches ahead of the consumer (same batches, same order).

    Packing a row and collating a batch are small tensor ops and Python loops; on the training thread they sit on
    the critical path of every step. On this thread they run while the training thread computes or waits in a
    collective (torch kernels and gloo waits release the GIL). An exception in the producer is raised by ``next``.
    """

    _END = object()

    def __init__(self, it: Iterator, depth: int) -> None:
        self._q: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(it,), name="v17-data-prefetch", daemon=True)
        self._thread.start()

    def _put(self, item: Any) -> bool:
        while not self._stop.is_set():
            try:
                self._q.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _run(self, it: Iterator) -> None:
        try:
            for batch in it:
                if not self._put((True, batch)):
                    return
            self._put((True, self._END))
        except BaseException as err:  # noqa: BLE001 - handed to the consumer, raised there
            self._put((False, err))

    def __next__(self) -> Any:
        ok, item = self._q.get()
        if not ok:
            raise item
        if item is self._END:
            raise StopIteration
        return item

    def close(self) -> None:
        """Stop the producer (it exits at its next batch); batches already made are dropped."""
        self._stop.set()

    def __del__(self) -> None:
        self._stop.set()


class ResumableDataLoader(DataLoader):
    """A DataLoader that Lightning treats as resumable (it has ``state_dict``/``load_state_dict``).

    The position itself is kept by ``state_owner`` (the :class:`PackedDataModule`), which counts the batches actually
    trained on, so the DataLoader's and Lightning's prefetching never make a resume skip rows. With
    ``prefetch_batches > 0`` and no worker processes, batches are built that many ahead on a background thread.
    """

    def __init__(self, *args: Any, state_owner: Any = None, prefetch_batches: int = 0, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.state_owner = state_owner
        self.prefetch_batches = prefetch_batches

    def __iter__(self) -> Iterator:
        it = super().__iter__()
        if self.prefetch_batches > 0 and self.num_workers == 0:
            return _ThreadPrefetch(it, self.prefetch_batches)
        return it

    def state_dict(self) -> dict[str, Any]:
        return self.state_owner.state_dict() if self.state_owner is not None else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.state_owner is not None:
            self.state_owner.load_state_dict(state_dict)

    def __len__(self) -> int:
        remaining = super().__len__()
        return self.state_owner.loader_length(remaining) if self.state_owner is not None else remaining


class PackedDataModule(L.LightningDataModule):
    """Packed train/validation batches from any document dataset (default: the embedded stdlib corpus).

    Batches are dicts: ``input_ids``, ``position_ids``, ``labels``, ``doc_ids`` [B, S], ``cu_seqlens`` (int32),
    ``max_seqlen`` and, for SFT data, ``loss_mask`` (see ``lightning_v17.data.packing``).

    Args:
        dataset: training documents: a map-style or iterable dataset of token-id sequences, of texts (with
            ``tokenizer``), or of dicts ``{"input_ids": ..., "loss_mask": ...}``; a Hugging Face ``datasets.Dataset``
            with an integer ``input_ids`` column, or the directory it was ``save_to_disk``-ed to, is read in place
            from its Arrow buffers (:class:`~lightning_v17.data.hf_arrow.ArrowTokens`: no row is converted to
            Python; other columns such as ``loss_mask`` are not read). None: the stdlib corpus.
        val_dataset: validation documents, same forms; None: the stdlib corpus's validation split when ``dataset``
            is None too, else no validation.
        tokenizer: text -> ids, used when items are text (default: byte-level).
        seq_len: tokens per row.
        batch_size: rows per batch per data-parallel rank.
        packing: ``ffd`` (first-fit decreasing), ``best_fit``, ``bucket`` (no packing; similar lengths batched
            together), ``none`` (no packing; padded to the longest row of each batch) or ``concat`` (token files:
            documents concatenated and cut every ``seq_len`` tokens, Megatron's GPT mode). None: ``concat`` with
            ``paths``, else ``ffd``.
        shuffle: reshuffle training rows every epoch (seeded by ``seed`` and the epoch); with ``concat`` the rows
            always come in the index's seeded order.
        seed: shuffle seed.
        drop_last: cut each epoch to whole batches on every rank, so all ranks step in lock-step.
        num_workers: DataLoader worker processes.
        pin_memory: pin host memory; None: only when CUDA is available.
        persistent_workers: keep workers alive between epochs (only with ``num_workers > 0``).
        prefetch_batches: with ``num_workers=0``, batches packed and collated ahead of the step on a background
            thread of each rank (0: built on demand by the training loop). The default 2 takes data loading off
            the critical path without extra processes (2 ranks on 2 cores have no core to spare for workers); the
            resume position counts batches trained on, so prefetched ones are never skipped.
        val_fraction: stdlib corpus: fraction of documents held out for validation.
        corpus_cache_dir: stdlib corpus: cache directory (default ``~/.cache/lightning_v17``).
        paths: token files (``.bin/.idx`` prefixes, e.g. from ``v17 preprocess``) to train on instead of
            ``dataset``; an entry may also be a Hugging Face ``save_to_disk`` directory (or, from Python, a
            ``datasets.Dataset``) with an integer ``input_ids`` column, blended like a token file of the same
            documents. Blended by ``weights``, cut every ``seq_len`` tokens behind the lazy index of
            :class:`~lightning_v17.data.blend.BlendedTokens` (``packing`` must be ``concat``, the default with
            ``paths``; ``ffd`` plans over a single path's lengths instead).
        weights: one sampling weight per path (normalized); None: in proportion to their sizes, every sample of
            every corpus once per epoch.
        num_samples: rows per epoch with ``paths``; None: the corpora's rows added up.
        val_paths: token files for validation with ``paths`` (one file with ``packing="ffd"``; None: no validation).
        mixture_change: on resume, accept other ``paths``/``weights`` than the checkpoint's and continue from its
            position under the new mixture, repeating nothing already seen (without it such a resume is refused).
    """

    def __init__(
        self,
        dataset: Dataset | Iterable | None = None,
        val_dataset: Dataset | Iterable | None = None,
        tokenizer: ByteTokenizer | None = None,
        seq_len: int = 512,
        batch_size: int = 8,
        packing: str | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = True,
        num_workers: int = 0,
        pin_memory: bool | None = None,
        persistent_workers: bool = False,
        prefetch_batches: int = 2,
        val_fraction: float = 0.05,
        corpus_cache_dir: str | None = None,
        paths: list[str] | None = None,
        weights: list[float] | None = None,
        num_samples: int | None = None,
        val_paths: list[str] | None = None,
        mixture_change: bool = False,
    ) -> None:
        super().__init__()
        if paths is not None and dataset is not None:
            raise ValueError("data.paths and data.dataset both given; train on token files (paths) or on a dataset")
        if (weights is not None or num_samples is not None or val_paths is not None) and paths is None:
            raise ValueError("data.weights, data.num_samples and data.val_paths need data.paths (token files)")
        # `concat` (token files cut every seq_len tokens) has no plan, so it is not a PackingMode: parsed here once.
        self.concat = packing == "concat" or (packing is None and paths is not None and len(paths) > 0)
        self.mode = PackingMode.FFD if self.concat else PackingMode.parse(packing or "ffd")
        if paths is not None and not self.concat:
            if len(paths) != 1 or weights is not None:
                raise ValueError(f"packing={packing!r} plans one dataset; blended data.paths use packing='concat'")
            dataset, paths = _one_dataset(paths[0]), None
            if val_paths is not None:  # ffd plans one validation file the same way
                if len(val_paths) != 1:
                    raise ValueError(f"packing={packing!r} plans one validation file; got data.val_paths={val_paths}")
                val_dataset, val_paths = _one_dataset(val_paths[0]), None
        if self.concat and paths is None:
            raise ValueError("packing='concat' cuts token files: give data.paths")
        self.paths, self.weights, self.num_samples = paths, weights, num_samples
        self.val_paths, self.mixture_change = val_paths, mixture_change
        if seq_len < 2:
            raise ValueError(f"seq_len={seq_len} must be >= 2")
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be >= 1")
        if num_workers < 0:
            raise ValueError(f"num_workers={num_workers} must be >= 0")
        if prefetch_batches < 0:
            raise ValueError(f"prefetch_batches={prefetch_batches} must be >= 0 (0: no prefetch thread)")
        from lightning_v17.data.hf_arrow import ArrowTokens, is_arrow_input

        # A Hugging Face Dataset (or its save_to_disk directory) is read in place: lengths from its offsets.
        self.dataset = ArrowTokens(dataset) if is_arrow_input(dataset) else dataset
        self.val_dataset = ArrowTokens(val_dataset) if is_arrow_input(val_dataset) else val_dataset
        self.tokenizer = tokenizer or ByteTokenizer()
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.num_workers = num_workers
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        self.persistent_workers = persistent_workers and num_workers > 0
        self.prefetch_batches = prefetch_batches
        self.val_fraction = val_fraction
        self.corpus_cache_dir = corpus_cache_dir
        self.train_rows: PackedRows | None = None
        self.val_rows: PackedRows | None = None
        self.train_sampler: PackedRowSampler | None = None
        # Resume bookkeeping: (epoch, groups consumed globally when restored, batches trained on since, batches of
        # this epoch trained before the restore as Lightning's loop counts them).
        self._epoch = 0
        self._base_consumed = 0
        self._batches = 0
        self._base_batches = 0
        self._pending_state: dict[str, Any] | None = None

    # ---- setup -----------------------------------------------------------------------------------------------------
    def _rows(self, dataset: Any) -> PackedRows:
        source = DocumentSource(dataset, self.tokenizer)
        if self.mode is PackingMode.FFD:  # the same plan as pack()'s, in numpy arrays (lightning_v17.data.ffd)
            from lightning_v17.data.ffd import pack_ffd, pack_ffd_cached
            from lightning_v17.data.indexed import TokenFileDataset

            if isinstance(dataset, TokenFileDataset):  # cached next to the token file, memory-mapped by other ranks
                plan = pack_ffd_cached(source.lengths, self.seq_len, dataset.prefix)
            else:
                plan = pack_ffd(source.lengths, self.seq_len)
        else:
            plan = pack(source.lengths, self.seq_len, mode=self.mode, group_size=self.batch_size)
        return PackedRows(source, plan, pad_id=self.tokenizer.pad_id)

    def setup(self, stage: str | None = None) -> None:
        if self.train_rows is not None:
            return
        if self.concat:
            from lightning_v17.data.blend import BlendedTokens

            self._check_seq_len()
            kw = {"seq_len": self.seq_len, "seed": self.seed, "pad_id": self.tokenizer.pad_id}
            self.train_rows = BlendedTokens(self.paths, weights=self.weights, num_samples=self.num_samples, **kw)
            self.val_rows = BlendedTokens(self.val_paths, **kw) if self.val_paths else None
            return
        train, val = self.dataset, self.val_dataset
        if train is None:
            from lightning_v17.data.corpus import StdlibCorpus

            kw = {
                "val_fraction": self.val_fraction,
                "cache_dir": self.corpus_cache_dir,
                "vocab_size": self.tokenizer.vocab_size,
            }
            train = StdlibCorpus("train", **kw)
            if val is None:
                val = StdlibCorpus("val", **kw)
        self._check_seq_len()
        self.train_rows = self._rows(train)
        self.val_rows = self._rows(val) if val is not None else None

    def _check_seq_len(self) -> None:
        """Refuse ``seq_len`` longer than the model's context (ours ``max_seq_len``, HF ``max_position_embeddings``,
        litgpt ``block_size``): rows that long would train positions the model was never meant to see, or index
        past a position table."""
        trainer = getattr(self, "trainer", None)
        module = getattr(trainer, "lightning_module", None) if trainer is not None else None
        found = _model_context_length(module)
        if found is not None and self.seq_len > found[1]:
            where, limit = found
            raise ValueError(
                f"seq_len={self.seq_len} (the data module's rows) is longer than the model's context {where}={limit}; "
                f"set data seq_len <= {limit}, or build the model with a longer context"
            )

    def stats(self) -> dict[str, float]:
        """Rows, chunks, split documents and padding fraction of the training plan."""
        if self.train_rows is None:
            self.setup()
        if self.concat:
            return {"rows": float(len(self.train_rows)), "corpora": float(len(self.train_rows.corpora))}
        return self.train_rows.plan.stats(self.batch_size)

    # ---- loaders ---------------------------------------------------------------------------------------------------
    def _dp(self) -> tuple[int, int]:
        trainer = getattr(self, "trainer", None)
        kwargs = (getattr(trainer, "distributed_sampler_kwargs", None) or {}) if trainer is not None else {}
        return int(kwargs.get("num_replicas", 1)), int(kwargs.get("rank", 0))

    def _loader(self, rows: PackedRows, sampler: Any, *, resumable: bool = False) -> DataLoader:
        return ResumableDataLoader(
            rows,
            state_owner=self if resumable else None,
            batch_size=self.batch_size,
            sampler=sampler,
            collate_fn=partial(collate_rows, pad_id=self.tokenizer.pad_id),
            num_workers=self.num_workers,
            pin_memory=self.pin_memory,
            persistent_workers=self.persistent_workers,
            drop_last=False,  # the sampler already gives every rank the same number of rows
            prefetch_batches=self.prefetch_batches,
        )

    def train_dataloader(self) -> DataLoader:
        if self.train_rows is None:
            self.setup("fit")
        world, rank = self._dp()
        self.train_sampler = self._sampler(world, rank)
        if self._pending_state is not None:
            self._restore(self._pending_state)
            self._pending_state = None
        return self._loader(self.train_rows, self.train_sampler, resumable=True)

    def val_dataloader(self) -> DataLoader | list:
        if self.train_rows is None:
            self.setup("validate")
        if self.val_rows is None:
            return []
        world, rank = self._dp()
        if self.concat:
            from lightning_v17.data.blend import PositionSampler

            sampler = PositionSampler(len(self.val_rows), num_replicas=world, rank=rank, drop_last=True)
        else:
            sampler = PackedRowSampler(self.val_rows.plan, num_replicas=world, rank=rank, shuffle=False,
                                       drop_last=True)  # fmt: skip
        return self._loader(self.val_rows, sampler)

    def _sampler(self, world: int, rank: int) -> PackedRowSampler:
        if self.concat:
            from lightning_v17.data.blend import PositionSampler

            return PositionSampler(len(self.train_rows), num_replicas=world, rank=rank, drop_last=self.drop_last)
        return PackedRowSampler(self.train_rows.plan, num_replicas=world, rank=rank, shuffle=self.shuffle,
                                seed=self.seed, drop_last=self.drop_last)  # fmt: skip

    def _restore(self, state: dict[str, Any]) -> None:
        """Load the sampler position and, with token files, the index (refused if the data changed, see
        :meth:`~lightning_v17.data.blend.BlendedTokens.load_index_state`)."""
        if self.concat:
            if "index" not in state:
                raise ValueError("the checkpoint's data state has no token-file index: it was trained on a dataset, "
                                 "not on data.paths; resume with the same data")  # fmt: skip
            if self.mixture_change and int(state["num_rows"]) != len(self.train_rows):
                self.train_rows.num_samples = int(state["num_rows"])  # keep the epoch length of the checkpoint
            position = int(state["epoch"]) * int(state["num_rows"]) + int(state["consumed"])
            self.train_rows.load_index_state(state["index"], position=position, mixture_change=self.mixture_change)
        self.train_sampler.load_state_dict(state)

    # ---- resumability ----------------------------------------------------------------------------------------------
    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        # Called by the training loop right before each step (after prefetching): counts batches trained on.
        trainer = getattr(self, "trainer", None)
        if trainer is not None and trainer.training and self.train_sampler is not None:
            if self.train_sampler.epoch != self._epoch:
                self._epoch, self._base_consumed, self._batches = self.train_sampler.epoch, 0, 0
                self._base_batches = 0
            self._batches += 1
        return batch

    def _groups_per_batch(self) -> int:
        group = self.train_rows.plan.group_size if self.train_rows is not None and not self.concat else 1
        return max(self.batch_size // group, 1)

    def state_dict(self) -> dict[str, Any]:
        """The train sampler's position after the batches trained on so far (Lightning saves this in checkpoints)."""
        if self.train_sampler is None:
            return dict(self._pending_state or {})
        world, _ = self._dp()
        state = self.train_sampler.state_dict()
        if self.train_sampler.epoch == self._epoch:
            state["consumed"] = self._base_consumed + self._batches * world * self._groups_per_batch()
            state["batches"] = self._base_batches + self._batches
        else:
            state["consumed"] = state["batches"] = 0
        if self.concat:
            state["index"] = self.train_rows.index_state()
        return state

    def loader_length(self, remaining: int) -> int:
        """``len()`` of the train loader as Lightning's loop reads it, given the ``remaining`` batches of this rank.

        Lightning restores its count of the epoch's batches on resume and ends the epoch when that count reaches
        ``len(loader)``; it reads ``len`` once and keeps it for the later epochs. So ``len`` must count the epoch from
        its start: the batches trained before the restore plus those left (the remaining ones alone ended a resumed
        epoch that many batches early, and every later epoch too). After a resume at another data-parallel size the
        two parts are in different units and a later epoch has its own length; the larger of the two is returned,
        and the loop then ends each epoch when the sampler runs out (an upper bound is safe, a lower one skips data).
        """
        if self.train_sampler is None or self.train_rows is None:
            return remaining
        world, rank = self._dp()
        fresh = self._sampler(world, rank)
        fresh.seed = self.train_sampler.seed
        fresh.set_epoch(self.train_sampler.epoch)
        return max(self._base_batches + remaining, -(-len(fresh) // self.batch_size))

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not state_dict:
            return
        self._pending_state = dict(state_dict)
        self._epoch = int(state_dict["epoch"])
        self._base_consumed = int(state_dict["consumed"])
        self._base_batches = int(state_dict.get("batches", 0))  # absent from checkpoints of older versions
        self._batches = 0
        if self.train_sampler is not None:
            self._restore(state_dict)
            self._pending_state = None


def _one_dataset(path: Any) -> Any:
    """The documents of one ``data.paths`` entry for a planned packing: a token file or a Hugging Face dataset."""
    from lightning_v17.data.hf_arrow import ArrowTokens, is_arrow_input
    from lightning_v17.data.indexed import TokenFileDataset

    return ArrowTokens(path) if is_arrow_input(path) else TokenFileDataset(path)


_CONTEXT_ATTRS = ("max_seq_len", "max_position_embeddings", "block_size")


def _model_context_length(module: Any) -> tuple[str, int] | None:
    """(attribute path, value) of the model's context length, looked up on the LightningModule, its ``config``, its
    ``model`` and ``model.config`` (our reference model, HF ``transformers``, litgpt); None when none is found."""
    if module is None:
        return None
    model = getattr(module, "model", None)
    candidates = (
        ("config", getattr(module, "config", None)),
        ("model.config", getattr(model, "config", None)),
        ("model", model),
    )
    for prefix, obj in candidates:
        for attr in _CONTEXT_ATTRS:
            value = getattr(obj, attr, None) if obj is not None else None
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return f"{prefix}.{attr}", value
    return None
