#!/usr/bin/env bash
# Data preparation for the LibriSpeech recipe, in the shape of icefall's
# egs/librispeech/ASR/prepare.sh.
#
#   bash prepare.sh                         # synthetic corpus (~10 h train), all stages
#   bash prepare.sh --size small            # the first 3 h of it (same dev/test parts)
#   bash prepare.sh --size tiny             # a few dozen utterances (tests, CI)
#   bash prepare.sh --corpus digits         # synthetic connected digits (11 words, ~3.3 h train)
#   bash prepare.sh --corpus librispeech    # real LibriSpeech from OpenSLR
#   bash prepare.sh --corpus mini_librispeech   # mini LibriSpeech (OpenSLR 31: 5 h train, 2 h dev), train.py --mini-libri true
#   bash prepare.sh --stage 2 --stop-stage 3
#
# Stages:
#   0: corpus -> $dl_dir/LibriSpeech  (synthesize, or download with lhotse)
#   1: lhotse manifests -> data/manifests/librispeech_{recordings,supervisions}_<part>.jsonl.gz
#   2: 80-dim fbank -> data/fbank/librispeech_cuts_<part>.jsonl.gz, then local/validate_manifest.py
#   3: noise for mixing: MUSAN (downloaded with lhotse; --musan true, the default for librispeech)
#      -> $dl_dir/musan, data/fbank/musan_cuts.jsonl.gz; else the synthetic noise corpus (MUSAN's
#      stand-in) -> $dl_dir/noise, data/fbank/noise_cuts.jsonl.gz
#   4: BPE -> data/lang_bpe_<vocab_size>/{transcript_words.txt,bpe.model,tokens.txt}
#
# Parts: train-clean-100 (the training part), dev-clean, dev-other, test-clean,
# test-other (+ train-clean-360, train-other-500 with --full-libri true); mini_librispeech:
# train-clean-5 and dev-clean-2 (its validation and test set).
# Outputs go under --work-dir (default: this folder): data/ and download/.
# A finished stage is skipped on rerun (marker files data/*/.*.done); every
# output is written to a temporary name and renamed.

set -eou pipefail

stage=0
stop_stage=4
corpus=synthetic        # synthetic | digits | librispeech | mini_librispeech
size=default            # default | small | tiny (synthetic); default | tiny | regime (digits)
work_dir=""             # where data/ and download/ go (default: this folder)
dl_dir=""               # default: $work_dir/download
vocab_size=""           # default: 100 for the synthetic corpus (2,000 words), 30 for digits (11 words), 500 for (mini) LibriSpeech
nj=""                   # default: all cores
seed=42                 # synthetic corpus and noise
full_libri=false        # librispeech: also train-clean-360 and train-other-500
perturb_speed=""        # default: true for (mini) librispeech, false for the synthetic corpora
musan=""                # real MUSAN for noise mixing; default: true for librispeech, else false (the synthetic noise corpus)
librispeech_url=http://www.openslr.org/resources   # or a mirror, e.g. file:///path
musan_url=https://www.openslr.org/resources/17/musan.tar.gz   # librispeech: MUSAN (or a mirror)

recipe_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo_root=$(cd "$recipe_dir/../../.." && pwd)

