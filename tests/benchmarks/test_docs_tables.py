"""Every measured number in docs/ comes from committed results: the generated tables must be current."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _module():
    spec = importlib.util.spec_from_file_location("docs_tables", ROOT / "benchmarks" / "docs_tables.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_docs_tables_match_committed_results():
    docs_tables = _module()
    pages = docs_tables.pages()
    assert len(pages) >= 5
    stale = [p.name for p in pages if docs_tables.render_page(p.read_text()) != p.read_text()]
    assert stale == [], f"run python benchmarks/docs_tables.py: {stale}"


def test_every_renderer_is_used_once():
    docs_tables = _module()
    used = [m["name"] for p in docs_tables.pages() for m in docs_tables.MARKER.finditer(p.read_text())]
    assert sorted(used) == sorted(docs_tables.RENDERERS)
