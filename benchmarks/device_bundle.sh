#!/usr/bin/env bash
# Makes .device/ here, for the GPU check on a lent GPU machine (benchmarks/device_check.sh runs it there):
#   .device/wheels  the Python 3.12 x86-64 wheels of the packages that machine's image lacks (lhotse and what it
#                   needs beyond the image, kaldialign for WERs, soxr), at the versions of this .venv, which
#                   the tests ran with; the image has torch, triton, sentencepiece, tensorboard, numpy
#   .device/data    the tiny corpus (prepare.sh --size tiny): its voices (espeak-ng, flite, sox) are Debian
#                   packages that machine has not got
# About 14 MB, inside the 64 MiB a call carries. Needs pip's access to PyPI (for the wheels) and `make setup`.
# Idempotent: a second run only checks. Then, in a session lent a GPU:
#   run(command="bash benchmarks/device_check.sh", carry=[".device"], timeout_s=600)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
PACKAGES=(lhotse audioread cffi cytoolz intervaltree lilcom pycparser soundfile kaldialign soxr)
mkdir -p .device/wheels
for name in "${PACKAGES[@]}"; do
  version=$("$PY" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$name")
  stem=$(echo "$name" | tr - _)
  if ls .device/wheels/"$stem"-"$version"-*.whl > /dev/null 2>&1; then continue; fi
  rm -f .device/wheels/"$stem"-*.whl  # one version of each: two stop the install there
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
    -d .device/wheels "$name==$version"
done
# prepare.sh skips the stages it has done.
PATH="$PWD/.venv/bin:$PATH" bash egs/librispeech/ASR/prepare.sh --size tiny --work-dir "$PWD/.device/data" > /dev/null
echo "$(du -sh .device | cut -f1) in .device: $(ls .device/wheels | wc -l) wheels, the tiny corpus"
