"""Qwen2 byte-level BPE tokenizer, built on the `tokenizers` library.

A Qwen checkpoint ships `vocab.json` + `merges.txt` (the BPE) and `tokenizer_config.json`,
whose `added_tokens_decoder` maps ids to the added (mostly special) tokens such as
`<|im_start|>` = 151644 or `<tts_pad>` = 151671. Those ids lie beyond the BPE vocabulary and,
in a small stand-in vocabulary, far beyond it, so they are never handed to `tokenizers` (which
would renumber them). Instead the text is split on the added-token strings (longest first),
each plain piece is run through the BPE, and each added token maps to its declared id.

The BPE pipeline is the one Qwen2 uses: NFC normalisation, the Qwen2 pre-tokenizer regex
(split, "isolated"), byte-level mapping without its own regex, byte-level decoding.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, normalizers, pre_tokenizers
from tokenizers.models import BPE

from ttsbuild.validation import read_json_object

# The Qwen2 pre-tokenizer pattern (contractions, letter runs, single digits, punctuation runs,
# newline runs, whitespace). Digits are split one by one.
QWEN2_PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

TOKENIZER_FILES = ("vocab.json", "merges.txt", "tokenizer_config.json")

# Friendly names for the added tokens the engine uses; `token_id` also accepts the literal.
SPECIAL_ALIASES: dict[str, str] = {
    "endoftext": "<|endoftext|>",
    "im_start": "<|im_start|>",
    "im_end": "<|im_end|>",
    "tts_pad": "<tts_pad>",
    "tts_bos": "<tts_text_bos>",
    "tts_eos": "<tts_text_eos>",
}


class TokenizerError(ValueError):
    """Missing or malformed tokenizer files."""


@dataclass(frozen=True)
class AddedToken:
    content: str
    id: int
    special: bool


def _read_json(path: Path) -> dict:
    return read_json_object(path, f"tokenizer file {path.name}", TokenizerError)


def read_merges(path: Path) -> list[tuple[str, str]]:
    """Read a GPT-2/Qwen2 `merges.txt` (optional `#version:` first line)."""
    merges: list[tuple[str, str]] = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise TokenizerError(f"tokenizer file {path} is missing") from None
    for i, raw in enumerate(lines):
        line = raw.strip()
        if not line or (i == 0 and line.startswith("#version:")):
            continue
        parts = line.split()
        if len(parts) != 2:
            raise TokenizerError(f"{path}:{i + 1}: a merge must be two tokens, got {raw!r}")
        merges.append((parts[0], parts[1]))
    return merges


def read_added_tokens(config: dict) -> list[AddedToken]:
    """The added tokens declared in a `tokenizer_config.json` dict, by id."""
    table = config.get("added_tokens_decoder") or {}
    if not isinstance(table, dict):
        raise TokenizerError("tokenizer_config.json: added_tokens_decoder must be an object")
    tokens = []
    for key, entry in table.items():
        try:
            token_id = int(key)
            content = entry["content"] if isinstance(entry, dict) else str(entry)
        except (ValueError, KeyError, TypeError):
            raise TokenizerError(
                f"tokenizer_config.json: bad added_tokens_decoder entry {key!r}"
            ) from None
        special = bool(entry.get("special", True)) if isinstance(entry, dict) else True
        tokens.append(AddedToken(content, token_id, special))
    return sorted(tokens, key=lambda t: t.id)


def build_bpe(vocab: dict[str, int], merges: list[tuple[str, str]]) -> Tokenizer:
    """The Qwen2 BPE pipeline without added tokens."""
    tok = Tokenizer(
        BPE(
            vocab=vocab,
            merges=merges,
            dropout=None,
            unk_token=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
            byte_fallback=False,
        )
    )
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = qwen2_pre_tokenizer()
    tok.decoder = decoders.ByteLevel()
    return tok


def qwen2_pre_tokenizer() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


_SHORT_PIECE, _SHORT_CACHE = 16, 4096  # pieces of up to 16 characters; at most 4096 of them

# The same pattern for ASCII text, in Python's `re`: \p{L} is [A-Za-z] there, \p{N} [0-9] and
# \s Unicode's White_Space within ASCII, [\t\n\v\f\r ] (not Python's \s, which adds
# \x1c-\x1f). On ASCII text it splits as the pre-tokenizer does (tests/text: a fuzz of ASCII
# strings against `tokenizers`), so an ASCII piece's words can be looked up, each encoded once:
# `tokenizers` spends ~30 of its ~40 us on a 60-character request in its regex.
_WS = "\t\n\x0b\x0c\r "
QWEN2_ASCII_SPLIT = re.compile(
    rf"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\nA-Za-z0-9]?[A-Za-z]+|[0-9]"
    rf"| ?[^{_WS}A-Za-z0-9]+[\r\n]*|[{_WS}]*[\r\n]+|[{_WS}]+(?![^{_WS}])|[{_WS}]+"
)
_WORD_LEN, _WORD_CACHE = 32, 65536  # words of up to 32 characters; at most 65536 of them


def ascii_words(text: str) -> list[str]:
    """The Qwen2 pre-tokenizer's pieces of ASCII `text` (its "isolated" split: the matches,
    and any text between them, in order)."""
    words, end = [], 0
    for m in QWEN2_ASCII_SPLIT.finditer(text):
        if m.start() > end:
            words.append(text[end : m.start()])
        words.append(m.group())
        end = m.end()
    if end < len(text):
        words.append(text[end:])
    return words


class TextTokenizer:
    """Encode text to Qwen2 token ids (added tokens by their declared ids) and back."""

    def __init__(
        self, vocab: dict[str, int], merges: list[tuple[str, str]], added: list[AddedToken]
    ):
        self._bpe = build_bpe(vocab, merges)
        self._added_by_content = {t.content: t for t in added}
        self._added_by_id = {t.id: t for t in added}
        vocab_ids = set(vocab.values())
        clash = sorted(t.id for t in added if t.id in vocab_ids and t.content not in vocab)
        if clash:
            raise TokenizerError(f"added token ids {clash[:5]} collide with BPE vocabulary ids")
        if added:
            alternatives = sorted(self._added_by_content, key=len, reverse=True)
            self._split = re.compile("(" + "|".join(re.escape(a) for a in alternatives) + ")")
        else:
            self._split = None
        # Admission is on the path to first audio: ASCII pieces (the chat template's
        # "assistant\n" and "\n" among them) are encoded word by word from `_words`; other
        # short pieces are encoded once, whole, into `_short`.
        self._short: dict[str, tuple[int, ...]] = {}
        self._words: dict[str, tuple[int, ...]] = {}  # ASCII words, each BPE-encoded once
        self.vocab_size = max([*vocab.values(), *self._added_by_id, -1]) + 1

    @classmethod
    def from_dir(cls, path: str | Path) -> TextTokenizer:
        """Load `vocab.json`, `merges.txt` and `tokenizer_config.json` from a directory."""
        path = Path(path)
        if not path.is_dir():
            raise TokenizerError(f"tokenizer directory {path} does not exist")
        missing = [name for name in TOKENIZER_FILES if not (path / name).is_file()]
        if missing:
            raise TokenizerError(f"tokenizer directory {path} lacks {', '.join(missing)}")
        vocab = _read_json(path / "vocab.json")
        if not isinstance(vocab, dict) or not all(isinstance(v, int) for v in vocab.values()):
            raise TokenizerError(f"{path / 'vocab.json'} must map token strings to integer ids")
        config = _read_json(path / "tokenizer_config.json")
        if not isinstance(config, dict):
            raise TokenizerError(f"{path / 'tokenizer_config.json'} must be a JSON object")
        return cls(vocab, read_merges(path / "merges.txt"), read_added_tokens(config))

    @property
    def added_tokens(self) -> dict[str, int]:
        return {t.content: t.id for t in self._added_by_id.values()}

    def token_id(self, name: str) -> int:
        """Id of an added token, by its literal (`"<|im_start|>"`) or alias (`"im_start"`)."""
        literal = SPECIAL_ALIASES.get(name, name)
        token = self._added_by_content.get(literal)
        if token is not None:
            return token.id
        plain = self._bpe.token_to_id(name)
        if plain is not None:
            return plain
        raise KeyError(f"no token named {name!r} in this tokenizer")

    def _pieces(self, text: str) -> Iterable[str]:
        if self._split is None:
            yield text
            return
        yield from (p for p in self._split.split(text) if p)

    def pre_tokens(self, text: str) -> list[str]:
        """The byte-level pieces BPE runs on (after NFC and the Qwen2 split), for tests."""
        out: list[str] = []
        for piece in self._pieces(text):
            if piece in self._added_by_content:
                out.append(piece)
            else:
                normalized = self._bpe.normalizer.normalize_str(piece)
                out += [p for p, _ in self._bpe.pre_tokenizer.pre_tokenize_str(normalized)]
        return out

    def encode(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"encode expects a str, got {type(text).__name__}")
        ids: list[int] = []
        for piece in self._pieces(text):
            added = self._added_by_content.get(piece)
            if added is not None:
                ids.append(added.id)
            elif piece.isascii():
                ids.extend(self._encode_ascii(piece))
            elif len(piece) <= _SHORT_PIECE:
                cached = self._short.get(piece)
                if cached is None:
                    cached = tuple(self._bpe.encode(piece, add_special_tokens=False).ids)
                    if len(self._short) < _SHORT_CACHE:
                        self._short[piece] = cached
                ids.extend(cached)
            else:
                ids.extend(self._bpe.encode(piece, add_special_tokens=False).ids)
        return ids

    def _encode_ascii(self, piece: str) -> list[int]:
        """An ASCII piece's ids word by word (the BPE runs on each pre-tokenized word alone,
        so this is the whole piece's encoding); words seen before come from a table."""
        ids: list[int] = []
        for word in ascii_words(piece):
            cached = self._words.get(word)
            if cached is None:
                cached = tuple(self._bpe.encode(word, add_special_tokens=False).ids)
                if len(word) <= _WORD_LEN and len(self._words) < _WORD_CACHE:
                    self._words[word] = cached
            ids.extend(cached)
        return ids

    def warm_words(self, limit: int = _WORD_CACHE) -> int:
        """Fill the word table ahead of requests: every vocabulary token that is one ASCII
        word of the pre-tokenizer's split (" hello", "Hello", ",") up to `limit` words, lowest
        ids (the earliest merges) first, each encoded by the BPE itself in one batch. A word
        a request meets for the first time otherwise costs it one BPE call on the way to its
        first audio. Returns the words added."""
        room = min(limit, _WORD_CACHE) - len(self._words)
        if room <= 0:
            return 0
        vocab = sorted(self._bpe.get_vocab(with_added_tokens=False).items(), key=lambda kv: kv[1])
        texts = self._bpe.decode_batch([[i] for _, i in vocab], skip_special_tokens=False)
        words = []
        for text in texts:
            if (text.isascii() and 0 < len(text) <= _WORD_LEN and text not in self._words
                    and ascii_words(text) == [text]):  # fmt: skip
                words.append(text)
                if len(words) == room:
                    break
        encoded = self._bpe.encode_batch(words, add_special_tokens=False)
        for word, enc in zip(words, encoded, strict=True):
            self._words[word] = tuple(enc.ids)
        return len(words)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        out: list[str] = []
        run: list[int] = []

        def flush() -> None:
            if run:
                out.append(self._bpe.decode(run, skip_special_tokens=False))
                run.clear()

        for raw in ids:
            token_id = int(raw)
            added = self._added_by_id.get(token_id)
            if added is not None:
                flush()
                if not (skip_special_tokens and added.special):
                    out.append(added.content)
            else:
                if self._bpe.id_to_token(token_id) is None:
                    raise KeyError(f"token id {token_id} is not in this tokenizer")
                run.append(token_id)
        flush()
        return "".join(out)
