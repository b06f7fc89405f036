"""Fixtures every test gets, and the test tiers.

Tiers: every test belongs to exactly one of the markers ``unit``, ``integration``, ``docs`` and ``bench`` (declared in
pyproject.toml, described in docs/development.md). The tier comes from ``TIER_RULES`` below, unless the test, its
class or its module carries ``@pytest.mark.<tier>`` itself; a test under tests/ that gets no tier fails collection.

Parallel runs: with pytest-xdist installed, ``python -m pytest`` runs on every core (``-n auto --dist loadgroup``,
set by ``pytest_cmdline_main`` below, not in addopts, so that ``-p no:xdist`` still works); ``-n 0`` or ``-p no:xdist``
runs in one process. Tests that must not run beside each other share an ``xdist_group`` (``XDIST_GROUPS``).
"""

from __future__ import annotations

import fnmatch
import os
import re
from pathlib import Path

import pytest
import torch

# Tiny models run faster on one thread, and results must not depend on how many cores a machine has.
torch.set_num_threads(1)

from diffusers_omni.attention.selector import ENV_BACKEND, ENV_DIFFUSERS_BACKEND, clear_resolution_cache
from diffusers_omni.attention.tuning import ENV_CACHE_DIR, forget_tuned_table

TESTS = Path(__file__).resolve().parent

TIERS = ("unit", "integration", "docs", "bench")

# (pattern, tier): the first rule whose pattern matches a test's key gives its tier. The key is the test's path under
# tests/ and its name without parameters, "offload/test_distributed.py::test_generate_cli_under_torchrun" (with the
# class between them for a test in a class); patterns are fnmatch patterns, where "*" also spans "/" and "::".
# Every folder and top-level file of tests/ is named here, so a new one fails collection until it is given a tier.
TIER_RULES: tuple[tuple[str, str], ...] = (
    # docs: the site build and the pages' checks, the notebooks executed, CI running the README's command.
    ("docs/*", "docs"),
    ("notebooks/*", "docs"),
    ("test_readme.py::*", "docs"),
    # bench: the benchmark scripts (smoke runs, their helpers) and the tables rendered from their results.
    ("benchmarks/*", "bench"),
    # integration: a second interpreter (subprocess, pseudo-terminal, torchrun, gloo ranks), torch.compile, Triton
    # (compiled, or interpreted in a child pytest), the package build, whole cycles repeated.
    ("offload/test_distributed*.py::*", "integration"),  # gloo ranks forked from a fork server; torchrun
    ("cli/test_terminal.py::*", "integration"),  # the CLI in a pseudo-terminal
    ("test_packaging.py::*", "integration"),  # python -m build, twine check
    ("*::*compile*", "integration"),  # torch.compile, Triton compilation
    ("*::*interpret*", "integration"),  # Triton's interpreter in a child pytest; an interpreter's exit
    ("*::*torchrun*", "integration"),
    ("*::*fresh_process*", "integration"),
    ("*::test_isolated_probe_*", "integration"),  # availability probes in a child interpreter
    ("*::test_distributed_layerwise_quantized", "integration"),  # gloo ranks
    ("*::test_distributed_allgather_host_bytes_*", "integration"),  # gloo ranks
    ("*::test_ctrl_c_*", "integration"),  # SIGINT to a child CLI
    ("*::test_omnify_imports_only_the_family_in_use", "integration"),  # a fresh interpreter
    ("*::test_without_any_logging_configuration_*", "integration"),  # a fresh interpreter
    ("*::test_delete_and_rebuild_cycles", "integration"),  # ten build/offload/generate/drop cycles
    # unit: the rest, folder by folder and file by file.
    ("alignment/*", "unit"),
    ("architectures/*", "unit"),
    ("attention/*", "unit"),
    ("cli/*", "unit"),
    ("config/*", "unit"),
    ("models/*", "unit"),
    ("offload/*", "unit"),
    ("pipelines/*", "unit"),
    ("testing/*", "unit"),
    ("utils/*", "unit"),
    ("test_import.py::*", "unit"),
    ("test_layers.py::*", "unit"),
    ("test_tiers.py::*", "unit"),
)

