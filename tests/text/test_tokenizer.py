"""Our Qwen2 BPE tokenizer against transformers' Qwen2 tokenizers on the stand-in files."""

from __future__ import annotations

import hashlib

import pytest

from ttsbuild.text import TextTokenizer, TokenizerError
from ttsbuild.text.standin import ADDED_TOKENS, harvard_sentences, write_standin_tokenizer

TEMPLATE = "<|im_start|>assistant\n{text}<|im_end|>\n<|im_start|>assistant\n"

EXTRA_TEXTS = [
    "",
    " ",
    "Hello, world!",
    "It's 3:45 pm on 2024-01-02; call 555-0123 or +44 20 7946 0958.",
    "Numbers: 1234567890 3.14159 1,000,000 ½ ⅔ ² ٣",
    "Whitespace   runs\t\ttabs   and  trailing   ",
    "line one\nline two\n\nline four\r\nwindows\r\rcr",
    "   leading spaces and a newline at the end\n",
    "Unicode: café naïve résumé Ångström Zürich façade coöperate",
    "Combining: cafe\u0301 vs café, Å vs A\u030a (NFC must merge them)",
    "中文：你好，世界！今天天气很好。我们去公园吧。",
    "日本語のテキストとカタカナ、ひらがな。",
    "한국어 문장입니다. Русский текст. Ελληνικά. עברית. العربية.",
    "Emoji: 😀🙂👍🏽 👨‍👩‍👧‍👦 🇺🇸 ❤️ and a snake 🐍",
    "Quotes “curly” ‘single’ «guillemets» — dashes – and … ellipsis",
    "I'm sure they'll say you've done what we'd READ'S and THEY'RE",
    "Code: def f(x): return x**2 # comment {braces} [brackets] <angle>",
    "<not special> <|im_starts|> <|im_end <tts_pad",
    "Specials inline<|im_end|>glued<|endoftext|>and <tts_pad><tts_text_bos><tts_text_eos>",
    "<think>\n\n</think>\n\n",
    "The birch canoe slid on the smooth planks.<|im_end|>\n<|im_start|>user\nhi",
]


@pytest.fixture(scope="module")
def standin_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("standin_tok")
    write_standin_tokenizer(d)
    return d


@pytest.fixture(scope="module")
def ours(standin_dir):
    return TextTokenizer.from_dir(standin_dir)


@pytest.fixture(scope="module")
def hf_slow(standin_dir):
    from transformers import Qwen2Tokenizer

    return Qwen2Tokenizer.from_pretrained(str(standin_dir))


@pytest.fixture(scope="module")
def hf_fast(standin_dir):
    from transformers import Qwen2TokenizerFast

    return Qwen2TokenizerFast.from_pretrained(str(standin_dir))


def _corpus() -> list[str]:
    harvard = harvard_sentences()
    texts = harvard[::7] + EXTRA_TEXTS
    texts += [" ".join(harvard[i:i + 5]) for i in range(0, 100, 5)]
    return texts + [TEMPLATE.format(text=t) for t in texts]


def test_standin_is_loadable_and_has_declared_special_ids(hf_slow, ours):
    for token_id, (content, _special) in ADDED_TOKENS.items():
        assert hf_slow.convert_tokens_to_ids(content) == token_id
        assert ours.token_id(content) == token_id
    assert ours.token_id("im_start") == 151644
    assert ours.token_id("im_end") == 151645
    assert ours.token_id("endoftext") == 151643
    assert ours.token_id("tts_pad") == 151671
    assert ours.token_id("tts_bos") == 151672
    assert ours.token_id("tts_eos") == 151673
    with pytest.raises(KeyError):
        ours.token_id("<no such token>")


def test_prompt_role_prefix_matches_real_qwen2_ids(ours):
    ids = ours.encode(TEMPLATE.format(text="Hello there."))
    assert ids[:3] == [151644, 77091, 198]  # <|im_start|> assistant \n, as in real Qwen2
    assert ids[-5:] == [151645, 198, 151644, 77091, 198]


def test_encode_matches_transformers_slow_tokenizer(ours, hf_slow):
    mismatches = []
    for text in _corpus():
        want = hf_slow(text, add_special_tokens=False)["input_ids"]
        got = ours.encode(text)
        if got != want:
            mismatches.append((text, got, want))
    assert not mismatches, mismatches[:3]


def test_bpe_matches_transformers_fast_tokenizer_on_plain_text(ours, hf_fast):
    # The fast tokenizer renumbers added tokens past a small vocab, so compare plain text only.
    plain = [t for t in _corpus() if not any(c in t for c, _ in ADDED_TOKENS.values())]
    assert len(plain) > 100
    for text in plain:
        assert ours.encode(text) == hf_fast(text, add_special_tokens=False)["input_ids"], text


def test_pre_tokenization_matches_qwen2_regex(ours, hf_slow):
    # Independent of the vocabulary: the stand-in BPE has no merges across these boundaries,
    # so compare the split itself with transformers' slow tokenizer (regex + byte map).
    import unicodedata

    from transformers.models.qwen2.tokenization_qwen2 import bytes_to_unicode

    byte_map = bytes_to_unicode()
    for text in _corpus():
        want = []
        for piece in hf_slow.tokens_trie.split(text):
            if piece in hf_slow.added_tokens_encoder:
                want.append(piece)
                continue
            for word in hf_slow.pat.findall(unicodedata.normalize("NFC", piece)):
                want.append("".join(byte_map[b] for b in word.encode("utf-8")))
        assert ours.pre_tokens(text) == want, text


