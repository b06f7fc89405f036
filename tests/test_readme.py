import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _ci_command() -> str:
    lines = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line and not line.startswith(("#", "set ", "cd "))]
    assert len(lines) == 1
    return lines[0]


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    assert _ci_command() in readme


def test_the_command_runs_every_test():
    # Every tier (tests/conftest.py): no marker or keyword selection, no path, nothing ignored or deselected.
    *_, pytest_command = _ci_command().split("&&")
    words = shlex.split(pytest_command)
    assert words[:3] == ["python", "-m", "pytest"]
    assert not [w for w in words[3:] if w.startswith(("-m", "-k", "--ignore", "--deselect", "-p", "tests")) or "::" in w], words


def test_the_readme_says_how_long_the_test_command_takes_and_how_to_run_the_unit_tier_alone():
    # The whole run took 23 minutes on a loaded 2-core machine with nothing said beside the command: the list item
    # that gives it says how long it takes and gives the unit tier on its own line.
    readme = (ROOT / "README.md").read_text()
    item = readme.split(_ci_command(), 1)[1].split("\nTo run a real model", 1)[0]
    assert "minutes" in item and "2-core machine" in item
    assert "```bash\n   python -m pytest -m unit\n   ```" in item
    development = (ROOT / "docs" / "development.md").read_text()
    assert "python -m pytest -m unit" in development