# (pattern, group): tests matching a pattern run on one xdist worker, one after the other (--dist loadgroup).
XDIST_GROUPS: tuple[tuple[str, str], ...] = (
    # Process groups on free ports of 127.0.0.1 (torchrun, gloo ranks): one launch at a time, so that two launches
    # neither race for a port nor share two cores among four ranks against their collective timeouts.
    ("offload/test_distributed*.py::*", "torch-distributed"),
    ("benchmarks/test_distributed_offload_bench.py::*", "torch-distributed"),
    ("*::test_distributed_layerwise_quantized", "torch-distributed"),
    ("*::test_distributed_allgather_host_bytes_*", "torch-distributed"),
    # One module-scoped sdist + wheel build for the module, not one per worker.
    ("test_packaging.py::*", "packaging"),
)

# A unit test whose call takes longer than this is named at the end of the run: it belongs in another tier.
UNIT_CALL_BUDGET_S = 5.0


def tier_key(item: pytest.Item) -> str | None:
    """The key ``TIER_RULES`` and ``XDIST_GROUPS`` match: the path under tests/ and the test's name without its
    parameters; None for an item outside tests/."""
    path = Path(item.path).resolve()
    if not path.is_relative_to(TESTS):
        return None
    names = item.nodeid.split("::")[1:]
    names[-1] = getattr(item, "originalname", None) or item.name
    return "::".join([path.relative_to(TESTS).as_posix(), *names])


def _explicit_tier(item: pytest.Item) -> str | None:
    """The tier the test, its class or its module is marked with, if any. Not more than one: ``-m`` selects by every
    marker of the chain, so a module's tier cannot be overridden by a test's."""
    named = sorted({mark.name for mark in item.iter_markers() if mark.name in TIERS})
    if len(named) > 1:
        raise ValueError(f"marked (itself, its class or its module) with more than one tier: {', '.join(named)}")
    return named[0] if named else None


def _first_match(key: str, rules: tuple[tuple[str, str], ...]) -> str | None:
    return next((value for pattern, value in rules if fnmatch.fnmatchcase(key, pattern)), None)


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector: pytest.Collector):
    """Give each test its tier (and its xdist group) as it is collected; a test without exactly one tier makes its
    module's collection fail, in one process or in an xdist worker alike."""
    report = yield
    if report.passed:
        problems = list(dict.fromkeys(  # one line per test function, not per parameter set
            f"{item.nodeid.split('[')[0]}: {problem}" for item in report.result if isinstance(item, pytest.Item)
            for problem in [_assign_tier(item)] if problem))
        if problems:
            report.outcome = "failed"
            report.longrepr = "\n".join([
                f"a test belongs to exactly one tier of {', '.join(TIERS)}:", *problems,
                "Add a rule for the folder or file to TIER_RULES in tests/conftest.py, or mark the test (class, module) "
                "@pytest.mark.<tier> (docs/development.md says which tier is which)."])
    return report


def _assign_tier(item: pytest.Item) -> str | None:
    """Mark ``item`` with its tier and its xdist group, or say why it has no tier. Items outside tests/ are left."""
    key = tier_key(item)
    if key is None:
        return None
    try:
        tier = _explicit_tier(item)
    except ValueError as error:
        return str(error)
    if tier is None:
        tier = _first_match(key, TIER_RULES)
        if tier is None:
            return f"no rule of TIER_RULES matches {key!r} and it has no tier marker"
        item.add_marker(tier)
    group = _first_match(key, XDIST_GROUPS)
    if group is not None and item.get_closest_marker("xdist_group") is None:
        item.add_marker(pytest.mark.xdist_group(group))
    return None


def file_tiers(relpath: str) -> set[str] | None:
    """Every tier ``TIER_RULES`` can give a test of the file at ``relpath`` (under tests/), or None where some of its
    tests may match no rule."""
    tiers = set()
    for pattern, tier in TIER_RULES:
        path_pattern, _, name_pattern = pattern.partition("::")
        if fnmatch.fnmatchcase(relpath, path_pattern):
            tiers.add(tier)
            if name_pattern in ("", "*"):  # the rule takes every test of the file that reaches it
                return tiers
    return None


