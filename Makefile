# icefall-lite: `make test` and `make demo` each set themselves up first.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: setup test demo bench

setup:
	@VENV=$(VENV) bash scripts/setup.sh

test: setup
	$(PY) -m pytest tests $(PYTEST_ARGS)

# Synthetic corpus -> training -> decoding -> WER table (about 45 minutes on 2 cores).
demo: setup
	. $(VENV)/bin/activate && bash egs/librispeech/ASR/demo.sh

# The five benchmarks (loss, scaling, filter overhead, training throughput,
# decoding vs sherpa-onnx); rewrites benchmarks/RESULTS.md. Decoding uses the
# trained default model (exp/, --epoch 8 --avg 3) and test-clean. About 15 minutes.
bench: setup
	. $(VENV)/bin/activate && python benchmarks/run_all.py
