"""The layout search behind ``v17 plan``: every layout the strategy accepts, kept when it fits, ranked by time.

Torch-free. :func:`search` enumerates the layouts of one model on one cluster (tp, pp with its schedule, cp, ep,
the ZeRO stage, the offload tiers), evaluates each with :func:`~lightning_v17.planner.plan.make_plan` (every size
fixed, the recompute the cheapest that fits), keeps those that pass the rules table
(:func:`lightning_v17.config.rules.violations`, through :func:`~lightning_v17.planner.recipes.rule_warnings`) and
fit every tier (:attr:`Plan.fits`: device, host and NVMe), and ranks them by predicted time per sample: the step
time plus every collective counted as exposed (no overlap, an upper bound), over the global batch.

Every candidate trains the same global batch G (``--global-batch``; else the rule of thumb's or one micro-batch per
device, whichever is larger): a replica of dp gets G/dp rows, split into m micro-batches of b rows
(:func:`split_batch`: the asked micro-batch where the rows allow it, and m >= pp so that a pipeline fills). At
different batches a deeper pipeline would win by its larger m alone (its bubble (p - 1)/m, Narayanan 2021 §2.2).
The cp scheme is the one that sends fewer bytes at that cp (``CPMode.AUTO``, the lower of both schemes' time).

Pruning (dominated options are not evaluated):
- recomputation costs time and only saves memory, so each layout takes the least that fits (``make_plan``);
- a higher ZeRO stage only adds traffic, so once a stage fits without recomputation or offload, the higher ones of
  that layout are skipped; offload is tried only where the device tier needs it;
- a larger cp only adds traffic at the same compute, so cp stops growing once a layout fits without recomputation.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from lightning_v17.config import MeshSpec, Recompute, Schedule, Tier, V17ConfigError, ZeroPolicy
from lightning_v17.planner import recipes
from lightning_v17.planner.plan import ClusterSpec, ModelSpec, Plan, TrainSpec, make_plan
from lightning_v17.planner.recipes import _divisors as divisors

#: the sizes whose presence on the command line means "plan this layout" rather than "search"
FIXED_SIZES = ("tp", "pp", "cp", "dp", "ep", "zero", "sp", "schedule", "virtual_stages", "dp_replicate")
#: the shortest sequence slice cp may leave each rank
_MIN_CP_SLICE = 512


@dataclass(frozen=True)
class Terms:
    """One plan's predicted step time split into what it spends (seconds)."""

    compute_s: float
    bubble_s: float
    recompute_s: float
    comm_s: float
    offload_s: float

    @property
    def total_s(self) -> float:
        return self.compute_s + self.bubble_s + self.recompute_s + self.comm_s + self.offload_s


def terms(plan: Plan) -> Terms:
    """Split ``plan``'s step into compute, pipeline bubble, recomputation, communication (all exposed) and offload."""
    busy = plan.step_time_s - plan.offload_time_s
    offload = plan.offload_time_s
    if plan.activation_offload is not None:
        busy -= plan.activation_offload.exposed_s_per_step
        offload += plan.activation_offload.exposed_s_per_step
    bubble = busy * plan.bubble / (1 + plan.bubble)
    work = busy - bubble
    recompute = work * (plan.flops_per_step - plan.model_flops_per_step) / plan.flops_per_step
    return Terms(work - recompute, bubble, recompute, plan.comm_time_s, offload)


@dataclass(frozen=True)
class Candidate:
    """A layout that passes the rules and fits, with its time split (:func:`terms`)."""

    plan: Plan
    terms: Terms

    @property
    def step_s(self) -> float:
        """The predicted step time with every collective exposed."""
        return self.terms.total_s

    @property
    def per_sample_s(self) -> float:
        return self.step_s / self.plan.layout.global_batch

    def loses_to(self, best: Candidate) -> str:
        """Why this candidate is slower than ``best``: the term that grows most per sample."""
        if self is best:
            return "fastest"
        if self.plan.warnings and not best.plan.warnings:
            return f"ranked after every layout without a warning: {self.plan.warnings[0]}"
        g, h = self.plan.layout.global_batch, best.plan.layout.global_batch
        names = ("compute", "bubble", "recompute", "comm", "offload")
        deltas = {n: getattr(self.terms, f"{n}_s") / g - getattr(best.terms, f"{n}_s") / h for n in names}
        name = max(deltas, key=lambda n: deltas[n])
        ratio = self.per_sample_s / best.per_sample_s
        return f"{ratio:.2f}x the time per sample; larger {name} ({deltas[name] * 1e3:+.3g} ms per sample)"


