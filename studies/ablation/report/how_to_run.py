"""The ablation's user manual: what a run is, the sets, the replays and how to run and resume them. One text,
two readers: the report's "How to run" heading and the launcher's ``--help``."""

HOW_TO_RUN = """\
The gradient-control ablation: what do the GradientFilter, clip_grad_norm,
or both do to an LSTM transducer's training and its WER?

Every arm (studies/ablation/arms.py) trains the same model from scratch
on the same data for the same number of steps, with the same seeds: a seed
fixes the initialisation and the batch order in every arm, so arms are
compared seed by seed (paired), and only between runs made on one CPU model
or on CPUs that --verify-cpu showed to compute alike (cpus.json; each
summary records the CPU model, flags digest, threads and torch). Each run is
decoded with greedy search on test-clean and test-other at a third, two
thirds and the whole budget, with icefall's averaging (--iter N --avg K
--use-averaged-model true).

An arm is named by train.py's flag (without --) of each rule it switches
on, + between rules, -<value> after a threshold that is not the study's
default for it; `none` switches every rule off (its filter only observes).
The names the runs were made under (filter, clip, guard, value, ...) are
read as aliases (studies/ablation/arm_names.py).

The round's configuration is fixed before its runs in
studies/ablation/family.json: the budget (and the pilot that confirms it),
the family of comparisons and its test (paired t with Holm, the exact
signed-rank test beside it), the seeds per arm and the power they were
chosen for, what 8 hours of 2 cores hold, the guard's threshold, the replays.

Sets (--set; flags below override its conditions, arms, seeds and replays):

  primary    the round of family.json on the learnable condition `digits`
             (connected digits, the default model, --base-lr 0.003): arms
             none, grad-filter-threshold (GradientFilter 25),
             clip-grad-norm (clip_grad_norm 5: normalisation at these
             norms), clip-grad-norm-1000 (the guard: clip_grad_norm at about
             4x none's median norm), grad-filter-threshold+clip-grad-norm,
             clip-grad-norm-relative (2x the running median) and
             clip-grad-norm-relative-5; 17 seeds of none and
             grad-filter-threshold, 5 of the others; 10 replayed outlier
             events with controls (below).
  secondary  the other thresholds and designs (grad-filter-threshold-10,
             grad-filter-threshold-5, agc-clipping, clip-grad-value,
             error-clip) with 2 seeds on `digits`, and every arm on the
             from-scratch instability `stress` (8 narrow projection layers
             at 6.7x the working learning rate, in which nothing learns).
  landscape  every other rule against `none` on the primary condition, its
             budget and seeds (5 each; the `none` runs are the primary set's):
             clip-grad-value, agc-clipping, error-clip,
             grad-filter-threshold-10, grad-filter-threshold-5,
             grad-filter-mode-hard-mask (the filter's hard mask),
             zclip-z-threshold, autoclip-percentile,
             scaled-adam-clipping-scale (ScaledAdam's rule) and
             recurrent-grad-clip (Kaldi's per-frame cap); family.json's
             "landscape" fixes their thresholds and their family (Holm over
             its 10 comparisons, apart from the primary family).
  depth      the 12-layer condition `digits-12` (12 x 128 LSTM layers, the
             primary budget and learning rate): none, grad-filter-threshold,
             clip-grad-norm-1000 (the guard) and scaled-adam-clipping-scale
             with 5 seeds; family.json's "depth" fixes its family and the
             filter's interaction with depth (12 layers minus 4).

Replays: in the `none` runs of the first seeds, the largest outlier events
(a layer's largest per-sequence gradient over the filter threshold x the
batch median) are resumed from the step before them and trained
--replay-steps steps on the same batches in five branches: (a) no control
(checked to reproduce the run at every step), (b) the filter on the event
step only, (c) the filter over the window, (d) the filter from a matched
step of the same run without an outlier, (e) the filter's mean scale
applied uniformly (train.py's --grad-filter-mode uniform).

After every run, the report (<results-dir>/README.md: the answer, the
family's table, WER curves, tables, the replays, every command) and its
PNG plots (<results-dir>/plots/) are rewritten from the runs' summaries,
small JSON files kept in <results-dir>/<summaries>/ (commit them: the
report is rebuilt from them without the run folders). Checkpoints are
pruned as each run is done (but the two its last averaged decoding uses);
the `none` runs' after their seed's replays.

Usage (from egs/librispeech/ASR; `make ablation` prepares the digits corpus,
runs the pilot, then, if the budget stands, the primary set; from the
repository root, `python -m studies.ablation` takes the same flags):

  bash prepare.sh --corpus digits --work-dir digits
  ./lstm_transducer_stateless/ablation.py --pilot only           # the budget check alone (family.json)
  ./lstm_transducer_stateless/ablation.py                        # the pilot, then (if it stands) the primary set
  ./lstm_transducer_stateless/ablation.py --set secondary        # (stress needs: bash prepare.sh)
  ./lstm_transducer_stateless/ablation.py --set landscape        # after the primary set
  ./lstm_transducer_stateless/ablation.py --set depth            # its pilot on digits-12, then (if it stands) its runs
  ./lstm_transducer_stateless/ablation.py --arms none grad-filter-threshold --num-seeds 2 --list
  ./lstm_transducer_stateless/ablation.py --report-only          # this report again from the summaries, no run

Resuming: a run with a summary is skipped; a run cut off part-way resumes
from its newest checkpoint in <exp-root>; a replay whose checkpoints are
gone (another machine) retrains the `none` run up to them first (the same
seed gives the same weights on the same CPU model). The settings that make
runs comparable are stored in <summaries>/ablation-config.json; a rerun
with other settings, or another threshold for an arm with runs, is refused.
A run whose seed has runs made on another CPU (model, flags digest or
threads) is skipped with a warning: it would pair with none of them, unless
`--verify-cpu 300` has shown here that this CPU computes as that one (it
retrains the newest seed of each arm that CPU made and compares every step).
"""