log() {
  # This function is from espnet (as in icefall)
  local fname=${BASH_SOURCE[1]##*/}
  echo -e "$(date '+%Y-%m-%d %H:%M:%S') (${fname}:${BASH_LINENO[0]}:${FUNCNAME[1]}) $*"
}

usage() {
  sed -n '2,27p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
  echo "Options (default): --stage ($stage) --stop-stage ($stop_stage) --corpus ($corpus)"
  echo "  --size ($size) --work-dir (recipe dir) --dl-dir (WORK_DIR/download) --vocab-size (100 synthetic, 30 digits, 500 librispeech)"
  echo "  --nj (all cores) --seed ($seed) --full-libri ($full_libri) --perturb-speed (auto) --musan (auto)"
  echo "  --librispeech-url ($librispeech_url) --musan-url ($musan_url)"
}

# icefall-style option parsing: --some-option value sets $some_option.
while [ $# -gt 0 ]; do
  case "$1" in
    --help|-h) usage; exit 0 ;;
    --*)
      name=${1#--}; name=${name//-/_}
      case "$name" in
        stage|stop_stage|corpus|size|work_dir|dl_dir|vocab_size|nj|seed|full_libri|perturb_speed|musan|librispeech_url|musan_url) ;;
        *) echo "prepare.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
      esac
      [ $# -ge 2 ] || { echo "prepare.sh: option $1 needs a value" >&2; exit 2; }
      printf -v "$name" '%s' "$2"
      shift 2 ;;
    *) echo "prepare.sh: unexpected argument $1 (see --help)" >&2; exit 2 ;;
  esac
done

case "$corpus" in synthetic|digits|librispeech|mini_librispeech) ;; *) echo "prepare.sh: --corpus must be synthetic, digits, librispeech or mini_librispeech" >&2; exit 2 ;; esac
case "$corpus" in librispeech|mini_librispeech) real_corpus=true ;; *) real_corpus=false ;; esac
if [ "$full_libri" = true ] && [ "$corpus" != librispeech ]; then
  echo "prepare.sh: --full-libri true needs --corpus librispeech" >&2; exit 2
fi
if [ "$corpus" = digits ]; then
  case "$size" in default|tiny|regime) ;; *) echo "prepare.sh: --size must be default, tiny or regime with --corpus digits" >&2; exit 2 ;; esac
else
  case "$size" in default|small|tiny) ;; *) echo "prepare.sh: --size must be default, small or tiny" >&2; exit 2 ;; esac
fi

work_dir=${work_dir:-$recipe_dir}
mkdir -p "$work_dir"
work_dir=$(cd "$work_dir" && pwd)
dl_dir=${dl_dir:-$work_dir/download}
mkdir -p "$dl_dir"
dl_dir=$(cd "$dl_dir" && pwd)  # absolute, as icefall's $PWD/download: audio paths in manifests stay valid
nj=${nj:-$(nproc)}
if [ -z "$vocab_size" ]; then
  case "$corpus" in synthetic) vocab_size=100 ;; digits) vocab_size=30 ;; *) vocab_size=500 ;; esac
fi
if [ -z "$perturb_speed" ]; then perturb_speed=$real_corpus; fi
if [ -z "$musan" ]; then
  if [ "$corpus" = librispeech ]; then musan=true; else musan=false; fi
fi

parts="train-clean-100 dev-clean dev-other test-clean test-other"
train_parts="train-clean-100"
if [ "$full_libri" = true ]; then
  parts="$parts train-clean-360 train-other-500"
  train_parts="train-clean-100 train-clean-360 train-other-500"
elif [ "$corpus" = mini_librispeech ]; then
  parts="train-clean-5 dev-clean-2"
  train_parts="train-clean-5"
fi

if [ -z "${PYTHON:-}" ]; then
  if [ -x "$repo_root/.venv/bin/python" ]; then PYTHON=$repo_root/.venv/bin/python; else PYTHON=python3; fi
fi
export PYTHONPATH="$repo_root${PYTHONPATH:+:$PYTHONPATH}"
local_dir=$recipe_dir/local

cd "$work_dir"
mkdir -p data
lang_dir=data/lang_bpe_${vocab_size}

log "corpus=$corpus size=$size stage=$stage stop_stage=$stop_stage work_dir=$work_dir dl_dir=$dl_dir"
log "vocab_size=$vocab_size nj=$nj seed=$seed perturb_speed=$perturb_speed musan=$musan parts: $parts"

# run_stage N MARKER DESCRIPTION: true when stage N is selected and not yet done.
run_stage() {
  local n=$1 marker=$2 what=$3
  if [ "$stage" -le "$n" ] && [ "$stop_stage" -ge "$n" ]; then
    if [ -n "$marker" ] && [ -f "$marker" ]; then
      log "Stage $n: $what: already done ($marker exists) - skipping"
      return 1
    fi
    log "Stage $n: $what"
    return 0
  fi
  return 1
}

