"""Long sequences on one GPU: the Llama-3 8B shape (``llama3-8b``: hidden 4096, 32 layers, 32 heads, 8 kv heads,
ffn 14336, vocab 128256; Llama-3.1-8B has the same shape) with every memory option at once, in bf16:

* full recompute of every block (``recompute="full"``),
* tiled loss (``LlamaLM(loss_chunk_tokens=2048)``) and tiled MLP (``mlp_chunk_tokens=8192``),
  ``lightning_v17/models/tiled.py``,
* activation offload ``"cpu"`` of the checkpointed blocks' inputs (``ActivationOffload(tier="cpu")``, pinned host
  buffers, ``engine/offload/activations.py``),
* ZeRO-3 (FSDP2) with ``offload_params="cpu"``: parameters and gradients live on the host, so the optimizer
  (fused AdamW) and its state do too.

Attention: the reference model runs one causal document per row through ``F.scaled_dot_product_attention`` on
CUDA (``causal_attention``), forced here to the flash kernel (GQA-capable; the math fallback would build S x S).

**This is a prediction, not the acceptance run.** One step at 1.3M tokens costs ~1e18 FLOPs of attention alone
(>= 30 min on one H200), far over ``bench/gpu_check.sh``'s 8 minutes. So :func:`test_long_sequence_memory_slope`
trains 2 steps at 65,536 and then 32,768 tokens, measures the peak device memory of each length
(``torch.cuda.max_memory_allocated``), fits peak = a + b x tokens through the two points and records:

* ``long_seq_peak_gb_65536``, ``long_seq_peak_gb_32768``, ``long_seq_step_s_*``;
* ``long_seq_predicted_max_tokens``: where the linear fit reaches the device's total memory;
* ``long_seq_host_fixed_gb`` (parameters + gradients + optimizer state, counted from their storage on the host),
  ``long_seq_host_bytes_per_token`` (what activation offload copied to the host per token, from its stats), and
  ``long_seq_predicted_max_tokens_host``: where those reach the host's ``MemTotal`` (an upper bound: the process's
  other host memory comes on top). The offloaded checkpoints cost (layers - 1) x hidden x 2 bytes = 254 KB per
  token, so a 128 GB host caps the run near 250k tokens whatever the GPU holds.

Parameters are bf16 (AdamW state too): an fp32 master plus fp32 AdamW is 16 bytes/parameter, 128 GB for 8B, the
whole host of the lent machine. The weights are random (a cheap fill on the device, not ``init_weights``' per-name
CPU draws, ~1 min for 8B): the test measures memory and time, not learning.

:func:`test_long_sequence_full_run` runs only with ``V17_LONGSEQ_FULL=1``: one step at ``V17_LONGSEQ_TOKENS``
(default 1,300,000) with the same options, recording ``long_seq_full_trained`` and ``long_seq_full_peak_gb``. It
refuses (records why, and fails) when the host cannot hold the offloaded checkpoints, instead of pinning more host
memory than exists; ``V17_LONGSEQ_FORCE=1`` tries anyway. Run it alone (``-k full``): pinned host memory cached by
the first test stays with the process.

Both offloads come from one ``OffloadPolicy(params="cpu", activations="cpu")`` through ``engine.parallelize``, as
``V17Strategy`` applies them: the activation offload is checked against the compute device, not the host the
parameter shards live on.
"""

from __future__ import annotations

import math
import os
import time

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (8B model, flash attention)"),
]

PRESET = "llama3-8b"
LENGTHS = (65_536, 32_768)  # the longer first: the pinned activation pool sized by it serves the shorter one
MLP_CHUNK, LOSS_CHUNK = 8192, 2048
STEPS = 2
GB = 2**30


@pytest.fixture(scope="module")
def _process_group():
    import torch.distributed as dist

    from tests._dist import free_port

    created = not dist.is_initialized()
    if created:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    yield
    if created:
        dist.destroy_process_group()


def _fill(model: torch.nn.Module) -> None:
    """Random weights on the device in seconds: N(0, 0.02), the residual projections scaled by 1/sqrt(2L), the
    head by h^-0.5, norms 1 (the scales of ``Llama.init_weights``, not its per-name draws)."""
    cfg = model.config
    gen = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
                continue
            std = 0.02 / math.sqrt(2 * cfg.layers) if name.endswith(("wo.weight", "w2.weight")) else 0.02
            p.normal_(0.0, cfg.hidden**-0.5 if name == "output.weight" else std, generator=gen)


