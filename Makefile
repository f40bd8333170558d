# Two commands set everything up on a fresh machine: `make run` and `make test`.
# torch comes first and pinned (the CPU wheel on disk); deepspeed is built against it without build isolation,
# otherwise its build env pulls another torch.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: run test bench venv lint clean
venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade "pip>=23" setuptools wheel
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q --no-build-isolation deepspeed==0.19.8
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

# The main job: plan it, then train the tiny Llama on the embedded stdlib corpus with ZeRO-3 on 2 CPU ranks.
# Resume it with: $(VENV)/bin/v17 fit --config configs/tiny-cpu.yaml --ckpt_path last --trainer.max_steps 400
run: $(STAMP)
	$(VENV)/bin/v17 plan --model tiny
	$(VENV)/bin/v17 fit --config configs/tiny-cpu.yaml

test: $(STAMP)
	$(PY) -m pytest -q tests

bench: $(STAMP)
	for b in bench/*.py; do $(PY) $$b || exit 1; done

lint: $(STAMP)
	$(VENV)/bin/ruff check lightning_v17 strategies callbacks tests bench

clean:
	rm -rf $(VENV) build *.egg-info
