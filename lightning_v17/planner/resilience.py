"""Checkpoint interval from write time and mean time between failures.

Torch-free. The save interval grows as √MTBF (design §16.8), and a measured write time beats an estimate: the
first-order optimum is Young's (1974); Daly's (2006) higher-order refinement is the one to use when the write time is
not small against the MTBF.
"""

from __future__ import annotations

import math
from typing import Any


def _check(checkpoint_write_s: float, mtbf_s: float) -> None:
    if not checkpoint_write_s > 0 or not mtbf_s > 0:
        raise ValueError(f"checkpoint_write_s={checkpoint_write_s} and mtbf_s={mtbf_s} must be > 0 seconds")


def young_interval_s(checkpoint_write_s: float, mtbf_s: float) -> float:
    """Young's optimal compute time between checkpoints, √(2·δ·M), in seconds.

    Source: Young 1974, "A first order approximation to the optimum checkpoint interval", CACM 17(9), Eq. 3.

    Args:
        checkpoint_write_s: δ, seconds the job is blocked writing one checkpoint.
        mtbf_s: M, mean time between failures of the whole job (all nodes), seconds.
    """
    _check(checkpoint_write_s, mtbf_s)
    return math.sqrt(2.0 * checkpoint_write_s * mtbf_s)


def daly_interval_s(checkpoint_write_s: float, mtbf_s: float) -> float:
    """Daly's higher-order optimal compute time between checkpoints, in seconds.

    Source: Daly 2006, "A higher order estimate of the optimum checkpoint interval for restart dumps", FGCS 22(3),
    Eq. 37: τ = √(2δM)·[1 + (1/3)·√(δ/(2M)) + (1/9)·(δ/(2M))] − δ for δ < 2M, and τ = M otherwise.

    Args:
        checkpoint_write_s: δ, seconds the job is blocked writing one checkpoint.
        mtbf_s: M, mean time between failures of the whole job, seconds.
    """
    _check(checkpoint_write_s, mtbf_s)
    d, m = checkpoint_write_s, mtbf_s
    if d >= 2.0 * m:
        return m
    x = d / (2.0 * m)
    return math.sqrt(2.0 * d * m) * (1.0 + math.sqrt(x) / 3.0 + x / 9.0) - d


def cluster_mtbf_s(node_mtbf_s: float, nodes: int) -> float:
    """MTBF of a job spanning ``nodes`` nodes with independent exponential failures: node MTBF / nodes.

    Source: the series-system rule for exponential lifetimes (failure rates add), as used in Daly 2006 §2.
    """
    if not node_mtbf_s > 0 or nodes < 1:
        raise ValueError(f"node_mtbf_s={node_mtbf_s} must be > 0 and nodes={nodes} >= 1")
    return node_mtbf_s / nodes


def checkpoint_write_s(bytes_per_node: float, *, write_bytes_per_s: float) -> float:
    """Seconds to write one sharded checkpoint when every node writes its shards in parallel (design §15.4).

    Source: sharded save (design §15.4, "write BW ∝ N"): time = bytes per node / per-node write bandwidth.
    """
    if not write_bytes_per_s > 0:
        raise ValueError(f"write_bytes_per_s={write_bytes_per_s} must be > 0")
    return bytes_per_node / write_bytes_per_s


__all__ = [
    "checkpoint_write_s",
    "cluster_mtbf_s",
    "daly_interval_s",
    "expected_goodput",
    "goodput_by_path",
    "recovery_goodput",
    "replica_drop_goodput",
    "young_interval_s",
]


