"""The model and its losses: gradient control (clip), scaled modules, the pruned RNN-T loss, encoder, decoder,
joiner, transducer."""