def describe(plan: Plan) -> str:
    """The layout in one line: ``tp=8 pp=16 (1f1b) cp=1 dp=128 zero=1 recompute=full``."""
    lay = plan.layout
    pp = f"pp={lay.pp}" + (f" ({lay.schedule.value}, v={lay.virtual_stages})" if lay.pp > 1 else "")
    words = [f"tp={lay.tp}", pp, f"cp={lay.cp}", f"dp={lay.dp}"]
    words += [f"(dp_replicate={lay.dims.dp_replicate} x dp_shard={lay.dims.dp_shard})"] if lay.dims.dp_replicate > 1 else []
    words += [f"ep={lay.ep}"] if lay.ep > 1 else []
    words += [f"zero={lay.zero.stage}", f"recompute={lay.recompute.value}"]
    words += [f"OffloadPolicy(optimizer={lay.offload_optimizer.value!r})"] if lay.offload_optimizer != Tier.NONE else []
    words += [f"OffloadPolicy(params={lay.params_tier.value!r})"] if lay.params_tier != Tier.NONE else []
    return " ".join(words)


def rule_failures(plan: Plan) -> list[str]:
    """The rules of the rules table ``plan``'s layout violates (empty: V17Strategy accepts it)."""
    lay = plan.layout
    return recipes.rule_warnings(lay.dims, zero=lay.zero, sp=lay.sp, offload_optimizer=lay.offload_optimizer,
                                 offload_params=lay.offload_params, fp8=lay.fp8)  # fmt: skip


@dataclass(frozen=True)
class Published:
    """A layout a paper trained with, planned beside the search's choice when the preset, world and sequence match."""

    source: str
    model: str
    gpus: int
    seq: int
    train: TrainSpec


#: Llama 3 (Dubey 2024) Table 4: the 405B runs; DeepSeek-V3 (DeepSeek-AI 2024) §3.2: PP16 x EP64 x ZeRO-1 on 2048 GPUs.
#: Planned with 1F1B (the papers' own schedules are interleaved 1F1B and DualPipe).
PUBLISHED = (
    Published("Llama 3 Table 4: TP8 CP1 PP16 DP64", "llama3-405b", 8192, 8192,
              TrainSpec(tp=8, pp=16, cp=1, zero=ZeroPolicy(stage=1))),
    Published("Llama 3 Table 4: TP8 CP1 PP16 DP128", "llama3-405b", 16384, 8192,
              TrainSpec(tp=8, pp=16, cp=1, zero=ZeroPolicy(stage=1))),
    Published("Llama 3 Table 4: TP8 CP16 PP16 DP4", "llama3-405b", 16384, 131072,
              TrainSpec(tp=8, pp=16, cp=16, zero=ZeroPolicy(stage=1))),
    Published("DeepSeek-V3: PP16 x EP64 x ZeRO-1", "deepseek-v3-671b", 2048, 4096,
              TrainSpec(tp=1, pp=16, cp=1, ep=64, zero=ZeroPolicy(stage=1))),
)  # fmt: skip


@dataclass(frozen=True)
class SearchResult:
    """The ranked candidates (fastest first), the decision tree's plan, the published layouts that match, and when
    nothing fits, the smallest changes that would."""

    candidates: tuple[Candidate, ...]
    rule_of_thumb: Plan
    evaluated: int
    published: tuple[tuple[Published, Plan], ...] = ()
    changes: tuple[str, ...] = ()

    @property
    def best(self) -> Plan | None:
        return self.candidates[0].plan if self.candidates else None


def has_fixed_sizes(train: TrainSpec) -> bool:
    """Whether the user fixed any layout size (then ``v17 plan`` plans that layout instead of searching)."""
    return any(getattr(train, name) is not None for name in FIXED_SIZES)


def split_batch(global_batch: int, *, dp: int, micro_batch: int, pp: int) -> tuple[int, int] | None:
    """(b, m): the rows each data-parallel replica trains per step, ``global_batch / dp``, as ``m`` micro-batches of
    ``b`` rows, ``b`` the largest divisor of the rows up to ``micro_batch`` that leaves a pipeline ``m >= pp``
    micro-batches to fill its stages with (G = dp·b·m, Narayanan 2021 §2). None when ``dp`` does not divide the
    global batch or a replica's rows cannot fill ``pp`` stages."""
    if global_batch % dp:
        return None
    rows = global_batch // dp
    for b in range(min(micro_batch, rows), 0, -1):
        if rows % b == 0 and rows // b >= pp:
            return b, rows // b
    return None


