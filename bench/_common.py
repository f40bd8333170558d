"""Shared pieces of the side-by-side benchmarks: one model, one data stream, one launcher, one way to measure.

Every configuration of a benchmark runs in its own pair of *fresh* processes (so peak RSS is not inherited and no
warm cache favours a later run), on the same model (same seed), the same synthetic token batches and the same number
of steps. Throughput is measured between two barriers that bracket the timed steps, so it is the wall clock of the
slowest rank; warm-up steps are excluded. Nothing here is imported by the package or by ``make test``.

Running this file does nothing (``make bench`` runs every ``bench/*.py``).
"""

from __future__ import annotations

import json
import math
import os
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Any

# --------------------------------------------------------------------------------------------------- model + data


@dataclass(frozen=True)
class GPTShape:
    """A small GPT-like decoder whose matmuls dominate a step on 2 CPU ranks (fp32).

    Args:
        vocab: vocabulary size (tokens).
        hidden: model width.
        layers: number of transformer blocks (each one FSDP/ZeRO-3 wrap unit).
        heads: attention heads.
        seq: tokens per sample.
        batch: samples per rank per step (micro-batch == global batch / world size; no accumulation).
    """

    vocab: int = 1024
    hidden: int = 256
    layers: int = 4
    heads: int = 8
    seq: int = 256
    batch: int = 8

    def num_params(self) -> int:
        h, v, L = self.hidden, self.vocab, self.layers
        block = (h * 3 * h + 3 * h) + (h * h + h) + (h * 4 * h + 4 * h) + (4 * h * h + h) + 4 * h  # attn, mlp, 2 LN
        return v * h + self.seq * h + L * block + 2 * h + h * v  # tok emb, pos emb, blocks, final LN, untied head

    def train_flops_per_token(self) -> float:
        """Training FLOPs per token: 6*N (dense, fwd+bwd) + 12*L*h*S (attention scores, Kaplan 2020 / PaLM App. B)."""
        n_dense = self.num_params() - self.vocab * self.hidden - self.seq * self.hidden  # embeddings are lookups
        return 6.0 * n_dense + 12.0 * self.layers * self.hidden * self.seq


def build_gpt(shape: GPTShape):
    """Pre-LN GPT: token+learned-position embeddings, ``layers`` blocks in an ``nn.ModuleList`` (the wrap units that
    FSDP2 / V17 auto-wrap detect), final LayerNorm, untied output head. Causal SDPA attention, GELU MLP, no dropout."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            h = shape.hidden
            self.ln1 = nn.LayerNorm(h)
            self.qkv = nn.Linear(h, 3 * h)
            self.proj = nn.Linear(h, h)
            self.ln2 = nn.LayerNorm(h)
            self.fc1 = nn.Linear(h, 4 * h)
            self.fc2 = nn.Linear(4 * h, h)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            B, S, h = x.shape
            q, k, v = self.qkv(self.ln1(x)).view(B, S, 3, shape.heads, h // shape.heads).permute(2, 0, 3, 1, 4)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(a.transpose(1, 2).reshape(B, S, h))
            return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))

    class GPT(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok_emb = nn.Embedding(shape.vocab, shape.hidden)
            self.pos_emb = nn.Embedding(shape.seq, shape.hidden)
            self.blocks = nn.ModuleList(Block() for _ in range(shape.layers))
            self.ln_f = nn.LayerNorm(shape.hidden)
            self.head = nn.Linear(shape.hidden, shape.vocab, bias=False)

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            pos = torch.arange(tokens.shape[1], device=tokens.device)
            x = self.tok_emb(tokens) + self.pos_emb(pos)
            for blk in self.blocks:
                x = blk(x)
            return self.head(self.ln_f(x))

    torch.manual_seed(0)  # identical initial weights in every configuration and on every rank
    return GPT()


def lm_loss(logits, targets):
    import torch.nn.functional as F

    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def make_batches(shape: GPTShape, rank: int, n_steps: int) -> list[dict]:
    """``n_steps`` batches of synthetic tokens for ``rank`` (a fixed seed per rank; the same in every configuration).

    Each batch is ``{"input": LongTensor[B, S], "target": LongTensor[B, S]}`` (target = input shifted by one)."""
    import torch

    g = torch.Generator().manual_seed(1234 + 7919 * rank)
    out = []
    for _ in range(n_steps):
        t = torch.randint(0, shape.vocab, (shape.batch, shape.seq + 1), generator=g)
        out.append({"input": t[:, :-1].contiguous(), "target": t[:, 1:].contiguous()})
    return out


# ------------------------------------------------------------------------------------------------ in-worker helpers


def worker_setup() -> tuple[int, int]:
    """Per-rank process hygiene: one intra-op thread (2 ranks on 2 cores), returns (rank, world_size)."""
    import torch

    torch.set_num_threads(1)
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


def peak_rss_mb() -> float:
    """Peak resident set size of this process (``ru_maxrss`` is KiB on Linux), in MB (2**20 bytes)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


