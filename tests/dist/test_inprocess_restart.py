"""The in-process restart (``lightning_v17.resilience.inprocess``): a rank of the only replica is SIGKILLed mid-step,
the survivor re-forms the group in its own process, a warm spare takes the lost rank, and training re-enters the loop
at the last step boundary's in-memory snapshot.

Two gloo ranks train a small residual MLP through ``engine.parallelize`` at ZeRO-3 (FSDP2), under an
:class:`InProcessLauncher` started here (it serves the store and keeps one warm spare). Rank 1 SIGKILLs itself after
the forward of a step, so rank 0 is blocked in the backward's reduce-scatter when its peer dies. Asserted:

* the re-formed group's next step starts within 3 s of the kill (measured: the kill until the later rank starts it);
* the survivor keeps its PID and never re-imports (a module-level import stamp and ``id(torch)`` are unchanged);
* the replacement's state came from the survivor's copy of its snapshot (the launcher handed the rank to the spare,
  and no checkpoint file exists);
* every step's loss and pre-clip gradient norm, and the final parameters, equal the uninterrupted 2-rank run bitwise,
  and a one-process run of the same batches within 1e-5.

Cases: AdamW with clipping that clips (short, in ``make test``); in ``make test-fault``, plain SGD without clipping,
and AdamW with the kill between the optimizer step and the snapshot exchange (the newest snapshot incomplete: the
group restores the one before it and re-runs that step), and rank 1 raising mid-step instead of dying (rank 0's
collective waits for its timeout, then both ranks re-form in their own processes and no spare is used).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch

_IMPORTED_AT = time.time()  # a process that re-imported this module would show a later stamp

ROOT = Path(__file__).resolve().parents[2]
STEPS, KILL_RANK, KILL_STEP, ROWS, TOL, CLIP = 8, 1, 5, 4, 1e-5, 0.05
RAISE_TIMEOUT_S = 5  # the collective timeout of the raise case (the peer waits for it)
ADAMW = {"lr": 1e-2, "eps": 1e-5, "weight_decay": 0.1}


def _model():
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(16, 16)

        def forward(self, x):
            return x + torch.tanh(self.fc(x))

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp, self.out = nn.Linear(8, 16), nn.Linear(16, 4)
            self.layers = nn.ModuleList([Block() for _ in range(2)])

        def forward(self, x):
            x = self.inp(x)
            for block in self.layers:
                x = block(x)
            return self.out(x)

    torch.manual_seed(0)
    return Net()


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(ROWS, 8, generator=g), torch.randn(ROWS, 4, generator=g)


def _optimizer(opt: str, params):
    return torch.optim.SGD(params, lr=0.1) if opt == "sgd" else torch.optim.AdamW(params, **ADAMW)


def _norm(t) -> float:
    return float(t.full_tensor() if hasattr(t, "full_tensor") else t)


# ---------------------------------------------------------------------------------------- one rank, one generation
def _die(out: Path) -> None:
    (out / "kill.json").write_text(json.dumps({"t": time.time(), "pid": os.getpid()}))
    os.kill(os.getpid(), signal.SIGKILL)


def _train(cfg: dict, ctx) -> None:
    import torch.distributed as dist

    from lightning_v17.config import MeshSpec, TrainingPolicy, ZeroPolicy
    from lightning_v17.engine.parallelize import parallelize
    from lightning_v17.mesh import MeshRuntime, build_device_mesh
    from lightning_v17.resilience.ft import load_local_state, local_state

    t_fn = time.time()
    out, rank = Path(cfg["out"]), ctx.rank
    spec = MeshSpec(dp_shard=ctx.world_size)
    mesh = MeshRuntime(spec, build_device_mesh(spec, device_type="cpu"))
    model = _model()
    parallelize(model, mesh=mesh, policy=TrainingPolicy(zero=ZeroPolicy(stage=3)), device="cpu")
    opt = _optimizer(cfg["opt"], model.parameters())
    start = 0
    if ctx.restored is not None:
        start, state = ctx.restored
        load_local_state(state, model, [opt], [], [opt.step])
    elif ctx.generation > 0:  # no in-memory snapshot: here the disk checkpoint would be read
        raise AssertionError("no complete in-memory snapshot after a restart")
    rec = (out / f"rec_{rank}_{os.getpid()}.jsonl").open("a")
    for step in range(start, STEPS):
        t_start = time.time()
        x, y = _batch(step)
        mine = slice(rank * ROWS // ctx.world_size, (rank + 1) * ROWS // ctx.world_size)
        loss = torch.nn.functional.mse_loss(model(x[mine]), y[mine])
        if cfg["kill"] == "step" and ctx.generation == 0 and rank == KILL_RANK and step == KILL_STEP:
            _die(out)  # mid-step: the peer is about to block in the reduce-scatter
        if cfg["kill"] == "raise" and ctx.generation == 0 and rank == KILL_RANK and step == KILL_STEP:
            (out / "kill.json").write_text(json.dumps({"t": time.time(), "pid": os.getpid()}))
            raise RuntimeError("a bad step")  # raised, not killed: the same process runs the step again
        loss.backward()  # FSDP2 reduce-scatters the mean gradient over the two ranks
        clip = CLIP if cfg["opt"] == "adamw" else float("inf")
        gnorm = _norm(torch.nn.utils.clip_grad_norm_(model.parameters(), clip))
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        if cfg["kill"] == "snapshot" and ctx.generation == 0 and rank == KILL_RANK and step == KILL_STEP:
            _die(out)  # the peer keeps its own snapshot of step + 1 but never receives this rank's
        ctx.snapshot(step + 1, {**local_state(model, [opt], []), "step": step + 1})
        rec.write(
            json.dumps(
                {
                    "step": step,
                    "loss": float(total) / ctx.world_size,
                    "gnorm": gnorm,
                    "t_start": t_start,
                    "generation": ctx.generation,
                    "pid": os.getpid(),
                    "imported_at": _IMPORTED_AT,
                    "torch": id(torch),
                    "t_fn": t_fn,
                    "restored_from": None if ctx.restored is None else ctx.restored[0],
                    "restore_s": ctx.restore_s,
                }
            )
            + "\n"
        )
        rec.flush()
    params = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    if rank == 0:
        torch.save(params, out / "params.pt")


def _warmup() -> None:
    """What a warm spare runs before it reports ready: the same model through the same transforms, one step."""
    from lightning_v17.config import MeshSpec, TrainingPolicy, ZeroPolicy
    from lightning_v17.engine.parallelize import parallelize
    from lightning_v17.mesh import MeshRuntime, build_device_mesh

    spec = MeshSpec(dp_shard=1)
    model = _model()
    parallelize(
        model,
        mesh=MeshRuntime(spec, build_device_mesh(spec, device_type="cpu")),
        policy=TrainingPolicy(zero=ZeroPolicy(stage=3)),
        device="cpu",
    )
    torch.nn.functional.mse_loss(model(_batch(0)[0]), _batch(0)[1]).backward()


def _main() -> None:
    """The worker process the launcher starts (a rank or a warm spare)."""
    import functools

    import lightning_v17.engine.parallelize  # noqa: F401 - a warm spare has imported everything before its turn
    from lightning_v17.resilience.inprocess import run_in_process

    cfg = json.loads(os.environ["V17_INPROC_TEST"])
    torch.set_num_threads(1)
    timeout = timedelta(seconds=RAISE_TIMEOUT_S if cfg["kill"] == "raise" else 20)
    run_in_process(functools.partial(_train, cfg), timeout=timeout, max_restarts=1, warmup=_warmup)
    sys.stdout.flush()
    os._exit(0)


# ------------------------------------------------------------------------------------------------- the test side
def _launch(tmp: Path, opt: str, kill: str) -> dict:
    from lightning_v17.resilience.inprocess import InProcessLauncher

    out = tmp / f"{opt}_{kill or 'clean'}"
    out.mkdir(parents=True)
    env = {
        "V17_INPROC_TEST": json.dumps({"out": str(out), "opt": opt, "kill": kill}),
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    launcher = InProcessLauncher(
        ["-c", "from tests.dist.test_inprocess_restart import _main; _main()"],
        world_size=2,
        spares=1 if kill else 0,
        env=env,
        max_restarts=1,
        replenish=False,  # the run ends soon after the restart: a new spare's imports would only cost CPU here
    )
    launcher.start()
    codes = launcher.wait(timeout_s=150)
    recs = [json.loads(line) for f in sorted(out.glob("rec_*.jsonl")) for line in f.read_text().splitlines()]
    kill_info = json.loads((out / "kill.json").read_text()) if kill else None
    return {
        "codes": codes,
        "recs": recs,
        "kill": kill_info,
        "events": launcher.events,
        "params": torch.load(out / "params.pt", weights_only=True),
        "files": sorted(p.name for p in out.iterdir()),
    }


def _steps(run: dict) -> dict[int, dict]:
    """Step -> its record; a step the restarted generation ran again is taken from that generation."""
    by: dict[int, dict] = {}
    for r in sorted(run["recs"], key=lambda r: r["generation"]):
        by[r["step"]] = r
    return by


def _reference(opt_name: str) -> tuple[list[float], list[float], dict]:
    model = _model()
    opt = _optimizer(opt_name, model.parameters())
    losses, norms = [], []
    for step in range(STEPS):
        x, y = _batch(step)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP if opt_name == "adamw" else 1e9)))
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses, norms, {n: p.detach().clone() for n, p in model.named_parameters()}


def _check(tmp: Path, opt: str, kill_at: str = "step") -> dict:
    """Run uninterrupted and with rank 1 killed at ``kill_at`` ("step": after a forward; "snapshot": after the
    optimizer step, before the snapshot exchange), and check the restarted run (module docstring)."""
    clean, hit = _launch(tmp, opt, kill=""), _launch(tmp, opt, kill=kill_at)
    assert clean["codes"] == [0, 0] and hit["codes"] == [0, 0], (clean["codes"], hit["codes"])
    kill = hit["kill"]
    gens = {r["generation"] for r in hit["recs"]}
    assert gens == {0, 1}, gens
    # the survivor: the same process in both generations, which never re-imported this module or torch
    lost = set() if kill_at == "raise" else {kill["pid"]}  # a rank that raised keeps its process
    survivor = {r["pid"] for r in hit["recs"] if r["generation"] == 0} - lost
    assert len(survivor) == 2 - len(lost), hit["recs"]
    assert survivor <= {r["pid"] for r in hit["recs"] if r["generation"] == 1}, hit["recs"]
    for pid in survivor:
        for key in ("imported_at", "torch"):
            assert len({r[key] for r in hit["recs"] if r["pid"] == pid}) == 1, key
    # the replacement is the warm spare, restored from the survivor's copy of the snapshot at the last boundary
    takeover = [e for e in hit["events"] if e[0] == "takeover"]
    if kill_at == "raise":
        assert not takeover, hit["events"]
    else:
        assert len(takeover) == 1 and takeover[0][1][1] == KILL_RANK, hit["events"]
    regen = [r for r in hit["recs"] if r["generation"] == 1]
    assert {r["restored_from"] for r in regen} == {KILL_STEP} and min(r["step"] for r in regen) == KILL_STEP
    assert not any(f.endswith((".ckpt", ".distcp")) for f in hit["files"])
    kill_to_step = max(r["t_start"] for r in regen if r["step"] == KILL_STEP) - kill["t"]
    # a raised error leaves the peer blocked in its collective until the group's timeout
    limit = 3.0 + (RAISE_TIMEOUT_S if kill_at == "raise" else 0.0)
    assert kill_to_step <= limit, f"kill -> next step took {kill_to_step:.2f} s"
    # bitwise against the uninterrupted run, and within 1e-5 of one process
    a, b = _steps(clean), _steps(hit)
    assert sorted(a) == sorted(b) == list(range(STEPS))
    for s in range(STEPS):
        assert (a[s]["loss"], a[s]["gnorm"]) == (b[s]["loss"], b[s]["gnorm"]), (s, a[s], b[s])
    for n, p in clean["params"].items():
        assert torch.equal(p, hit["params"][n]), n
    ref_losses, ref_norms, ref_params = _reference(opt)
    assert [a[s]["loss"] for s in range(STEPS)] == pytest.approx(ref_losses, rel=TOL)
    assert [a[s]["gnorm"] for s in range(STEPS)] == pytest.approx(ref_norms, rel=TOL)
    if opt == "adamw":
        assert all(n > CLIP for n in ref_norms), "the clipping case must clip"
    err = max(float((clean["params"][n] - p).abs().max()) for n, p in ref_params.items())
    assert err < TOL, err
    out = {
        "kill_to_next_step_s": round(kill_to_step, 3),
        "restore_s": round(max(r["restore_s"] for r in regen), 4),
        "param_diff_vs_one_process": err,
        "bitwise_vs_uninterrupted": True,  # asserted above
    }
    print(json.dumps({"opt": opt, **out}))
    return out


@pytest.mark.timeout(300)
def test_inprocess_restart_adamw_clip(tmp_path):
    _check(tmp_path, "adamw")


@pytest.mark.fault
@pytest.mark.timeout(300)
def test_inprocess_restart_sgd(tmp_path):
    _check(tmp_path, "sgd")


@pytest.mark.fault
@pytest.mark.timeout(300)
def test_inprocess_restart_mid_snapshot(tmp_path):
    """Killed between the optimizer step and the snapshot exchange: the survivor's newest snapshot has no copy of
    the lost rank's, so the group restores the one before and re-runs that step."""
    _check(tmp_path, "adamw", kill_at="snapshot")


@pytest.mark.fault
@pytest.mark.timeout(300)
def test_inprocess_restart_raise(tmp_path):
    """Rank 1 raises mid-step instead of dying: both ranks re-form in their own processes, without a spare, once
    rank 0's pending collective has timed out."""
    _check(tmp_path, "adamw", kill_at="raise")
