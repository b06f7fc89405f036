"""The package page and the notebooks' links: PyPI's long description (PYPI.md, rendered from the README) has only
absolute links and images and the released wheel's install line; the notebooks' Markdown links work where the site
serves them (mkdocs-jupyter copies a notebook's links as written, relative to its page's URL) and on GitHub; build
output stays out of git."""

from __future__ import annotations

import json
import posixpath
import re
from pathlib import Path

import pytest

from benchmarks import docs_tables

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
REPO = "https://github.com/diffusers-omni/diffusers-omni"
REPO_FILE = re.compile(r"^(?:" + re.escape(REPO) + r"/(?:blob|tree)/main|"
                       r"https://raw\.githubusercontent\.com/diffusers-omni/diffusers-omni/main)(?:/(?P<path>[^#?]*))?")
MD_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^)\s]+)\)")
HTML_LINK = re.compile(r"""(?:src|href)\s*=\s*["']([^"']+)["']""")
FENCED = re.compile(r"```.*?```|`[^`\n]*`", re.S)


def _pyproject() -> dict:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def links(markdown: str) -> list[str]:
    """Every link and image target of ``markdown`` outside code, Markdown and HTML."""
    text = FENCED.sub("", markdown)
    return MD_LINK.findall(text) + HTML_LINK.findall(text)


def relative_links(markdown: str) -> list[str]:
    return [t for t in links(markdown) if not re.match(r"^[a-z][a-z0-9+.-]*:", t)]


def test_the_long_description_is_pypi_md_as_rendered_from_the_readme():
    readme = _pyproject()["project"]["readme"]
    assert readme == {"file": "PYPI.md", "content-type": "text/markdown"}
    assert (ROOT / "PYPI.md").read_text() == docs_tables.pypi_description((ROOT / "README.md").read_text()), (
        "run python -m benchmarks.docs_tables")


def test_the_long_description_has_no_relative_link_or_image_and_installs_the_released_wheel():
    text = (ROOT / "PYPI.md").read_text()
    assert relative_links(text) == []
    assert "pip install -e" not in text and "-e ." not in text and '-e "' not in text
    assert "pip install diffusers-omni" in text and 'pip install "diffusers-omni[flash]"' in text
    assert "<!--" not in text  # the README's markers and the results blocks' comments are gone
    # Every repository URL it has names a path the repository has (an image that would not load, a moved page).
    for target in links(text):
        match = REPO_FILE.match(target)
        if match:
            assert (ROOT / (match["path"] or "")).exists(), target
    # The images are the README's, at their raw URLs.
    images = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", text)
    assert len(images) >= 2 and all(i.startswith("https://raw.githubusercontent.com/") for i in images)


def test_the_readme_itself_still_installs_from_the_checkout():
    # GitHub readers have a clone: the README keeps pip install -e (the package page says the wheel instead).
    readme = (ROOT / "README.md").read_text()
    assert "pip install -e ." in readme


def test_the_rendering_makes_links_absolute_and_honours_the_markers(tmp_path):
    (tmp_path / "docs").mkdir()
    page = ("# T\n\n[a](docs/x.md#h) [b](#sec) [c](docs/) ![i](benchmarks/p.png) [w](https://x.org/y)\n"
            "<!-- results: t -->\n| x |\n<!-- /results -->\n"
            "<!-- pypi: omit -->\npip install -e .\n<!-- /pypi -->\n<!-- pypi: only\npip install diffusers-omni\n-->\n"
            "```bash\n[kept](in/code.md)\n```\n")
    out = docs_tables.pypi_description(page)
    assert f"[a]({REPO}/blob/main/docs/x.md#h)" in out and f"[b]({REPO}#sec)" in out
    assert f"[c]({REPO}/tree/main/docs)" in out
    assert "![i](https://raw.githubusercontent.com/diffusers-omni/diffusers-omni/main/benchmarks/p.png)" in out
    assert "[w](https://x.org/y)" in out and "[kept](in/code.md)" in out
    assert "pip install -e" not in out and "pip install diffusers-omni" in out and "<!--" not in out


