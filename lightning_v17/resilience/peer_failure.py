"""A failing pipeline stage ends its peers within a second, with its error (part of
:mod:`lightning_v17.engine.pipeline.runtime`, which re-exports it).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist

# -------------------------------------------------------------------------------------------------- a failing stage


def _describe(err: BaseException, limit: int = 8000) -> str:
    """The root cause first (torch's ``PipelineStage`` wraps a stage's error in "failed to run forward"), then the
    traceback, cut in the middle when longer than ``limit`` characters."""
    root = err
    for _ in range(32):  # a bounded walk down the chain of causes
        if (nxt := root.__cause__ or root.__context__) is None:
            break
        root = nxt
    text = "".join(traceback.format_exception(err))
    if len(text) > limit:
        text = text[: limit // 2] + "\n[...]\n" + text[-limit // 2 :]
    return f"{type(root).__name__}: {root}\n{text}"


class PeerFailureWatch:
    """Ends this process within about ``poll_s`` when another rank fails inside the same pipeline step.

    Why: a stage that raises leaves its peers blocked in a P2P send/receive of the schedule. On gloo that wait only
    ends at the process-group timeout (30 minutes by default), and ``ProcessGroupGloo.abort()`` does not unblock it
    (measured here, torch 2.13: the peer of a rank that raised and stayed alive waited the full timeout with a
    message that names no error). So, as torch's NCCL watchdog does with ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` (it
    tears the process down rather than leave a rank hung in a collective), the failing rank publishes its traceback
    in the default process group's store (first writer wins: ``compare_set``) and re-raises; every rank inside a
    step polls that key from a daemon thread and, when a peer's failure appears, prints that traceback to stderr and
    ends its own process with exit code 1 (a launcher such as torchrun then tears the job down). The thread polls
    only while a step runs (``guard``), so a rank that already left its step, or a failure before any step, ends
    nothing.

    Args:
        key: store key shared by all ranks of one pipeline runtime (:func:`build_schedule` makes it).
        poll_s: seconds between two polls of the store (one small request each). None: 0.25 s, longer on big jobs
            so that all ranks together send at most about 2000 requests per second to the store's host.
    """

    def __init__(self, key: str, *, poll_s: float | None = None) -> None:
        self.key = key
        world = dist.get_world_size() if dist.is_initialized() else 1
        self.poll_s = max(0.25, world / 2000) if poll_s is None else poll_s
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self._store: Any = None
        if world > 1:
            with contextlib.suppress(Exception):  # no default store (exotic init): no watchdog, as before
                self._store = dist.distributed_c10d._get_default_store()
        self._armed = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def active(self) -> bool:
        """Whether a store is available to watch (a multi-rank process group)."""
        return self._store is not None

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        """Watch peers while the body runs; publish this rank's own exception before re-raising it."""
        if self._store is None:
            yield
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="v17-pipeline-watchdog", daemon=True)
            self._thread.start()
        self._armed.set()
        try:
            yield
        except Exception as err:
            self._armed.clear()  # before publishing: this rank's own key must never end this rank
            self._publish(_describe(err))
            raise
        finally:
            self._armed.clear()

    def _publish(self, text: str) -> None:
        with contextlib.suppress(Exception):  # the original error matters more than the report
            self._store.compare_set(self.key, "", f"rank {self.rank}: {text}")

    def _loop(self) -> None:
        while True:
            self._armed.wait()
            try:
                failed = self._store.check([self.key])
                text = self._store.get(self.key).decode(errors="replace") if failed else ""
            except Exception:  # noqa: BLE001 - the store's host rank ended: gloo reports that in the main thread
                return
            if failed and not text.startswith(f"rank {self.rank}:") and self._armed.is_set():
                sys.stderr.write(
                    f"\n[lightning_v17 pipeline] rank {self.rank}: ending this process because a pipeline peer "
                    "failed during the same step; a pending gloo P2P send/receive cannot be cancelled, so this "
                    "rank would otherwise wait for the process-group timeout. The first failure was on "
                    f"{text}\n"
                )
                sys.stderr.flush()
                os._exit(1)
            time.sleep(self.poll_s)
