"""Generate ``docs/layouts.md``: which options compose with which, and the published layouts run in miniature.

Nothing on the page is typed in by hand. It is a pure function of two sources:

* the tests: a test module that checks a composition against one process declares, at module level,
  ``COMPOSES = (("pp", "zero3"), ("pp", "ep"), ...)`` (tuples of keys of :data:`KEYS`; an entry of more than two keys
  checks them all together, so each pair among them) and optionally ``PUBLISHED = {"name": "the miniature"}``. The
  constants are read from ``tests/**/test_*.py`` with :mod:`ast`; no test module is imported.
* the composition rules, ``lightning_v17.config.rules.RULES``: each pair of keys is built as the strategy's policies
  (every value of each key that :data:`KEYS` lists, e.g. each fp8 recipe) and handed to every rule's ``violated``. A
  rule that refuses only some values says which. Every rule whose ``options`` name two keys must refuse some pair of
  them here, and every option a rule names must be mapped in :data:`OPTION_KEYS`, so a new rule cannot be missed.

A pair that a test checks and a rule refuses for every value is a contradiction: the generator raises.

    python docs/gen_layouts.py            # rewrite docs/layouts.md
    python docs/gen_layouts.py --check    # exit 1 if docs/layouts.md is not what it would write
"""

from __future__ import annotations

import argparse
import ast
import sys
import textwrap
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import combinations, product
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "layouts.md"
TESTS = ROOT / "tests"
REGENERATE = "python docs/gen_layouts.py"

Settings = Mapping[str, Any]  # V17Strategy arguments, a policy as the dict of its fields (the rules' example spelling)


@dataclass(frozen=True)
class Key:
    """One key of the vocabulary: what it means, and how the strategy is told (for the rules).

    Attributes:
        means: what the key turns on, as the user writes it.
        values: ``(label, settings)`` for each value of the key the rules are asked about; empty for a key that is
            no strategy argument (the rules cannot refuse it).
        needs: settings the key needs and another key may override (parameter offload needs ZeRO-3).
    """

    means: str
    values: tuple[tuple[str, Settings], ...] = ()
    needs: Settings = field(default_factory=dict)


