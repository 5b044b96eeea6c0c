"""Triton kernels. Importing anything here imports triton: only the dispatchers do, lazily."""
