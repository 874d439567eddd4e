"""The offline synthetic corpus in the LibriSpeech layout: text selection, TTS voices, noise, the noise corpus."""
