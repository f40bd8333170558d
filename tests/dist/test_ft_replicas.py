"""``V17Strategy(fault_tolerance=FTPolicy(...))``: a replica group dies mid-step, the other keeps training; a
replacement rejoins from the live peer.

Two replica groups of 2 gloo ranks each (``dp_replicate=2, dp_shard=2``, ZeRO-3), each its own job (its own
``MASTER_PORT``), forked here from the tests' forkserver, with a torchft lighthouse in the test process. Rank 1 of group 1
SIGKILLs itself after the forward of a step (mid-step); its group's other rank fails in its next collective and
exits, as a launcher would end the group. Asserted:

* the survivors' next step (their next quorum) starts within 2 s of the kill, in the same processes (PIDs);
* every sample of the epoch is trained exactly once: each committed step trains the samples from the committed
  position on, the failed step's included, and the global batch shrinks to the survivors' share;
* every committed step's loss (the mean of the participating ranks' shares) equals a one-process replay of the same
  schedule (the same samples per step, the shrunk batches included) within 1e-5, and so do every step's pre-clip
  gradient norm (relative) and the final parameters;
* rejoin (``fault``): a replacement started under the failed group's ``replica_id`` joins, receives parameters and
  optimizer state from the live peer through torchft's checkpoint transport (no checkpoint file is read: ``torch.load``
  and DCP's load on a path are refused in it), holds bitwise the peer's state after the join, and trains at the full
  batch from then on.

Cases: AdamW with clipping that clips (the short drop test, in ``make test``), plain SGD without clipping and AdamW
with clipping, each with a rejoin (``make test-fault``).
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from tests._dist import _context, free_port, spawn

SEQ, ROWS, D = 16, 2, 2  # tokens per row, rows per rank and step, ranks per replica group
TOL = 1e-5
CLIP = 0.05  # clips on this model and data (the pre-clip norms are 7-18)
ADAMW = {"lr": 1e-3, "eps": 1e-5, "weight_decay": 0.1}


def _rows(n: int):
    import torch
    from torch.utils.data import Dataset

    class Rows(Dataset):
        def __len__(self) -> int:
            return n

        def __getitem__(self, i: int) -> dict:
            ids = torch.randint(0, 320, (SEQ + 1,), generator=torch.Generator().manual_seed(i))
            labels = ids[1:].clone()
            labels[: (i * 5) % 13] = -100  # unequal target counts per row and rank: the token normalization matters
            return {"input_ids": ids[:-1], "labels": labels, "position_ids": torch.arange(SEQ)}

    return Rows()


def _module(opt: str):
    import torch

    from lightning_v17.models import LlamaLM

    class LM(LlamaLM):
        def configure_optimizers(self):
            if opt == "sgd":
                return torch.optim.SGD(self.parameters(), lr=0.1)  # 0.5 amplifies fp32 noise past 1e-5 in ~10 steps
            return torch.optim.AdamW(self.parameters(), **ADAMW)

    torch.manual_seed(0)
    return LM(model="tiny", model_overrides={"layers": 2}, warmup_steps=0)


# ---------------------------------------------------------------------------------------------------- the replica
def _replica_main() -> None:
    """One rank of one replica group (run as its own process by :func:`_run`)."""
    cfg = json.loads(os.environ["V17_FT_TEST"])
    replica, rank, out = int(os.environ["REPLICA_GROUP_ID"]), int(os.environ["RANK"]), Path(cfg["out"])
    tag = f"{replica}_{rank}_{cfg['incarnation']}"
    try:
        _fit_replica(cfg, replica, rank, out, tag)
    except BaseException as err:  # noqa: BLE001 - the group failed: end this rank now, as its launcher would
        (out / f"error_{tag}.txt").write_text(repr(err))
        os._exit(3)
    os._exit(0)


def _fit_replica(cfg: dict, replica: int, rank: int, out: Path, tag: str) -> None:
    import lightning as L
    import torch
    from lightning_v17.strategies import V17Strategy
    from torch.utils.data import DataLoader

    from lightning_v17.config import FTPolicy
    from lightning_v17.resilience.ft import local_state
    from tests._strategy import full

    torch.set_num_threads(1)
    if cfg["incarnation"] > 0:  # the replacement must not read a checkpoint file: refuse every path load
        import torch.distributed.checkpoint as dcp

        real_load = torch.load

        def no_file_load(f, *a, **k):
            if not isinstance(f, (str, os.PathLike)):
                return real_load(f, *a, **k)  # torchft's transport: bytes received from the peer
            raise AssertionError(f"the replacement read a checkpoint file: {f}")

        def no_dcp(*a, **k):
            raise AssertionError("the replacement loaded a DCP checkpoint")

        torch.load, dcp.load, dcp.load_state_dict = no_file_load, no_dcp, no_dcp
    n = cfg["samples"]
    records = (out / f"rec_{tag}.jsonl").open("a")
    state: dict = {"solo_seen": False, "dumped": False}

    class Rec(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            h = trainer.strategy.ft.history[-1]
            state["solo_seen"] |= h["participants"] == 1 and h["step"] >= (cfg.get("kill") or [0, 0, 0])[2]
            if (state["solo_seen"] or cfg["incarnation"] > 0) and h["participants"] == 2 and not state["dumped"]:
                # the first step both groups run after the join: the state right after the quorum (and the heal)
                st = local_state(pl_module, trainer.strategy.optimizers, [])
                torch.save({"step": h["step"], "state": st}, out / f"state_{replica}_{rank}.pt")
                state["dumped"] = True

        def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:  # the pre-clip gradient norm
            state["norm"] = _grad_norm(pl_module)

        def on_before_backward(self, trainer, pl_module, loss) -> None:
            ft = trainer.strategy.ft
            kill = cfg.get("kill")
            h = ft.history[-1]  # the first step at or after kill[2] that both groups run
            if (kill and cfg["incarnation"] == 0 and [replica, rank] == kill[:2] and h["step"] >= kill[2]
                    and h["participants"] == 2):  # fmt: skip
                (out / "kill_time.txt").write_text(repr(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            ft = trainer.strategy.ft
            h = dict(ft.history[-1])
            h.update(
                loss=float(outputs["loss"]),
                norm=state.pop("norm", None),
                pid=os.getpid(),
                replica=replica,
                rank=rank,
                incarnation=cfg["incarnation"],
            )
            records.write(json.dumps(h) + "\n")
            records.flush()
            if ft.position_batches() * D * ROWS >= n:
                trainer.should_stop = True
            elif cfg.get("solo_sleep") and h["participants"] == 1:
                time.sleep(cfg["solo_sleep"])  # the survivors wait a little per step for the replacement to start

    from lightning_v17.callbacks import GoodputMonitor

    goodput = GoodputMonitor(log=False)  # counts the dropped step and the wait for the next quorum (dropped_s)
    policy = FTPolicy(min_replicas=1, timeout=cfg["timeout"], init_sync=False)
    strategy = V17Strategy(dp_replicate=2, dp_shard=D, zero_stage=3, fault_tolerance=policy)
    module = _module(cfg["opt"])
    trainer = L.Trainer(accelerator="cpu", devices=D, strategy=strategy, max_steps=10_000, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        gradient_clip_val=cfg["clip"], callbacks=[Rec(), goodput], use_distributed_sampler=False)  # fmt: skip
    trainer.fit(module, DataLoader(_rows(n), batch_size=ROWS))
    (out / f"goodput_{tag}.json").write_text(json.dumps(goodput.last.metrics(prefix="")))
    params = {k: full(p) for k, p in module.model.named_parameters()}
    torch.save(params, out / f"final_{tag}.pt")


# ---------------------------------------------------------------------------------------------------- the harness
def _entry(env: dict[str, str], log: str) -> None:
    """A replica rank forked from the tests' forkserver (torch and Lightning imported once, ``tests/_dist.py``)."""
    os.environ.clear()
    os.environ.update(env)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    from lightning.fabric.utilities.rank_zero import rank_zero_only

    rank_zero_only.rank = int(env["RANK"])
    _replica_main()


