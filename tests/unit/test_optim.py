"""``lightning_v17.optim`` in one process: names, the factory, each class against the library it wraps, the CPU-Adam
fallback, MemoryBuckets' kind, LlamaLM's ``optimizer=``, YAML class paths, and why 8-bit blocks care about shards.

The distributed behaviour (ZeRO-1/2/3, TP, DTensor state) is in tests/dist/test_optim_library.py.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from lightning_v17.config import OptimizerKind, V17ConfigError
from lightning_v17.optim import (
    Adafactor,
    Adam8bit,
    AdamW,
    CPUAdam,
    Lion,
    Lion8bit,
    OptimizerName,
    build_optimizer,
    cpu_adam_cached,
    library,
)

CLASSES = {
    "adamw": AdamW, "cpu_adam": CPUAdam, "adam8bit": Adam8bit, "adafactor": Adafactor, "lion": Lion,
    "lion8bit": Lion8bit,
}  # fmt: skip


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(48, 40, generator=g)), torch.nn.Parameter(torch.randn(40, generator=g))]


def _run(make, steps: int = 3) -> list[torch.Tensor]:
    params = _params()
    opt = make(params)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
    return [p.detach() for p in params]


def _needs_cpu_adam() -> None:
    # building the op takes 35-210 s on these 2 cores: the unit tests only use it when it is already cached (the
    # dist test builds it once, in its fixture)
    if not cpu_adam_cached():
        pytest.skip("DeepSpeed's cpu_adam op is not built yet (tests/dist/test_optim_library.py builds it)")


def test_names_parse_once_and_errors_name_the_option() -> None:
    assert [n.value for n in OptimizerName] == ["adamw", "cpu_adam", "adam8bit", "adafactor", "lion", "lion8bit"]
    assert OptimizerName.parse("CPU-Adam") is OptimizerName.CPU_ADAM
    with pytest.raises(V17ConfigError, match=r"optimizer='adamx' is not supported; choose one of 'adamw'"):
        OptimizerName.parse("adamx")
    # the planner's bytes per parameter: CPU-Adam keeps AdamW's fp32 moments; Lion8bit one uint8 state + absmax
    assert OptimizerName.CPU_ADAM.planner_kind is OptimizerKind.ADAMW
    assert OptimizerName.LION8BIT.planner_kind is OptimizerKind.LION8BIT


@pytest.mark.parametrize("name", list(CLASSES))
def test_factory_builds_the_library_class_and_it_declares_its_kind(name: str) -> None:
    if name == "cpu_adam":
        _needs_cpu_adam()
    opt = build_optimizer(name, _params(), lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    assert isinstance(opt, CLASSES[name])
    assert opt.v17_kind == name
    # ZeRO-1/2 partition by rows only what is elementwise (8-bit blocks and Adafactor's factors are not)
    assert opt.v17_elementwise is (name in ("adamw", "cpu_adam", "lion"))


def _bnb(name: str):
    import bitsandbytes as bnb

    return getattr(bnb.optim, name)


REFERENCES = {
    "adamw": (lambda p: AdamW(p, lr=1e-2), lambda p: torch.optim.AdamW(p, lr=1e-2, fused=True)),
    "adafactor": (lambda p: Adafactor(p, lr=1e-2), lambda p: torch.optim.Adafactor(p, lr=1e-2)),
    "lion": (lambda p: Lion(p, lr=1e-2), lambda p: _bnb("Lion32bit")(p, lr=1e-2)),
    "lion8bit": (
        lambda p: Lion8bit(p, lr=1e-2, min_8bit_size=0),
        lambda p: _bnb("Lion8bit")(p, lr=1e-2, min_8bit_size=0),
    ),
    "adam8bit": (
        lambda p: Adam8bit(p, lr=1e-2, min_8bit_size=0),
        lambda p: _bnb("AdamW8bit")(p, lr=1e-2, min_8bit_size=0),
    ),
}


@pytest.mark.parametrize("name", list(REFERENCES))
def test_plain_tensors_step_exactly_like_the_wrapped_library(name: str) -> None:
    ours, theirs = REFERENCES[name]
    got, want = _run(ours), _run(theirs)
    for a, b in zip(got, want):
        assert torch.equal(a, b), name
    assert not torch.equal(got[0], _params()[0])  # it moved


def test_cpu_adam_is_deepspeeds_op_and_matches_it() -> None:
    _needs_cpu_adam()
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    opt = CPUAdam(_params(), lr=1e-2)
    assert isinstance(opt, DeepSpeedCPUAdam) and opt.backend == "deepspeed"
    got = _run(lambda p: CPUAdam(p, lr=1e-2))
    want = _run(lambda p: DeepSpeedCPUAdam(p, lr=1e-2, weight_decay=1e-2, adamw_mode=True))
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_cpu_adam_falls_back_to_fused_adamw_with_one_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(library, "cpu_adam_unavailable", lambda: "CalledProcessError: g++ not found")
    library._cpu_adam_class.cache_clear()
    try:
        with pytest.warns(UserWarning, match=r"cpu_adam op cannot build \(CalledProcessError: g\+\+ not found\)"):
            opt = CPUAdam(_params(), lr=1e-2)
        assert isinstance(opt, CPUAdam) and isinstance(opt, torch.optim.AdamW)
        assert opt.backend == "torch" and opt.defaults["fused"] is True
        assert opt.v17_kind == OptimizerName.CPU_ADAM
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # one warning per process, not one per optimizer
            CPUAdam(_params(), lr=1e-2)
        got = _run(lambda p: CPUAdam(p, lr=1e-2))
        want = _run(lambda p: torch.optim.AdamW(p, lr=1e-2, fused=True))
        assert all(torch.equal(a, b) for a, b in zip(got, want))
        with pytest.raises(V17ConfigError, match="bias_correction=False"):
            CPUAdam(_params(), bias_correction=False)
    finally:
        library._cpu_adam_class.cache_clear()


def test_adamw_is_fused_by_default_where_torch_has_it() -> None:
    assert AdamW(_params()).defaults["fused"] is True
    assert not AdamW(_params(), foreach=True).defaults["fused"]


def test_factory_drops_defaults_the_class_does_not_take_and_specs_override() -> None:
    opt = build_optimizer("lion", _params(), lr=1e-4, eps=1e-8, betas=(0.9, 0.99))  # Lion has no eps
    assert isinstance(opt, Lion) and opt.defaults["lr"] == 1e-4
    spec = {"class_path": "lightning_v17.optim.Adafactor", "init_args": {"lr": 5e-3}}
    opt = build_optimizer(spec, _params(), lr=1e-4, betas=(0.9, 0.99), eps=1e-8)  # no betas; eps is a pair there
    assert isinstance(opt, Adafactor) and opt.defaults["lr"] == 5e-3 and opt.defaults["eps"] == (None, 1e-3)
    foreign = build_optimizer({"class_path": "torch.optim.SGD", "init_args": {"momentum": 0.9}}, _params(), lr=0.1)
    assert type(foreign) is torch.optim.SGD and foreign.defaults["momentum"] == 0.9
    with pytest.raises(V17ConfigError, match="not a torch.optim.Optimizer"):
        build_optimizer({"class_path": "collections.OrderedDict"}, _params())
    with pytest.raises(V17ConfigError, match="cannot be imported"):
        build_optimizer({"class_path": "lightning_v17.optim.Nope"}, _params())


def test_memory_buckets_asks_the_declared_kind_before_guessing_from_the_name() -> None:
    from lightning_v17.callbacks.memory import _optimizer_kind

    class Renamed(AdamW):  # a name the guess would not recognize
        pass

    assert _optimizer_kind(Renamed(_params())) is OptimizerKind.ADAMW
    assert _optimizer_kind(Adafactor(_params())) is OptimizerKind.ADAFACTOR
    assert _optimizer_kind(Lion(_params())) is OptimizerKind.LION
    assert _optimizer_kind(Adam8bit(_params())) is OptimizerKind.ADAM8BIT
    assert _optimizer_kind(Lion8bit(_params())) is OptimizerKind.LION8BIT
    # foreign optimizers: still the name guess
    assert _optimizer_kind(torch.optim.AdamW(_params())) is OptimizerKind.ADAMW
    assert _optimizer_kind(torch.optim.Adagrad(_params())) is None


def test_llamalm_takes_its_optimizer_from_the_library() -> None:
    from lightning_v17.models import LlamaLM

    lm = LlamaLM(model="tiny", model_overrides={"layers": 1}, max_steps=10)
    opt = lm.configure_optimizers()["optimizer"]
    assert type(opt) is AdamW and opt.defaults["fused"] is True  # the default: today's AdamW numbers, fused
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    assert (opt.defaults["lr"], opt.defaults["betas"], opt.defaults["eps"]) == (3e-3, (0.9, 0.95), 1e-8)
    lm = LlamaLM(model="tiny", model_overrides={"layers": 1}, max_steps=10, optimizer="lion", lr=1e-4)
    opt = lm.configure_optimizers()["optimizer"]
    assert isinstance(opt, Lion) and opt.defaults["lr"] == 1e-4 and opt.defaults["betas"] == (0.9, 0.95)
    spec = {"class_path": "lightning_v17.optim.Adafactor", "init_args": {"lr": 1e-2}}
    opt = LlamaLM(model="tiny", model_overrides={"layers": 1}, max_steps=10, optimizer=spec).configure_optimizers()
    assert isinstance(opt["optimizer"], Adafactor) and opt["optimizer"].defaults["lr"] == 1e-2
    with pytest.raises(V17ConfigError, match=r"optimizer='adam9' is not supported"):
        LlamaLM(model="tiny", optimizer="adam9")


def test_classes_are_nameable_in_yaml() -> None:
    """What the Lightning CLI does with ``class_path``/``init_args``: jsonargparse reads the typed ``__init__`` and
    its "Args:" docstring, validates the values, and builds the class."""
    import io

    import jsonargparse

    parser = jsonargparse.ArgumentParser(exit_on_error=False)
    parser.add_subclass_arguments(torch.optim.Optimizer, "optimizer", skip={"params"}, instantiate=False)
    cfg = parser.parse_object(
        {"optimizer": {"class_path": "lightning_v17.optim.Lion8bit", "init_args": {"lr": 2e-4, "min_8bit_size": 0}}}
    )
    assert cfg.optimizer.init_args.lr == 2e-4 and cfg.optimizer.init_args.betas == (0.9, 0.99)
    opt = build_optimizer(cfg.optimizer.as_dict(), _params())
    assert isinstance(opt, Lion8bit) and opt.defaults["lr"] == 2e-4
    with pytest.raises(jsonargparse.ArgumentError, match="backend"):
        parser.parse_object(
            {"optimizer": {"class_path": "lightning_v17.optim.Adam8bit", "init_args": {"backend": "x"}}}
        )
    for cls in CLASSES.values():
        out = io.StringIO()
        help_parser = jsonargparse.ArgumentParser()
        help_parser.add_class_arguments(cls, "opt", skip={"params"})
        help_parser.print_help(out)
        assert "learning rate" in out.getvalue() or "ρ cap" in out.getvalue(), cls


def test_8bit_blocks_make_shard_boundaries_matter() -> None:
    """Why Adam8bit tolerates more at ZeRO-3: it quantizes each tensor it steps in blocks of 256 values with one
    absmax each. Two shards of 256 are the whole tensor's two blocks: bitwise the same step. Two shards of 16 of a
    32-value bias are two blocks where the whole tensor has one: the moments quantize differently."""

    def step(shards: list[torch.Tensor], grads: list[torch.Tensor]) -> torch.Tensor:
        params = [torch.nn.Parameter(s.clone()) for s in shards]
        opt = Adam8bit(params, lr=1e-2, min_8bit_size=0)
        for k in range(3):
            for p, g in zip(params, grads):
                p.grad = g * (k + 1)
            opt.step()
        return torch.cat([p.detach().reshape(-1) for p in params])

    for n, aligned in ((512, True), (32, False)):
        g = torch.Generator().manual_seed(n)
        w, grad = torch.randn(n, generator=g), torch.randn(n, generator=g) * torch.logspace(-3, 0, n)
        whole = step([w], [grad])
        halves = step(list(w.chunk(2)), list(grad.chunk(2)))
        assert torch.equal(whole, halves) is aligned, n


@pytest.mark.parametrize("bnb_name", ["AdamW8bit", "Lion8bit"])
def test_8bit_moments_requantize_exactly_after_a_checkpoint(bnb_name: str) -> None:
    """ZeRO-3 checkpoints hold the 8-bit moments dequantized (fp32 DTensors that DCP reshards); loading quantizes them
    back. On the same layout that must give back the same codes and absmax, bit for bit, including blocks whose
    largest magnitude is negative (the signed code book ends at -0.993, not -1)."""
    params = _params()
    opt = _bnb(bnb_name)(params, lr=1e-2, min_8bit_size=0)
    g = torch.Generator().manual_seed(5)
    for _ in range(3):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g) * torch.rand(p.shape[0], *([1] * (p.dim() - 1)), generator=g)
        opt.step()
    negative_extreme = 0
    for st in opt.state.values():
        for i in (1, 2):
            if f"state{i}" not in st:
                continue
            q, absmax, code = st[f"state{i}"], st[f"absmax{i}"], st[f"qmap{i}"]
            values = library._dequantize(q, absmax, code)
            q2, absmax2 = library._quantize(values, code)
            assert torch.equal(q2, q) and torch.equal(absmax2, absmax)
            if code.min() < 0:  # the signed map (first moments)
                negative_extreme += int((code[q.reshape(-1).long()] == code.min()).sum())
    assert negative_extreme > 0  # the case plain max|x| gets wrong did occur


def test_adam8bit_torchao_backend_is_selected_by_option() -> None:
    """backend="torchao": torchao's AdamW8bit, which steps DTensors itself (its states are DTensor-wrapped 8-bit
    subclasses), so local stepping is off. Not stepped here: its step compiles with torch.compile (~36 s on CPU)."""
    pytest.importorskip("torchao")
    from torchao.optim import AdamW8bit

    opt = Adam8bit(_params(), lr=1e-3, backend="torchao")
    assert isinstance(opt, Adam8bit) and isinstance(opt, AdamW8bit)
    assert opt.backend == "torchao" and opt.v17_local_step is False and opt.v17_kind == OptimizerName.ADAM8BIT
    assert isinstance(Adam8bit(_params()), _bnb("AdamW8bit"))
    with pytest.raises(V17ConfigError, match="backend='apex'"):
        Adam8bit(_params(), backend="apex")


def test_planner_counts_lion8bit_as_one_blockwise_uint8_state() -> None:
    """bitsandbytes Lion8bit: one uint8 momentum + one fp32 absmax per 256 values (hand: 1 + 4/256 = 1.015625 B);
    fp32 training has no separate master copy."""
    from lightning_v17.config import Precision
    from lightning_v17.planner.memory import optimizer_bytes_per_param

    assert optimizer_bytes_per_param(OptimizerKind.LION8BIT, Precision.FP32) == 1.015625
    assert optimizer_bytes_per_param(OptimizerKind.LION8BIT, Precision.BF16_MIXED) == 4 + 1.015625
