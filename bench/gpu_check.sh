#!/usr/bin/env bash
# GPU checks for one lent CUDA machine (DESIGN.md "GPU checks"). Runs in well under 8 minutes on one GPU and prints
# one JSON summary on its last line. Run it through the `device` tool as one command:
#   bash bench/gpu_check.sh
# It installs the pinned stack into a fresh venv when one is not there (the machine starts bare).
# FP8 (issue 12): tests/gpu/test_fp8_gpu.py puts fp8_gemm_speedup (8192^3 _scaled_mm vs bf16, target >= 1.3) and
# fp8_1b_speedup (~1.1B Llama, torchao tensorwise + torch.compile vs bf16, target >= 1.15) into "measured".
# Activation offload tier 'cpu': tests/gpu/test_activation_offload_gpu.py checks bit-identical grads and puts
# act_offload_cpu_overhead (step time vs no offload, equal batch, target <= 1.05) and act_offload_cpu_seq_ratio
# (longest seq within a fixed memory budget vs no offload, target >= 1.5) into "measured".
# MoE: tests/gpu/test_moe_gpu.py puts moe_loop_over_grouped_* (grouped experts vs HF's per-expert eager loop, 8
# experts, top-2, bf16, forward + backward, target >= 3) into "measured".
# Long sequences: tests/gpu/test_long_sequence_gpu.py trains the llama3-8b shape (bf16) with full recompute, tiled
# loss and MLP, activation offload 'cpu' and ZeRO-3 offload_params='cpu', 2 steps at 65536 then 32768 tokens (up to
# ~4 min), and puts long_seq_peak_gb_<tokens>, long_seq_step_s_<tokens>, long_seq_gb_per_ktoken and
# long_seq_predicted_max_tokens (where the linear fit of the peak reaches the device memory: a prediction, not a
# run at that length), long_seq_host_fixed_gb, long_seq_host_bytes_per_token and long_seq_predicted_max_tokens_host
# into "measured". The full-length run is opt-in and not part of this script: V17_LONGSEQ_FULL=1
# [V17_LONGSEQ_TOKENS=1300000] .venv/bin/python -m pytest tests/gpu/test_long_sequence_gpu.py -k full
# records long_seq_full_trained and long_seq_full_peak_gb.
set -uo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv && .venv/bin/pip install -q torch==2.13.0 && \
  .venv/bin/pip install -q --no-build-isolation deepspeed==0.19.8 && .venv/bin/pip install -q -e '.[test]' || exit 1
fi
.venv/bin/pip install -q flash-attn --no-build-isolation >/dev/null 2>&1 || echo "flash-attn not installable here" >&2
.venv/bin/pip install -q 'transformer-engine[pytorch]' >/dev/null 2>&1 || echo "transformer-engine not installable here" >&2
log=$(mktemp)
timeout 420 .venv/bin/python -m pytest -q tests/gpu -rs --junitxml="$log.xml" >"$log" 2>&1
rc=$?
tail -n 30 "$log" >&2
.venv/bin/python - "$log.xml" "$rc" "$start" <<'PY'
import json, sys, time, xml.etree.ElementTree as ET
path, rc, start = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
try:
    suite = ET.parse(path).getroot().iter("testsuite").__next__()
    summary = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    cases = {c.get("name"): ("skipped" if c.find("skipped") is not None else
                             "failed" if c.find("failure") is not None or c.find("error") is not None else "passed")
             for c in suite.iter("testcase")}
    # measured figures the tests record (MFU, tokens/s, peak source): record_property -> <properties> in the XML
    measured = {p.get("name"): p.get("value") for c in suite.iter("testcase") for p in c.iter("property")}
except Exception as e:  # noqa: BLE001
    summary, cases, measured = {"error": repr(e)}, {}, {}
print(json.dumps({"gpu_check": summary, "cases": cases, "measured": measured, "pytest_rc": rc,
                  "seconds": int(time.time()) - start}))
PY
