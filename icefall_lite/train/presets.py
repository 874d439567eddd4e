"""Presets of train.py's settings: ``--preset icefall`` sets every training and data flag to icefall's
lstm_transducer_stateless3 (its train.py, get_params() and asr_datamodule.py defaults), by argparse dest."""

from __future__ import annotations

from typing import Any, Dict

ICEFALL_PRESET: Dict[str, Any] = {
    "model_preset": "icefall",  # 12 layers, d_model 512, LSTM hidden 1024 with projection, 84.7 M parameters
    "num_epochs": 40,
    "bpe_model": "data/lang_bpe_500/bpe.model",
    "optimizer_name": "eve",
    "base_lr": 0.003,  # icefall's --initial-lr
    "lr_batches": 5000,
    "lr_epochs": 10,
    "model_warm_step": 3000,
    "loss_ramp": "step",
    "prune_range": 5,
    "lm_scale": 0.25,
    "am_scale": 0.0,
    "simple_loss_scale": 0.5,
    "ctc_loss_scale": 0.0,
    "tail_pad_frames": 0,
    "delay_penalty": 0.0,
    "dropout": 0.1,  # icefall's RNNEncoderLayer: dropout 0.1, layer_dropout 0.075
    "layer_dropout": 0.075,
    "grad_filter_threshold": 25.0,  # --grad-norm-threshold
    "clip_grad_norm": 0.0,  # no gradient clipping
    "clip_grad_value": 0.0,
    "agc_clipping": 0.0,
    "error_clip": 0.0,
    "clip_grad_norm_relative": 0.0,
    "average_period": 100,
    "save_every_n": 4000,
    "keep_last_k": 20,
    "log_interval": 50,
    "seed": 42,
    "max_duration": 200.0,
    "bucketing_sampler": True,
    "num_buckets": 30,
    "drop_last": True,
    "shuffle": True,
    "num_workers": 2,
    "enable_spec_aug": True,
    "spec_aug_time_warp_factor": 80,
    "enable_musan": True,
}
PRESETS = ("none", "icefall")


def icefall_preset(full_libri: bool) -> Dict[str, Any]:
    """:data:`ICEFALL_PRESET` with icefall's validation interval: 3000 batches with --full-libri, 800 without
    (as icefall's run() sets it)."""
    return {**ICEFALL_PRESET, "valid_interval": 3000 if full_libri else 800}
