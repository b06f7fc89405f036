"""The documentation site builds with ``mkdocs build --strict``, and no relative link or anchor is broken."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LINK = re.compile(r"\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*$", re.M)


def _pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _slug(heading: str) -> str:
    # Python-Markdown's toc slugify (mkdocs) and GitHub agree on these headings: lower case, punctuation dropped.
    text = re.sub(r"`", "", heading).lower()
    text = re.sub(r"[^\w\- ]", "", text).strip()
    return re.sub(r"[\s]+", "-", text)


def broken_links(pages: list[Path]) -> list[str]:
    problems = []
    fenced = re.compile(r"```.*?```", re.S)
    for page in pages:
        text = fenced.sub("", page.read_text())
        for match in LINK.finditer(text):
            target = match.group(1)
            if target.startswith(("http://", "https://", "mailto:")):
                continue
            path, _, anchor = target.partition("#")
            resolved = (page.parent / path).resolve() if path else page
            where = f"{page.name}: {target}"
            if not resolved.exists():
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
    (tmp_path / "b.md").write_text("# Real heading\n")
    page = tmp_path / "a.md"
    page.write_text("[ok](b.md#real-heading) [gone](missing.md) [anchor](b.md#nope) [web](https://x.org/y)\n"
                    "```\n[in code](ignored.md)\n```\n")
    assert [p.split(": ", 1)[1] for p in broken_links([page])] == ["missing.md (no such file)",
                                                                  "b.md#nope (no heading #nope)"]


def test_site_builds_strict(tmp_path):
    pytest.importorskip("mkdocs", reason="the docs extra is part of the test extra")
    env = dict(os.environ, DOCS_EXECUTE_NOTEBOOKS="false", NO_MKDOCS_2_WARNING="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(tmp_path / "site")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    api = (tmp_path / "site" / "api" / "index.html").read_text()
    assert "omnify" in api and "Return the Omni version of a Diffusers pipeline" in api
    assert (tmp_path / "site" / "notebooks" / "offload" / "index.html").exists()