def _launch(cfg: dict, replica: int, lighthouse: str) -> list:
    """The ``D`` ranks of one replica group: its own job (its own ``MASTER_PORT``, store and process group)."""
    port = free_port()
    procs = []
    for rank in range(D):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(D), RANK=str(rank),
                   LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(D), NODE_RANK="0", GROUP_RANK="0",
                   REPLICA_GROUP_ID=str(replica), TORCHFT_LIGHTHOUSE=lighthouse, V17_FT_TEST=json.dumps(cfg),
                   OMP_NUM_THREADS="1")  # fmt: skip
        log = str(Path(cfg["out"]) / f"log_{replica}_{rank}_{cfg['incarnation']}.txt")
        procs.append(_context().Process(target=_entry, args=(env, log)))
        procs[-1].start()
    return procs


def _run(out: Path, *, opt: str, clip: float | None, samples: int, kill: list[int] | None, rejoin: bool,
         timeout: float, solo_sleep: float = 0.0) -> dict:  # fmt: skip
    from lightning_v17.resilience.ft import start_lighthouse

    cfg = {"out": str(out), "opt": opt, "clip": clip, "samples": samples, "kill": kill, "timeout": 10.0,
           "incarnation": 0, "solo_sleep": solo_sleep}  # fmt: skip
    t0 = time.time()
    # join_timeout above a step under load: a healthy group that is still stepping is waited for, never left out
    # (a lone group then steps alone, the groups split); a dead group is left out once its heartbeats stop
    lighthouse = start_lighthouse(min_replicas=1, join_timeout_ms=10_000, heartbeat_timeout_ms=1000)
    groups = {r: _launch(cfg, r, lighthouse.address()) for r in (0, 1)}
    launched = {r: [[p.pid for p in ps]] for r, ps in groups.items()}
    deadline = time.monotonic() + timeout
    try:
        while any(p.is_alive() for ps in groups.values() for p in ps):
            if rejoin and len(launched[1]) == 1 and all(not p.is_alive() for p in groups[1]) and _solo(out):
                groups[1] = _launch(dict(cfg, incarnation=1), 1, lighthouse.address())
                launched[1].append([p.pid for p in groups[1]])
            if time.monotonic() > deadline:
                raise AssertionError(f"the run did not end within {timeout} s:\n{_logs(out)}")
            time.sleep(0.05)
    finally:
        for ps in groups.values():
            for p in ps:
                if p.is_alive():
                    p.kill()
                p.join(timeout=5)
        lighthouse.shutdown()
    records = [json.loads(line) for f in sorted(out.glob("rec_*.jsonl")) for line in f.read_text().splitlines()]
    kill_file = out / "kill_time.txt"
    return {"records": records, "launched": launched, "wall_s": time.time() - t0, "exit": {r: [p.exitcode for p in ps] for r, ps in groups.items()},
            "kill_time": float(kill_file.read_text()) if kill_file.exists() else None}  # fmt: skip