def _replicas(dp: int, *, group: int, gpn: int, world: int) -> int:
    """The HSDP replicas the search tries for ``dp`` data-parallel ranks: those that leave each shard group on one
    node (dp_shard x cp x tp <= devices per node, the largest such dp_shard), where the data-parallel ranks span
    nodes and a node holds more than one of them; 1 (no HSDP) otherwise."""
    if world <= gpn or dp * group <= gpn:
        return 1
    shard = max((s for s in divisors(dp) if s * group <= gpn), default=1)
    return dp // shard if shard > 1 else 1  # one rank per shard group is plain replication: ZeRO-0's layout


def _options(values: list[int], world: int, used: int) -> list[int]:
    return [v for v in values if world % (used * v) == 0]


def _offloads(zero: int, allow_nvme: bool) -> list[tuple[Tier, Tier]]:
    """The (optimizer, params) offload tiers to try: cpu, and nvme when allowed; the parameters at ZeRO-3 only."""
    tiers = [Tier.CPU, Tier.NVME] if allow_nvme else [Tier.CPU]
    return [(t, Tier.NONE) for t in tiers] + ([(t, t) for t in tiers] if zero == 3 else [])


def _evaluate(model: ModelSpec, cluster: ClusterSpec, train: TrainSpec) -> Plan | None:
    try:
        return make_plan(model, cluster, train)
    except (V17ConfigError, ValueError):
        return None


def _passes(plan: Plan) -> bool:
    return plan.fits and not rule_failures(plan)


def _layouts(model: ModelSpec, world: int, gpn: int, seq: int):
    """(tp, pp, schedule, virtual_stages) in the order searched; cp and ep are chosen per layout."""
    shape = model.shape
    if shape is None:
        yield 1, 1, Schedule.ONE_F_ONE_B, 1
        return
    tps = [t for t in divisors(gpn) if shape.heads % t == 0 and shape.kv_heads % t == 0 and shape.ffn % t == 0]
    pps = sorted(set(divisors(shape.layers)) | {2**k for k in range(shape.layers.bit_length()) if 2**k <= shape.layers})
    for tp in _options(tps, world, 1):
        for pp in _options(pps, world, tp):
            yield tp, pp, Schedule.ONE_F_ONE_B, 1
            if pp > 1 and shape.layers >= 2 * pp:
                yield tp, pp, Schedule.INTERLEAVED_1F1B, 2