_NVME = {"nvme_path": "."}
#: The vocabulary of ``COMPOSES``, in the page's order.
KEYS: dict[str, Key] = {
    "dp_replicate": Key("`dp_replicate=2`: HSDP, replicas of the sharded group", (("dp_replicate=2", {"dp_replicate": 2}),)),
    "zero1": Key("`zero_stage=1`: optimizer state sharded", (("zero_stage=1", {"zero_stage": 1}),)),
    "zero2": Key("`zero_stage=2`: optimizer state and gradients sharded", (("zero_stage=2", {"zero_stage": 2}),)),
    "zero3": Key("`zero_stage=3`: parameters sharded too (FSDP2)", (("zero_stage=3", {"zero_stage": 3}),)),
    "tp": Key("`tp=2`: tensor parallel", (("tp=2", {"tp": {"size": 2}}),)),
    "sp": Key("`tp=TPPolicy(size=2, sequence_parallel=True)`: tensor parallel with sequence parallelism",
              (("TPPolicy(sequence_parallel=True)", {"tp": {"size": 2, "sequence_parallel": True}}),)),
    "pp": Key("`pp=2`: pipeline parallel", (("pp=2", {"pp": {"size": 2}}),)),
    "cp": Key("`cp=2`: context parallel", (("cp=2", {"cp": {"size": 2}}),)),
    "ep": Key("`ep=2`: expert parallel (MoE models)", (("ep=2", {"ep": {"size": 2}}),)),
    "offload_params": Key(
        "`offload=OffloadPolicy(params='cpu')` or `'nvme'`: ZeRO-3 parameter shards offloaded",
        (("OffloadPolicy(params='cpu')", {"offload": {"params": "cpu"}}),
         ("OffloadPolicy(params='nvme')", {"offload": {"params": "nvme", **_NVME}})),
        needs={"zero_stage": 3},
    ),
    "offload_optimizer": Key(
        "`offload=OffloadPolicy(optimizer='cpu')` or `'nvme'`: optimizer state offloaded",
        (("OffloadPolicy(optimizer='cpu')", {"offload": {"optimizer": "cpu"}}),
         ("OffloadPolicy(optimizer='nvme')", {"offload": {"optimizer": "nvme", **_NVME}})),
    ),
    "offload_activations": Key(
        "`offload=OffloadPolicy(activations='nvme')` or `'cpu'` (CUDA only): saved activations offloaded",
        (("OffloadPolicy(activations='nvme')", {"offload": {"activations": "nvme", **_NVME}}),
         ("OffloadPolicy(activations='cpu')", {"offload": {"activations": "cpu"}})),
    ),
    "recompute": Key(
        "`activation_checkpointing='selective'` or `'full'`: activation checkpointing",
        (("activation_checkpointing='selective'", {"activation_checkpointing": "selective"}),
         ("activation_checkpointing='full'", {"activation_checkpointing": "full"})),
    ),
    "fp8": Key(
        "`fp8='tensorwise'`, `'rowwise'` or `'delayed'`, optionally `FP8Policy(all_gather=True)`: float8 matmuls",
        (("fp8='tensorwise'", {"fp8": {"recipe": "tensorwise"}}), ("fp8='rowwise'", {"fp8": {"recipe": "rowwise"}}),
         ("fp8='delayed'", {"fp8": {"recipe": "delayed"}}),
         ("FP8Policy(all_gather=True)", {"fp8": {"recipe": "tensorwise", "all_gather": True}})),
        needs={"zero_stage": 3},
    ),
    "loss_parallel": Key("`tp=TPPolicy(size=2, loss_parallel=True)`: the loss on vocabulary-sharded logits",
                         (("TPPolicy(loss_parallel=True)", {"tp": {"size": 2, "loss_parallel": True}}),)),
    "accumulation": Key("`Trainer(accumulate_grad_batches=2)`: gradient accumulation"),
    "moe_balance": Key("the MoE balance terms: sequence-wise aux loss, router z-loss, aux-loss-free expert bias"),
}  # fmt: skip

#: every option a rule may name -> the key it turns on (None: an option of no key, e.g. a TP plan)
OPTION_KEYS: dict[str, tuple[str, ...] | None] = {
    "zero_stage": ("zero1", "zero2", "zero3"), "tp": ("tp",), "pp": ("pp",), "cp": ("cp",), "ep": ("ep",),
    "dp_replicate": ("dp_replicate",), "fp8": ("fp8",), "FP8Policy.all_gather": ("fp8",),
    "OffloadPolicy.params": ("offload_params",), "OffloadPolicy.optimizer": ("offload_optimizer",),
    "OffloadPolicy.activations": ("offload_activations",), "activation_checkpointing": ("recompute",),
    "TPPolicy.sequence_parallel": ("sp",), "TPPolicy.loss_parallel": ("loss_parallel",),
    "TPPolicy.plan": None, "TPPolicy.vocab_parallel": None, "PipelinePolicy.split_points": None,
}  # fmt: skip


# ------------------------------------------------------------------------------------------- the tests' constants


@dataclass(frozen=True)
class Declared:
    """What the test modules declare: pair -> the test files that check it; published name -> (miniature, file)."""

    checks: dict[frozenset[str], tuple[str, ...]]
    published: dict[str, tuple[str, str]]


def _constant(tree: ast.Module, name: str, path: str) -> tuple[Any, int] | None:
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        if any(isinstance(t, ast.Name) and t.id == name for t in targets) and node.value is not None:
            try:
                return ast.literal_eval(node.value), node.lineno
            except ValueError as err:
                raise ValueError(f"{path}:{node.lineno}: {name} must be a literal ({err})") from None
    return None