def test_decode_round_trips(ours, hf_slow):
    import unicodedata

    for text in _corpus():
        ids = ours.encode(text)
        assert ours.decode(ids) == unicodedata.normalize("NFC", text)
        assert ours.decode(ids) == hf_slow.decode(ids)
    ids = ours.encode(TEMPLATE.format(text="Hi."))
    assert ours.decode(ids, skip_special_tokens=True) == "assistant\nHi.\nassistant\n"


def test_nfc_normalisation_applies(ours):
    assert ours.encode("cafe\u0301") == ours.encode("café")


def test_standin_builder_is_deterministic(tmp_path, standin_dir):
    write_standin_tokenizer(tmp_path)
    for name in ("vocab.json", "merges.txt", "tokenizer_config.json"):
        a = hashlib.sha256((tmp_path / name).read_bytes()).hexdigest()
        b = hashlib.sha256((standin_dir / name).read_bytes()).hexdigest()
        assert a == b, name


def test_missing_files_are_reported(tmp_path, standin_dir):
    (tmp_path / "vocab.json").write_bytes((standin_dir / "vocab.json").read_bytes())
    with pytest.raises(TokenizerError, match="merges.txt, tokenizer_config.json"):
        TextTokenizer.from_dir(tmp_path)
    with pytest.raises(TokenizerError, match="does not exist"):
        TextTokenizer.from_dir(tmp_path / "nope")


def test_corrupt_vocab_is_reported(tmp_path, standin_dir):
    for name in ("merges.txt", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((standin_dir / name).read_bytes())
    (tmp_path / "vocab.json").write_text("{not json", encoding="utf-8")
    with pytest.raises(TokenizerError, match="not valid JSON"):
        TextTokenizer.from_dir(tmp_path)


def test_unknown_id_in_decode(ours):
    with pytest.raises(KeyError):
        ours.decode([100000])


def _ascii_fuzz(n: int, seed: int) -> list[str]:
    """Random ASCII strings weighted to the pre-tokenizer's corners: contractions in either
    case, digit runs, whitespace and newline runs, the control characters Python's \\s takes
    and Unicode's White_Space does not (\\x1c-\\x1f), punctuation runs."""
    import random
    import string

    rng = random.Random(seed)
    atoms = [*string.ascii_letters, *string.digits, *string.punctuation, " ", "  ", "\t", "\n",
             "\r\n", "\r", "\x0b", "\x0c", "\x1c", "\x1f", "\x00", "\x7f", "'s", "'S", "'LL",
             "'re", "'Ve", "'m", "'d", "'t", " the", "...", "\n\n", "   \n", "42"]  # fmt: skip
    return ["".join(rng.choice(atoms) for _ in range(rng.randint(0, 24))) for _ in range(n)]


def test_ascii_split_is_the_pre_tokenizers_split():
    """`ascii_words` (Python's re on ASCII text) against `tokenizers`' own Split with the
    Qwen2 regex, on fuzzed ASCII and the corpus's ASCII texts."""
    from tokenizers import Regex, pre_tokenizers

    from ttsbuild.text.tokenizer import QWEN2_PRETOKENIZE_REGEX, ascii_words

    split = pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated")
    texts = _ascii_fuzz(4000, 0) + [t for t in _corpus() if t.isascii()]
    for text in texts:
        assert ascii_words(text) == [p for p, _ in split.pre_tokenize_str(text)], repr(text)


def test_ascii_words_path_equals_whole_piece_encoding(standin_dir):
    """ASCII pieces are encoded word by word from the table: the ids of `tokenizers`
    encoding the whole piece, and the table is what serves them the second time."""
    tok = TextTokenizer.from_dir(standin_dir)
    texts = _ascii_fuzz(2000, 1) + [TEMPLATE.format(text=t) for t in _ascii_fuzz(200, 2)]
    for text in texts:
        want = []
        for piece in tok._pieces(text):
            added = tok._added_by_content.get(piece)
            want += [added.id] if added else tok._bpe.encode(piece, add_special_tokens=False).ids
        assert tok.encode(text) == want, repr(text)
    assert len(tok._words) > 100
    words = len(tok._words)
    tok.encode(texts[3])  # words seen before: nothing new in the table
    assert len(tok._words) == words


def test_warm_words_fills_the_table_with_the_bpes_own_encodings(standin_dir, monkeypatch):
    """`warm_words` puts the vocabulary's one-word ASCII tokens in the word table, each as the
    BPE encodes it; a text of those words then costs no BPE call, and texts of any words
    still encode as `tokenizers` does on the whole piece."""
    from ttsbuild.text.tokenizer import ascii_words

    tok = TextTokenizer.from_dir(standin_dir)
    added = tok.warm_words()
    assert added > 500 and len(tok._words) == added
    for word, ids in tok._words.items():
        assert word.isascii() and ascii_words(word) == [word]
        assert list(ids) == tok._bpe.encode(word, add_special_tokens=False).ids, repr(word)
    assert tok.warm_words() == 0  # nothing left to add
    assert TextTokenizer.from_dir(standin_dir).warm_words(limit=50) == 50
    words = [w for w in tok._words if w.startswith(" ") and w[1:].isalpha()][:40]
    assert len(words) == 40
    calls = []
    encode = tok._bpe.encode
    monkeypatch.setattr(tok, "_bpe", type("Spy", (), {
        "encode": lambda self, *a, **k: calls.append(a) or encode(*a, **k)})())  # fmt: skip
    text = "".join(words)  # each word with its space, as the split gives it
    assert tok.encode(text) == encode(text, add_special_tokens=False).ids
    assert calls == []
    for text in _ascii_fuzz(300, 3):
        want = encode(text, add_special_tokens=False).ids if text else []
        assert tok.encode(text) == want, repr(text)