class _Run:
    """The 8B LlamaLM with every memory option, its FSDP2 root, optimizer and activation offload."""

    def __init__(self, max_tokens: int) -> None:
        from lightning_v17.config import MeshSpec, OffloadPolicy, TrainingPolicy, ZeroPolicy
        from lightning_v17.engine.parallelize import parallelize
        from lightning_v17.engine.zero import fsdp as fsdp_engine
        from lightning_v17.mesh import MeshRuntime, build_device_mesh
        from lightning_v17.models.lightning import LlamaLM

        overrides = {"max_seq_len": max_tokens, "mlp_chunk_tokens": MLP_CHUNK}
        with torch.device("meta"):
            lm = LlamaLM(model=PRESET, model_overrides=overrides, loss_chunk_tokens=LOSS_CHUNK)
            lm.configure_model()
        lm.model.to(torch.bfloat16)
        lm.model.to_empty(device="cuda")
        _fill(lm.model)
        spec = MeshSpec()
        mesh = MeshRuntime(spec, build_device_mesh(spec, device_type="cuda"))
        offload = OffloadPolicy(params="cpu", activations="cpu")
        self.policy = TrainingPolicy(zero=ZeroPolicy(stage=3), offload=offload, recompute="full")
        out = parallelize(lm, mesh=mesh, policy=self.policy, device=torch.device("cuda", 0))
        self.offload = out.activations
        assert self.offload is not None and self.offload.device_type == "cuda", "no activation offload attached"
        self.lm, self.root, self.zero = lm, fsdp_engine.fsdp_root(lm), out.zero
        assert all(p.to_local().device.type == "cpu" for p in lm.parameters()), "parameters are not on the host"
        self.opt = torch.optim.AdamW(lm.parameters(), lr=1e-5, fused=True)
        self.zero.prepare_optimizers([self.opt], offload=self.policy.offload)
        self.cfg = lm.config
        self.gen = torch.Generator(device="cuda").manual_seed(1)
        torch.cuda.empty_cache()  # the device copy the shards were cut from is gone

    def step(self, tokens: int) -> float:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        from lightning_v17.engine.zero.fsdp import run_as_forward

        ids = torch.randint(0, self.cfg.vocab_size, (1, tokens + 1), device="cuda", generator=self.gen)
        batch = {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            loss, _count = run_as_forward(self.root, self.lm.loss, batch)  # as V17Strategy runs a step hook
            loss.backward()
        self.opt.step()
        return float(loss.detach())

    def host_fixed_bytes(self) -> int:
        """Parameters, gradients and optimizer state on the host, from their storage (call before zero_grad); a CPU
        dry run of this class with the tiny preset counted exactly 8 bytes per parameter (bf16 weight, gradient and
        two AdamW moments)."""
        local = [p.to_local() for p in self.lm.parameters()]
        grads = [p.grad.to_local() for p in self.lm.parameters() if p.grad is not None]
        state = [t for s in self.opt.state.values() for t in s.values() if torch.is_tensor(t) and t.dim() > 0]
        state = [t.to_local() if hasattr(t, "to_local") else t for t in state]
        # per storage: FSDP2's gradients can be views of one reduce-scatter buffer
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                    for t in (*local, *grads, *state) if t.device.type == "cpu"}  # fmt: skip
        return sum(storages.values())

    def close(self) -> None:
        self.offload.close()
        self.opt.zero_grad(set_to_none=True)


def _mem_total_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no MemTotal in /proc/meminfo")


