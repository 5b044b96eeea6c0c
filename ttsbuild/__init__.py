"""ttsbuild: a fast streaming text-to-speech engine and server for Qwen3-TTS (12 Hz family)."""

__version__ = "0.1.0"