def read_declarations(files: Iterable[Path], root: Path = ROOT) -> Declared:
    """``COMPOSES`` and ``PUBLISHED`` of each test module, parsed (never imported).

    Raises:
        ValueError: a constant that is not a literal of the right shape, or a key outside :data:`KEYS`.
    """
    checks: dict[frozenset[str], set[str]] = {}
    published: dict[str, tuple[str, str]] = {}
    for file in files:
        rel, text = file.relative_to(root).as_posix(), file.read_text()
        if "COMPOSES" not in text and "PUBLISHED" not in text:
            continue
        tree = ast.parse(text, filename=rel)
        found = _constant(tree, "COMPOSES", rel)
        if found is not None:
            entries, line = found
            if not isinstance(entries, (tuple, list)):
                raise ValueError(f"{rel}:{line}: COMPOSES must be a tuple of tuples of keys")
            for entry in entries:
                if not isinstance(entry, (tuple, list)) or len(entry) < 2 or len(set(entry)) != len(entry):
                    raise ValueError(f"{rel}:{line}: COMPOSES entry {entry!r} must name two or more distinct keys")
                unknown = [k for k in entry if k not in KEYS]
                if unknown:
                    raise ValueError(f"{rel}:{line}: COMPOSES names {unknown}, not in the vocabulary {list(KEYS)}")
                for a, b in combinations(entry, 2):
                    checks.setdefault(frozenset((a, b)), set()).add(rel)
        found = _constant(tree, "PUBLISHED", rel)
        if found is not None:
            layouts, line = found
            if not isinstance(layouts, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in layouts.items()):
                raise ValueError(f"{rel}:{line}: PUBLISHED must be a dict {{name: miniature}} of strings")
            for name, miniature in layouts.items():
                if name in published:
                    raise ValueError(f"{rel}:{line}: PUBLISHED {name!r} is declared by {published[name][1]} too")
                published[name] = (miniature, rel)
    return Declared({pair: tuple(sorted(files)) for pair, files in checks.items()}, published)


def test_files(root: Path = ROOT) -> list[Path]:
    return sorted((root / "tests").rglob("test_*.py"))


# ------------------------------------------------------------------------------------------------------ the rules


def _merge(into: dict, settings: Settings, *, strict: bool, path: str = "") -> None:
    """Merge ``settings`` into ``into`` (dicts field by field). ``strict``: a different value for the same field raises
    ``KeyError`` (two keys that set one option are exclusive); otherwise the later value wins."""
    for k, v in settings.items():
        if isinstance(v, Mapping) and isinstance(into.get(k), dict):
            _merge(into[k], v, strict=strict, path=f"{path}{k}.")
        elif strict and k in into and into[k] != v:
            raise KeyError(f"{path}{k}")
        else:
            into[k] = dict(v) if isinstance(v, Mapping) else v


def layout_of(settings: Settings) -> Any:
    """``V17Strategy`` arguments (the rules' example spelling) -> the rules' ``Layout``; torch-free."""
    from lightning_v17 import config
    from lightning_v17.config import rules

    s = dict(settings)
    axes = {name: s.get(name, {}) for name in ("tp", "pp", "cp", "ep")}
    fp8 = s.get("fp8")
    policy = config.TrainingPolicy(
        zero=config.ZeroPolicy(**({"stage": s["zero_stage"]} if "zero_stage" in s else {})),
        offload=config.OffloadPolicy(**s.get("offload", {})),
        tensor_parallel=config.TPPolicy(**axes["tp"]),
        pipeline=config.PipelinePolicy(**axes["pp"]),
        context=config.CPPolicy(**axes["cp"]),
        expert=config.EPPolicy(**axes["ep"]),
        recompute=s.get("activation_checkpointing", "none"),
        fp8=None if fp8 is None else config.FP8Policy(**({"recipe": fp8} if isinstance(fp8, str) else fp8)),
    )
    sizes = {name: axes[name].get("size", 1) for name in axes} | {"dp_replicate": s.get("dp_replicate", 1)}
    return rules.Layout(policy, config.ParallelDims(**sizes))


