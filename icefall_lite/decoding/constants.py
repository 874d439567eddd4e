"""Names and sizes that decoding, the ablation tools and the export share (no imports: any layer may use them)."""

# The searches of decode.py (offline) and of streaming decoding (PyTorch and sherpa-onnx).
DECODING_METHODS = ("greedy_search", "modified_beam_search", "fast_beam_search")
STREAMING_METHODS = ("greedy_search", "modified_beam_search")

# The LibriSpeech test sets decoded by default and tabulated by the reports.
TEST_SETS = ("test-clean", "test-other")

# Feature frames between two encoder calls in streaming decoding and export
# (each call sees decode_chunk_len + 5 frames: one output frame per 4).
DEFAULT_DECODE_CHUNK_LEN = 4

__all__ = ["DECODING_METHODS", "STREAMING_METHODS", "TEST_SETS", "DEFAULT_DECODE_CHUNK_LEN"]
