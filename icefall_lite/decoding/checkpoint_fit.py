"""Which model flags a checkpoint fits, read from its tensors' shapes: the fix that goes with a checkpoint that
does not load into the model of the flags given (pretrained.py, export.py).

The sizes are read from icefall's names (:mod:`icefall_lite.nn.encoder`'s module tree): the number of
``encoder.encoder.layers.N``, ``encoder_dim`` from ``encoder.encoder_embed.out.weight`` (d_model, in), the LSTM's
hidden size from its projection ``weight_hr_l0`` (hidden 1024 projected to 512 in icefall's model) or else from
``weight_hh_l0``, ``dim_feedforward`` from ``feed_forward.0``, ``decoder_dim`` and the vocabulary from
``decoder.embedding``, ``context_size`` from ``decoder.conv`` (none: 1), ``joiner_dim`` from
``joiner.output_linear``.
"""

from __future__ import annotations

import re
from typing import Dict, Optional

import torch

from icefall_lite.nn.model import MODEL_PRESETS
from icefall_lite.train.checkpoint import CheckpointError, PathLike, load_checkpoint_file, strip_ddp_prefix

LAYER = re.compile(r"^encoder\.encoder\.layers\.(\d+)\.")


def model_sizes(state_dict: Dict[str, torch.Tensor]) -> Optional[Dict[str, int]]:
    """The model-size flags (``MODEL_PRESETS``' names, ``context_size`` and ``vocab_size``) of an icefall-format
    state dict, or None if its names are not icefall's LSTM transducer's."""
    sd = strip_ddp_prefix(state_dict)
    try:
        layers = {int(m.group(1)) for k in sd if (m := LAYER.match(k))}
        lstm = "encoder.encoder.layers.0.lstm."
        # with a projection, weight_hr_l0 is (d_model, hidden); without, weight_hh_l0 is (4 hidden, hidden)
        hidden = sd[lstm + ("weight_hr_l0" if lstm + "weight_hr_l0" in sd else "weight_hh_l0")].shape[1]
        conv = sd.get("decoder.conv.weight")
        return dict(
            num_encoder_layers=len(layers),
            encoder_dim=sd["encoder.encoder_embed.out.weight"].shape[0],
            rnn_hidden_size=hidden,
            dim_feedforward=sd["encoder.encoder.layers.0.feed_forward.0.weight"].shape[0],
            decoder_dim=sd["decoder.embedding.weight"].shape[1],
            joiner_dim=sd["joiner.output_linear.weight"].shape[1],
            context_size=1 if conv is None else conv.shape[2],
            vocab_size=sd["decoder.embedding.weight"].shape[0],
        )
    except (KeyError, IndexError):
        return None


def fitting_flags(state_dict: Dict[str, torch.Tensor], vocab_size: int) -> str:
    """A sentence naming the flags that fit ``state_dict``: its preset (``--model-preset icefall``) or its size
    flags, its ``--context-size`` when not 2, and the BPE model's size when it differs from ``vocab_size``."""
    sizes = model_sizes(state_dict)
    if sizes is None:
        return "Its names are not those of icefall's LSTM transducer: it is not a checkpoint of this model."
    preset = next((name for name, p in MODEL_PRESETS.items() if all(sizes[k] == v for k, v in p.items())), None)
    if preset is not None:
        flags = f"--model-preset {preset}"
    else:
        flags = " ".join(f"--{k.replace('_', '-')} {sizes[k]}" for k in MODEL_PRESETS["cpu"])
    if sizes["context_size"] != 2:
        flags += f" --context-size {sizes['context_size']}"
    text = f"It fits: {flags}."
    if sizes["vocab_size"] != vocab_size:
        text += (
            f" Its vocabulary has {sizes['vocab_size']} tokens and --bpe-model {vocab_size}: pass the BPE model it "
            "was trained with."
        )
    return text


def with_fitting_flags(error: CheckpointError, checkpoint: PathLike, vocab_size: int) -> CheckpointError:
    """``error`` with :func:`fitting_flags` of ``checkpoint``'s model appended when the error is a size or
    architecture mismatch (:func:`~icefall_lite.train.checkpoint.load_state_dict_checked`'s "does not fit");
    other errors (a missing or damaged file) as they are."""
    if "does not fit this model" not in str(error):
        return error
    return CheckpointError(f"{error}\n{fitting_flags(load_checkpoint_file(checkpoint)['model'], vocab_size)}")


__all__ = ["model_sizes", "fitting_flags", "with_fitting_flags"]