def test_gitignore_keeps_the_built_site_out():
    lines = (ROOT / ".gitignore").read_text().splitlines()
    assert "/site/" in lines  # mkdocs build's default output folder


# Notebooks ---------------------------------------------------------------------------------------------------------

def _site_target_exists(url: str) -> bool:
    """Whether the built site serves ``url`` (a path relative to the site root): a page (``x/`` from ``x.md``,
    ``x/index.md``, ``x.ipynb``) or a file mkdocs copies (anything under docs/ but Markdown)."""
    url = url.split("#", 1)[0].split("?", 1)[0]
    if url.endswith("/") or url == "":
        stem = url.rstrip("/")
        candidates = [f"{stem}.md", f"{stem}.ipynb", f"{stem}/index.md", "index.md" if not stem else ""]
        return any(c and (DOCS / c).exists() for c in candidates)
    return not url.endswith(".md") and (DOCS / url).is_file()


def notebook_link_problems(notebook: Path, site_path: str, repo_dir: Path) -> list[str]:
    """Links of ``notebook``'s Markdown cells that break on the site (where the notebook is the page
    ``site_path``, e.g. ``notebooks/offload/``, and mkdocs-jupyter leaves its links as written) or on GitHub (where
    it sits in ``repo_dir``)."""
    problems = []
    cells = json.loads(notebook.read_text())["cells"]
    for index, cell in enumerate(cells):
        if cell["cell_type"] != "markdown":
            continue
        for target in links("".join(cell["source"])):
            where = f"{notebook.name} cell {index}: {target}"
            repo_file = REPO_FILE.match(target)
            if repo_file:
                if not (ROOT / (repo_file["path"] or "")).exists():
                    problems.append(f"{where} (no such path in the repository)")
                continue
            if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
                continue
            on_site = posixpath.normpath(posixpath.join(site_path, target.split("#", 1)[0]))
            on_site += "/" if target.split("#", 1)[0].endswith("/") else ""
            if on_site.startswith("..") or not _site_target_exists(on_site.removeprefix("./")):
                problems.append(f"{where} (the site page {site_path} links to {on_site}, which it does not serve)")
            elif not (repo_dir / target.split("#", 1)[0]).exists():
                problems.append(f"{where} (broken on GitHub, from {repo_dir.relative_to(ROOT)}/)")
    return problems


def _site_notebooks() -> list[tuple[Path, str]]:
    return [(path, f"{path.relative_to(DOCS).with_suffix('').as_posix()}/") for path in sorted(DOCS.rglob("*.ipynb"))]


def test_notebook_markdown_links_work_on_the_site_and_on_github():
    notebooks = _site_notebooks()
    assert {p.name for p, _ in notebooks} >= {"offload.ipynb", "quickstart.ipynb", "alignment.ipynb"}
    problems = [p for path, site in notebooks
                for p in notebook_link_problems(path, site, path.resolve().parent)]
    assert problems == [], "\n".join(problems)


def test_the_notebook_link_check_finds_a_link_the_site_does_not_serve(tmp_path):
    notebook = tmp_path / "n.ipynb"
    cells = [{"cell_type": "markdown", "source": ["[guide](../user_guide/offload.md) [ok](", REPO,
                                                  "/blob/main/docs/user_guide/offload.md) [gone](", REPO,
                                                  "/blob/main/nope.md)"]},
             {"cell_type": "code", "source": ["# [not a link](x.md)"]}]
    notebook.write_text(json.dumps({"cells": cells}))
    problems = notebook_link_problems(notebook, "notebooks/offload/", ROOT / "notebooks")
    assert len(problems) == 2, problems
    assert "links to notebooks/user_guide/offload.md, which it does not serve" in problems[0]
    assert "nope.md (no such path in the repository)" in problems[1]
