# `make test`, `make demo`, `make finetune-demo` and `make dpo-demo` work on a fresh machine: each creates .venv and installs what it needs.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
TORCH  ?= torch==2.13.0

.PHONY: venv test test-all test-gpu demo finetune-demo dpo-demo clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The CPU wheel comes from local disk; pinning it first keeps pip from pulling a CUDA build.
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[test]"
	touch $(STAMP)

venv: $(STAMP)

# `make test` leaves out the tests marked slow (the benchmark scripts' smoke tests, and checks that not-slow
# tests also make); `make test-all` runs them too.
test: $(STAMP)
	$(PY) -m pytest -q -x --timeout=900 -m "not slow" tests

test-all: $(STAMP)
	$(PY) -m pytest -q -x --timeout=900 tests

test-gpu: $(STAMP)
	$(PY) -m pytest -q -m gpu tests

demo: $(STAMP)
	$(PY) -m mfsdp.demo

# Fine-tunes a tiny random Hugging Face directory on CPU and chats with the export; exits 1 unless it learned.
finetune-demo: $(STAMP)
	$(PY) -m mfsdp.demo_finetune

# Goes on from the fine-tuning demo's model to DPO on pairs it writes; exits 1 unless the export learned the rule.
dpo-demo: $(STAMP)
	$(PY) -m mfsdp.demo_dpo

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
