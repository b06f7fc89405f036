"""Every measured number in docs/ comes from committed results: the generated tables must be current."""

from benchmarks import docs_tables as _docs_tables


def _module():
    return _docs_tables


def test_docs_tables_match_committed_results():
    docs_tables = _module()
    pages = docs_tables.pages()
    assert len(pages) >= 5
    stale = [p.name for p in pages if docs_tables.render_page(p.read_text()) != p.read_text()]
    assert stale == [], f"run python -m benchmarks.docs_tables: {stale}"


def test_every_renderer_is_used_once():
    docs_tables = _module()
    used = [m["name"] for p in docs_tables.pages() for m in docs_tables.MARKER.finditer(p.read_text())]
    assert sorted(used) == sorted(docs_tables.RENDERERS)
