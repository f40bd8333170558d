"""AdamW parity in fp32: a per-element bound for what rounding, not the parallelism, makes differ.

AdamW moves an element by ``lr * r_t`` per step, ``r_t = m_hat_t / d_t`` with ``d_t = sqrt(v_hat_t) + eps``. A parallel
run adds its sums in another order (a sharded matmul, an all-reduce, micro-batches) and the ISA picks other GEMM
kernels (``ATEN_CPU_CAPABILITY``), so its gradients differ from one process's at fp32 rounding level. Where an
element's gradient is itself near zero (``d_t ~ eps``), that difference sets the size and the sign of its update:
measured on the MoE LlamaLM's ``tok_embeddings`` under ep=2 x tp=2 with ``ATEN_CPU_CAPABILITY=default``, one element
whose step-2 gradient was 7.5e-9 (``2**-27``: a cancellation) ended 4.4e-5 off, past the 1e-5 tolerance; the same
element's gradients agree, and the SGD runs of the same tests compare the resulting weights at 1e-5.

So each element is held to ``tol * (1 + |want|) + lr * A``, where ``A`` is the first-order change of its summed updates
under a rounding-level gradient difference ``delta_t`` at every step (:func:`record_adamw_amplification`):

    A = sum_t C_t * delta_t / d_t,   C_t = 1 + r_max(t) * sqrt((1 - b2) / (1 - b2**t)) * sum_{k<t} b2**(k/2)

``C_t`` bounds ``sum_s |dr_t / dg_s|`` times ``d_t`` (the first moment's share sums to 1; the second moment's is
``|r_t|`` times the weights of ``g_s`` in ``sqrt(v_hat_t)``), ``r_max(t)`` bounds ``|r_t|`` (:func:`adam_ratio_bound`),
and ``delta_t = ROUNDING_ULPS`` fp32 units in the last place of the tensor's largest gradient up to step ``t``.
Measured gradient differences of near-zero elements (``|g| < 1e-7``): up to 2.7 such units (5.5e-10 against a largest
gradient of 1.7e-3); larger elements differ by more in absolute terms but have ``d_t >= |g_t| / 2.3``, so their
share stays below ``tol``. ``A`` comes from the one-process reference only, so the code under test cannot loosen it.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

#: fp32 units in the last place (of a tensor's largest gradient) a rounding-level gradient difference may span: 3x the
#: 2.7 measured on near-zero elements (module docstring).
ROUNDING_ULPS = 8.0
_FP32_ULP = 2.0**-23


def adam_ratio_bound(t: int, beta1: float, beta2: float) -> float:
    """``max |m_hat_t| / sqrt(v_hat_t)`` over any gradients, after ``t`` steps: every past gradient satisfies
    ``|g_s| <= sqrt(v_t / ((1 - b2) b2**(t - s)))``, so ``|m_t| <= sqrt(v_t) (1 - b1) / sqrt(1 - b2) sum_k (b1 /
    sqrt(b2))**k`` (1 at ``t = 1``; 2.24 at ``t = 5`` with torch's betas)."""
    q = beta1 / math.sqrt(beta2)
    return math.sqrt(1 - beta2**t) / (1 - beta1**t) * (1 - beta1) / math.sqrt(1 - beta2) * sum(q**k for k in range(t))


class AdamWAmplification:
    """What :func:`record_adamw_amplification` saw: per parameter, each element's ``A`` (module docstring; 0 for an
    element whose gradient was exactly 0 at every step: that is structural, an unseen token or an unrouted expert),
    and the optimizer's ``lr``."""

    def __init__(self) -> None:
        self.by_param: dict[torch.Tensor, torch.Tensor] = {}
        self.largest: dict[torch.Tensor, float] = {}
        self.order: list[torch.Tensor] = []
        self.lr = float("nan")
        self.steps = 0

    def named(self, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``lr * A`` by parameter name: ``params`` are the reference's final parameters by name, in the model's
        order, which is the optimizer's (each is checked to equal the optimizer's tensor bit for bit)."""
        assert len(params) == len(self.order), (len(params), len(self.order))
        out = {}
        for (name, value), p in zip(params.items(), self.order):
            assert value.shape == p.shape and torch.equal(value, p.detach()), name
            out[name] = self.lr * self.by_param.get(p, torch.zeros_like(value))
        return out


@contextlib.contextmanager
def record_adamw_amplification() -> Iterator[AdamWAmplification]:
    """Record ``A`` for the one ``torch.optim.AdamW`` stepped inside the block (a one-process reference: plain
    tensors; its gradients, as the step saw them, are still on the parameters after the step), through torch's
    global optimizer step hook."""
    rec = AdamWAmplification()

    def hook(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
        if not isinstance(optimizer, torch.optim.AdamW):
            return
        (group,) = optimizer.param_groups
        assert not group["amsgrad"] and not group["maximize"], "the bound follows plain AdamW"
        (b1, b2), eps = group["betas"], group["eps"]
        rec.lr, rec.order = group["lr"], list(group["params"])
        rec.steps += 1
        for p in group["params"]:
            state = optimizer.state.get(p)
            if not state or p.grad is None:
                continue
            t = int(state["step"])
            assert t == rec.steps, (t, rec.steps)
            rec.largest[p] = max(rec.largest.get(p, 0.0), float(p.grad.abs().max()))
            delta = ROUNDING_ULPS * _FP32_ULP * rec.largest[p]
            share = 1 + adam_ratio_bound(t, b1, b2) * math.sqrt((1 - b2) / (1 - b2**t)) * sum(
                b2 ** (k / 2) for k in range(t)
            )
            denominator = (state["exp_avg_sq"] / (1 - b2**t)).sqrt() + eps
            step = torch.where(state["exp_avg"] != 0, share * delta / denominator, 0.0)
            rec.by_param[p] = rec.by_param.get(p, torch.zeros_like(step)) + step

    handle = register_optimizer_step_post_hook(hook)
    try:
        yield rec
    finally:
        handle.remove()


def reference_with_amplification(run: Callable[[], dict]) -> dict:
    """``run()``, a one-process reference that returns its final parameters as ``{"params": {name: tensor}}``, with
    ``"adamw_slack"`` (``lr * A`` by name) added when it stepped an AdamW."""
    with record_adamw_amplification() as rec:
        out = run()
    if rec.steps:
        out["adamw_slack"] = rec.named(out["params"])
    return out


def assert_params_close(got: dict[str, torch.Tensor], ref: dict, *, tol: float, msg: str) -> None:
    """Each of ``got`` (a subset of ``ref["params"]``: a pipeline stage holds its own) within ``tol`` (absolute and
    relative) of the reference's parameter of its name, plus, after AdamW, each element's ``lr * A``."""
    for name, value in got.items():
        want = ref["params"][name]
        slack = ref.get("adamw_slack", {}).get(name)
        if slack is None:
            torch.testing.assert_close(value, want, rtol=tol, atol=tol, msg=f"{msg} {name}")
            continue
        off = (value - want).abs() - tol * (1 + want.abs()) - slack
        worst = int(off.argmax())
        assert float(off.flatten()[worst]) <= 0, (
            f"{msg} {name}: element {worst} off by {float((value - want).abs().flatten()[worst]):.3e}, beyond "
            f"{tol} x (1 + |want|) + lr x A = {float(slack.flatten()[worst]):.3e} (A: tests/_adamw_parity.py)"
        )