@dataclass(frozen=True)
class Refusal:
    """A rule that refuses a pair: its name, its message and fix for the first refused values, and which values
    (``""``: every value of both keys)."""

    rule: str
    text: str
    which: str = ""


@dataclass(frozen=True)
class Cell:
    """The verdict on one pair of keys."""

    tests: tuple[str, ...] = ()
    refusals: tuple[Refusal, ...] = ()
    exclusive: bool = False  # the two keys set one option to two values (zero1 and zero2)
    flag: bool = False  # one key is the other with a flag (sp is tp with sequence_parallel=True)

    @property
    def refused(self) -> bool:
        """Refused for every value of the two keys."""
        return any(not r.which for r in self.refusals)

    @property
    def symbol(self) -> str:
        if self.exclusive:
            return "—"
        if self.tests:
            return "✓*" if self.refusals else "✓"
        if self.refusals:
            return "✗" if self.refused else "✗*"
        return "—" if self.flag else "·"


def _values(key: str) -> tuple[tuple[str, Settings], ...]:
    return KEYS[key].values or (("", {}),)


def _combine(a: str, va: Settings, b: str, vb: Settings) -> dict | None:
    """The settings of ``a`` and ``b`` together, their needs first; None when both set one option differently."""
    merged: dict = {}
    _merge(merged, KEYS[a].needs, strict=False)
    _merge(merged, KEYS[b].needs, strict=False)
    sets: dict = {}
    try:
        _merge(sets, va, strict=True)
        _merge(sets, vb, strict=True)
    except KeyError:
        return None
    _merge(merged, sets, strict=False)
    return merged


def _which(refused: set[tuple[str, str]], la: Sequence[str], lb: Sequence[str]) -> str:
    """Name the refused values: ``""`` for all; else the values of one key that are refused whatever the other's."""
    if len(refused) == len(la) * len(lb):
        return ""
    for labels, pick, others in ((la, 0, lb), (lb, 1, la)):
        chosen = [lab for lab in labels if any(r[pick] == lab for r in refused)]
        if len(refused) == len(chosen) * len(others):
            return " or ".join(chosen)
    return "; ".join(f"{x} with {y}" for x, y in sorted(refused))


def refusals(a: str, b: str, rules: Sequence[Any]) -> tuple[Refusal, ...] | None:
    """Every rule that refuses ``a`` with ``b`` for some of their values; None when they are exclusive."""
    found: dict[str, tuple[str, set[tuple[str, str]]]] = {}
    la, lb = [lab for lab, _ in _values(a)], [lab for lab, _ in _values(b)]
    for (xa, va), (xb, vb) in product(_values(a), _values(b)):
        settings = _combine(a, va, b, vb)
        if settings is None:
            return None
        layout = layout_of(settings)
        for rule in rules:
            if rule.violated(layout):
                found.setdefault(rule.name, (rule.text(layout), set()))[1].add((xa, xb))
    return tuple(Refusal(name, text, _which(combos, la, lb)) for name, (text, combos) in found.items())


def _check_alone(rules: Sequence[Any]) -> None:
    for key, spec in KEYS.items():
        for label, settings in _values(key):
            merged: dict = {}
            _merge(merged, spec.needs, strict=False)
            _merge(merged, settings, strict=False)
            hit = [r.name for r in rules if r.violated(layout_of(merged))]
            if hit:
                raise ValueError(f"KEYS[{key!r}] value {label!r} alone violates {hit}: give the key what it needs")


def _implies(a: str, b: str) -> bool:
    """Every value of ``a`` sets what ``b`` sets (sp and loss_parallel are tp with a flag)."""
    if not KEYS[b].values or not KEYS[a].values:
        return False
    for _, va in KEYS[a].values:
        for _, vb in KEYS[b].values:
            merged: dict = {}
            _merge(merged, va, strict=False)
            try:
                _merge(merged, vb, strict=True)
            except KeyError:
                return False
            if merged != _plain(va):
                return False
    return True