def search(model: ModelSpec, cluster: ClusterSpec, train: TrainSpec, *, allow_nvme: bool = False,
           suggest: bool = True) -> SearchResult:
    """Every layout of ``model`` on ``cluster`` that passes the rules and fits, fastest per sample first.

    ``train`` gives what is not searched: the batch (``micro_batch``, ``global_batch`` or ``microbatches``), the
    sequence, precision, optimizer, a recompute mode or offload tiers when set. NVMe offload is tried only with
    ``allow_nvme``. With ``suggest`` and no candidate, the result names the changes that make one fit.
    """
    gpn = cluster.gpus_per_node or cluster.accelerator.gpus_per_node
    world = cluster.gpus or gpn
    cluster = replace(cluster, gpus=world)
    base = replace(train, **{name: None for name in FIXED_SIZES})
    rule_of_thumb = make_plan(model, cluster, base)
    # every candidate trains one global batch: the user's, else the rule of thumb's or one micro-batch per device,
    # whichever is larger (each replica of tp·pp·cp devices then has at least pp micro-batches to fill its pipeline)
    batch = train.global_batch or max(rule_of_thumb.layout.global_batch, world * train.micro_batch)
    base = replace(base, global_batch=None, microbatches=None)
    shape = model.shape
    seq = train.seq or (shape.seq if shape is not None else 2048)
    found: list[Candidate] = []
    evaluated = 0
    for tp, pp, schedule, v in _layouts(model, world, gpn, seq):
        cps = [2**k for k in range(20) if seq % (2 ** (k + 1)) == 0 and seq // 2**k >= min(seq, _MIN_CP_SLICE)]
        previous = None
        for cp in _options(cps if shape is not None else [1], world, tp * pp):
            dp = world // (tp * pp * cp)
            experts = shape.num_experts if shape is not None else 0
            eps = [e for e in divisors(experts) if dp % e == 0] if experts else [1]
            best_cp = None
            best_ep = None
            split = split_batch(batch, dp=dp, micro_batch=train.micro_batch, pp=pp)
            if split is None:
                break  # a larger cp leaves fewer replicas, each with more rows: it may fill the pipeline
            for ep in eps:
                cell = replace(base, tp=tp, pp=pp, cp=cp, dp=dp, ep=ep, schedule=schedule, virtual_stages=v,
                               micro_batch=split[0], microbatches=split[1])  # fmt: skip
                got, n = _cell(model, cluster, cell, train, allow_nvme)
                hybrid = _replicas(dp, group=tp * cp, gpn=gpn, world=world) if ep == 1 else 1
                if hybrid > 1:  # HSDP: ZeRO within a node, the replicas across nodes
                    more, k = _cell(model, cluster, replace(cell, dp_replicate=hybrid), train, allow_nvme)
                    got, n = got + more, n + k
                evaluated += n
                found += got
                here = min((c.per_sample_s for c in got), default=None)
                if best_ep is not None and (here is None or here > best_ep):
                    break  # a larger ep only adds traffic from here on
                best_ep = here if best_ep is None or (here is not None and here < best_ep) else best_ep
            best_cp = best_ep
            if previous is not None and (best_cp is None or best_cp > previous):
                break  # a larger cp only adds traffic from here on
            previous = best_cp if best_cp is not None else previous
    # a layout the planner itself warns about (an anti-pattern of design §17.5/§10.7) is never the recommendation
    found.sort(key=lambda c: (bool(c.plan.warnings), c.per_sample_s, c.plan.layout.gpus, describe(c.plan)))
    published = tuple((p, plan) for p in PUBLISHED if p.model == model.name and p.gpus == world and p.seq == seq
                      and (plan := _evaluate(model, cluster, replace(base, global_batch=batch,
                                                                     **_sizes(p.train)))) is not None)
    changes = _changes(model, cluster, train, allow_nvme) if suggest and not found else ()
    return SearchResult(tuple(found), rule_of_thumb, evaluated, published, changes)


def _cell(model: ModelSpec, cluster: ClusterSpec, cell: TrainSpec, train: TrainSpec,
          allow_nvme: bool) -> tuple[list[Candidate], int]:
    """The candidates of one set of axis sizes: the ZeRO stages upward until one fits without recomputation, then,
    where none does, the offload tiers at the highest stage the rules allow."""
    found: list[Candidate] = []
    evaluated = 0
    r = cell.dp_replicate or 1
    dims = MeshSpec(pp=cell.pp, dp_replicate=r, dp_shard=cell.dp // r, cp=cell.cp, tp=cell.tp, ep=cell.ep)
    stages = [z for z in range(4) if not recipes.rule_warnings(dims, zero=ZeroPolicy(stage=z), sp=cell.tp > 1,
                                                               fp8=train.fp8) and (z > 0 or r == 1)]  # fmt: skip
    if cell.dp * cell.cp > 1 and 0 in stages and 1 in stages:
        stages.remove(0)  # ZeRO-1 moves the same bytes as ZeRO-0's all-reduce and holds less
    user_tiers = train.offload_optimizer != Tier.NONE or train.offload_params != Tier.NONE
    for zero in stages:
        tiers = [(train.offload_optimizer, train.offload_params)] if user_tiers else [(Tier.NONE, Tier.NONE)]
        if zero == stages[-1] and not user_tiers and not any(_clean(c.plan, train) for c in found):
            tiers += _offloads(zero, allow_nvme)
        for opt, params in tiers:
            spec = replace(cell, zero=ZeroPolicy(stage=zero), offload_optimizer=opt, offload_params=params)
            plan = _evaluate(model, cluster, spec)
            evaluated += 1
            if plan is not None and _passes(plan):
                found.append(Candidate(plan, terms(plan)))
                if _clean(plan, train):
                    return found, evaluated
    return found, evaluated


def _clean(plan: Plan, train: TrainSpec) -> bool:
    """Fits without recomputation (or with the user's), so nothing above it in ZeRO stage or offload is faster."""
    return plan.layout.recompute in (Recompute.NONE, train.recompute)


def _sizes(train: TrainSpec) -> dict[str, object]:
    return {name: getattr(train, name) for name in FIXED_SIZES if getattr(train, name) is not None}


def _changes(model: ModelSpec, cluster: ClusterSpec, train: TrainSpec, allow_nvme: bool) -> tuple[str, ...]:
    """The smallest change of each kind that makes some layout fit: offload, more devices, a shorter sequence."""
    out: list[str] = []

    def first(result: SearchResult) -> str:
        return describe(result.candidates[0].plan)

    if not allow_nvme or train.offload_optimizer == Tier.NONE:
        r = search(model, cluster, train, allow_nvme=True, suggest=False)
        if r.candidates:
            out.append(f"offload (--allow-nvme-offload): {first(r)}")
    world = cluster.gpus or 1
    for k in (2, 4, 8, 16):
        r = search(model, replace(cluster, gpus=world * k), train, allow_nvme=allow_nvme, suggest=False)
        if r.candidates:
            out.append(f"more devices (--gpus {world * k}, which allows a longer pp): {first(r)}")
            break
    seq = train.seq or (model.shape.seq if model.shape is not None else None)
    for k in (2, 4, 8):
        if seq is None or seq % k or seq // k < 128:
            break
        r = search(model, cluster, replace(train, seq=seq // k), allow_nvme=allow_nvme, suggest=False)
        if r.candidates:
            out.append(f"a shorter sequence (--seq {seq // k}): {first(r)}")
            break
    return tuple(out)


def _row(plan: Plan, step_s: float) -> dict[str, object]:
    lay = plan.layout
    return {"layout": describe(plan), "tp": lay.tp, "pp": lay.pp, "cp": lay.cp, "dp": lay.dp, "ep": lay.ep,
            "dp_replicate": lay.dims.dp_replicate,
            "zero_stage": lay.zero.stage, "recompute": lay.recompute.value, "schedule": lay.schedule.value,
            "virtual_stages": lay.virtual_stages, "microbatches": lay.microbatches, "global_batch": lay.global_batch,
            "offload_optimizer": lay.offload_optimizer.value, "offload_params": lay.params_tier.value,
            "device_gb": round(plan.memory.tiers.gpu / 1e9, 3), "fits": plan.fits,
            "step_time_s": round(step_s, 6), "per_sample_s": round(step_s / lay.global_batch, 9),
            "rules": rule_failures(plan)}  # fmt: skip


def to_dict(result: SearchResult, top: int) -> dict[str, object]:
    """The search in the JSON of ``v17 plan``: the top candidates, the rule of thumb, the published layouts."""
    best = result.candidates[0] if result.candidates else None
    shown = [dict(_row(c.plan, c.step_s), loses_to_first=c.loses_to(best)) for c in result.candidates[:top]]
    return {
        "evaluated": result.evaluated, "fitting": len(result.candidates), "candidates": shown,
        "rule_of_thumb": _row(result.rule_of_thumb, terms(result.rule_of_thumb).total_s),
        "published": [dict(_row(plan, terms(plan).total_s), source=p.source) for p, plan in result.published],
        "nothing_fits_changes": list(result.changes),
    }  # fmt: skip


def render(result: SearchResult, top: int) -> str:
    """The search section of the ``v17 plan`` report."""
    head = (f"Search: {result.evaluated} layouts evaluated, {len(result.candidates)} pass the rules and fit "
            f"(time per step counts every collective as exposed)")
    lines = [head]
    best = result.candidates[0] if result.candidates else None
    for i, c in enumerate(result.candidates[:top], 1):
        lay = c.plan.layout
        lines.append(f"  {i}. {describe(c.plan)}: {c.step_s:.3g} s/step at G={lay.global_batch}, "
                     f"{c.plan.memory.tiers.gpu / 1e9:.1f} GB/rank; {c.loses_to(best)}")
    if best is None:
        lines.append("  nothing fits; " + ("what would:" if result.changes else "no change tried makes it fit"))
        lines += [f"    - {change}" for change in result.changes]
    rows = [("rule of thumb", result.rule_of_thumb)] + [(p.source, plan) for p, plan in result.published]
    for name, plan in rows:
        fit = "fits" if plan.fits else "DOES NOT FIT"
        refused = "; refused: " + "; ".join(rule_failures(plan)) if rule_failures(plan) else ""
        lines.append(f"  {name}: {describe(plan)}: {terms(plan).total_s:.3g} s/step at G={plan.layout.global_batch}, "
                     f"{plan.memory.tiers.gpu / 1e9:.1f} GB/rank, {fit}{refused}")
    return "\n".join(lines)


__all__ = ["PUBLISHED", "Candidate", "Published", "SearchResult", "Terms", "describe", "has_fixed_sizes", "render",
           "rule_failures", "search", "split_batch", "terms", "to_dict"]