def _solo(out: Path) -> bool:
    """Whether the survivors committed a step alone after the kill (the replacement is started after that, so that
    the run has both a shrunk and a rejoined phase)."""
    kill, f = out / "kill_time.txt", out / "rec_0_0_0.jsonl"
    if not kill.exists() or not f.exists():
        return False
    after = float(kill.read_text())
    for line in f.read_text().splitlines():
        try:
            r = json.loads(line)
        except json.JSONDecodeError:  # the line being written
            continue
        if r["participants"] == 1 and r["committed"] and r["quorum_time"] > after:
            return True
    return False


def _logs(out: Path) -> str:
    return "\n".join(f"--- {f.name}\n{f.read_text()[-3000:]}" for f in sorted(out.glob("log_*.txt")))


# ---------------------------------------------------------------------------------------------------- the checks
def _lineage(records: list[dict]) -> list[dict]:
    """The committed records the final state descends from. A group that committed steps alone and then healed from
    a peer was behind it: its lone steps were discarded with its state (torchft lets a lone group train when its peer
    misses the quorum's join timeout, e.g. while the peer is still starting)."""
    keep = []
    by_rank: dict[tuple, list[dict]] = {}
    for r in records:  # each rank's file is in its own order
        by_rank.setdefault((r["replica"], r["incarnation"], r["rank"]), []).append(r)
    for rows in by_rank.values():
        last_heal = max((i for i, r in enumerate(rows) if r["healed"]), default=-1)
        keep += [r for i, r in enumerate(rows) if r["committed"] and not (i < last_heal and r["participants"] == 1)]
    return keep


