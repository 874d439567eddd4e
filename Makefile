# icefall-lite: `make test` and `make demo` each set themselves up first.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
# Tests on up to 2 worker processes (pytest-xdist; the number measured and tested), one OpenMP thread each
# (tests/conftest.py): on 2 idle cores (AMD EPYC) pytest took 9 min 14 s this way at cf61c56, make test on a clean
# clone 10 min 56 s with the new venv (2026-12-03: `d=$(mktemp -d) && git clone -q . $d && cd $d && make test`).
# PYTEST_ARGS= runs it in one process.
PYTEST_ARGS ?= -n auto --maxprocesses 2

.PHONY: setup test demo bench gpu-check ablation learning-speed

setup:
	@VENV=$(VENV) bash scripts/setup.sh

# Lint and format check (ruff, configured in pyproject.toml), then the tests.
test: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PY) -m pytest tests $(PYTEST_ARGS)

# Synthetic corpus -> training -> decoding -> WER table (timings: egs/librispeech/ASR/RESULTS.md).
demo: setup
	. $(VENV)/bin/activate && bash egs/librispeech/ASR/demo.sh

# Gradient-control ablation, round 2 as studies/ablation/family.json fixed it before its runs: first the pilot
# (none / seed 42 to 2,700 steps: the 1,800-step budget stands if greedy test-other moves by at most 1 point
# from 1,800 to 2,700 and stays at 1% or more; else it stops and says so), then 7 arms on connected digits
# (17 seeds of none and grad-filter-threshold, 5 of each other arm: studies/ablation/PROTOCOL.md), each run decoded with
# icefall's averaging at 600 / 1,200 / 1,800 steps, and 10 replayed outlier events with their controls ->
# studies/ablation/README.md, its run summaries (studies/ablation/summaries/round-2/) and PNG plots
# (studies/ablation/plots/); the statistics need the [studies] extra (SciPy, statsmodels), installed first.
# About 17.7 h on 2 idle cores (8 h hold the pilot, seeds 42-44 of every arm and the replays); resumable: a
# rerun skips finished runs, and the runs of a seed with runs made on another CPU (they would pair with none of
# them) unless `ablation.py --verify-cpu 300` has shown this CPU computes as theirs.
# The other sets: ablation.py --set secondary, --set landscape, --set depth.
ablation: setup
	. $(VENV)/bin/activate && pip install -q -e '.[studies]' && cd egs/librispeech/ASR && bash prepare.sh --corpus digits --work-dir digits && python lstm_transducer_stateless/ablation.py

# The ten benchmarks (loss, scaling, filter overhead, training throughput, decoding vs sherpa-onnx, the loss
# recursion before/after fusing, the losses against their earlier versions, float32 vs bf16 training step, the
# two on the corpus's own batches, the recurrent cap's cost off and on); rewrites benchmarks/RESULTS.md. Decoding uses the trained default model (exp/,
# --epoch 5 --avg 2) and test-clean, benchmark 9 the demo's corpus. About 12 minutes (benchmark 9: 6 min 50 s).
bench: setup
	. $(VENV)/bin/activate && python -m benchmarks.run_all

# The GPU check: icefall-preset training in float32/fp16/bf16 with a resume, the three decoding methods and
# streaming on CUDA, LSTM dtypes under autocast, an injected overflow under the GradScaler, the losses CUDA
# against CPU, host synchronisations per step, DDP decisions on two ranks, every gradient control CUDA against
# the CPU, the step's profile, the graphed step against the eager one -> benchmarks/gpu-check.md, within 7.5 minutes
# (--minutes). Fails at once without a GPU. On a lent GPU machine: benchmarks/device_bundle.sh, device_check.sh.
gpu-check: setup
	. $(VENV)/bin/activate && python -m benchmarks.gpu_check

# The learning-speed study: 17 arms x 5 minutes of training each from scratch on the 3-h corpus
# (--size small, own work dir; one change from the defaults of 2026-11-23 per arm, a second baseline seed, the combination), greedy WER ->
# studies/learning_speed/README.md "Learning speed" (about 100 min on 2 idle cores; a rerun skips finished arms).
learning-speed: setup
	. $(VENV)/bin/activate && cd egs/librispeech/ASR && bash prepare.sh --size small --work-dir small-corpus && python -m studies.learning_speed --work-dir small-corpus