def _plain(settings: Settings) -> dict:
    out: dict = {}
    _merge(out, settings, strict=False)
    return out


def matrix(declared: Declared, rules: Sequence[Any]) -> dict[frozenset[str], Cell]:
    """The verdict on every pair of keys.

    Raises:
        ValueError: a pair a test checks that a rule refuses for every value; a rule naming an option missing from
            :data:`OPTION_KEYS`; a rule whose options name two keys that refuses no pair of them.
    """
    _check_alone(rules)
    cells: dict[frozenset[str], Cell] = {}
    for a, b in combinations(KEYS, 2):
        pair = frozenset((a, b))
        found = refusals(a, b, rules)
        tests = declared.checks.get(pair, ())
        cell = Cell(tests, found or (), exclusive=found is None, flag=_implies(a, b) or _implies(b, a))
        if cell.exclusive and tests:
            raise ValueError(f"{', '.join(tests)} declare ({a!r}, {b!r}), which set one option to two values")
        if cell.refused and tests:
            why = "; ".join(f"{r.rule}: {r.text}" for r in cell.refusals if not r.which)
            raise ValueError(f"({a!r}, {b!r}) is refused by {why}, and {', '.join(tests)} declare that it composes")
        cells[pair] = cell
    for rule in rules:
        keys: set[str] = set()
        for option in rule.options:
            if option not in OPTION_KEYS:
                raise ValueError(f"rule {rule.name!r} names {option!r}: map it in OPTION_KEYS (docs/gen_layouts.py)")
            keys |= set(OPTION_KEYS[option] or ())
        pairs = [frozenset(p) for p in combinations(sorted(keys), 2)]
        pairs = [p for p in pairs if not (cells[p].exclusive or cells[p].flag)]
        if pairs and not any(r.rule == rule.name for p in pairs for r in cells[p].refusals):
            raise ValueError(f"rule {rule.name!r} names {sorted(keys)} and refuses no pair of them here: give KEYS "
                             "the values it refuses (docs/gen_layouts.py)")  # fmt: skip
    return cells


def one_option_rules(cells: Mapping[frozenset[str], Cell], rules: Sequence[Any]) -> list[Any]:
    """The rules no pair trips: each refuses an option alone (a TP flag without tp > 1, ...)."""
    used = {r.rule for cell in cells.values() for r in cell.refusals}
    return [rule for rule in rules if rule.name not in used]


# --------------------------------------------------------------------------------------------------------- the page


def _code(paths: Iterable[str]) -> str:
    return ", ".join(f"`{p}`" for p in paths)


def _verdict(cell: Cell) -> str:
    parts = []
    if cell.tests:
        parts.append("works: " + _code(cell.tests))
    for r in cell.refusals:
        parts.append(f"refused{' for ' + r.which if r.which else ''} (`{r.rule}`): {r.text}")
    return "; ".join(parts).replace("|", "\\|")


def _para(text: str, width: int = 120) -> list[str]:
    """``text`` wrapped at ``width`` columns, never inside a code span."""
    spans = text.split("`")
    protected = "`".join(p.replace(" ", "\0") if i % 2 else p for i, p in enumerate(spans))
    wrapped = textwrap.wrap(protected, width, break_long_words=False, break_on_hyphens=False)
    return [line.replace("\0", " ") for line in wrapped]