def markexpr_can_select(markexpr: str, tier: str) -> bool:
    """Whether ``-m markexpr`` can select a test of ``tier``, whatever other markers the test has (True where the
    expression is beyond this plain and/or/not reading)."""
    tokens = re.findall(r"\(|\)|[^\s()]+", markexpr)
    names = sorted({t for t in tokens if t not in ("(", ")", "and", "or", "not") and t not in TIERS})
    if len(names) > 8 or not all(re.fullmatch(r"[A-Za-z_][\w]*", t) for t in names):
        return True
    for values in range(2 ** len(names)):
        truth = {name: bool(values >> i & 1) for i, name in enumerate(names)} | {t: t == tier for t in TIERS}
        try:
            if eval(" ".join(str(truth.get(t, t)) for t in tokens), {"__builtins__": {}}):  # noqa: S307 - True/False/and/or/not
                return True
        except SyntaxError:
            return True
    return False


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """With ``-m``, a test file whose tests can only be of tiers that ``-m`` leaves out is not even imported (so
    ``-m unit`` does not start the fork server tests/offload/test_distributed.py starts on import). A file that names a
    tier marker itself is always collected."""
    markexpr = config.option.markexpr
    path = collection_path.resolve()
    if not markexpr or path.suffix != ".py" or not path.name.startswith("test_") or not path.is_relative_to(TESTS):
        return None
    tiers = file_tiers(path.relative_to(TESTS).as_posix())
    if tiers is None or re.search(r"mark\.(" + "|".join(TIERS) + r")\b", path.read_text()):
        return None
    return True if not any(markexpr_can_select(markexpr, tier) for tier in tiers) else None


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # `slow` tests (long fuzz runs) run only when -m names them (-m slow, -m "unit or slow"): -m unit leaves them out.
    if not re.search(r"\bslow\b", config.option.markexpr or ""):
        slow = [item for item in items if item.get_closest_marker("slow") is not None]
        if slow:
            config.hook.pytest_deselected(items=slow)
            items[:] = [item for item in items if item.get_closest_marker("slow") is None]


@pytest.hookimpl(tryfirst=True)  # before xdist reads -n
def pytest_cmdline_main(config: pytest.Config) -> None:
    """``-n auto --dist loadgroup`` unless the command line says otherwise (``-n 0``, ``-n 4``, ``--dist load``), or
    pytest-xdist is missing or blocked (``-p no:xdist``), or the run is ``--collect-only`` or ``--pdb``, or this pytest
    was started by a test (the Triton-interpreter run in tests/attention/test_fp8.py): that one stays in one process."""
    if not config.pluginmanager.hasplugin("xdist") or hasattr(config, "workerinput") or "PYTEST_XDIST_WORKER" in os.environ:
        return  # a worker runs what the controller sends it
    option = config.option
    if option.numprocesses is None and not (option.collectonly or option.usepdb or "PYTEST_CURRENT_TEST" in os.environ):
        option.numprocesses = "auto"
    if option.numprocesses not in (None, 0) and option.dist == "no":
        option.dist = "loadgroup"


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    slow = sorted((report.duration, report.nodeid) for report in terminalreporter.stats.get("passed", [])
                  if report.when == "call" and "unit" in report.keywords and report.duration > UNIT_CALL_BUDGET_S)
    if slow:
        terminalreporter.section(f"unit tests slower than {UNIT_CALL_BUDGET_S:g} s", sep="-", yellow=True)
        for duration, nodeid in reversed(slow):
            terminalreporter.write_line(f"{duration:6.1f}s {nodeid}")
        terminalreporter.write_line("(on a loaded machine any test can be; one that stays slow belongs in another tier: "
                                    "TIER_RULES in tests/conftest.py)")


@pytest.fixture(autouse=True)
def _isolated_tuned_tables(monkeypatch, tmp_path_factory):
    """Tuned routing tables of the machine running the tests never decide a test's routing: each test sees an empty
    cache directory of its own."""
    monkeypatch.setenv(ENV_CACHE_DIR, str(tmp_path_factory.mktemp("omni-cache")))
    forget_tuned_table()
    yield
    forget_tuned_table()


@pytest.fixture(autouse=True)
def _isolated_resolution(monkeypatch):
    """Each test starts without the backend environment variables and with an empty resolution cache."""
    monkeypatch.delenv(ENV_BACKEND, raising=False)
    monkeypatch.delenv(ENV_DIFFUSERS_BACKEND, raising=False)
    clear_resolution_cache()
    yield
    clear_resolution_cache()