def _committed_steps(records: list[dict], samples: int) -> list[dict]:
    """Per committed step: its position, participants, the ranks' samples in rank order and the mean loss."""
    by_step: dict[int, list[dict]] = {}
    for r in _lineage(records):
        by_step.setdefault(r["step"], []).append(r)
    steps = []
    for s in sorted(by_step):
        rs = sorted(by_step[s], key=lambda r: (r["replica_rank"], r["rank"]))
        assert len(rs) == rs[0]["participants"] * D, (s, rs)  # every participating rank recorded it
        assert len({r["position"] for r in rs}) == 1, rs
        steps.append({"step": s, "position": rs[0]["position"] * D * ROWS, "participants": rs[0]["participants"],
                      "samples": [i for r in rs for i in r["samples"]],
                      "loss": sum(r["loss"] for r in rs) / len(rs), "norms": [r["norm"] for r in rs]})  # fmt: skip
    return steps


def _grad_norm(module) -> float:
    """The whole gradient's norm (a ZeRO-3 shard gathered first: a collective over the rank's group)."""
    import torch

    from tests._strategy import full

    return float(torch.stack([full(p.grad).double().pow(2).sum() for p in module.parameters()
                              if p.grad is not None]).sum().sqrt())  # fmt: skip


def _replay(_rank: int, _world: int, steps: list[dict], opt: str, clip: float | None, samples: int) -> dict:
    """One process (plain Lightning, ``devices=1``) on each committed step's samples (forked by ``spawn``)."""
    import lightning as L
    from torch.utils.data import DataLoader

    from tests._strategy import full

    losses: list[float] = []
    norms: list[float] = []

    class Rec(L.Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
            norms.append(_grad_norm(pl_module))

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            losses.append(float(outputs["loss"]))

    module = _module(opt)
    loader = DataLoader(_rows(samples), batch_sampler=[s["samples"] for s in steps])
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=len(steps), logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, gradient_clip_val=clip,
                        callbacks=[Rec()])  # fmt: skip
    trainer.fit(module, loader)
    return {"losses": losses, "norms": norms, "params": {k: full(p) for k, p in module.model.named_parameters()}}


def _check(out: Path, run: dict, *, opt: str, clip: float | None, samples: int, rejoin: bool) -> dict:
    import torch

    steps = _committed_steps(run["records"], samples)
    # every sample once: the committed steps tile the positions from 0 without a gap or an overlap
    pos = 0
    for s in steps:
        assert s["position"] == pos, (s, pos)
        n = s["participants"] * D * ROWS
        assert s["samples"] == [(pos + k) % samples for k in range(n)], s
        pos += n
    assert pos >= samples, (pos, samples)
    trained = [i for s in steps for i in s["samples"]][:samples]
    assert sorted(trained) == list(range(samples))
    assert [s["participants"] for s in steps].count(1) >= 1, "the batch never shrank: no replica was dropped"
    # the survivors: the same processes throughout, and the next step within 2 s of the kill
    survivors = [r for r in run["records"] if r["replica"] == 0]
    for rank in range(D):
        assert {r["pid"] for r in survivors if r["rank"] == rank} == {run["launched"][0][0][rank]}
    after = [r["quorum_time"] for r in survivors if r["quorum_time"] > run["kill_time"]]
    latency = min(after) - run["kill_time"]
    assert latency <= 2.0, latency
    # GoodputMonitor on the survivors: the uncommitted step and the wait for the next quorum are dropped_s, at least
    # the kill-to-next-quorum latency (the failed step started before the kill) and not a withheld (bad) step
    for rank in range(D):
        g = json.loads((out / f"goodput_0_{rank}_0.json").read_text())
        assert g["dropped_s"] >= latency - 0.25 and g["bad_step_s"] == 0.0, (g, latency)
        assert g["useful_s"] + g["dropped_s"] <= g["wall_s"], g
    ref = spawn(_replay, world_size=1, args=(steps, opt, clip, samples), init_process_group=False, timeout=120)[0]
    loss_diff = max(abs(a - s["loss"]) for a, s in zip(ref["losses"], steps))
    assert len(ref["losses"]) == len(steps) and loss_diff <= TOL, (loss_diff, ref["losses"], steps)
    norm_diff = max(abs(n - a) / max(1.0, a) for a, s in zip(ref["norms"], steps) for n in s["norms"])
    assert norm_diff <= TOL, (norm_diff, ref["norms"], [s["norms"] for s in steps])
    finals = sorted(out.glob("final_*.pt"))
    assert finals, _logs(out)
    param_diff = 0.0
    for f in finals:
        got = torch.load(f)
        param_diff = max(param_diff, max(float((v - ref["params"][k]).abs().max()) for k, v in got.items()))
    assert param_diff <= TOL, param_diff
    result = {
        "latency_s": latency,
        "loss_diff": loss_diff,
        "param_diff": param_diff,
        "norm_rel_diff": norm_diff,
        "steps": len(steps),
        "processes_wall_s": run["wall_s"],
    }
    if rejoin:
        assert len(run["launched"][1]) == 2, run["launched"]
        assert steps[-1]["participants"] == 2, "the replacement never trained at the full batch"
        healed = [r for r in run["records"] if r["replica"] == 1 and r["incarnation"] == 1 and r["healed"]]
        assert healed, "the replacement did not receive the state from the live peer"
        for rank in range(D):
            a, b = (torch.load(out / f"state_{rep}_{rank}.pt") for rep in (0, 1))
            assert a["step"] == b["step"], (a["step"], b["step"])
            _assert_bitwise(a["state"], b["state"])
        result["rejoined_at_step"] = min(r["step"] for r in healed)
    return result


