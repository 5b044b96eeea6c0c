"""A small Qwen2-style byte-level BPE tokenizer, trained on the shipped Harvard sentences.

The real Qwen2 vocabulary (151,643 BPE tokens) cannot be fetched here, so random-weight
stand-in checkpoints carry this one instead. It keeps what the engine relies on:

* the 256 byte tokens first, in GPT-2 byte order, so `"\\n"` is id 198 exactly as in Qwen2;
* `"assistant"` as a single token with the Qwen2 id 77091, so the prompt's role prefix
  `<|im_start|>assistant\\n` is `[151644, 77091, 198]` as in the real model;
* the added tokens at their Qwen3 / Qwen3-TTS ids (151643 `<|endoftext|>` ..., 151671
  `<tts_pad>`, 151672 `<tts_text_bos>`, 151673 `<tts_text_eos>`), declared in
  `tokenizer_config.json` the way Qwen2 does, so transformers' `Qwen2Tokenizer` loads it too.

Ids 151669 and 151670 exist in Qwen3-TTS but their names are not known here; they are left out.
The output is deterministic: the same files byte for byte on every run.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

from tokenizers import Tokenizer, pre_tokenizers, trainers
from tokenizers.models import BPE

from ttsbuild.text.tokenizer import qwen2_pre_tokenizer

STANDIN_VOCAB_SIZE = 3000
ASSISTANT_ID = 77091

# id -> (content, special). Qwen3's added tokens plus the three Qwen3-TTS text-channel tokens.
ADDED_TOKENS: dict[int, tuple[str, bool]] = {
    151643: ("<|endoftext|>", True),
    151644: ("<|im_start|>", True),
    151645: ("<|im_end|>", True),
    151646: ("<|object_ref_start|>", True),
    151647: ("<|object_ref_end|>", True),
    151648: ("<|box_start|>", True),
    151649: ("<|box_end|>", True),
    151650: ("<|quad_start|>", True),
    151651: ("<|quad_end|>", True),
    151652: ("<|vision_start|>", True),
    151653: ("<|vision_end|>", True),
    151654: ("<|vision_pad|>", True),
    151655: ("<|image_pad|>", True),
    151656: ("<|video_pad|>", True),
    151657: ("<tool_call>", False),
    151658: ("</tool_call>", False),
    151659: ("<|fim_prefix|>", False),
    151660: ("<|fim_middle|>", False),
    151661: ("<|fim_suffix|>", False),
    151662: ("<|fim_pad|>", False),
    151663: ("<|repo_name|>", False),
    151664: ("<|file_sep|>", False),
    151665: ("<tool_response>", False),
    151666: ("</tool_response>", False),
    151667: ("<think>", False),
    151668: ("</think>", False),
    151671: ("<tts_pad>", True),
    151672: ("<tts_text_bos>", True),
    151673: ("<tts_text_eos>", True),
}

# Prompt words the template uses; repeated so BPE learns each as one token.
_TEMPLATE_WORDS = ("assistant", "user", "system")


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map, in GPT-2's vocabulary order."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = printable[:]
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return dict(zip(printable, (chr(c) for c in chars), strict=True))


def harvard_sentences() -> list[str]:
    text = resources.files("ttsbuild.data").joinpath("harvard720.txt").read_text(encoding="utf-8")
    return [line.strip() for line in text.splitlines() if line.strip()]


def _training_corpus() -> list[str]:
    lines = harvard_sentences()
    lines += [f"{word}\n" for word in _TEMPLATE_WORDS for _ in range(64)]
    return lines


def _train(vocab_size: int) -> tuple[dict[str, int], list[tuple[str, str]]]:
    alphabet = bytes_to_unicode()
    tok = Tokenizer(BPE(unk_token=None, continuing_subword_prefix="", end_of_word_suffix=""))
    tok.pre_tokenizer = qwen2_pre_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tok.train_from_iterator(_training_corpus(), trainer=trainer)
    model = json.loads(tok.to_str())["model"]
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    # Renumber: bytes in GPT-2 order (0..255), then each merge's result in merge order.
    vocab: dict[str, int] = {char: i for i, char in enumerate(alphabet.values())}
    for left, right in merges:
        merged = left + right
        if merged not in vocab:
            vocab[merged] = len(vocab)
    if "assistant" in vocab:
        vocab["assistant"] = ASSISTANT_ID
    return vocab, [(a, b) for a, b in merges]


def tokenizer_config() -> dict:
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {
            str(i): {
                "content": content,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": special,
            }
            for i, (content, special) in sorted(ADDED_TOKENS.items())
        },
        "additional_special_tokens": [
            c for _, (c, s) in sorted(ADDED_TOKENS.items()) if s and c != "<|endoftext|>"
        ],
        "bos_token": None,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 131072,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


def write_standin_tokenizer(dst: str | Path, vocab_size: int = STANDIN_VOCAB_SIZE) -> list[Path]:
    """Write `vocab.json`, `merges.txt`, `tokenizer_config.json` into `dst` (must exist)."""
    dst = Path(dst)
    vocab, merges = _train(vocab_size)
    if vocab.get("assistant") != ASSISTANT_ID:
        raise RuntimeError("stand-in BPE did not learn 'assistant' as one token")
    paths = [dst / "vocab.json", dst / "merges.txt", dst / "tokenizer_config.json"]
    ordered = dict(sorted(vocab.items(), key=lambda kv: kv[1]))
    paths[0].write_text(json.dumps(ordered, ensure_ascii=False), encoding="utf-8")
    paths[1].write_text(
        "#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges), encoding="utf-8"
    )
    paths[2].write_text(json.dumps(tokenizer_config(), indent=2, ensure_ascii=False) + "\n",
                        encoding="utf-8")
    return paths
