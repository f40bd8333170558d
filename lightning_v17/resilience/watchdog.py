"""A step watchdog: a hung rank is named (with the collective it waits in and the step), a failing rank ends its
peers with its own error, and both exit non-zero so an elastic launcher restarts the group.

Torch-only, Lightning-free. Why it is needed (design §16; Lightning#20434, #19487): a collective that one rank never
joins blocks the others until the process-group timeout (30 minutes by default) with a message that names neither
the rank nor the op; and a rank that raises leaves its peers blocked the same way. ``ProcessGroupGloo.abort()`` does
not unblock a pending operation (measured here, torch 2.13), so, as torch's NCCL watchdog does with
``TORCH_NCCL_ASYNC_ERROR_HANDLING``, the process is ended rather than left hung.

How: every rank runs one daemon thread. The training loop reports progress (:meth:`StepWatchdog.progress`, at each
step's hooks). Every ``poll_s`` the thread

1. publishes this rank's heartbeat to the default process group's store: the step, the phase, and the collective
   the main thread is inside (the innermost ``torch.distributed`` frame of its Python stack, read with
   ``sys._current_frames()``: no collective is wrapped or patched, so this costs nothing on the hot path);
2. ends this process with exit code 1 when a peer published a failure (its exception, first writer wins);
3. when no progress was reported for longer than ``hang_timeout_s``: reads every rank's heartbeat, prints which
   rank waits in which collective at which step and which ranks are *not* inside a collective (the likely
   culprits), dumps torch's Flight Recorder trace where torch keeps one (NCCL), and exits with
   :data:`HANG_EXIT_CODE`.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist

__all__ = ["HANG_EXIT_CODE", "StepWatchdog", "current_collective"]

#: Exit code of a rank the watchdog ends for a hang (a peer's failure ends a rank with 1, as an uncaught error does).
HANG_EXIT_CODE = 3
_DIST_DIR = os.path.dirname(dist.__file__)


def current_collective(thread_id: int) -> str | None:
    """The ``torch.distributed`` function the thread is inside (innermost frame), e.g. ``"all_reduce"``; None when it
    is not inside one. Read from the thread's live Python stack (``sys._current_frames``)."""
    frame = sys._current_frames().get(thread_id)
    found = None
    while frame is not None:
        code = frame.f_code
        if code.co_filename.startswith(_DIST_DIR) and not code.co_name.startswith("_"):
            found = found or code.co_name  # innermost public torch.distributed function
        frame = frame.f_back
    return found


