"""Diffusers' verbosity (``diffusers.utils.logging.set_verbosity_*``) reaches our loggers, unless ours is configured."""

import logging
import os
import subprocess
import sys

import pytest
from diffusers.utils import logging as diffusers_logging

from diffusers_omni.attention.registry import canonical_backend_name as normalize_backend_name

ALIAS_INFO = "backend='native' is Diffusers' name for TORCH_SDPA"  # an INFO line of ours (attention.registry)


@pytest.fixture
def verbosity():
    """Diffusers' verbosity and our logger's own level (unset for the test: the CLI's tests set it), restored after."""
    before, ours = diffusers_logging.get_verbosity(), logging.getLogger("diffusers_omni").level
    logging.getLogger("diffusers_omni").setLevel(logging.NOTSET)
    yield diffusers_logging
    diffusers_logging.set_verbosity(before)
    logging.getLogger("diffusers_omni").setLevel(ours)


def _ours(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name.startswith("diffusers_omni")]


def test_diffusers_info_verbosity_shows_our_info_logs(verbosity, caplog):
    verbosity.set_verbosity_warning()
    normalize_backend_name("native")
    assert not any(ALIAS_INFO in m for m in _ours(caplog))
    verbosity.set_verbosity_info()
    normalize_backend_name("native")
    assert any(ALIAS_INFO in m for m in _ours(caplog))


def test_diffusers_error_verbosity_silences_our_warnings(verbosity, caplog):
    logger = logging.getLogger("diffusers_omni.attention")
    logger.warning("first")
    verbosity.set_verbosity_error()
    logger.warning("second")
    logger.error("third")
    assert _ours(caplog) == ["first", "third"]


def test_our_own_level_wins(verbosity, caplog):
    logging.getLogger("diffusers_omni").setLevel(logging.WARNING)
    verbosity.set_verbosity_info()
    normalize_backend_name("native")
    assert not any(ALIAS_INFO in m for m in _ours(caplog))
    verbosity.set_verbosity_error()
    logging.getLogger("diffusers_omni.attention").warning("still shown")
    assert _ours(caplog) == ["still shown"]


_SCRIPT = """
import logging, sys
import diffusers_omni
from diffusers.utils import logging as diffusers_logging
from diffusers_omni.attention.registry import canonical_backend_name as normalize_backend_name
diffusers_logging.set_verbosity_info()
normalize_backend_name("native")
diffusers_logging.set_verbosity_error()
logging.getLogger("diffusers_omni.attention").warning("silenced warning")
diffusers_logging.set_verbosity_warning()
logging.getLogger("diffusers_omni.attention").warning("shown warning")
"""


def test_without_any_logging_configuration_our_info_shows_where_diffusers_logs_do():
    """No handler anywhere (a plain script or notebook): our records go to Diffusers' stderr handler."""
    env = {k: v for k, v in os.environ.items() if k != "DIFFUSERS_VERBOSITY"}
    done = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stderr.splitlines()
    assert sum(ALIAS_INFO in line for line in lines) == 1, done.stderr[-2000:]
    assert "shown warning" in lines and "silenced warning" not in done.stderr
