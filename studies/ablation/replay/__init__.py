"""Replayed outlier events with controls: what does the GradientFilter do at an outlier, beyond what switching
it on does anyway?

In a run of the arm without control (its filter only observing), an *event* is a step after warm-up at which
some encoder layer's largest per-sequence gradient RMS is above the filter's threshold times the batch
median. A replay resumes the run at the step just before the event (from its nearest earlier checkpoint,
trained on without control up to that step: the prefix) and trains the window on the same batches
(train.py's exact resume) in branches that differ only in the gradient control:

  (a) ``none``        no control: must reproduce the run at every step of the window (checked);
  (b) ``event-only``  the filter on the event step only, no control after it;
  (c) ``filter``      the filter on over the whole window;
  (d) ``matched``     the filter switched on, for a window as long, at a checkpoint step of the same run whose
                      first step has no outlier (every layer under the matched maximum, 5x the median), its
                      window clear of every replayed event's window and of the other replays' (d), compared
                      with the run itself over that window (its checkpoint at the window's end decoded as the
                      reference);
  (e) ``uniform``     the filter's mean scale applied to every sequence alike, no per-sequence capping
                      (train.py's ``--grad-filter-mode uniform`` at the filter's threshold).

(b) against (c) tells whether the gain comes from filtering the event or from the filter staying on; (d)
whether switching the filter on helps without an event (a transient cut of Adam's step size, whose second
moment was built on unfiltered gradients); (e) whether capping matters beyond that cut. Each branch is decoded
at the window's end; the per-layer Adam second moments (``exp_avg_sq`` summed over each layer's tensors of
more than one element) are compared at the event step and at the window's end.

The events are chosen in :mod:`~studies.ablation.replay.events`, the branches run in
:mod:`~studies.ablation.replay.run`, read back and summarised in :mod:`~studies.ablation.replay.result`, and
the report's replay tables made in :mod:`~studies.ablation.replay.tables`.
"""
