"""Shipped configs: the published Qwen3-TTS 12 Hz configs (verbatim) and a tiny one."""
