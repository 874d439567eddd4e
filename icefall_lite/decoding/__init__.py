"""Decoding: greedy, modified beam and fast beam search, the decode loop and its output files, streaming
decoding, WER."""
