"""The tuned-table cache read back (#39 item 5): every unusable file is named in one warning and the shipped table
decides; ``tune`` into a cache directory that cannot be written is refused up front, naming the variable."""

from __future__ import annotations

import json
import logging

import pytest

from diffusers_omni.attention import routing, tuning
from diffusers_omni.attention.selector import clear_resolution_cache
from diffusers_omni.cli.main import main

TINY_CLASS = "q0/kv0/d16/dense"


def _good_table() -> dict:
    return dict(routing.load_table(), format=tuning.TABLE_FORMAT, key=tuning.environment_key(), tolerance=0.01,
                allow_lossy=False, date="2026-12-05", measured=[],
                families={"cpu": {TINY_CLASS: {"ranking": ["TORCH_SDPA"], "worst_ratio": {"TORCH_SDPA": 1.0}}}})


def _write(content: bytes | str):
    path = tuning.table_path(tuning.environment_key())
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content.encode() if isinstance(content, str) else content)
    tuning.forget_tuned_table()
    clear_resolution_cache()
    return path


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING
            and r.name.startswith("diffusers_omni")]


def _other_gpu() -> dict:
    table = _good_table()
    return dict(table, key=dict(table["key"], device_name="NVIDIA H200", compute_capability="sm_90"))


CASES = {
    "families is a string": (lambda: json.dumps(dict(_good_table(), families="cpu")), "'families'"),
    "a rule's ranking is a string": (lambda: json.dumps(dict(_good_table(), families={"cpu": {
        TINY_CLASS: {"ranking": "TORCH_SDPA", "worst_ratio": {}}}})), "ranking"),
    "tolerance is text": (lambda: json.dumps(dict(_good_table(), tolerance="tight")), "tolerance"),
    "deeply nested": (lambda: "[" * 200_000 + "]" * 200_000, "nest"),
    "truncated": (lambda: json.dumps(_good_table())[:50], "not valid JSON"),
    "empty": (lambda: "", "empty"),
    "binary": (lambda: bytes(range(256)) * 4, "not text"),
    "list-shaped": (lambda: json.dumps([_good_table()]), "list"),
    "another GPU": (lambda: json.dumps(_other_gpu()), "another environment"),
    "an older format": (lambda: json.dumps(dict(_good_table(), format="diffusers-omni tuned routing table v0")),
                        "format"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_an_unusable_cache_file_is_named_once_and_the_shipped_table_decides(case, caplog):
    content, why = CASES[case]
    path = _write(content())
    with caplog.at_level(logging.WARNING, logger="diffusers_omni"):
        table = routing.active_table()
        routing.active_table()  # read once: one warning
    assert not routing.is_tuned(table) and table is routing.load_table()
    [message] = _warnings(caplog)
    assert str(path) in message and why in message and "shipped" in message


@pytest.mark.parametrize("case", ["families is a string", "deeply nested"])
@pytest.mark.parametrize("command", [["explain"], ["generate", "--steps", "1", "--height", "32", "--width", "32"]])
def test_explain_and_generate_run_on_the_shipped_table_past_a_broken_cache_file(case, command, capsys, tmp_path):
    _write(CASES[case][0]())
    argv = command + (["--output", str(tmp_path / "out.png")] if command[0] == "generate" else [])
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "Traceback" not in err and "ignoring the tuned routing table" in err
    assert err.count("ignoring the tuned routing table") == 1


def test_a_good_table_is_used_without_a_word(caplog):
    _write(json.dumps(_good_table()))
    with caplog.at_level(logging.WARNING, logger="diffusers_omni"):
        assert routing.is_tuned(routing.active_table())
    assert _warnings(caplog) == []


def test_tune_into_a_cache_dir_that_cannot_be_written_exits_2_naming_the_variable(monkeypatch, tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setenv(tuning.ENV_CACHE_DIR, str(blocker))
    assert main(["tune", "--height", "32", "--width", "32", "--warmup", "1", "--repeats", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert tuning.ENV_CACHE_DIR in err and str(blocker) in err and "Errno" not in err
    with pytest.raises(tuning.CacheNotWritable, match=tuning.ENV_CACHE_DIR):
        tuning.check_cache_writable()