class CommTimer:
    """Main-thread time spent blocked in collectives over the timed steps: *exposed* communication.

    Installed once per worker (:meth:`install`), it wraps the ``torch.distributed`` collectives called from Python
    (a synchronous call is timed whole: it blocks the caller) and ``Work.wait`` (an asynchronous one blocks only
    while it is waited for). Time a collective spends running on gloo's threads while the main thread computes is
    hidden, so it is not counted. Includes the wait for a slower peer rank (skew) at each sync point: that is what
    the step loses there. Only counted while :attr:`active` (the :class:`StepTimer` window), and nested calls once
    (a synchronous collective that waits internally is counted by its outer call only). Collectives issued from C++
    (DDP's reducer) are invisible here, so Lightning ``"ddp"`` reports only its Python-level ones.
    """

    OPS = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single", "broadcast",
           "all_gather", "reduce_scatter", "_broadcast_coalesced", "all_gather_object", "broadcast_object_list")  # fmt: skip

    def __init__(self) -> None:
        self.active = False
        self.installed = False
        self.seconds: dict[str, float] = {}
        self._depth = 0

    def _timed(self, name: str, fn: Any) -> Any:
        timer = self

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            if not timer.active or timer._depth:
                return fn(*args, **kwargs)
            timer._depth += 1
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                timer._depth -= 1
                if not kwargs.get("async_op"):
                    timer.seconds[name] = timer.seconds.get(name, 0.0) + time.perf_counter() - t

        wrapped._v17_comm_timed = True  # type: ignore[attr-defined]
        return wrapped

    def install(self) -> CommTimer:
        import torch.distributed as dist
        from torch._C._distributed_c10d import Work

        for name in self.OPS:
            fn = getattr(dist, name, None)
            if fn is not None and not getattr(fn, "_v17_comm_timed", False):
                setattr(dist, name, self._timed(name, fn))
        wait = Work.wait
        timer = self

        def timed_wait(work: Any, *args: Any, **kwargs: Any) -> Any:
            if not timer.active or timer._depth:
                return wait(work, *args, **kwargs)
            t = time.perf_counter()
            try:
                return wait(work, *args, **kwargs)
            finally:
                timer.seconds["wait"] = timer.seconds.get("wait", 0.0) + time.perf_counter() - t

        Work.wait = timed_wait
        self.installed = True
        return self

    @property
    def total_s(self) -> float:
        return sum(self.seconds.values())


COMM = CommTimer()


