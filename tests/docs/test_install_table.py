"""docs/install.md and pyproject.toml's extras stay in step: every GPU extra has a row in the GPU-extras table that
names exactly the packages it installs, every row is an extra, every extra has its install command, and the
"what `auto` picks" table follows the shipped platform routes."""

import re
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from diffusers_omni.attention.platform import Platform
from diffusers_omni.attention.routing import platform_routes

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[2]
INSTALL = ROOT / "docs" / "install.md"
# Extras that are not GPU kernels: install.md lists their commands, not a row in the GPU table.
NOT_GPU = {"video", "docs", "test"}
EXTRA = re.compile(r"`\[([a-z0-9_-]+)\]`")
CODE = re.compile(r"`([^`]+)`")


def pyproject_extras() -> dict[str, list[str]]:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]["optional-dependencies"]


def table_under(text: str, heading: str) -> list[dict[str, str]]:
    """The rows (header → cell) of the first Markdown table after ``## heading``."""
    section = text.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]
    lines = [line for line in section.splitlines() if line.startswith("|")]
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    return [dict(zip(header, (cell.strip() for cell in line.strip("|").split("|")))) for line in lines[2:]]


def documented_extras(rows: list[dict[str, str]]) -> dict[str, set[str]]:
    """Extra name → the package names its row lists; rows without an extra (FlashAttention-2) are skipped."""
    documented = {}
    for row in rows:
        names = EXTRA.findall(row["Extra"])
        assert len(names) <= 1, f"one extra per row: {row['Extra']}"
        if names:
            documented[names[0]] = {canonicalize_name(name) for name in CODE.findall(row["Packages"])}
    return documented


def mismatches(extras: dict[str, list[str]], documented: dict[str, set[str]]) -> list[str]:
    gpu = {name: reqs for name, reqs in extras.items() if name not in NOT_GPU}
    problems = [f"[{name}] is an extra in pyproject.toml but has no row in docs/install.md's GPU table"
                for name in sorted(gpu.keys() - documented.keys())]
    problems += [f"[{name}] has a row in docs/install.md's GPU table but is no extra in pyproject.toml"
                 for name in sorted(documented.keys() - gpu.keys())]
    for name in sorted(gpu.keys() & documented.keys()):
        packages = {canonicalize_name(Requirement(req).name) for req in gpu[name]}
        if packages != documented[name]:
            problems.append(f"[{name}]: pyproject installs {sorted(packages)}, the table lists "
                            f"{sorted(documented[name])}")
    return problems


def test_every_gpu_extra_has_a_row_naming_its_packages_and_every_row_is_an_extra():
    rows = table_under(INSTALL.read_text(), "GPU extras")
    problems = mismatches(pyproject_extras(), documented_extras(rows))
    assert not problems, "\n".join(problems)


def test_the_non_gpu_exemptions_are_real_extras():
    # An exemption naming no extra would hide nothing today but could hide a new extra of that name tomorrow.
    assert NOT_GPU <= pyproject_extras().keys()


def test_the_check_catches_an_undocumented_extra_and_a_stale_row():
    extras = pyproject_extras()
    documented = documented_extras(table_under(INSTALL.read_text(), "GPU extras"))
    added = {**extras, "newkernel": ["newkernel-python>=1"]}
    assert mismatches(added, documented) == [
        "[newkernel] is an extra in pyproject.toml but has no row in docs/install.md's GPU table"]
    removed = {name: reqs for name, reqs in extras.items() if name != "sage"}
    assert mismatches(removed, documented) == [
        "[sage] has a row in docs/install.md's GPU table but is no extra in pyproject.toml"]
    changed = {**extras, "hub": ["kernels>=0.14", "huggingface-hub"]}
    assert mismatches(changed, documented) == [
        "[hub]: pyproject installs ['huggingface-hub', 'kernels'], the table lists ['kernels']"]


def test_every_extra_has_its_install_command():
    text = INSTALL.read_text()
    missing = [name for name in pyproject_extras() if f'pip install -e ".[{name}]"' not in text]
    assert not missing, f"docs/install.md has no install command for {missing}"


def test_flash_attention_2_is_not_offered_as_an_extra():
    # flash-attn is an sdist whose setup.py imports torch: under pip's build isolation it cannot build.
    for name, requirements in pyproject_extras().items():
        assert all(canonicalize_name(Requirement(req).name) != "flash-attn" for req in requirements), name
    assert ".[flash2]" not in INSTALL.read_text()


def test_the_auto_table_follows_the_shipped_platform_routes():
    rows = table_under(INSTALL.read_text(), "What `auto` picks on each GPU")
    assert rows
    for row in rows:
        sms = re.findall(r"sm_(\d+)", row["GPU"])
        assert sms, row["GPU"]
        documented = CODE.findall(row["`auto` tries, in order"])
        for sm in sms:
            platform = Platform(device_type="cuda", compute_capability=(int(sm[:-1]), int(sm[-1])))
            shipped = list(dict.fromkeys(route.backend for route in platform_routes(platform)))
            assert documented == shipped, f"{row['GPU']} (sm_{sm}, {platform.family}): docs {documented}, routes {shipped}"
