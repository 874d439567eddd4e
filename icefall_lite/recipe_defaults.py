"""The defaults the LibriSpeech recipe's scripts, the studies and the benchmarks must agree on, written once.

train.py trains :data:`NUM_EPOCHS` epochs into :data:`EXP_DIR`; decode.py,
streaming_decode.py, export_onnx.py, sherpa_onnx_decode.py, demo.sh and
benchmarks/bench_decode.py then use ``--epoch NUM_EPOCHS --avg AVG`` of it.
5 epochs of the 10.7-h default corpus, averaged over the last 2, was chosen by
the learning-speed study (studies/learning_speed/README.md).

``--max-duration`` (seconds of audio per batch) has one default for training
and one for decoding: small training batches give a 2-core CPU more updates
per minute (--max-duration 100 learned slower per minute in the learning-speed
study); decoding has no updates, and larger batches decode faster. icefall's
own values (200 on a GPU) are in train.py's ``--preset icefall``.
"""

from pathlib import Path

NUM_EPOCHS = 5
AVG = 2
EXP_DIR = Path("lstm_transducer_stateless/exp")
TRAIN_MAX_DURATION = 40.0
DECODE_MAX_DURATION = 100.0
