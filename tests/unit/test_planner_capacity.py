"""``v17 plan`` counts what a node's ranks share: host memory and NVMe space, against hand-computed bytes.

Bytes by hand: mixed-precision AdamW keeps 2 B of bf16 parameter, 2 B of gradient and 12 B of fp32 master, moment
and variance per parameter (ZeRO (Rajbhandari 2020) §3.1, K = 12); ZeRO-3 shards all 16 B over dp; a tier's
per-rank bytes times the node's ranks must fit the node.
"""

from __future__ import annotations

import json
import shutil

import pytest

from lightning_v17.planner.cli import main

#: llama2-7b: L (4h² attention + 3·h·ffn SwiGLU + 2h norms) + 2·V·h untied embeddings + h final norm
H, FFN, V = 4096, 11008, 32000
PER_LAYER = 4 * H * H + 3 * H * FFN + 2 * H
EMBED = 2 * V * H + H
PSI_7B = 32 * PER_LAYER + EMBED
#: the user's example: 2 CPU ranks on one host, ZeRO-3, parameters and optimizer state on NVMe
EXAMPLE = ("--model", "llama2-7b", "--gpu", "cpu", "--gpus", "2", "--zero-stage", "3", "--offload-params", "nvme",
           "--offload-optimizer", "nvme")  # fmt: skip


def _plan(capsys, *argv: str) -> dict:
    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _text(capsys, *argv: str) -> str:
    assert main(list(argv)) == 0
    return capsys.readouterr().out


def test_hand_count_of_the_7b_shape():
    assert PSI_7B == 6_738_415_616


def test_nvme_of_both_ranks_is_refused_by_a_78_gb_drive(capsys):
    out = _plan(capsys, *EXAMPLE, "--nvme-capacity", "78", "--host-memory", "1000")
    # per rank on NVMe: parameters 2Ψ/2 + optimizer state 12Ψ/2 = 7Ψ; the host runs both ranks: 14Ψ = 94.3 GB
    nvme = out["capacity"]["nvme"]
    assert out["tiers"]["nvme_bytes"] == 7 * PSI_7B
    assert (nvme["ranks"], nvme["bytes_per_rank"], nvme["need_bytes"]) == (2, 7 * PSI_7B, 14 * PSI_7B)
    assert nvme["capacity_bytes"] == 78 * 10**9 and nvme["fits"] is False
    assert out["capacity"]["device"]["fits"] is True  # one rank's 47.2 GB alone would fit
    assert out["fits"] is False and out["capacity"]["does_not_fit"] == ["nvme"]
    assert any("nvme does not fit: 2 ranks per node x 47.2 GB = 94.3 GB > 78.0 GB (--nvme-capacity)" in w
               for w in out["recommendation"]["warnings"])  # fmt: skip
    text = _text(capsys, *EXAMPLE, "--nvme-capacity", "78", "--host-memory", "1000")
    assert "nvme 94.3 GB of 78 GB (--nvme-capacity) (DOES NOT FIT)" in text
    assert _plan(capsys, *EXAMPLE, "--nvme-capacity", "95", "--host-memory", "1000")["fits"] is True


def test_nvme_capacity_defaults_to_the_free_space_at_nvme_path(capsys, tmp_path):
    out = _plan(capsys, *EXAMPLE, "--nvme-path", str(tmp_path))
    nvme = out["capacity"]["nvme"]
    assert out["capacity"]["nvme_path"] == str(tmp_path)
    assert nvme["source"] == f"free at {tmp_path}"
    assert nvme["capacity_bytes"] == pytest.approx(shutil.disk_usage(tmp_path).free, abs=2e9)  # other jobs write
    err = main([*EXAMPLE, "--nvme-path", str(tmp_path / "missing")])
    assert err == 2 and "is not a directory" in capsys.readouterr().err


def test_cpu_ranks_share_one_host(capsys):
    # On --gpu cpu the device is the host: each rank's device bytes and its cpu tier (the gradients, 2Ψ/2 = Ψ,
    # with the optimizer offloaded) share the one host with the other rank.
    out = _plan(capsys, *EXAMPLE, "--host-memory", "25", "--nvme-capacity", "1000")
    gpu = out["tiers"]["gpu_bytes"]
    assert out["tiers"]["cpu_bytes"] == PSI_7B
    host = out["capacity"]["host"]
    assert (host["ranks"], host["bytes_per_rank"], host["need_bytes"]) == (2, gpu + PSI_7B, 2 * (gpu + PSI_7B))
    assert host["capacity_bytes"] == int(25e9 * 0.9)  # less the default 10% host reserve
    assert gpu + PSI_7B <= 25e9 * 0.9 < 2 * (gpu + PSI_7B)  # one rank alone would fit the host; the two do not
    assert out["capacity"]["device"]["fits"] is True
    assert out["fits"] is False and out["capacity"]["does_not_fit"] == ["host"]
    assert any(w.startswith("host does not fit: 2 ranks per node x ") for w in out["recommendation"]["warnings"])
    assert _plan(capsys, *EXAMPLE, "--host-memory", "50", "--nvme-capacity", "1000")["fits"] is True


