"""Prompt layout, sampling and the frame-by-frame generation loop (reference path)."""
