"""An unknown DIFFUSION_ATTENTION_BACKEND or DIFFUSERS_ATTN_BACKEND: one line naming the variable, the value and the
allowed names, exit status 2, before anything imports Diffusers (which raises on a bad DIFFUSERS_ATTN_BACKEND deep in
its own import)."""

import os
import subprocess
import sys

import pytest

from diffusers_omni.attention.selector import ENV_BACKEND, ENV_DIFFUSERS_BACKEND
from diffusers_omni.cli.main import main


@pytest.fixture(autouse=True)
def _no_diffusers_variable(monkeypatch):
    monkeypatch.delenv(ENV_DIFFUSERS_BACKEND, raising=False)


@pytest.mark.parametrize("command", [["explain"], ["generate"], ["info"], ["info", "--platform", "sm_90"]])
@pytest.mark.parametrize("variable, value, expected", [
    (ENV_DIFFUSERS_BACKEND, "bogus", f"{ENV_DIFFUSERS_BACKEND}='bogus' is not one of Diffusers' attention backend "
                                     "names; allowed: native, _native_cudnn"),
    (ENV_DIFFUSERS_BACKEND, "flex", f"{ENV_DIFFUSERS_BACKEND}='flex' is a Diffusers attention backend with no "
                                    f"equivalent here"),
    (ENV_BACKEND, "bogus", f"{ENV_BACKEND}='bogus' is not a known attention backend"),
])
def test_unknown_value_is_one_line_and_exit_2(monkeypatch, capsys, command, variable, value, expected):
    monkeypatch.setenv(variable, value)
    assert main(command) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"diffusers-omni {command[0]}: error: environment variable ")
    assert expected in lines[0] and captured.out == ""


def test_diffusers_own_import_crash_is_preempted():
    """Without the check, Diffusers' import raises "'bogus' is not a valid AttentionBackendName" with a traceback."""
    env = {**os.environ, ENV_DIFFUSERS_BACKEND: "bogus"}
    env.pop(ENV_BACKEND, None)
    done = subprocess.run([sys.executable, "-m", "diffusers_omni.cli.main", "explain"], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "Traceback" not in done.stderr and "AttentionBackendName" not in done.stderr
    assert done.stderr.strip().splitlines() == [
        line for line in done.stderr.strip().splitlines() if line.startswith("diffusers-omni explain: error: ")
    ]