def test_gpu_node_host_memory_counts_the_ranks_of_one_node(capsys):
    # ZeRO-3 over dp, optimizer on the CPU: gradients 2Ψ/dp + optimizer 12Ψ/dp per rank on the host, 8 ranks a node
    psi = 70 * 10**9
    argv = ("--params", "70e9", "--tp", "1", "--pp", "1", "--zero-stage", "3", "--offload-optimizer", "cpu",
            "--nvme-capacity", "1")
    out = _plan(capsys, *argv, "--dp", "8")
    host = out["capacity"]["host"]
    assert host["capacity_bytes"] == 0.9 * 2 * 10**12  # the default: a DGX's 2 TB for 8 devices, less 10%
    assert host["source"] == "default: a DGX's 250 GB per device; --host-memory, less a 10% reserve"
    assert (host["ranks"], host["need_bytes"]) == (8, 8 * (14 * psi // 8)) and out["fits"] is True
    assert _plan(capsys, *argv, "--dp", "8", "--host-memory", "900")["capacity"]["does_not_fit"] == ["host"]
    # 8 x 14Ψ/8 = 980 GB: within 1050 GB, not within its 945 GB after the default reserve; --host-reserve 0 keeps none
    assert _plan(capsys, *argv, "--dp", "8", "--host-memory", "1050")["capacity"]["does_not_fit"] == ["host"]
    assert _plan(capsys, *argv, "--dp", "8", "--host-memory", "1050", "--host-reserve", "0")["fits"] is True
    host16 = _plan(capsys, *argv, "--dp", "16", "--host-memory", "900")["capacity"]["host"]
    assert (host16["ranks"], host16["need_bytes"], host16["fits"]) == (8, 8 * (14 * psi // 16), True)


def test_max_model_is_bounded_by_the_nvme_capacity(capsys):
    # Without a shape nothing stays on the device with both offloaded: only the NVMe bounds Ψ. 8 ranks a node at
    # 14Ψ/8 each: 14Ψ <= 140 GB -> Ψ = 10e9 (the bisection stops within Ψ/1e6).
    out = _plan(capsys, "--params", "1e9", "--dp", "8", "--zero-stage", "3", "--offload-params", "nvme",
                "--offload-optimizer", "nvme", "--nvme-capacity", "140", "--max-model")  # fmt: skip
    mm = out["max_model"]
    assert mm["bounded"] is True and mm["limited_by"] == "nvme"
    assert 10e9 * (1 - 2e-6) <= mm["params"] <= 10e9


def test_max_model_of_the_example_is_the_deepest_whose_nvme_fits(capsys):
    # 14Ψ(L) <= 78 GB for both ranks; the device (23.2 GB usable per rank) and a 1 TB host hold deeper models
    out = _plan(capsys, *EXAMPLE, "--nvme-capacity", "78", "--host-memory", "1000", "--max-model")
    layers = (78 * 10**9 // 14 - EMBED) // PER_LAYER
    assert layers == 26
    mm = out["max_model"]
    assert (mm["layers"], mm["params"], mm["limited_by"]) == (layers, layers * PER_LAYER + EMBED, "nvme")
    assert 14 * (layers * PER_LAYER + EMBED) <= 78e9 < 14 * ((layers + 1) * PER_LAYER + EMBED)
    text = _text(capsys, *EXAMPLE, "--nvme-capacity", "78", "--host-memory", "1000", "--max-model")
    assert "max model: 5.52B params (26 layers)" in text and "refused by the nvme" in text


def test_cpu_ranks_beyond_the_cores_share_them(capsys):
    # The cpu row's peak is one core's; 4 ranks on 2 cores compute at half of it each: the same FLOPs take twice
    # the compute time, the communication is unchanged.
    argv = ("--model", "tiny", "--gpu", "cpu", "--gpus", "4", "--tp", "1", "--pp", "1", "--zero-stage", "1")
    own = _plan(capsys, *argv, "--cpu-cores", "4")
    shared = _plan(capsys, *argv, "--cpu-cores", "2")
    assert (own["cluster"]["core_share"], shared["cluster"]["core_share"]) == (1.0, 0.5)
    comm = own["comm"]["time_s_if_not_overlapped"]
    assert shared["comm"]["time_s_if_not_overlapped"] == comm
    compute_own = own["flops"]["step_time_s"]
    assert shared["flops"]["step_time_s"] == pytest.approx(2 * compute_own, rel=1e-12)
    assert "at 0.5 of a core per rank" in _text(capsys, *argv, "--cpu-cores", "2")
    assert _plan(capsys, *argv[:5], "2", *argv[6:], "--cpu-cores", "2")["cluster"]["core_share"] == 1.0
