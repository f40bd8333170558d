# Two commands set everything up on a fresh machine: `make run` and `make test`.
# torch comes first and pinned (the CPU wheel on disk); deepspeed is built against it without build isolation,
# otherwise its build env pulls another torch. pyproject.toml states ranges (lightning-v17 is a library); the exact
# versions this set-up installs are pinned in constraints.txt.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: run test test-fault bench venv lint clean
venv: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade "pip>=23" setuptools wheel
	$(PY) -m pip install -q -c constraints.txt torch
	$(PY) -m pip install -q -c constraints.txt --no-build-isolation deepspeed
	$(PY) -m pip install -q -c constraints.txt -e '.[test,all]'
	# litgpt 0.5.13 pins huggingface-hub<1.4 (transformers >= 5.4 needs a newer one); without its pins it runs as is.
	$(PY) -m pip install -q --no-deps litgpt==0.5.13
	# megatron-core 0.16.1 (the last cp311 wheel): the reference the token-file tests compare with, kept out of the env.
	$(PY) -m pip install -q --no-deps --target $(VENV)/megatron-target megatron-core==0.16.1
	# DeepSpeed's CPU-Adam op, JIT-built once into ~/.cache/torch_extensions (35-210 s on 2 cores) as part of the set-up,
	# not of the test run; where it cannot build, lightning_v17.optim falls back to fused AdamW with a warning.
	$(PY) -c 'from lightning_v17.optim import cpu_adam_unavailable as u; r = u(); print("cpu_adam op:", r or "built")'
	# DeepSpeed's async_io op (the nvme tier's libaio backend) likewise, where libaio-dev is installed; else a note.
	$(PY) -c 'from lightning_v17.engine.offload.aio import prebuild; print("async_io op:", prebuild())'
	touch $(STAMP)

# The main job: plan it, preprocess the embedded stdlib corpus into token files once (runs/tokens), then train the
# tiny Llama from them with ZeRO-3 on 2 CPU ranks. Resume it with the same two configs and
# --ckpt_path last --trainer.max_steps 400.
TOKENS := runs/tokens
run: $(STAMP) $(TOKENS)/stdlib-train.idx $(TOKENS)/stdlib-val.idx
	$(VENV)/bin/v17 plan --config configs/tiny-cpu.yaml --config configs/tiny-cpu-tokens.yaml
	$(VENV)/bin/v17 fit --config configs/tiny-cpu.yaml --config configs/tiny-cpu-tokens.yaml

$(TOKENS)/stdlib-%.idx: $(STAMP)
	$(VENV)/bin/v17 preprocess stdlib:$* --output $(TOKENS)/stdlib-$* --bos --workers 2

test: $(STAMP)
	$(PY) -m pytest -q tests -m "not fault" -n 2 --dist loadfile --durations=25

# The longer fault-tolerance checks (a hung rank under torchrun, ~1 min; one of two torchrun agents killed and a new one
# joining, 2 -> 1 -> 2 nodes, ~2 min; goodput against Young/Daly with one injected failure, ~2-3 min; SIGKILL with
# optimizer state and parameters on nvme); `python bench/fault.py --tries 10` for the 10 consecutive restarts of the
# acceptance, `python bench/fault.py --scenario agent-kill --tries 3` for the resize, `python bench/goodput.py` for
# goodput with three failures.
test-fault: $(STAMP)
	$(PY) -m pytest -q tests -m fault

bench: $(STAMP)
	for b in bench/*.py; do $(PY) $$b || exit 1; done

lint: $(STAMP)
	$(VENV)/bin/ruff check lightning_v17 strategies callbacks tests bench

clean:
	rm -rf $(VENV) build *.egg-info
