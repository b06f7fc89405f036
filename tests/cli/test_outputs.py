"""An existing ``--output`` file is never overwritten silently (#39 item 6): refused without ``--overwrite`` (exit 2,
one line, before any work), replaced with ``--overwrite`` through a temporary file renamed over it (a new inode:
a reader of the old file keeps it whole), and the run says "replaced"."""

from __future__ import annotations

import json
import os

import pytest
from PIL import Image

from diffusers_omni.cli.main import main

SMALL = ["--steps", "1", "--height", "32", "--width", "32"]
COMMANDS = {
    "generate": ["generate", *SMALL],
    "compare": ["compare", "--candidate", "stock", *SMALL],
}


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_an_existing_output_is_refused_without_overwrite(command, tmp_path, capsys):
    output = tmp_path / "mine.png"
    output.write_bytes(b"precious")
    assert main([*COMMANDS[command], "--output", str(output)]) == 2
    captured = capsys.readouterr()
    [line] = captured.err.strip().splitlines()
    assert f"--output={str(output)!r}" in line and "exists" in line and "--overwrite" in line
    assert output.read_bytes() == b"precious" and captured.out == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine.png"]  # no temporary file left behind


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_overwrite_replaces_through_a_new_file_and_says_so(command, tmp_path, capsys):
    output = tmp_path / "mine.png"
    output.write_bytes(b"old")
    inode = os.stat(output).st_ino
    with open(output, "rb") as reader:  # a reader of the old file keeps reading the old file
        assert main([*COMMANDS[command], "--output", str(output), "--overwrite"]) == 0
        assert reader.read() == b"old"
    out = capsys.readouterr().out
    assert f"replaced {output}" in out
    assert os.stat(output).st_ino != inode
    with Image.open(output) as image:
        assert image.width >= 32
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine.png"]


def test_a_new_output_says_wrote_and_json_says_whether_it_replaced(tmp_path, capsys):
    output = tmp_path / "new.png"
    assert main([*COMMANDS["generate"], "--output", str(output), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["replaced"] is False
    assert main([*COMMANDS["generate"], "--output", str(output), "--json", "--overwrite"]) == 0
    assert json.loads(capsys.readouterr().out)["replaced"] is True


def test_the_default_output_is_not_overwritten_either(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "omni.png").write_bytes(b"earlier run")
    assert main(COMMANDS["generate"]) == 2
    assert "'omni.png' exists" in capsys.readouterr().err
    assert (tmp_path / "omni.png").read_bytes() == b"earlier run"
