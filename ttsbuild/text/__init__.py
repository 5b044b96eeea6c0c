"""Text side of the engine: the Qwen2 byte-level BPE tokenizer and a small stand-in builder."""

from ttsbuild.text.tokenizer import TextTokenizer, TokenizerError

__all__ = ["TextTokenizer", "TokenizerError"]
