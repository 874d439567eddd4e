#!/usr/bin/env bash
# The GPU check on a lent GPU machine, in one call, within 8 minutes (gpu_check's budget: 7.5 from its start):
#   run(command="bash benchmarks/device_check.sh", carry=[".device"], timeout_s=600)
# after benchmarks/device_bundle.sh made .device/ here. Writes $OUT/gpu-check.md (copy it to
# benchmarks/gpu-check.md) and $OUT/gpu-check-logs.tar.gz (the scripts' logs: one file, since at most 8 come
# back). Extra arguments go to gpu_check (e.g. --only 6,10,11).
set -uo pipefail
cd "$(dirname "$0")/.."
if [ ! -d .device/wheels ] || [ ! -d .device/data ]; then
  echo "device_check: .device/ is missing: make it here with benchmarks/device_bundle.sh and carry it" >&2
  exit 2
fi
OUT=${OUT:-$PWD/benchmarks/device-out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  .device/wheels/*.whl || exit 2
export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -m benchmarks.gpu_check --work-dir .device/data --report "$OUT/gpu-check.md" "$@"
rc=$?
tar czf "$OUT/gpu-check-logs.tar.gz" -C "$OUT" gpu-check-logs && rm -rf "$OUT/gpu-check-logs"
exit $rc
