"""The shipped voice-agent prompt set: its shape (count, lengths, sentences, domains) and that
it is exactly what the committed generator makes."""

import statistics
from importlib import resources

from ttsbuild.bench.schedule import load_prompts
from ttsbuild.bench.voice_agent_prompts import CORE, generate, sentences, to_jsonl


def test_shipped_file_is_the_generator_output():
    shipped = resources.files("ttsbuild").joinpath("data/voice_agent.jsonl").read_text("utf-8")
    assert shipped == to_jsonl(generate())


def test_lengths_sentences_and_domains_have_the_voice_agent_shape():
    prompts = load_prompts("voice-agent")
    lengths = [len(p) for p in prompts]
    assert len(prompts) >= 600 and len(set(prompts)) == len(prompts)
    assert min(lengths) >= 15 and max(lengths) <= 250
    assert 85 <= statistics.mean(lengths) <= 95
    # the spread a voice agent has: one-liners and long explanations, not one length
    assert sum(n < 40 for n in lengths) >= 0.1 * len(prompts)
    assert sum(n > 150 for n in lengths) >= 0.05 * len(prompts)
    assert {sentences(p) for p in prompts} == {1, 2, 3}
    domains = {r["domain"] for r in generate()}
    assert set(CORE) | {"short", "question"} == domains


def test_sentence_count_ignores_abbreviations_and_decimals():
    assert sentences("Dr. Patel is free at 9:30 AM. It's $12.50. Okay?") == 3


def test_builtin_sets_by_name_and_harvard_stays_the_default():
    harvard = load_prompts("harvard")
    assert load_prompts(None) == harvard and len(harvard) == 720
    assert load_prompts("voice-agent") != harvard
