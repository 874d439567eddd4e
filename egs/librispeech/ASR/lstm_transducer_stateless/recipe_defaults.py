"""The defaults this recipe's scripts must agree on, written once.

train.py trains :data:`NUM_EPOCHS` epochs into :data:`EXP_DIR`; decode.py,
streaming_decode.py, export_onnx.py, sherpa_onnx_decode.py, demo.sh and
benchmarks/bench_decode.py then use ``--epoch NUM_EPOCHS --avg AVG`` of it.
5 epochs of the 10.7-h default corpus, averaged over the last 2, was chosen by
the learning-speed study (RESULTS.md, "Learning speed"). The scripts' folder is
on ``sys.path`` when they run (as in icefall), so they import this module by name.
"""

from pathlib import Path

NUM_EPOCHS = 5
AVG = 2
EXP_DIR = Path("lstm_transducer_stateless/exp")
