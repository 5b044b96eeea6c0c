"""Model definitions: our own PyTorch implementations of the Qwen3-TTS 12 Hz components."""
