"""Streaming decoding in PyTorch needs neither onnx nor onnxruntime (nor the export package)."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# Run in a fresh interpreter where importing onnx or onnxruntime raises ImportError.
PROGRAM = textwrap.dedent(
    """
    import sys
    sys.modules["onnx"] = None
    sys.modules["onnxruntime"] = None
    import torch
    torch.set_num_threads(1)
    from icefall_lite.decoding.streaming import TorchStreamingModel, streaming_search
    from icefall_lite.nn.model import build_transducer

    torch.manual_seed(0)
    model = build_transducer(vocab_size=10, num_features=80, encoder_dim=16, rnn_hidden_size=24, dim_feedforward=32,
                             num_encoder_layers=2, decoder_dim=16, joiner_dim=20, context_size=2, blank_id=0,
                             grad_filter_threshold=25.0, dropout=0.0, layer_dropout=0.0, use_ctc=False)
    streamer = TorchStreamingModel(model)
    feats = [torch.randn(40, 80), torch.randn(25, 80)]
    for method in ("greedy_search", "modified_beam_search"):
        hyps = streaming_search(streamer, feats, decoding_method=method)
        assert len(hyps) == 2 and all(isinstance(h, list) for h in hyps), hyps
    loaded = sorted(m for m in sys.modules if m.startswith(("onnx", "icefall_lite.export")) and sys.modules[m])
    assert not loaded, loaded
    print("ok")
    """
)


def test_streaming_decoding_imports_no_onnx():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [sys.executable, "-c", PROGRAM], cwd=REPO, env=env, capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().endswith("ok")


def test_streaming_decode_script_imports_no_onnx():
    """The recipe's streaming_decode.py imports (its module level) without onnx/onnxruntime."""
    script = REPO / "egs/librispeech/ASR/lstm_transducer_stateless/streaming_decode.py"
    program = textwrap.dedent(
        f"""
        import sys, importlib.util
        sys.modules["onnx"] = None
        sys.modules["onnxruntime"] = None
        spec = importlib.util.spec_from_file_location("streaming_decode", {str(script)!r})
        spec.loader.exec_module(importlib.util.module_from_spec(spec))
        print("ok")
        """
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [sys.executable, "-c", program], cwd=REPO, env=env, capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().endswith("ok")
