"""Live text -> synthesis segments, for the WebSocket protocol.

An upstream LLM streams text a few characters at a time; the model needs whole phrases to
sound right. The segmenter cuts the text at the first boundary that makes a segment worth
synthesizing: a sentence end, else a clause boundary once the segment has clause_words words,
else max_words words; the first segment uses smaller limits so audio starts sooner. When input
stalls (no append for flush_after_s) or ends, whatever is left becomes a segment. Each
segment is one engine request; their audio is sent in order on the same stream.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_SENTENCE_END = re.compile(r"[.!?…。！？]+[\"')\]]*\s")
_CLAUSE_END = re.compile(r"[,;:，；：、—–]\s")


@dataclass(frozen=True)
class SegmenterConfig:
    clause_words: int = 6  # a clause boundary cuts once the segment has this many words
    max_words: int = 30  # no boundary by then: cut at the last space
    first_clause_words: int = 3
    first_max_words: int = 12


class Segmenter:
    def __init__(self, config: SegmenterConfig = SegmenterConfig()):
        self.config = config
        self.buffer = ""
        self.segments_cut = 0

    def append(self, text: str) -> list[str]:
        self.buffer += text
        out = []
        while (seg := self._cut()) is not None:
            out.append(seg)
        return out

    def flush(self) -> str | None:
        """Everything buffered (input ended or stalled), or None if only whitespace."""
        text, self.buffer = self.buffer.strip(), ""
        if not text:
            return None
        self.segments_cut += 1
        return text

    def _cut(self) -> str | None:
        cfg, first = self.config, self.segments_cut == 0
        clause_words = cfg.first_clause_words if first else cfg.clause_words
        max_words = cfg.first_max_words if first else cfg.max_words
        end = None
        if m := _SENTENCE_END.search(self.buffer):
            end = m.end()
        else:
            for m in _CLAUSE_END.finditer(self.buffer):
                if len(self.buffer[: m.end()].split()) >= clause_words:
                    end = m.end()
                    break
        if end is None:
            words = list(re.finditer(r"\S+\s", self.buffer))
            if len(words) < max_words:
                return None
            end = words[max_words - 1].end()
        text, self.buffer = self.buffer[:end].strip(), self.buffer[end:]
        if not text:
            return None
        self.segments_cut += 1
        return text
