"""Every message the product prints names its options as the user writes them today.

The front door is ``V17Strategy(...)`` with one policy per concern (``pp=PipelinePolicy(schedule=...)``,
``offload=OffloadPolicy(params=...)``, ...). The flat spellings it replaced (``pp_schedule=``, ``offload_params=``,
``tp_plan=``, ``cp_mode=``, ``fp8_skip=``, ...) are gone from it, so a message that still says ``pp_schedule='zbv'``
sends the user to an option that does not exist.

The product's strings are read with ``ast`` (docstrings excluded): every string constant and f-string (an f-string's
fields read as a placeholder), which covers the messages of ``raise``, ``warnings.warn``, the loggers and the rules
table, and every option name handed to a helper that prints it as ``{option}=...`` (``parse_enum(option=...)``,
``Tier.parse(value, "...")``, ``_check_positive_int("...", ...)``). Each ``name=`` in them must be an option of the
front door or a keyword the message legitimately cites; the vocabulary is read from the code, not copied from the
messages:

* ``Callee(name=`` (``ZeroPolicy(stage=``, ``parallelize(tp_plan=``): ``name`` is a parameter of that callee;
* ``a.b=``: ``b`` is a field of the policy ``V17Strategy(a=...)`` takes, a LightningCLI ``data.``/``trainer.`` key,
  or a DeepSpeed JSON key;
* a bare ``name=``: a ``V17Strategy`` argument, a policy field, a parameter of a public class or function of the
  package, a ``v17 plan`` flag, a torch/Lightning keyword, or a DeepSpeed JSON key; never a flat spelling
  ``<argument>_<field>`` of a policy (``offload_params``), even where an internal or planner name still uses it.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import re
import typing
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("lightning_v17", "strategies", "callbacks")
#: the packages whose public classes and functions (their ``__all__``) a user calls; their parameters are options too
PUBLIC = ("callbacks", "data", "models", "optim", "checkpoint", "trackers", "resilience", "planner")
PH = "\x00"  # an f-string field or a %-placeholder: its text is not known here
#: ``name=`` in text (not ``==``, not part of a longer dotted name, a flag or a placeholder), and parentheses
TOKEN = re.compile(r"[()]|(?<![\w.\-\x00])([A-Za-z_][\w.]*)=(?!=)")
CALLEE = re.compile(r"([A-Za-z_][\w.]*)$")
#: Names third-party models and files use, which messages cite when they tell the user what to change there.
ALLOWED = {
    "tie_word_embeddings": "Hugging Face PretrainedConfig: untie the input and output embeddings",
    "use_cache": "Hugging Face PretrainedConfig: a KV cache cannot be recomputed under activation checkpointing",
    "shift_labels": "Hugging Face's causal-LM loss keyword",
    "norm_qk": "litgpt Config: q/k norms litgpt's tensor-parallel plan cannot shard",
    "mp_world_size": "a DeepSpeed checkpoint's model-parallel world size (deepspeed/checkpoint/constants.py)",
    "partition_count": "a DeepSpeed optimizer file's ZeRO partition count (deepspeed/checkpoint/constants.py)",
    "class_path": "jsonargparse/LightningCLI: the class a YAML section instantiates",
    "kv": "the planner report's model-shape notation (L h a kv ffn V), the --kv-heads flag",
    "batched": "Hugging Face datasets' Dataset.map keyword, in the fix for an untokenized dataset",
    "format": "the key of a v17 sharded checkpoint's manifest, named when the manifest is not one",
}


# ---------------------------------------------------------------------------------------------- the product's strings
def _render(node: ast.AST) -> str | None:
    """The text of a string constant, f-string or ``+`` of them; fields and %-placeholders become :data:`PH`."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return re.sub(r"%[-\d.]*[sdrfig]", PH, node.value)
    if isinstance(node, ast.JoinedStr):
        return "".join(_render(v) or PH if isinstance(v, ast.Constant) else PH for v in node.values)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _render(node.left), _render(node.right)
        if left is not None or right is not None:
            return (left or PH) + (right or PH)
    return None


