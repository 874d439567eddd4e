"""Names and sizes that decoding, the ablation tools and the export share (no imports: any layer may use them)."""

# The searches of decode.py (offline) and of streaming decoding (PyTorch and sherpa-onnx).
DECODING_METHODS = ("greedy_search", "modified_beam_search", "fast_beam_search")
STREAMING_METHODS = ("greedy_search", "modified_beam_search")

# The LibriSpeech test sets decoded by default and tabulated by the reports.
TEST_SETS = ("test-clean", "test-other")

# icefall pads this many frames of log(1e-10) at the end of every utterance
# before the LSTM encoder, against deletions at the end of utterances.
NUM_TAIL_PADDED_FRAMES = 35

# Feature frames between two encoder calls in streaming decoding and export
# (each call sees decode_chunk_len + 5 frames: one output frame per 4).
DEFAULT_DECODE_CHUNK_LEN = 4

__all__ = ["DECODING_METHODS", "STREAMING_METHODS", "TEST_SETS", "NUM_TAIL_PADDED_FRAMES", "DEFAULT_DECODE_CHUNK_LEN"]