if run_stage 0 "" "get the $corpus corpus into $dl_dir/LibriSpeech"; then
  if [ "$real_corpus" = false ]; then
    "$PYTHON" "$local_dir/synthesize_corpus.py" --dl-dir "$dl_dir" --corpus "$corpus" --size "$size" --seed "$seed" --nj "$nj"
  else
    # shellcheck disable=SC2086
    "$PYTHON" "$local_dir/download_librispeech.py" --dl-dir "$dl_dir" --parts $parts --base-url "$librispeech_url"
  fi
fi

if run_stage 1 data/manifests/.librispeech.done "lhotse manifests -> data/manifests"; then
  mkdir -p data/manifests
  # shellcheck disable=SC2086
  "$PYTHON" "$local_dir/prepare_manifests.py" --corpus-dir "$dl_dir/LibriSpeech" \
    --output-dir data/manifests --parts $parts --nj "$nj"
  echo "$parts" > data/manifests/.librispeech.done
fi

if run_stage 2 data/fbank/.librispeech.done "fbank -> data/fbank (speed perturbation: $perturb_speed)"; then
  mkdir -p data/fbank
  # shellcheck disable=SC2086
  "$PYTHON" "$local_dir/compute_fbank_librispeech.py" --manifest-dir data/manifests \
    --output-dir data/fbank --parts $parts --perturb-speed "$perturb_speed" --nj "$nj"
  manifests=()
  for part in $parts; do manifests+=("data/fbank/librispeech_cuts_${part}.jsonl.gz"); done
  log "Stage 2: validating ${manifests[*]}"
  "$PYTHON" "$local_dir/validate_manifest.py" "${manifests[@]}"
  echo "$parts" > data/fbank/.librispeech.done
fi

if [ "$musan" = true ]; then
  if run_stage 3 data/fbank/.musan.done "MUSAN -> $dl_dir/musan, data/fbank/musan_cuts.jsonl.gz"; then
    mkdir -p data/manifests data/fbank
    "$PYTHON" "$local_dir/download_musan.py" --dl-dir "$dl_dir" --url "$musan_url"
    "$PYTHON" "$local_dir/compute_fbank_musan.py" --musan-dir "$dl_dir/musan" --manifest-dir data/manifests \
      --fbank-dir data/fbank --nj "$nj"
    "$PYTHON" "$local_dir/validate_manifest.py" --supervised false data/fbank/musan_cuts.jsonl.gz
    touch data/fbank/.musan.done
  fi
elif run_stage 3 data/fbank/.noise.done "noise corpus (MUSAN's place) -> $dl_dir/noise, data/fbank/noise_cuts.jsonl.gz"; then
  mkdir -p data/manifests data/fbank
  "$PYTHON" "$local_dir/prepare_noise.py" --dl-dir "$dl_dir" --manifest-dir data/manifests \
    --fbank-dir data/fbank --size "${size/regime/default}" --seed "$seed" --nj "$nj"
  "$PYTHON" "$local_dir/validate_manifest.py" --supervised false data/fbank/noise_cuts.jsonl.gz
  touch data/fbank/.noise.done
fi

if run_stage 4 "$lang_dir/.done" "BPE model (vocab size $vocab_size) -> $lang_dir"; then
  mkdir -p "$lang_dir"
  sups=()
  for part in $train_parts; do sups+=("data/manifests/librispeech_supervisions_${part}.jsonl.gz"); done
  "$PYTHON" "$local_dir/train_bpe_model.py" --lang-dir "$lang_dir" --vocab-size "$vocab_size" \
    --supervisions "${sups[@]}"
  touch "$lang_dir/.done"
fi

log "Done (stages $stage..$stop_stage). Outputs under $work_dir/data"