class StepTimer:
    """Barrier-synchronized wall clock over the timed steps (the slowest rank decides, warm-up excluded).

    Call :meth:`after_step` after every optimizer step with the 0-based step index. Besides the wall clock it keeps
    this process's CPU time (all threads) over the same steps: on a machine whose cores are shared with other jobs the
    wall clock mostly measures the neighbours, while CPU seconds per token measure the work our code path does."""

    def __init__(self, warmup: int, steps: int) -> None:
        self.warmup, self.steps = warmup, steps
        self.t0: float | None = None
        self.t1: float | None = None
        self.cpu0: float | None = None
        self.cpu1: float | None = None
        self.ru0: Any = None  # getrusage at the window's ends: system time and minor page faults of the process
        self.ru1: Any = None
        self.step_s: list[float] = []
        self._last: float | None = None

    def after_step(self, step: int) -> None:
        import torch.distributed as dist

        now = time.perf_counter()
        if self._last is not None and step >= self.warmup:
            self.step_s.append(now - self._last)  # per-rank step time, unsynchronized (diagnostic only)
        self._last = now
        if step == self.warmup - 1:
            dist.barrier()
            self.t0 = time.perf_counter()
            self.cpu0 = time.process_time()
            self.ru0 = resource.getrusage(resource.RUSAGE_SELF)
            self._last = self.t0
            COMM.active = True
        elif step == self.warmup + self.steps - 1:
            COMM.active = False
            self.cpu1 = time.process_time()  # before the barrier: waiting for the other rank is not our work
            self.ru1 = resource.getrusage(resource.RUSAGE_SELF)
            dist.barrier()
            self.t1 = time.perf_counter()

    @property
    def seconds(self) -> float:
        if self.t0 is None or self.t1 is None:
            raise RuntimeError("the timed window did not complete (fewer steps ran than warmup + steps)")
        return self.t1 - self.t0


def write_result(path: str, timer: StepTimer, shape: GPTShape, world_size: int, **extra: Any) -> None:
    import torch

    secs = timer.seconds
    tokens = shape.batch * shape.seq * world_size * timer.steps
    res = {
        "seconds": secs,
        "tokens_per_s": tokens / secs,
        "peak_rss_mb": peak_rss_mb(),
        "cpu_s": timer.cpu1 - timer.cpu0,
        # the timed window's system CPU seconds and minor page faults per step (allocator and I/O costs)
        "sys_s_per_step": (timer.ru1.ru_stime - timer.ru0.ru_stime) / timer.steps if timer.ru1 else None,
        "minor_faults_per_step": (timer.ru1.ru_minflt - timer.ru0.ru_minflt) / timer.steps if timer.ru1 else None,
        "rank_tokens": shape.batch * shape.seq * timer.steps,
        "num_threads": torch.get_num_threads(),
        "step_s_median": statistics.median(timer.step_s) if timer.step_s else None,
        **extra,
    }
    if COMM.installed:  # exposed communication: main-thread seconds blocked in collectives per second of the window
        res.update(
            comm_wait_s=COMM.total_s,
            comm_wait_by_op_s={k: round(v, 4) for k, v in sorted(COMM.seconds.items())},
            exposed_comm_share=COMM.total_s / secs,
        )
    with open(path, "w") as f:
        json.dump(res, f)


# ---------------------------------------------------------------------------------------------------- the launcher