def _docstrings(tree: ast.AST) -> set[int]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def _printed_options(trees: dict[str, ast.AST]) -> dict[tuple[str, int | None, str], None]:
    """Where an option name travels as a plain string: ``(function, position, keyword)`` of every parameter that a
    function prints as ``{param}=...`` (an f-string field followed by ``=``, or the first argument of
    ``lightning_v17.config.errors.spell``), or hands on to such a parameter of another function (``Schedule.parse``'s
    ``option`` goes to ``parse_enum``'s)."""
    functions = [fn for tree in trees.values() for fn in ast.walk(tree)
                 if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))]  # fmt: skip
    found: dict[tuple[str, int | None, str], None] = {}

    def signature(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> tuple[list[str], set[str]]:
        args = [a.arg for a in fn.args.posonlyargs + fn.args.args]
        args = args[1:] if args and args[0] in ("self", "cls") else args
        return args, set(args) | {a.arg for a in fn.args.kwonlyargs}

    def into_printed(call: ast.Call) -> list[ast.AST]:
        name = getattr(call.func, "id", None) or getattr(call.func, "attr", None)
        out = [call.args[0]] if name == "spell" and call.args else []
        for fn, pos, kw in found:
            if fn == name:
                out += [k.value for k in call.keywords if k.arg == kw]
                out += [call.args[pos]] if pos is not None and pos < len(call.args) else []
        return out

    while True:
        before = len(found)
        for fn in functions:
            args, names = signature(fn)
            printed = set()
            for node in ast.walk(fn):
                if isinstance(node, ast.JoinedStr):
                    for field, after in zip(node.values, node.values[1:]):
                        if (isinstance(field, ast.FormattedValue) and isinstance(field.value, ast.Name)
                                and isinstance(after, ast.Constant) and re.match(r"=(?!=)", after.value)):
                            printed.add(field.value.id)
                if isinstance(node, ast.Call):
                    printed |= {a.id for a in into_printed(node) if isinstance(a, ast.Name)}
            for name in printed & names:
                found[(fn.name, args.index(name) if name in args else None, name)] = None
        if len(found) == before:
            return found


@cache
def product_strings() -> tuple[tuple[str, int, str, frozenset[str]], ...]:
    """``(file, line, text, own)`` of every non-docstring string of the product, and of every option name a helper
    prints as ``{option}=...`` (as ``option=``, or as written when it already spells the call, ``Cls(field=...)``);
    ``own`` are the parameters of the function the string is in (a message may report the arguments it was given)."""
    trees = {str(p.relative_to(ROOT)): ast.parse(p.read_text(), str(p))
             for top in PRODUCT for p in sorted((ROOT / top).rglob("*.py"))}  # fmt: skip
    printed = _printed_options(trees)
    by_function = {}
    for fn, pos, kw in printed:
        by_function.setdefault(fn, []).append((pos, kw))
    out = []
    for path, tree in trees.items():
        skip = _docstrings(tree)
        own: dict[int, frozenset[str]] = {}
        for fn in ast.walk(tree):  # outer functions first: an inner function's parameters replace them
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                a = fn.args
                names = frozenset(x.arg for x in a.posonlyargs + a.args + a.kwonlyargs) - {"self", "cls"}
                own |= {id(n): names for n in ast.walk(fn)}
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and node.name in ("__repr__", "extra_repr"):
                skip |= {id(n) for n in ast.walk(node)}  # an object's repr shows its attributes, not options
        for node in ast.walk(tree):  # parts of a larger string are read with it
            if isinstance(node, (ast.JoinedStr, ast.BinOp)) and _render(node) is not None:
                skip |= {id(n) for n in ast.walk(node) if n is not node}
        for node in ast.walk(tree):
            text = None if id(node) in skip else _render(node)
            if text is not None:
                out.append((path, node.lineno, text, own.get(id(node), frozenset())))
            options: list[ast.AST] = []
            if isinstance(node, ast.Call):
                name = getattr(node.func, "id", None) or getattr(node.func, "attr", None)
                for pos, kw in by_function.get(name, ()):
                    options += [k.value for k in node.keywords if k.arg == kw]
                    options += [node.args[pos]] if pos is not None and pos < len(node.args) else []
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = node.args
                defaults = dict(zip([x.arg for x in a.posonlyargs + a.args][::-1], a.defaults[::-1]))
                defaults |= {x.arg: d for x, d in zip(a.kwonlyargs, a.kw_defaults) if d is not None}
                options += [d for p, d in defaults.items() if any(kw == p for _, kw in by_function.get(node.name, ()))]
            for opt in options:
                if isinstance(opt, ast.Constant) and isinstance(opt.value, str) and not opt.value.startswith("-"):
                    text = opt.value if "=" in opt.value else f"{opt.value}=..."
                    out.append((path, opt.lineno, text, frozenset()))
    return tuple(out)


def mentions(text: str) -> list[tuple[str | None, str]]:
    """Every ``name=`` in ``text`` with the callee whose parentheses hold it (None outside any call)."""
    stack: list[str | None] = []
    found = []
    for m in TOKEN.finditer(text):
        if m.group(0) == "(":
            callee = CALLEE.search(text[: m.start()])
            stack.append(callee.group(1) if callee else None)
        elif m.group(0) == ")":
            stack = stack[:-1]
        else:
            found.append((stack[-1] if stack else None, m.group(1)))
    return found


# ---------------------------------------------------------------------------------------------------- the vocabulary
def _parameters(obj: object) -> set[str] | None:
    """The keyword names ``obj`` takes (a dataclass's fields, a callable's parameters); None when it takes
    ``**kwargs`` or has no signature."""
    if dataclasses.is_dataclass(obj):
        return {f.name for f in dataclasses.fields(obj)}
    try:
        params = inspect.signature(obj).parameters.values()  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None
    if any(p.kind == p.VAR_KEYWORD for p in params):
        return None
    return {p.name for p in params if p.kind != p.VAR_POSITIONAL} - {"self", "cls"}


@cache
def front_door() -> dict[str, type | None]:
    """``V17Strategy``'s arguments, each with the policy class it takes (None for a plain value)."""
    from lightning_v17 import V17Strategy, config

    policies = {getattr(config, n) for n in config.__all__ if dataclasses.is_dataclass(getattr(config, n))}
    hints = typing.get_type_hints(V17Strategy.__init__)
    out = {}
    for name in inspect.signature(V17Strategy.__init__).parameters:
        if name != "self":
            found = [a for a in typing.get_args(hints[name]) or (hints[name],) if a in policies]
            out[name] = found[0] if found else None
    return out


@cache
def policies() -> dict[str, type]:
    """Every policy dataclass of ``lightning_v17.config`` a user builds, by name. ``TrainingPolicy`` is not one: it is
    the parsed whole (``strategy.policy``), whose field names (``tensor_parallel=``, ``pipeline=``) no user writes."""
    from lightning_v17 import config

    return {n: getattr(config, n) for n in config.__all__
            if dataclasses.is_dataclass(getattr(config, n)) and n != "TrainingPolicy"}  # fmt: skip


@cache
def flat_spellings() -> frozenset[str]:
    """``<argument>_<field>`` for every policy argument of ``V17Strategy`` (``offload_params``, ``pp_schedule``,
    ``fp8_skip``): the options the policies replaced, unless one is still a real argument (``zero_stage``)."""
    flat = {f"{arg}_{f.name}" for arg, cls in front_door().items() if cls is not None for f in dataclasses.fields(cls)}
    return frozenset(flat - set(front_door()))


@cache
def deepspeed_keys() -> frozenset[str]:
    """The DeepSpeed JSON keys the config reader knows (dotted paths, and each leaf alone)."""
    from lightning_v17.config import DEEPSPEED_NO_EFFECT_KEYS, DEEPSPEED_SUPPORTED_KEYS

    paths = set(DEEPSPEED_SUPPORTED_KEYS) | set(DEEPSPEED_NO_EFFECT_KEYS)
    return frozenset(paths | {p.rsplit(".", 1)[-1] for p in paths})


@cache
def public_names(*packages: str) -> dict[str, list[object]]:
    """The names in the ``__all__`` of ``lightning_v17.<package>`` and of each of its modules, each with every object
    it names (the planner's ``ActivationOffload`` is not the engine's)."""
    import pkgutil

    out: dict[str, list[object]] = {}
    for pkg in packages:
        top = importlib.import_module(f"lightning_v17.{pkg}")
        subs = pkgutil.walk_packages(getattr(top, "__path__", []), f"{top.__name__}.")
        mods = [top.__name__, *(m.name for m in subs)]
        for mod in mods:
            module = importlib.import_module(mod)
            for name in getattr(module, "__all__", ()):
                obj = getattr(module, name, None)
                if obj is not None and all(obj is not o for o in out.setdefault(name, [])):
                    out[name].append(obj)
    return out


@cache
def namespace() -> dict[str, list[object]]:
    """What a message may name as a callee: the public names of the package (engine included), torch's and
    Lightning's entry points that messages cite."""
    import lightning.pytorch as pl
    import torch

    import lightning_v17

    out = dict(public_names("config", "engine", *PUBLIC))
    out |= {"V17Strategy": [lightning_v17.V17Strategy], "torch": [torch], "L": [pl], "Trainer": [pl.Trainer],
            "trainer": [pl.Trainer], "ModelCheckpoint": [pl.callbacks.ModelCheckpoint],
            "load_state_dict": [torch.nn.Module.load_state_dict]}  # fmt: skip
    return out


def _resolve(callee: str) -> list[object]:
    """Every object ``callee`` (a public name, or a dotted path into one) may mean."""
    head, *rest = callee.split(".")
    found = []
    for obj in namespace().get(head, []):
        for part in rest:
            obj = getattr(obj, part, None)
        if obj is not None:
            found.append(obj)
    return found


@cache
def vocabulary() -> frozenset[str]:
    """Every name a bare ``name=`` may use (see the module docstring), flat spellings removed."""
    import lightning.pytorch as pl
    import torch
    import torch.distributed as dist

    from lightning_v17.planner.cli import build_parser

    words = set(front_door())
    for cls in policies().values():
        words |= {f.name for f in dataclasses.fields(cls)}
        # what the policies answer (MeshSpec.efsdp, FP8Policy.history_len): messages report them beside the options
        words |= {n for n, v in vars(cls).items() if isinstance(v, property)}
    for obj in (o for objs in public_names(*PUBLIC).values() for o in objs):
        if inspect.isclass(obj) or inspect.isfunction(obj):
            words |= _parameters(obj) or set()
        if inspect.isclass(obj):  # and its public methods' (GoodputTracker.model_inputs(saves=...))
            for name, method in vars(obj).items():
                if inspect.isfunction(method) and not name.startswith("_"):
                    words |= _parameters(method) or set()
    words |= {a.dest for a in build_parser()._actions}  # v17 plan's flags, as messages about the plan name them
    # torch and Lightning keywords the messages tell users to pass
    for fn in (pl.Trainer.__init__, pl.Trainer.fit, pl.Trainer.init_module, pl.strategies.Strategy.save_checkpoint,
               torch.load, torch.nn.Module.load_state_dict, torch.nn.Linear.__init__,
               torch.nn.functional.scaled_dot_product_attention, dist.init_process_group):
        words |= _parameters(fn) or set()
    words |= deepspeed_keys() | set(ALLOWED)
    return frozenset(words - flat_spellings())


def stale(callee: str | None, name: str, own: frozenset[str] = frozenset()) -> str | None:
    """Why ``name=`` (inside ``callee(...)``, in a function taking ``own``) is not an option as the user writes it,
    or None when it is."""
    if len(name) == 1 or not re.search(r"[a-z]", name):
        return None  # a math symbol (p=, m=) or an environment variable, not an option
    if callee is not None and (targets := _resolve(callee)):
        params = [_parameters(t) for t in targets]
        if any(p is None or name in p for p in params):
            return None
        return f"{callee}() has no parameter {name!r} (it takes {sorted(set().union(*params))})"
    if "." in name:
        head, *rest = name.split(".")
        policy = front_door().get(head) or policies().get(head)  # offload.params, or OffloadPolicy.params
        if policy is not None:
            fields = {f.name for f in dataclasses.fields(policy)}
            ok = len(rest) == 1 and rest[0] in fields
            return None if ok else f"{policy.__name__} has no field {'.'.join(rest)!r} (it has {sorted(fields)})"
        if head == "data" and len(rest) == 1 and rest[0] in vocabulary():
            return None  # a LightningCLI ``data:`` key (the datamodules' parameters are in the vocabulary)
        if name in deepspeed_keys():
            return None
        return f"{name!r} is neither a policy field (offload.params), a LightningCLI data key nor a DeepSpeed key"
    if name in flat_spellings():
        return f"{name!r} is a flat spelling that V17Strategy no longer takes"
    if name not in vocabulary() | own:
        return f"{name!r} is no option of V17Strategy, of a policy, of a public class or of v17 plan"
    return None


def test_every_message_names_options_as_the_user_writes_them() -> None:
    bad = [f"{path}:{line}: {name}=  ({why})\n    {text[:160]!r}"
           for path, line, text, own in product_strings() for callee, name in mentions(text)
           if (why := stale(callee, name, own)) is not None]  # fmt: skip
    assert not bad, "messages name options the front door does not have:\n" + "\n".join(bad)


def test_every_rule_names_its_options_as_the_user_writes_them() -> None:
    """The rules table's ``options`` (the planner titles its warnings with them): a ``V17Strategy`` argument or a
    ``Policy.field``."""
    from lightning_v17.config.rules import RULES

    bad = []
    for rule in RULES:
        for option in rule.options:
            cls, _, field = option.rpartition(".")
            if not (option in front_door() or cls in policies() and field in {f.name for f in
                                                                              dataclasses.fields(policies()[cls])}):
                bad.append((rule.name, option))
    assert not bad


def test_the_checker_catches_what_it_is_for() -> None:
    """The check itself, on text: the flat spellings and unknown names fail, the front door's spellings pass."""
    flagged = lambda text: [n for c, n in mentions(text) if stale(c, n)]
    assert flagged("pp_schedule='zbv' uses exactly virtual_stages=2") == ["pp_schedule"]
    assert flagged("set offload_params='cpu' or tp_plan={...}; cp_mode='ulysses', fp8_skip=['x']") == [
        "offload_params", "tp_plan", "cp_mode", "fp8_skip"]
    assert flagged("PipelinePolicy(schedule='zbv') uses exactly virtual_stages=2 with zero_stage=1") == []
    assert flagged("V17Strategy(tp=TPPolicy(size=2, plan={'x': 'colwise'}), offload=OffloadPolicy(params='cpu'))") == []
    assert flagged("PipelinePolicy(virtual=2) or ZeroPolicy(stage=1, bucket=3)") == ["virtual", "bucket"]
    assert flagged("offload.params='nvme' and offload.param='nvme' and parallelize(tp_plan={...})") == ["offload.param"]
    assert flagged("no_such_option=3 (got p=2, MALLOC_ARENA_MAX=2)") == ["no_such_option"]
    # a function may report its own arguments, but never under a flat spelling
    assert stale(None, "cap", frozenset({"cap"})) is None and stale(None, "cap") is not None
    assert stale(None, "offload_params", frozenset({"offload_params"})) is not None
    assert {"offload_params", "pp_schedule", "tp_plan", "cp_mode", "fp8_all_gather"} <= flat_spellings()
    assert "zero_stage" not in flat_spellings()


def test_the_option_names_helpers_print_are_read() -> None:
    """An option name handed to a printing helper (``Tier.parse(value, "offload_params")``) is checked like a
    message: the extraction finds such names (here, the policies' own)."""
    texts = {t for _, _, t, _ in product_strings()}
    assert "microbatches=..." in texts  # _check_positive_int("microbatches", ...) prints "microbatches=..."


SEED = re.compile(r"seed\s*§", re.IGNORECASE)


@pytest.mark.parametrize("top", PRODUCT)
def test_no_product_file_cites_the_seed_document(top: str) -> None:
    """Citations name a paper, an upstream project or a measurement here; "seed §N" is a document outside the repo."""
    bad = [f"{p.relative_to(ROOT)}:{i}" for p in sorted((ROOT / top).rglob("*.py"))
           for i, line in enumerate(p.read_text().splitlines(), 1) if SEED.search(line)]  # fmt: skip
    assert not bad
