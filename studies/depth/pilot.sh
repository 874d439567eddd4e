#!/usr/bin/env bash
# The ablation's depth pilot: the `none` arm (the GradientFilter observes, controls nothing), one seed, at the
# budget of studies/ablation/family.json, for each model LABEL=MODEL_FLAGS[@BASE_LR] (the condition's learning
# rate, 0.003, unless @BASE_LR is given), all at once (one process each,
# the cores shared out among them), then studies/depth's report of where the outliers arise in each.
#
# From egs/librispeech/ASR, after `bash prepare.sh --corpus digits --work-dir digits`:
#   bash ../../../studies/depth/pilot.sh OUT_DIR "L4 d256=" "L12 d256=--num-encoder-layers 12" \
#     "L12 d256 lr 0.0015=--num-encoder-layers 12@0.0015"
# Writes OUT_DIR/<label>/ (the run's ablation report, plots, summaries in runs/), OUT_DIR/<label>.log,
# OUT_DIR/exp/ (checkpoints) and OUT_DIR/depth.md. Environment: WORK_DIR (digits), SEED (42), STEPS (the
# budget's). Rerunning resumes: finished runs are skipped, cut-off ones go on from their newest checkpoint.
set -euo pipefail

if [ $# -lt 2 ]; then
  echo "usage: $0 OUT_DIR LABEL=MODEL_FLAGS[@BASE_LR] [LABEL=MODEL_FLAGS[@BASE_LR] ...]" >&2
  exit 2
fi
out=$1
shift
work_dir=${WORK_DIR:-digits}
steps_flag=()
if [ -n "${STEPS:-}" ]; then steps_flag=(--steps "$STEPS"); fi
# The repository root, for `python3 -m studies.ablation` and `python3 -m studies.depth`.
export PYTHONPATH="$(cd "$(dirname "$0")/../.." && pwd)${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$out"
threads=$(( $(nproc) / $# ))
if [ "$threads" -lt 1 ]; then threads=1; fi

pids=()
reports=()
for item in "$@"; do
  label=${item%%=*}
  flags=${item#*=}
  lr_flag=()
  if [[ $flags == *@* ]]; then
    lr_flag=(--base-lr "${flags##*@}")
    flags=${flags%@*}
  fi
  if [ "$label" = "$item" ] || [ -z "$label" ]; then
    echo "$item: write LABEL=MODEL_FLAGS[@BASE_LR] (MODEL_FLAGS may be empty: the default model)" >&2
    exit 2
  fi
  slug=$(echo "$label" | tr -c 'A-Za-z0-9.\n' '-')
  echo "$label: $out/$slug.log (model flags: ${flags:-none}; ${lr_flag[*]:-default --base-lr}; $threads thread(s))"
  OMP_NUM_THREADS=$threads python3 -m studies.ablation --pilot skip --arms none --num-seeds 1 \
    --seed "${SEED:-42}" "${steps_flag[@]}" "${lr_flag[@]}" --replay-events 0 --work-dir "$work_dir" --exp-root "$out/exp/$slug" \
    --results-dir "$out/$slug" --summaries runs --model-args "$flags" >"$out/$slug.log" 2>&1 &
  pids+=($!)
  reports+=("$label=$out/$slug/runs")
done

failed=0
for i in "${!pids[@]}"; do
  if ! wait "${pids[$i]}"; then
    echo "${reports[$i]%%=*} failed: see its log" >&2
    failed=1
  fi
done
python3 -m studies.depth "${reports[@]}" >"$out/depth.md"
echo "wrote $out/depth.md"
exit $failed