def host_info() -> dict:
    """Where a report was measured: the command, the CPU and its kernels, the stack, and any note.

    ``cpu_capability`` is ``torch.backends.cpu.get_cpu_capability()`` (AVX2 hosts emulate bf16 matmuls, AVX512-BF16
    and AMX hosts run them natively: the same bench differs by an order of magnitude between them). ``note`` is the
    ``V17_BENCH_NOTE`` environment variable, e.g. "host shared with other jobs"; ``loadavg_1m`` is read at the end.
    """
    import torch

    cpu_model = None
    try:
        with open("/proc/cpuinfo") as f:
            cpu_model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), None)
    except OSError:
        pass
    script = os.path.relpath(os.path.abspath(sys.argv[0]), os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return {
        "command": " ".join(["python", script, *sys.argv[1:]]),
        "cpu_model": cpu_model,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "loadavg_1m": round(os.getloadavg()[0], 2),
        "note": os.environ.get("V17_BENCH_NOTE"),
    }


def emit_json(report: dict, path: str | None) -> None:
    """Print a benchmark's JSON report and, with ``path`` (``--json-out``), also write exactly that text there.

    The report gets a ``host`` entry (:func:`host_info`) unless it has one; ``bench/render.py`` renders the files
    written to ``bench/results/`` into ``docs/benchmarks.md``.
    """
    if "host" not in report:
        report = {**report, "host": host_info()}
    text = json.dumps(report, indent=1)
    print(text)
    if path:
        with open(path, "w") as f:
            f.write(text + "\n")


def free_port() -> int:
    """A free TCP port chosen by the OS (bind to port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(script: str, worker_args: list[str], *, world_size: int = 2, timeout_s: float = 240.0) -> dict:
    """Run ``python script --_worker ... --_out FILE`` as ``world_size`` fresh processes with torchrun-style env vars.

    Returns ``{"ok": True, "ranks": [result dict per rank]}`` or ``{"ok": False, "error": "..."}``. A Lightning
    ``Trainer(devices=world_size)`` inside the worker sees an externally launched job (LOCAL_RANK is set) and does
    not re-launch. On a failure or a hang every rank is killed (by its own pid) and the stderr tail is returned.
    """
    port = free_port()
    tmp = tempfile.mkdtemp(prefix="v17bench_")
    procs, outs, logs = [], [], []
    for r in range(world_size):
        env = dict(os.environ)
        env.update(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            WORLD_SIZE=str(world_size),
            RANK=str(r),
            LOCAL_RANK=str(r),
            LOCAL_WORLD_SIZE=str(world_size),
            GROUP_RANK="0",
            NODE_RANK="0",
            OMP_NUM_THREADS="1",
            MKL_NUM_THREADS="1",
            PYTHONWARNINGS="ignore",
        )
        out = os.path.join(tmp, f"rank{r}.json")
        log = open(os.path.join(tmp, f"rank{r}.log"), "w+")  # noqa: SIM115 - closed below, after the ranks end
        procs.append(
            subprocess.Popen([sys.executable, script, *worker_args, "--_out", out], env=env, stdout=log, stderr=log)
        )
        outs.append(out)
        logs.append(log)
    deadline = time.monotonic() + timeout_s
    failed = None
    try:
        while any(p.poll() is None for p in procs):
            if time.monotonic() > deadline:
                failed = f"timeout after {timeout_s:.0f}s"
                break
            if any(p.poll() not in (None, 0) for p in procs):
                failed = "a rank exited with code " + str([p.poll() for p in procs])
                time.sleep(1.0)  # let the other rank's error reach its log
                break
            time.sleep(0.1)
    finally:  # also on Ctrl-C / SIGTERM of the driver: never leave ranks behind
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    if failed is None and any(p.returncode != 0 for p in procs):
        failed = "exit codes " + str([p.returncode for p in procs])
    if failed is None:
        try:
            ranks = []
            for o in outs:
                with open(o) as f:
                    ranks.append(json.load(f))
            for log in logs:
                log.close()
            shutil.rmtree(tmp, ignore_errors=True)
            return {"ok": True, "ranks": ranks}
        except (OSError, ValueError) as e:
            failed = f"no result file: {e}"
    tails = []
    for r, log in enumerate(logs):
        log.seek(0)
        lines = [ln for ln in log.read().splitlines() if ln.strip()]
        tails.append(f"[rank {r}] " + " | ".join(lines[-6:]))
    for log in logs:
        log.close()
    return {"ok": False, "error": f"{failed} (logs in {tmp}) :: " + " || ".join(tails)}


def summarize(runs: list[dict]) -> dict:
    """Median over rounds of the global tokens/s (rank 0's measurement of the barrier-bracketed window) and of each
    rank's peak RSS; every round's raw tokens/s is kept for judging the noise."""
    ok = [r for r in runs if r["ok"]]
    if not ok:
        return {"tokens_per_s": None, "peak_rss_mb": None, "error": runs[-1]["error"] if runs else "not run"}
    world = len(ok[0]["ranks"])
    out = {
        "tokens_per_s": round(statistics.median(r["ranks"][0]["tokens_per_s"] for r in ok), 1),
        # tokens of all ranks per CPU-second of all ranks (process CPU time over the timed steps): robust to neighbours
        "tokens_per_cpu_s": round(statistics.median(_per_cpu_s(r) for r in ok), 1),
        "peak_rss_mb": [round(statistics.median(r["ranks"][k]["peak_rss_mb"] for r in ok), 1) for k in range(world)],
        "rounds_tokens_per_s": [round(r["ranks"][0]["tokens_per_s"], 1) for r in ok],
        "rounds_tokens_per_cpu_s": [round(_per_cpu_s(r), 1) for r in ok],
        "step_s_median": [round(r["ranks"][0]["step_s_median"], 4) for r in ok if r["ranks"][0]["step_s_median"]],
        # rank 0, each round: system CPU seconds and minor page faults per timed step
        "sys_s_per_step": [_round(r["ranks"][0].get("sys_s_per_step"), 4) for r in ok],
        "minor_faults_per_step": [_round(r["ranks"][0].get("minor_faults_per_step"), 0) for r in ok],
        # median over rounds of the mean over ranks (None for results written before the CommTimer existed)
        "exposed_comm_share": _median_comm(ok),
        "rounds_exposed_comm_share": [_mean_comm(r) for r in ok],
        "comm_wait_by_op_s_rank0_last_round": ok[-1]["ranks"][0].get("comm_wait_by_op_s"),
        "loss_last": ok[-1]["ranks"][0].get("loss_last"),
    }
    bad = [r["error"] for r in runs if not r["ok"]]
    if bad:
        out["failed_rounds"] = bad
    return out


def _round(x: float | None, n: int) -> float | None:
    return None if x is None else round(x, n)


def _mean_comm(run: dict) -> float | None:
    shares = [k.get("exposed_comm_share") for k in run["ranks"]]
    return round(statistics.mean(shares), 4) if all(x is not None for x in shares) else None


def _median_comm(runs: list[dict]) -> float | None:
    vals = [v for v in (_mean_comm(r) for r in runs) if v is not None]
    return round(statistics.median(vals), 4) if vals else None


def _per_cpu_s(run: dict) -> float:
    return sum(k["rank_tokens"] for k in run["ranks"]) / sum(k["cpu_s"] for k in run["ranks"])


def ratio(results: dict, ours: str, anchor: str, key: str = "tokens_per_s") -> float | None:
    a, b = results.get(ours, {}).get(key), results.get(anchor, {}).get(key)
    if not a or not b or math.isnan(a) or math.isnan(b):
        return None
    return round(a / b, 3)


def shape_dict(shape: GPTShape) -> dict:
    return {**asdict(shape), "num_params": shape.num_params(), "train_flops_per_token": shape.train_flops_per_token()}


def ratio_tables(results: dict, names: Any, pairs: Any) -> dict[str, dict[str, float]]:
    """``ratios`` (tokens/s) and ``ratios_per_cpu_s`` of every (ours, anchor) pair whose two configurations ran."""
    run = [(a, b) for a, b in pairs if a in names and b in names]
    return {
        "ratios": {f"{a}/{b}": ratio(results, a, b) for a, b in run},
        "ratios_per_cpu_s": {f"{a}/{b}": ratio(results, a, b, "tokens_per_cpu_s") for a, b in run},
    }


def run_main(main: Any) -> None:
    """Run a bench's ``main`` with SIGTERM turned into SystemExit, so the launcher's ``finally`` kills the running
    ranks instead of orphaning them."""
    import signal

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    main()
