"""Voice cloning with Base checkpoints: reference clips in, reusable cloned voices out.

clip.py     decode and check a reference clip (any libsndfile format, resampled to 24 kHz)
encoder.py  clip -> x-vector (speaker encoder) + reference codes (codec encoder)
store.py    registered voices on disk (safetensors + JSON), atomic and safe to share
"""