def expected_goodput(
    *, interval_s: float, checkpoint_s: float, mtbf_s: float, restart_s: float = 0.0, overhead_s: float = 0.0
) -> float:
    """Expected fraction of wall time spent on useful compute with periodic checkpoints and exponential failures.

    Daly 2006 ("A higher order estimate of the optimum checkpoint interval for restart dumps", FGCS 22(3): the
    wall-clock model whose minimum is its Eq. 37 interval, ``daly_interval_s``) gives, for solve time T_s, compute
    time τ between checkpoints, checkpoint cost δ, restart time R and exponential failures of mean M::

        T_w = M · e^{R/M} · (e^{(τ+o+δ)/M} − 1) · T_s / τ        so        goodput = T_s / T_w

    with o = 0 in Daly's paper, where everything between two checkpoints is solve time. A training loop also spends
    wall time between its steps that is not step time (data waits, logging, callbacks): o seconds per interval.
    It lengthens each segment of Daly's renewal argument (a failure anywhere in it loses the segment's progress,
    so it sits in the exponent) but is not goodput (so T_s / τ counts segments by τ alone). Without failures
    (M → ∞) goodput is τ / (τ + o + δ).

    Its first-order expansion is Young 1974's (CACM 17(9)) waste δ/τ + (τ/2 + R)/M (o = 0), whose minimum is the
    ``young_interval_s`` above.

    Args:
        interval_s: τ, useful compute seconds between checkpoints.
        checkpoint_s: δ, seconds the job is blocked per checkpoint.
        mtbf_s: M, mean wall seconds between failures of the job.
        restart_s: R, seconds from a failure to the first step of the restarted job.
        overhead_s: o, wall seconds per interval that are neither useful compute nor checkpointing (the loop's
            own time between steps, withheld steps).
    """
    if not interval_s > 0 or not mtbf_s > 0 or checkpoint_s < 0 or restart_s < 0 or overhead_s < 0:
        raise ValueError(
            f"interval_s={interval_s} and mtbf_s={mtbf_s} must be > 0; checkpoint_s={checkpoint_s}, "
            f"restart_s={restart_s} and overhead_s={overhead_s} must be >= 0 (seconds)"
        )
    m = mtbf_s
    segment_s = interval_s + overhead_s + checkpoint_s
    wall_per_compute = m * math.exp(restart_s / m) * math.expm1(segment_s / m) / interval_s
    return 1.0 / wall_per_compute


def replica_drop_goodput(
    *,
    mtbf_s: float,
    replica_groups: int,
    detect_s: float,
    step_s: float,
    replace_s: float,
    checkpoint_fraction: float = 0.0,
) -> float:
    """Expected goodput when a failure drops one replica group instead of restarting the job (torchft's replica
    drop, ``V17Strategy(fault_tolerance=FTPolicy(...))``), to first order in the failure rate.

    Per failure every group stalls for the detection ``d`` (the kill until the survivors' next step) and re-runs the
    failed step ``s``; the failed group's share ``1/G`` of the global batch is then missing for ``r`` seconds (its
    replacement's start and heal), since the survivors' steps shrink to their own share. Failures arrive at rate
    ``1/M`` for the whole job, so the expected waste is Young 1974's (CACM 17(9)) first-order form, waste per failure
    times rate::

        goodput = (1 - c) · (1 - (d + s + r / G) / M)

    ``c``: the fraction of time still spent writing checkpoints for the failures that hit every group at once. Valid
    while ``d + s + r`` is small against ``M`` (one failure at a time); clamped at 0.

    Args:
        mtbf_s: M, mean wall seconds between failures of the whole job (:func:`cluster_mtbf_s`).
        replica_groups: G, the replica groups (``dp_replicate``).
        detect_s: d, seconds from a failure to the survivors' next step (measured: ``bench/fault.py``).
        step_s: s, seconds of one training step (the failed step, re-run).
        replace_s: r, seconds until a replacement group trains (its start-up and the state transfer).
        checkpoint_fraction: c, share of wall time blocked on checkpoint writes.
    """
    if not mtbf_s > 0 or replica_groups < 2 or min(detect_s, step_s, replace_s) < 0 or not 0 <= checkpoint_fraction < 1:
        raise ValueError(
            f"mtbf_s={mtbf_s} must be > 0, replica_groups={replica_groups} >= 2, detect_s={detect_s}, "
            f"step_s={step_s} and replace_s={replace_s} >= 0 and checkpoint_fraction={checkpoint_fraction} in [0, 1)"
        )
    lost_s = detect_s + step_s + replace_s / replica_groups
    return max(0.0, (1.0 - checkpoint_fraction) * (1.0 - lost_s / mtbf_s))


