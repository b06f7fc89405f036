"""The test tiers of tests/conftest.py: the markers pyproject.toml declares, a tier for every test file, the reading
of ``-m``; and, in a scratch project run by a fresh pytest, collection failing on a test without a tier, a marker
taking precedence over the rules, ``-m`` leaving files of other tiers unimported, and xdist workers that run tests
without starting workers of their own."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent


@pytest.fixture
def tiers(request):
    """tests/conftest.py, as pytest loaded it."""
    return request.config.pluginmanager.get_plugin(str(TESTS / "conftest.py"))


def _pytest_section() -> str:
    text = (ROOT / "pyproject.toml").read_text()
    return text[text.index("[tool.pytest.ini_options]"):]


def test_the_tiers_are_the_markers_pyproject_declares(tiers):
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    markers = tomllib.loads(_pytest_section())["tool"]["pytest"]["ini_options"]["markers"]
    names = [re.match(r"\w+", marker).group() for marker in markers]
    assert set(tiers.TIERS) <= set(names) and {"slow", "xdist_group"} <= set(names)
    assert {tier for _, tier in tiers.TIER_RULES} == set(tiers.TIERS)


def test_every_test_file_has_a_tier(tiers):
    files = sorted(p.relative_to(TESTS).as_posix() for p in TESTS.rglob("test_*.py"))
    assert files and [f for f in files if tiers.file_tiers(f) is None] == []
    assert tiers.file_tiers("docs/test_site.py") == {"docs"}
    assert tiers.file_tiers("benchmarks/test_anything.py") == {"bench"}
    assert tiers.file_tiers("offload/test_distributed.py") == {"integration"}
    assert tiers.file_tiers("offload/test_layerwise.py") == {"unit", "integration"}  # test names can make integration
    assert tiers.file_tiers("a_new_folder/test_x.py") is None and tiers.file_tiers("test_new.py") is None


@pytest.mark.parametrize(("markexpr", "selectable"), [
    ("unit", {"unit"}),
    ("not unit", {"integration", "docs", "bench"}),
    ("unit and not slow", {"unit"}),
    ("not (integration or bench)", {"unit", "docs"}),
    ("docs or bench", {"docs", "bench"}),
    ("slow", {"unit", "integration", "docs", "bench"}),  # any test may be slow
    ("unit or slow", {"unit", "integration", "docs", "bench"}),
    ("unknown(arg=1)", {"unit", "integration", "docs", "bench"}),  # beyond and/or/not: assume anything
])
def test_markexpr_reading(tiers, markexpr, selectable):
    assert {tier for tier in tiers.TIERS if tiers.markexpr_can_select(markexpr, tier)} == selectable


def _run(project: Path, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    """pytest in ``project`` in a session of its own, killed whole (workers included) if it overruns."""
    env = {**os.environ, "PYTEST_XDIST_AUTO_NUM_WORKERS": "2", "OUTER_PYTEST": ""}
    env.pop("PYTEST_CURRENT_TEST", None)  # as if started from a shell, not by a test
    env.pop("PYTEST_XDIST_WORKER", None)
    proc = subprocess.Popen([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args], cwd=project, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"pytest {' '.join(args)} overran {timeout} s:\n{out[-3000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out)


def test_tiers_and_workers_in_a_scratch_project_run_by_a_fresh_process(tmp_path):
    (tmp_path / "pyproject.toml").write_text(_pytest_section())
    tests = tmp_path / "tests"
    (tests / "offload").mkdir(parents=True)
    (tests / "benchmarks").mkdir()
    shutil.copy2(TESTS / "conftest.py", tests / "conftest.py")
    # Each unit test checks that it runs in a worker that the outer pytest started itself.
    (tests / "offload" / "test_unit.py").write_text(
        "import os\n\nimport pytest\n\n\n"
        "@pytest.mark.parametrize('n', range(4))\n"
        "def test_in_a_worker_of_the_outer_pytest(n):\n"
        "    assert os.environ.get('PYTEST_XDIST_WORKER', 'gw0').startswith('gw')\n"
        "    assert os.environ['OUTER_PYTEST'] == str(os.getppid()) or 'PYTEST_XDIST_WORKER' not in os.environ\n\n\n"
        "@pytest.mark.bench\n"
        "def test_marked_bench():\n    pass\n")
    (tests / "benchmarks" / "test_bench.py").write_text("raise RuntimeError('imported')\n")
    (tests / "test_new.py").write_text("def test_without_a_rule():\n    pass\n")

    untiered = _run(tmp_path, "-n", "0")
    assert untiered.returncode != 0, untiered.stdout[-3000:]
    assert "ERROR collecting tests/test_new.py" in untiered.stdout
    assert "tests/test_new.py::test_without_a_rule: no rule of TIER_RULES matches 'test_new.py::test_without_a_rule'" \
        in untiered.stdout

    (tests / "test_new.py").unlink()
    # -m unit does not import tests/benchmarks (its module raises on import); the test marked bench is left out.
    unit = _run(tmp_path, "-m", "unit", "-p", "no:xdist")
    assert unit.returncode == 0 and "4 passed, 1 deselected" in unit.stdout, unit.stdout[-3000:]

    # The default: workers (one here: were a worker to start workers of its own, they would form a chain, not a
    # tree, until the deadline) started by the outer pytest and by nothing else.
    (tests / "benchmarks" / "test_bench.py").unlink()
    script = ("import os, sys, pytest; os.environ['OUTER_PYTEST'] = str(os.getpid()); "
              "sys.exit(pytest.main(['-p', 'no:cacheprovider', '-m', 'unit']))")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTEST_CURRENT_TEST", "PYTEST_XDIST_WORKER")}
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=tmp_path, env={**env, "PYTEST_XDIST_AUTO_NUM_WORKERS": "1"},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=90)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail("the default run overran 90 s")
    assert proc.returncode == 0, out[-3000:]
    assert "created: 1/1 worker" in out and "1 worker [4 items]" in out and "4 passed in" in out, out[-3000:]
