#!/usr/bin/env bash
# The demo: default synthetic corpus -> train (filter on) -> decode with all
# three methods -> WER table. `make demo` runs it; a rerun reuses finished
# stages (prepare.sh skips finished stages, train.py resumes from its newest
# checkpoint or returns at once when all epochs are done, decoding is skipped
# for methods whose WER files exist).
set -eou pipefail

cd "$(dirname "${BASH_SOURCE[0]}")"
# = icefall_lite/recipe_defaults.py's EXP_DIR, NUM_EPOCHS, AVG (tests/test_checkpoint.py checks)
exp_dir=lstm_transducer_stateless/exp
num_epochs=5
avg=2

log() {
  echo -e "$(date '+%Y-%m-%d %H:%M:%S') (demo.sh) $*"
}

log "Stage 1/3: data (prepare.sh)"
bash prepare.sh

log "Stage 2/3: training ($num_epochs epochs, GradientFilter threshold 25, clip_grad_norm 5, train.py's defaults)"
if [ -f "$exp_dir/epoch-$num_epochs.pt" ]; then
  log "$exp_dir/epoch-$num_epochs.pt exists: training finished, skipping"
else
  python lstm_transducer_stateless/train.py --exp-dir "$exp_dir" --num-epochs "$num_epochs"
fi

log "Stage 3/3: decoding test-clean and test-other"
for method in greedy_search modified_beam_search fast_beam_search; do
  if compgen -G "$exp_dir/$method/wer-summary-test-other-epoch-$num_epochs-avg-$avg-*" > /dev/null; then
    log "$method: results exist, skipping"
    continue
  fi
  python lstm_transducer_stateless/decode.py --exp-dir "$exp_dir" --epoch "$num_epochs" --avg "$avg" \
    --decoding-method "$method"
done

python local/wer_table.py --exp-dir "$exp_dir"