def goodput_by_path(
    *,
    node_mtbf_s: float,
    nodes: int,
    checkpoint_s: float,
    restart_s: float,
    inprocess_restart_s: float,
    snapshot_s: float,
    step_s: float,
    replica_groups: int,
    drop_s: float,
    replace_s: float,
) -> dict[str, float]:
    """Expected goodput of the three recovery paths for one job, from the node MTBF, the node count and the
    measured recovery times (``bench/fault.py``).

    * ``"job_restart"``: every process restarts and reloads the newest disk checkpoint, written at Daly's optimum
      interval (:func:`daly_interval_s`, :func:`expected_goodput` with ``restart_s``);
    * ``"in_process_restart"``: the processes stay, the group re-forms and the state comes from the newest in-memory
      snapshot, taken at Daly's interval for ``snapshot_s`` but at most once a step (:func:`expected_goodput` with
      ``inprocess_restart_s``);
    * ``"replica_drop"``: the failed replica group is dropped at that step (:func:`replica_drop_goodput`).

    The last two still write disk checkpoints for the failures they do not cover (a whole node's memory lost, every
    group at once); those are far rarer than ``M``, so their interval is far longer and their cost is left out here.

    Args:
        node_mtbf_s: mean seconds between failures of one node; nodes: the job's nodes (:func:`cluster_mtbf_s`).
        checkpoint_s: seconds blocked per disk checkpoint; restart_s: failure to first step of a restarted job.
        inprocess_restart_s: failure to first step without new processes; snapshot_s: seconds per in-memory snapshot.
        step_s: seconds per training step; replica_groups: ``dp_replicate``.
        drop_s: failure to the survivors' next step; replace_s: until a replacement group trains.
    """
    mtbf_s = cluster_mtbf_s(node_mtbf_s, nodes)
    interval_s = daly_interval_s(checkpoint_s, mtbf_s) if checkpoint_s > 0 else mtbf_s
    restart = expected_goodput(interval_s=interval_s, checkpoint_s=checkpoint_s, mtbf_s=mtbf_s, restart_s=restart_s)
    snap_every_s = max(step_s, daly_interval_s(snapshot_s, mtbf_s)) if snapshot_s > 0 else step_s
    inprocess = expected_goodput(interval_s=snap_every_s, checkpoint_s=snapshot_s, mtbf_s=mtbf_s,
                                 restart_s=inprocess_restart_s)  # fmt: skip
    drop = replica_drop_goodput(
        mtbf_s=mtbf_s, replica_groups=replica_groups, detect_s=drop_s, step_s=step_s, replace_s=replace_s
    )
    return {"job_restart": restart, "in_process_restart": inprocess, "replica_drop": drop}


def recovery_goodput(plan: Any) -> dict[str, Any]:
    """The expected goodput of a :class:`~lightning_v17.planner.plan.Plan`'s job under each recovery path, with the
    seconds each failure costs, from the cluster's MTBF and recovery times (``ClusterSpec.restart_s``,
    ``replica_drop_s``, ``inprocess_restart_s``) and the plan's own bytes and step time:

    * job restart: ``restart_s`` plus reading the newest checkpoint (as long as writing it), disk checkpoints at
      Daly's interval;
    * in-process restart (with ``inprocess_restart_s``): that plus fetching a rank's state (parameters and optimizer
      state) from the peer holding its snapshot over the inter-node link; a snapshot blocks the step for its copy to
      host memory (at ``pcie_gbps``);
    * replica drop (``dp_replicate`` >= 2): ``replica_drop_s``; a replacement group trains after ``restart_s`` plus
      the same fetch. With ``dp_replicate`` = 1 it is reported as needing HSDP.
    """
    from lightning_v17.planner.hardware import get_accelerator

    cluster, lay = plan.cluster, plan.layout
    acc = get_accelerator(cluster.gpu)
    gpn = cluster.gpus_per_node or acc.gpus_per_node
    nodes = max(1, -(-lay.gpus // gpn))
    rank_bytes = plan.memory.param + plan.memory.optimizer
    fetch_s = rank_bytes / acc.inter_node_bytes_per_s
    mtbf_s = cluster_mtbf_s(cluster.node_mtbf_hours * 3600.0, nodes)
    write_s = plan.checkpoint_write_s
    restart_s = cluster.restart_s + write_s
    paths: dict[str, Any] = {
        "job_restart": {
            "goodput": expected_goodput(interval_s=daly_interval_s(write_s, mtbf_s), checkpoint_s=write_s,
                                        mtbf_s=mtbf_s, restart_s=restart_s),
            "recovery_s": restart_s,
        }
    }  # fmt: skip
    if cluster.inprocess_restart_s is not None:
        snapshot_s = rank_bytes / (cluster.pcie_gbps * 1e9)
        every_s = max(plan.step_time_s, daly_interval_s(snapshot_s, mtbf_s))
        recovery_s = cluster.inprocess_restart_s + fetch_s
        paths["in_process_restart"] = {
            "goodput": expected_goodput(interval_s=every_s, checkpoint_s=snapshot_s, mtbf_s=mtbf_s,
                                        restart_s=recovery_s),
            "recovery_s": recovery_s,
        }  # fmt: skip
    groups = lay.dims.dp_replicate
    if groups >= 2:
        paths["replica_drop"] = {
            "goodput": replica_drop_goodput(mtbf_s=mtbf_s, replica_groups=groups, detect_s=cluster.replica_drop_s,
                                            step_s=plan.step_time_s, replace_s=cluster.restart_s + fetch_s),
            "recovery_s": cluster.replica_drop_s + plan.step_time_s,
        }  # fmt: skip
    else:
        paths["replica_drop"] = {"needs": "dp_replicate >= 2 (HSDP) with V17Strategy(fault_tolerance=FTPolicy(...))"}
    return {"mtbf_s": mtbf_s, "paths": paths}
