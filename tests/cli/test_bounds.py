"""Counts have an upper bound (#39 item 7): a step, warm-up or repeat count no run could finish (or whose schedule
alone fills the memory) is refused by the parser, exit 2, one line naming the flag, the value and the range."""

from __future__ import annotations

import time

import pytest

from diffusers_omni.cli.common import MAX_REPEATS, MAX_STEPS, MAX_WARMUP
from diffusers_omni.cli.main import main

CASES = [
    (["compare", "--candidate", "stock", "--warmup-runs", "99999999999"], "--warmup-runs", "99999999999", 0,
     MAX_WARMUP),
    (["compare", "--candidate", "stock", "--steps", "100000000"], "--steps", "100000000", 1, MAX_STEPS),
    (["generate", "--steps", "100000000"], "--steps", "100000000", 1, MAX_STEPS),
    (["align", "--steps", "5000"], "--steps", "5000", 1, MAX_STEPS),
    (["tune", "--warmup", "1000000"], "--warmup", "1000000", 1, MAX_WARMUP),
    (["tune", "--repeats", "1000000"], "--repeats", "1000000", 1, MAX_REPEATS),
    (["generate", "--steps", "0"], "--steps", "0", 1, MAX_STEPS),
]


@pytest.mark.parametrize("argv, flag, value, low, high", CASES, ids=lambda v: v if isinstance(v, str) else None)
def test_an_unbounded_count_is_refused_at_once(argv, flag, value, low, high, capsys):
    started = time.monotonic()
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2 and time.monotonic() - started < 10
    [line] = capsys.readouterr().err.strip().splitlines()
    assert f"argument {flag}: must be an integer from {low} to {high}, got {value!r}" in line


def test_the_bounds_are_what_a_real_run_uses():
    # FLUX.1-dev runs 28 steps, Wan 50; a tune round of 7 repeats; the bounds leave ample room above them.
    assert MAX_STEPS >= 500 and MAX_WARMUP >= 10 and MAX_REPEATS >= 50
