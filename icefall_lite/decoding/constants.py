"""Names and sizes that decoding, the ablation tools and the export share (no imports: any layer may use them)."""

# The searches of decode.py (offline) and of streaming decoding (PyTorch and sherpa-onnx).
DECODING_METHODS = ("greedy_search", "modified_beam_search", "fast_beam_search")
STREAMING_METHODS = ("greedy_search", "modified_beam_search")

# The LibriSpeech test sets decoded by default and tabulated by the reports.
TEST_SETS = ("test-clean", "test-other")

__all__ = ["DECODING_METHODS", "STREAMING_METHODS", "TEST_SETS"]
