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


def test_streaming_decode_script_imports_no_onnx(tmp_path):
    """The recipe's streaming_decode.py runs (its imports, its flags: ``--help``) where onnx and onnxruntime
    cannot be imported: stand-ins for both that raise ImportError come first on the path."""
    blocked = tmp_path / "blocked"
    blocked.mkdir()
    for name in ("onnx", "onnxruntime"):
        (blocked / f"{name}.py").write_text(f"raise ImportError('{name} is blocked in this test')\n")
    script = REPO / "egs/librispeech/ASR/lstm_transducer_stateless/streaming_decode.py"
    path = os.pathsep.join([str(blocked), str(REPO), os.environ.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, str(script), "--help"],
        cwd=tmp_path,
        env=dict(os.environ, PYTHONPATH=path),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr
    assert "--decode-chunk-len" in proc.stdout