def render(declared: Declared, rules: Sequence[Any]) -> str:
    """The page, from the tests' declarations and the rules."""
    cells = matrix(declared, rules)
    keys = list(KEYS)
    counts = {s: sum(1 for c in cells.values() if c.symbol.startswith(s)) for s in ("✓", "✗", "·", "—")}
    lines = [
        "# Layouts: what composes with what",
        "",
        "<!-- Generated by docs/gen_layouts.py from the tests and the composition rules; do not edit by hand: run",
        f"     `{REGENERATE}`. -->",
        "",
        *_para("Before a launch, this page says which options of `V17Strategy` (and of the Trainer and the model) "
               "work together. Every pair of options is one of three things: a test trains it and finds what one "
               "process finds, a composition rule refuses it when the strategy is built (with the reason and the "
               "fix), or nothing checks it yet. The page is generated from the `COMPOSES` and `PUBLISHED` constants "
               "of the test modules (`tests/dist/`) and from the rules in `lightning_v17/config/rules.py`; a pair "
               "that a test checks and a rule refuses stops the generator."),
        "",
        "## Usage",
        "",
        *_para("Find the row of one option and the column of the other. **✓** (works): every test file named for "
               "the pair under [every pair](#every-pair) is a parity test against one process: it trains that "
               "composition on 2 to 8 gloo ranks, and one process on the same model, seed and global batch, and "
               "holds the losses and every parameter after a few steps to the one process's in fp32, within the "
               "tolerance it states (1e-5 for most; most also compare the unclipped gradient norm, under plain SGD "
               "and under AdamW with gradient clipping that clips). **✗** (refused): `V17Strategy(...)` raises at "
               "construction with the message shown under every pair. **✓\\*** and **✗\\***: some values of the "
               "pair are refused (every pair says which), the rest is tested or not checked. **·**: not checked; it "
               "may work, but no test says so. **—**: one option (a layout has one ZeRO stage; `sp` and "
               "`loss_parallel` are `tp` with a flag, which a test may still name)."),
        "",
        *_para(f"Of the {len(cells)} pairs, {counts['✓']} are tested, {counts['✗']} refused in whole or in part, "
               f"{counts['·']} not checked and {counts['—']} one option."),
        "",
        "| key | what turns it on |",
        "|---|---|",
        *[f"| `{k}` | {KEYS[k].means} |" for k in keys],
        "",
        "## The matrix",
        "",
        "| | " + " | ".join(f"`{k}`" for k in keys) + " |",
        "|---|" + "---|" * len(keys),
    ]
    for a in keys:
        row = ["—" if a == b else cells[frozenset((a, b))].symbol for b in keys]
        lines.append(f"| `{a}` | " + " | ".join(row) + " |")
    lines += ["", "## Every pair", "", "The pairs that are tested or refused; every other pair is not checked.", "",
              "| pair | verdict |", "|---|---|"]  # fmt: skip
    for a, b in combinations(keys, 2):
        cell = cells[frozenset((a, b))]
        if cell.tests or cell.refusals:
            lines.append(f"| `{a}` x `{b}` | {_verdict(cell)} |")
    alone = one_option_rules(cells, rules)
    if alone:
        lines += ["", "Rules about one option alone, which no pair trips:", ""]
        lines += [f"- `{r.name}` ({option_list(r.options)}): {r.fix}" for r in alone]
    lines += ["", "## Published layouts", "",
              *_para("Layouts of published training runs, each run here in miniature (every axis 2, a tiny model) "
                     "against one process, as above."), ""]  # fmt: skip
    if declared.published:
        lines += ["| layout | miniature | test |", "|---|---|---|"]
        lines += [f"| {name} | {mini} | `{path}` |" for name, (mini, path) in sorted(declared.published.items())]
    else:
        lines.append("None yet.")
    return "\n".join(lines) + "\n"


def option_list(options: Sequence[str]) -> str:
    from lightning_v17.config.rules import option_text

    return ", ".join(f"`{option_text(o)}`" for o in options)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="compare with docs/layouts.md instead of writing it")
    args = ap.parse_args(argv)
    from lightning_v17.config.rules import RULES

    text = render(read_declarations(test_files()), RULES)
    if args.check:
        same = PAGE.exists() and PAGE.read_text() == text
        print("docs/layouts.md is up to date" if same else f"docs/layouts.md differs: run {REGENERATE}")
        return 0 if same else 1
    PAGE.write_text(text)
    print(f"wrote {PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
