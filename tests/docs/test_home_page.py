"""The docs site's home page as a browser shows it: its nested lists nest (Python-Markdown needs four spaces per
level, GitHub takes two), and, like the README's first screen, it has the one-line example and a measured picture
the site serves itself, drawn from the committed results."""

from __future__ import annotations

import re
from pathlib import Path
from xml.etree import ElementTree

import pytest

from benchmarks import docs_tables

ROOT = Path(__file__).resolve().parents[2]
INDEX = ROOT / "docs" / "index.md"


def _html(text: str) -> ElementTree.Element:
    """``text`` rendered as mkdocs renders it (its markdown_extensions from mkdocs.yml), parsed."""
    markdown = pytest.importorskip("markdown")
    html = markdown.markdown(text, extensions=["tables", "admonition", "pymdownx.superfences", "toc"])
    return ElementTree.fromstring(f"<body>{html}</body>")


def _nested_lists(body: ElementTree.Element) -> list[ElementTree.Element]:
    return [ul for li in body.iter("li") for ul in li if ul.tag in ("ul", "ol")]


def test_the_home_pages_nested_lists_nest_when_rendered():
    body = _html(INDEX.read_text())
    nested = _nested_lists(body)
    # User guides and Design have their pages under them.
    assert len(nested) >= 2
    items = {"".join(li.itertext()).split("\n", 1)[0].strip(): li for li in body.find("ul")}
    for parent, child in (("User guides", "Attention backends"), ("Design", "Layers")):
        [sub] = [ul for ul in items[parent] if ul.tag == "ul"]
        assert any(child in "".join(li.itertext()) for li in sub), parent
    # Every indented list line is indented by a multiple of four spaces (two would render flat).
    for line in INDEX.read_text().splitlines():
        match = re.match(r"^( +)[-*] ", line)
        if match:
            assert len(match[1]) % 4 == 0, line


def test_two_space_nesting_renders_flat_so_the_check_sees_it():
    assert _nested_lists(_html("- a\n  - b\n")) == []
    assert len(_nested_lists(_html("- a\n    - b\n"))) == 1


def test_the_home_page_has_the_one_line_example_and_a_measured_picture():
    text = INDEX.read_text()
    readme = (ROOT / "README.md").read_text()
    example = re.search(r"```python\n(.*?)```", readme, re.S)[1]
    assert "omnify(" in example and example in text  # the README's first example, as it is there
    body = _html(text)
    [image] = list(body.iter("img"))
    source = image.get("src")
    path = INDEX.parent / source
    assert path.is_file(), source  # served by the site (a file under docs/), not a link out of it
    # The picture is the README's offload plot, drawn from the same committed results.
    assert docs_tables.plot_is_current(path.name, path.parent)
    assert path.name in docs_tables.SITE_PLOTS and docs_tables.SITE_PLOTS[path.name] == path.parent