def _describe(err: BaseException, limit: int = 6000) -> str:
    text = "".join(traceback.format_exception(err))
    if len(text) > limit:
        text = text[: limit // 2] + "\n[...]\n" + text[-limit // 2 :]
    return f"{type(err).__name__}: {err}\n{text}"


def _flight_recorder_dump() -> str:
    """Where torch keeps a Flight Recorder (NCCL builds): write its trace next to the working directory."""
    dump = getattr(dist.distributed_c10d, "_dump_nccl_trace", None) or getattr(
        __import__("torch")._C._distributed_c10d, "_dump_nccl_trace", None
    )
    if dump is None or dist.get_backend() != "nccl":
        return "no Flight Recorder trace (torch keeps one for NCCL process groups only)"
    try:
        path = os.path.abspath(f"v17_flight_recorder_rank{dist.get_rank()}.pkl")
        with open(path, "wb") as f:
            f.write(dump())
        return f"Flight Recorder trace written to {path}"
    except Exception as err:  # noqa: BLE001 - the diagnosis matters more than the dump
        return f"Flight Recorder dump failed: {err!r}"


class StepWatchdog:
    """Hang detection and failure propagation for one training run (see the module docstring).

    Args:
        hang_timeout_s: seconds without progress after which this rank is ended with a diagnosis; None: no hang
            detection (a peer's failure still ends this rank).
        prefix: store key prefix shared by the ranks of one run and attempt (e.g. ``v17/attempt-0/watchdog``).
        poll_s: seconds between two polls of the store; None: 0.5 s, longer on big jobs so that all ranks together
            send at most about 2000 store requests per second.
    """

    def __init__(self, hang_timeout_s: float | None, *, prefix: str, poll_s: float | None = None) -> None:
        if hang_timeout_s is not None and hang_timeout_s <= 0:
            raise ValueError(f"hang_timeout={hang_timeout_s} must be a positive number of seconds, or None (off)")
        self.hang_timeout_s = hang_timeout_s
        self.prefix = prefix
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.poll_s = max(0.5, self.world / 2000) if poll_s is None else poll_s
        self._store: Any = None
        if self.world > 1:
            with contextlib.suppress(Exception):  # no default store (exotic init): no watchdog
                self._store = dist.distributed_c10d._get_default_store()
        self._main = threading.main_thread().ident
        self._last = time.monotonic()
        self._step, self._phase = 0, "setup"
        self._armed = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def active(self) -> bool:
        return self._store is not None

    def start(self) -> None:
        """Start the thread (idempotent) and arm it."""
        if self._store is None:
            return
        self._last = time.monotonic()
        self._armed.set()
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="v17-step-watchdog", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """Disarm: no hang detection and no ending for a peer's failure (e.g. after ``fit`` returned)."""
        self._armed.clear()

    def progress(self, step: int, phase: str) -> None:
        """The loop made progress (a hook ran): reset the hang clock."""
        self._step, self._phase, self._last = step, phase, time.monotonic()

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        """Publish an exception raised in the body for the peers, then re-raise it."""
        try:
            yield
        except Exception as err:
            if self._store is not None and self._armed.is_set():
                self._armed.clear()  # this rank's own failure must never end this rank
                with contextlib.suppress(Exception):  # the original error matters more than the report
                    self._store.compare_set(f"{self.prefix}/failure", "", f"rank {self.rank}: {_describe(err)}")
            raise

    # -- the thread ----------------------------------------------------------------------------------------------
    def _heartbeat(self) -> dict[str, Any]:
        return {"rank": self.rank, "host": os.uname().nodename, "step": self._step, "phase": self._phase,
                "collective": current_collective(self._main), "idle_s": round(time.monotonic() - self._last, 1)}  # fmt: skip

    def _loop(self) -> None:
        while not self._stop.is_set():
            time.sleep(self.poll_s)
            if not self._armed.is_set():
                continue
            try:
                if self.hang_timeout_s is not None:
                    self._store.set(f"{self.prefix}/rank{self.rank}", json.dumps(self._heartbeat()))
                failed = self._store.check([f"{self.prefix}/failure"])
                text = self._store.get(f"{self.prefix}/failure").decode(errors="replace") if failed else ""
            except Exception:  # noqa: BLE001 - the store's host ended: the main thread's collective reports that
                return
            if failed and not text.startswith(f"rank {self.rank}:") and self._armed.is_set():
                self._exit(1, f"ending this rank because a peer failed; the first failure was on {text}")
            idle = time.monotonic() - self._last
            if self.hang_timeout_s is not None and idle > self.hang_timeout_s and self._armed.is_set():
                self._exit(HANG_EXIT_CODE, self._hang_report(idle))

    def _hang_report(self, idle: float) -> str:
        me = self._heartbeat()
        peers = []
        for r in range(self.world):
            try:
                peers.append(json.loads(self._store.get(f"{self.prefix}/rank{r}")) if r != self.rank else me)
            except Exception:  # noqa: BLE001 - a peer without a heartbeat is itself a finding
                peers.append({"rank": r, "step": None, "phase": "no heartbeat", "collective": None, "idle_s": None})
        outside = [p["rank"] for p in peers if not p.get("collective")]
        waiting = me["collective"] or "(none: not in torch.distributed)"
        head = (
            f"hang: rank {self.rank} made no progress for {idle:.1f} s (hang_timeout={self.hang_timeout_s} s) at "
            f"global_step {me['step']} ({me['phase']}), waiting in collective {waiting}"
        )
        rows = [
            f"  rank {p['rank']} on {p.get('host', '?')}: global_step {p['step']}, {p['phase']}, "
            f"{p['collective'] or 'not in a collective'}, {p['idle_s']} s"
            for p in peers
        ]
        lines = [
            head,
            "ranks (global_step, phase, collective the main thread is in, seconds since its last progress):",
            *rows,
            f"likely culprit(s), not inside a collective: {outside or 'none (all wait: a mismatched collective?)'}",
            _flight_recorder_dump(),
            f"exiting with code {HANG_EXIT_CODE} so that an elastic launcher (torchrun --max-restarts) restarts the group",
        ]
        return "\n".join(lines)

    def _exit(self, code: int, message: str) -> None:
        sys.stderr.write(f"\n[lightning_v17 watchdog] rank {self.rank}: {message}\n")
        sys.stderr.flush()
        os._exit(code)
