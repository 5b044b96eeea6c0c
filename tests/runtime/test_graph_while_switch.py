"""runtime.graph_while.full_edges: TTSBUILD_WHILE_EDGES read once per process (CPU; the
probe of `auto` runs on the GPU, tests/runtime/test_graph_while.py)."""

import pytest

from ttsbuild.runtime.graph_while import full_edges


@pytest.fixture(autouse=True)
def _fresh():
    full_edges.cache_clear()
    yield
    full_edges.cache_clear()


@pytest.mark.parametrize(("mode", "want"), [("keep", False), ("full", True)])
def test_a_set_mode_needs_no_probe(monkeypatch, mode, want):
    monkeypatch.setenv("TTSBUILD_WHILE_EDGES", mode)
    assert full_edges() is want


def test_a_bad_mode_is_refused_by_name(monkeypatch):
    monkeypatch.setenv("TTSBUILD_WHILE_EDGES", "sideways")
    with pytest.raises(ValueError, match="TTSBUILD_WHILE_EDGES.*sideways"):
        full_edges()
