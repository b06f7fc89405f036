"""The documentation site builds with ``mkdocs build --strict`` (a broken link fails it), every page is in the nav,
the API reference covers ``diffusers_omni.__all__``, and no relative link, repository link or anchor is broken."""

import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import diffusers_omni

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
LINK = re.compile(r"\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*$", re.M)
# The repository's address: pyproject's [project.urls], mkdocs.yml's repo_url and the docs' links to files outside
# docs/ (benchmarks/results/) all use it.
REPO = "https://github.com/diffusers-omni/diffusers-omni"
REPO_FILE = re.compile(r"^(?:" + re.escape(REPO) + r"/(?:blob|tree)/main|"
                       r"https://raw\.githubusercontent\.com/diffusers-omni/diffusers-omni/main)(?:/(?P<path>[^#?]*))?")
API_ENTRY = re.compile(r"^:::\s+(diffusers_omni(?:\.\w+)+)\s*$", re.M)


def _pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _slug(heading: str) -> str:
    # Python-Markdown's toc slugify (mkdocs) and GitHub agree on these headings: lower case, punctuation dropped.
    text = re.sub(r"`", "", heading).lower()
    text = re.sub(r"[^\w\- ]", "", text).strip()
    return re.sub(r"[\s]+", "-", text)


def broken_links(pages: list[Path], root: Path = ROOT, docs: Path = DOCS) -> list[str]:
    """Relative links whose file or heading is missing, links from ``docs`` to files outside it (the site does not
    serve them: link them by their repository URL), and repository URLs naming a path ``root`` does not have."""
    problems = []
    fenced = re.compile(r"```.*?```", re.S)
    for page in pages:
        text = fenced.sub("", page.read_text())
        for match in LINK.finditer(text):
            target = match.group(1)
            where = f"{page.name}: {target}"
            repo_file = REPO_FILE.match(target)
            if repo_file:
                if not (root / (repo_file["path"] or "")).exists():
                    problems.append(f"{where} (no such path in the repository)")
                continue
            if target.startswith(("http://", "https://", "mailto:")):
                continue
            path, _, anchor = target.partition("#")
            # normpath, not resolve: docs/notebooks/*.ipynb are symlinks the site serves as pages of docs/.
            resolved = Path(os.path.normpath(page.parent / path)) if path else page
            if page.is_relative_to(docs) and not resolved.is_relative_to(docs):
                problems.append(f"{where} (outside docs/: the site does not serve it; link {REPO}/blob/main/...)")
            elif not resolved.exists():
                problems.append(f"{where} (no such file)")
            elif anchor and resolved.suffix == ".md":
                slugs = {_slug(h) for h in HEADING.findall(fenced.sub("", resolved.read_text()))}
                if anchor not in slugs:
                    problems.append(f"{where} (no heading #{anchor})")
    return problems


def test_every_relative_link_and_anchor_resolves():
    problems = broken_links(_pages())
    assert not problems, "\n".join(problems)


def test_the_link_check_finds_broken_links(tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    (tmp_path / "results.md").write_text("# Results\n")
    (docs / "b.md").write_text("# Real heading\n")
    page = docs / "a.md"
    page.write_text("[ok](b.md#real-heading) [gone](missing.md) [anchor](b.md#nope) [web](https://x.org/y)\n"
                    f"[repo ok]({REPO}/blob/main/results.md) [repo gone]({REPO}/blob/main/nope.md)\n"
                    "[out](../results.md)\n"
                    "```\n[in code](ignored.md)\n```\n")
    problems = [p.split(": ", 1)[1] for p in broken_links([page], root=tmp_path, docs=docs)]
    assert problems == ["missing.md (no such file)", "b.md#nope (no heading #nope)",
                        f"{REPO}/blob/main/nope.md (no such path in the repository)",
                        f"../results.md (outside docs/: the site does not serve it; link {REPO}/blob/main/...)"]


def _mkdocs_config() -> dict:
    class Loader(yaml.SafeLoader):
        pass

    Loader.add_constructor("!ENV", lambda loader, node: None)
    return yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=Loader)


def _nav_pages(nav) -> list[str]:
    if isinstance(nav, str):
        return [nav]
    if isinstance(nav, dict):
        return [page for value in nav.values() for page in _nav_pages(value)]
    return [page for item in nav for page in _nav_pages(item)]


def test_every_docs_page_is_in_the_nav():
    pages = {str(p.relative_to(DOCS)) for p in DOCS.rglob("*") if p.suffix in (".md", ".ipynb")}
    nav = _nav_pages(_mkdocs_config()["nav"])
    assert sorted(pages - set(nav)) == [], "add these pages to the nav in mkdocs.yml"
    assert sorted(set(nav) - pages) == [], "the nav names pages that do not exist"


def test_strict_build_fails_on_broken_links_and_pages_outside_the_nav():
    config = _mkdocs_config()
    assert config["strict"] is True
    assert config["validation"]["links"]["not_found"] == "warn"
    assert config["validation"]["links"]["anchors"] == "warn"
    assert config["validation"]["nav"]["omitted_files"] == "warn"
    assert config["repo_url"] == REPO


def documented_api(pages: list[Path]) -> dict[str, str]:
    """Exported name → the ``::: path`` that documents it, for every mkdocstrings entry on ``pages``."""
    return {entry.rsplit(".", 1)[1]: entry for page in pages for entry in API_ENTRY.findall(page.read_text())}


def test_api_reference_covers_every_exported_name():
    documented = documented_api(sorted((DOCS / "api").glob("*.md")))
    missing = [name for name in diffusers_omni.__all__ if name not in documented]
    assert not missing, f"add '::: <module>.<name>' entries to a page under docs/api/ for: {', '.join(missing)}"
    for name in diffusers_omni.__all__:
        module, _, attribute = documented[name].rpartition(".")
        # The documented path is the object the package root exports, not a namesake.
        assert getattr(importlib.import_module(module), attribute) is getattr(diffusers_omni, name), documented[name]


def test_api_coverage_check_sees_a_missing_name(tmp_path):
    page = tmp_path / "api.md"
    page.write_text("# API\n\n::: diffusers_omni.pipelines.registry.omnify\n\n`::: not.an.entry`\n")
    assert documented_api([page]) == {"omnify": "diffusers_omni.pipelines.registry.omnify"}


def test_site_builds_strict(tmp_path):
    pytest.importorskip("mkdocs", reason="the docs extra is part of the test extra")
    env = dict(os.environ, DOCS_EXECUTE_NOTEBOOKS="false", NO_MKDOCS_2_WARNING="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(tmp_path / "site")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    api = (tmp_path / "site" / "api" / "pipelines" / "index.html").read_text()
    assert "omnify" in api and "Return the Omni version of a Diffusers pipeline" in api
    assert "OmniWanImageToVideoPipeline" in api
    assert "DIFFUSERS_ATTN_BACKEND" in (tmp_path / "site" / "environment" / "index.html").read_text()
    assert (tmp_path / "site" / "notebooks" / "offload" / "index.html").exists()
