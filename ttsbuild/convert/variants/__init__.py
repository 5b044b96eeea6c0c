"""Shipped configs: the published Qwen3-TTS 12 Hz configs (verbatim) and tiny ones
(CustomVoice, and Base with a small speaker encoder).

variant -> (config file, speech tokenizer config file), both in this package.
Kept free of heavy imports so the CLI can list variants without importing torch.
"""

VARIANTS: dict[str, tuple[str, str]] = {
    "tiny": ("tiny.json", "speech_tokenizer-tiny.json"),
    "tiny-base": ("tiny-base.json", "speech_tokenizer-tiny.json"),
    "0.6b-customvoice": ("0.6b-customvoice.json", "speech_tokenizer-12hz.json"),
    "0.6b-base": ("0.6b-base.json", "speech_tokenizer-12hz.json"),
    "1.7b-customvoice": ("1.7b-customvoice.json", "speech_tokenizer-12hz.json"),
    "1.7b-voicedesign": ("1.7b-voicedesign.json", "speech_tokenizer-12hz.json"),
    "1.7b-base": ("1.7b-base.json", "speech_tokenizer-12hz.json"),
}
