"""The package builds (sdist, then the wheel from it) and passes ``twine check``; one version everywhere; the licence,
project URLs and changelog are there; build caches stay out of git."""

from __future__ import annotations

import email
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

import diffusers_omni
from diffusers_omni.cli.main import main

ROOT = Path(__file__).resolve().parents[1]
REPO = "https://github.com/diffusers-omni/diffusers-omni"


def _pyproject() -> dict:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


@pytest.fixture(scope="module")
def dists(tmp_path_factory) -> dict[str, Path]:
    """sdist and wheel built by ``python -m build`` from a copy of the sources (the checkout is left untouched)."""
    pytest.importorskip("build", reason="`build` is part of the test extra")
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md", "PYPI.md", "LICENSE"):
        shutil.copy2(ROOT / name, src / name)
    shutil.copytree(ROOT / "diffusers_omni", src / "diffusers_omni",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info"))
    out = tmp_path_factory.mktemp("dist")
    # Default mode: the sdist first, then the wheel built from the unpacked sdist (so the sdist is complete).
    proc = subprocess.run([sys.executable, "-m", "build", "--outdir", str(out), str(src)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (wheel,) = out.glob("*.whl")
    (sdist,) = out.glob("*.tar.gz")
    return {"wheel": wheel, "sdist": sdist}


def test_twine_check_passes(dists):
    pytest.importorskip("twine", reason="`twine` is part of the test extra")
    proc = subprocess.run([sys.executable, "-m", "twine", "check", "--strict", str(dists["sdist"]), str(dists["wheel"])],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("PASSED") == 2, proc.stdout


def test_wheel_ships_data_files_licence_and_metadata(dists):
    with zipfile.ZipFile(dists["wheel"]) as wheel:
        names = set(wheel.namelist())
        (metadata_name,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        metadata = email.message_from_bytes(wheel.read(metadata_name))
        (licence_name,) = [n for n in names if n.endswith(".dist-info/licenses/LICENSE")]
        licence = wheel.read(licence_name).decode()
    assert {"diffusers_omni/attention/routing_table.json", "diffusers_omni/py.typed"} <= names
    assert licence == (ROOT / "LICENSE").read_text()
    assert metadata["Version"] == _pyproject()["project"]["version"]
    assert metadata["License-Expression"] == "Apache-2.0"
    urls = dict(value.split(", ", 1) for value in metadata.get_all("Project-URL"))
    assert set(urls) == {"Homepage", "Documentation", "Repository", "Issues", "Changelog"}
    assert all(url.startswith(REPO) for url in urls.values()), urls
    # The package page is PYPI.md as committed: absolute links, the released wheel's install line
    # (tests/docs/test_package_page.py checks the file).
    assert metadata["Description-Content-Type"].startswith("text/markdown")
    description = metadata.get_payload(decode=True).decode("utf-8")
    assert description.strip() == (ROOT / "PYPI.md").read_text().strip()
    assert "pip install -e" not in description and "](docs/" not in description


def test_sdist_ships_the_licence(dists):
    with tarfile.open(dists["sdist"]) as sdist:
        names = {name.split("/", 1)[1] for name in sdist.getnames() if "/" in name}
    assert {"LICENSE", "README.md", "pyproject.toml", "diffusers_omni/attention/routing_table.json"} <= names


def test_licence_is_the_apache_2_text_pyproject_names():
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text
    project = _pyproject()["project"]
    assert project["license"] == "Apache-2.0" and project["license-files"] == ["LICENSE"]


def test_one_version_everywhere(capsys):
    version = _pyproject()["project"]["version"]
    assert diffusers_omni.__version__ == version
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"diffusers-omni {version}"
    # Written once: no module of the package spells the version out.
    spelled = [str(p.relative_to(ROOT)) for p in (ROOT / "diffusers_omni").rglob("*.py")
               if re.search(r"""__version__\s*=\s*["']|["']""" + re.escape(version) + r"""["']""", p.read_text())]
    assert spelled == [], "the version is written only in pyproject.toml"


def test_changelog_has_the_current_version():
    changelog = (ROOT / "CHANGELOG.md").read_text()
    version = _pyproject()["project"]["version"]
    assert changelog.startswith("# Changelog")
    assert re.search(rf"^## \[{re.escape(version)}\] - (Unreleased|\d{{4}}-\d{{2}}-\d{{2}})$", changelog, re.M)


def test_build_caches_are_not_committed():
    if not (ROOT / ".git").exists() or shutil.which("git") is None:
        pytest.skip("not a git checkout")
    tracked = subprocess.run(["git", "ls-files", ".cache"], cwd=ROOT, capture_output=True, text=True, check=True)
    assert tracked.stdout == ""
    ignored = subprocess.run(["git", "check-ignore", "-q", ".cache/mkdocs-jupyter/page.json"], cwd=ROOT)
    assert ignored.returncode == 0, ".cache/ is not in .gitignore"