def _assert_bitwise(a, b, where: str = "state") -> None:
    import torch

    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _assert_bitwise(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_bitwise(x, y, f"{where}[{i}]")
    else:
        assert a == b, (where, a, b)


@pytest.mark.timeout(120)
def test_replica_drop_trains_every_sample_once(tmp_path) -> None:
    """AdamW with clipping that clips: group 1 loses a rank mid-step 2; group 0 finishes the epoch alone."""
    pytest.importorskip("torchft", reason="the ft extra: pip install 'lightning-v17[ft]'")
    run = _run(tmp_path, opt="adamw", clip=CLIP, samples=32, kill=[1, 1, 2], rejoin=False, timeout=100)
    print(_check(tmp_path, run, opt="adamw", clip=CLIP, samples=32, rejoin=False))


@pytest.mark.fault
@pytest.mark.timeout(300)
@pytest.mark.parametrize(("opt", "clip"), [("sgd", None), ("adamw", CLIP)])
def test_replica_drop_and_rejoin_from_live_peer(tmp_path, opt, clip) -> None:
    pytest.importorskip("torchft", reason="the ft extra: pip install 'lightning-v17[ft]'")
    run = _run(tmp_path, opt=opt, clip=clip, samples=96, kill=[1, 1, 2], rejoin=True, timeout=280, solo_sleep=1.0)
    print(_check(tmp_path, run, opt=opt, clip=clip, samples=96, rejoin=True))


def test_fault_tolerance_refuses_what_it_does_not_support(monkeypatch) -> None:
    from lightning_v17.strategies import V17Strategy

    from lightning_v17.config import FTPolicy, TPPolicy, V17ConfigError

    ft = FTPolicy()
    assert V17Strategy(dp_replicate=2, dp_shard=2, fault_tolerance=ft).dims.dp_replicate == 1  # torchft's axis
    for kwargs, named in [({"dp_replicate": 1}, "dp_replicate=1"), ({"tp": TPPolicy(size=2)}, "tp"),
                          ({"pp": 2}, "pp"), ({"cp": 2}, "cp"), ({"zero_stage": 2}, "zero_stage=2")]:  # fmt: skip
        with pytest.raises(V17ConfigError, match=named):
            V17Strategy(**{"dp_replicate": 2, **kwargs}, fault_tolerance=ft)
    with pytest.raises(V17ConfigError, match="min_replicas"):
        FTPolicy(min_replicas=0)
    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
    monkeypatch.delenv("REPLICA_GROUP_ID", raising=False)
    with pytest.raises(V17ConfigError, match="TORCHFT_LIGHTHOUSE"):
        ft.lighthouse_address()
    with pytest.raises(V17ConfigError, match="REPLICA_GROUP_ID"):
        ft.replica_name()
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", "http://lighthouse:29510")
    monkeypatch.setenv("REPLICA_GROUP_ID", "3")
    assert (ft.lighthouse_address(), ft.replica_name()) == ("http://lighthouse:29510", "3")