@pytest.mark.timeout(300)
def test_long_sequence_memory_slope(_process_group, record_property):
    run = _Run(max(LENGTHS))
    peaks, times, losses, host_per_token = {}, {}, {}, {}
    fixed = 0
    try:
        for tokens in LENGTHS:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = run.offload.stats["bytes_offloaded"]
            t0 = time.perf_counter()
            for _ in range(STEPS):
                losses[tokens] = run.step(tokens)
                fixed = max(fixed, run.host_fixed_bytes())
                run.opt.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            times[tokens] = (time.perf_counter() - t0) / STEPS
            peaks[tokens] = torch.cuda.max_memory_allocated()
            host_per_token[tokens] = (run.offload.stats["bytes_offloaded"] - before) / (STEPS * tokens)
    finally:
        run.close()
    (s1, p1), (s2, p2) = sorted(peaks.items())
    slope = (p2 - p1) / (s2 - s1)
    intercept = p1 - slope * s1
    total = torch.cuda.get_device_properties(0).total_memory
    predicted = int((total - intercept) / slope) if slope > 0 else None
    per_token = host_per_token[max(LENGTHS)]
    predicted_host = int((_mem_total_bytes() - fixed) / per_token) if per_token > 0 else None
    for tokens in LENGTHS:
        record_property(f"long_seq_peak_gb_{tokens}", round(peaks[tokens] / GB, 2))
        record_property(f"long_seq_step_s_{tokens}", round(times[tokens], 2))
    record_property("long_seq_gb_per_ktoken", round(slope * 1024 / GB, 4))
    record_property("long_seq_intercept_gb", round(intercept / GB, 2))
    record_property("long_seq_predicted_max_tokens", predicted)
    record_property("long_seq_host_fixed_gb", round(fixed / GB, 2))
    record_property("long_seq_host_bytes_per_token", round(per_token))
    record_property("long_seq_predicted_max_tokens_host", predicted_host)
    record_property("long_seq_options", f"{PRESET} bf16, recompute=full, loss_chunk_tokens={LOSS_CHUNK}, "
                    f"mlp_chunk_tokens={MLP_CHUNK}, activations=cpu, zero_stage=3 offload_params=cpu, fused AdamW")
    print(f"peaks GB {({k: round(v / GB, 2) for k, v in peaks.items()})}, step s {times}, losses {losses}, "
          f"predicted max tokens: device {predicted}, host {predicted_host}")
    assert all(math.isfinite(v) for v in losses.values()), losses
    assert p2 > p1 and max(peaks.values()) < total, peaks  # memory grows with tokens and the runs fitted
    assert per_token > 0, "activation offload copied nothing to the host"


@pytest.mark.timeout(3600)
@pytest.mark.skipif(os.environ.get("V17_LONGSEQ_FULL") != "1", reason="the full-length run is opt-in: set "
                    "V17_LONGSEQ_FULL=1 (and V17_LONGSEQ_TOKENS, default 1300000); one step takes >= 30 min")
def test_long_sequence_full_run(_process_group, record_property):
    tokens = int(os.environ.get("V17_LONGSEQ_TOKENS", "1300000"))
    record_property("long_seq_full_tokens", tokens)
    from lightning_v17.models import ModelConfig

    cfg = ModelConfig.from_preset(PRESET)
    params = cfg.num_params()
    # bf16 parameter + gradient + two AdamW moments on the host, and every block's input but the last one
    need = 8 * params + (cfg.layers - 1) * tokens * cfg.hidden * 2
    host = _mem_total_bytes()
    record_property("long_seq_full_host_need_gb", round(need / GB, 1))
    if need > host and os.environ.get("V17_LONGSEQ_FORCE") != "1":
        reason = (f"{tokens} tokens need ~{need / GB:.0f} GB of host memory (parameters, gradients and AdamW state "
                  f"{8 * params / GB:.0f} GB + offloaded checkpoints {(need - 8 * params) / GB:.0f} GB) but the host "
                  f"has {host / GB:.0f} GB; not attempted (V17_LONGSEQ_FORCE=1 tries anyway)")
        record_property("long_seq_full_trained", False)
        record_property("long_seq_full_reason", reason)
        pytest.fail(reason)
    run = _Run(tokens)
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    try:
        loss = run.step(tokens)
        torch.cuda.synchronize()
        trained, why = math.isfinite(loss), f"loss {loss}"
    except torch.OutOfMemoryError as err:
        trained, why = False, f"CUDA out of memory: {str(err).splitlines()[0]}"
    finally:
        run.close()
    record_property("long_seq_full_trained", trained)
    record_property("long_seq_full_reason", why)
    record_property("long_seq_full_peak_gb", round(torch.cuda.max_memory_allocated() / GB, 2))
    record_property("long_seq_full_step_s", round(time.perf_counter() - t0, 1))
    assert trained, why
