"""What a user sees in an 80-column terminal: no line wider than the terminal, ``models`` as a table (Markdown only
with ``--markdown``), and nothing on the screen but our own output (no third-party import notices)."""

from __future__ import annotations

import io
import json
import logging
import os
import pty
import re
import select
import subprocess
import sys
import time

import pytest

from diffusers_omni.cli.main import main
from diffusers_omni.utils.quiet import KNOWN_IMPORT_NOISE, quiet_third_party_imports
from diffusers_omni.utils.text import fit, output_width, table

# What the import notices look like when they leak (torch's glog-style prefix, the packages' own messages).
NOISE = re.compile(r"^[WE]\d{4} \d|Failed to load|Unable to import|is an Enum subclass|requires torchvision|"
                   r"\w+Warning:|^WARNING", re.M)


def run_in_terminal(*args: str, columns: int = 80, timeout: float = 300) -> str:
    """``diffusers-omni ARGS`` with stdout and stderr on a pseudo-terminal of ``columns`` columns: all it shows."""
    leader, follower = pty.openpty()
    env = {**os.environ, "COLUMNS": str(columns), "LINES": "50", "TERM": "xterm"}
    proc = subprocess.Popen([sys.executable, "-m", "diffusers_omni.cli.main", *args], stdin=follower,
                            stdout=follower, stderr=follower, env=env, close_fds=True)
    os.close(follower)
    chunks, deadline = [], time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([leader], [], [], 1.0)
            if ready:
                try:
                    data = os.read(leader, 65536)
                except OSError:  # EIO: the child closed the terminal
                    break
                if not data:
                    break
                chunks.append(data)
            elif proc.poll() is not None:
                break
    finally:
        os.close(leader)
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=60)
    assert proc.returncode == 0, b"".join(chunks).decode(errors="replace")[-3000:]
    return b"".join(chunks).decode().replace("\r\n", "\n")


def _too_wide(text: str, columns: int) -> list[str]:
    return [line for line in text.splitlines() if len(line) > columns]


@pytest.mark.parametrize("command", ["info", "explain", "models"])
def test_output_fits_an_80_column_terminal_with_nothing_but_ours(command):
    text = run_in_terminal(command)
    assert _too_wide(text, 80) == [], text
    assert not NOISE.search(text), text
    assert {"info": "backends:", "explain": "flux.single", "models": "flux.joint (self)"}[command] in text
    if command == "models":  # a table, not Markdown rows with <br>
        assert "<br>" not in text and "|---" not in text
        assert re.search(r"^architecture +roles \(category\)", text, re.M)
        assert "Not shown at this width: Omni pipelines" in text  # what a wider terminal adds is named


def test_models_on_a_wide_terminal_shows_more_columns():
    wide = run_in_terminal("models", columns=200)
    assert re.search(r"^architecture +roles \(category\) +Omni pipelines", wide, re.M)
    assert _too_wide(wide, 200) == []


def test_models_markdown_and_json(capsys):
    assert main(["models", "--markdown"]) == 0
    markdown = capsys.readouterr().out
    assert markdown.startswith("| Architecture | Example checkpoint |") and "|---|" in markdown
    assert main(["models"]) == 0  # not a terminal (captured): every column, lines whole
    piped = capsys.readouterr().out
    assert "|---|" not in piped and re.search(r"^architecture +roles \(category\) +Omni pipelines +example", piped,
                                              re.M)
    assert "Not shown at this width" not in piped
    with pytest.raises(SystemExit) as exit_info:
        main(["models", "--markdown", "--json"])
    assert exit_info.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err
    assert main(["models", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)


def test_output_width_is_the_terminal_s_and_none_when_piped(monkeypatch):
    monkeypatch.setenv("COLUMNS", "93")

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    assert output_width(Terminal()) == 93
    assert output_width(io.StringIO()) is None
    monkeypatch.setenv("COLUMNS", "10")
    assert output_width(Terminal()) == 40  # MIN_WIDTH: narrower terminals get lines this long


def test_table_wraps_cells_at_spaces_within_the_width():
    rows = [{"role": "wan.image_cross", "source": "platform default (CPU)", "call": "cpu, float32, head_dim=12"},
            {"role": "wan.self", "source": "per_role['cross'] auto", "call": "cuda, bfloat16, head_dim=128"}]
    narrow = table(rows, ["role", "source", "call"], width=50)
    assert max(len(line) for line in narrow.splitlines()) <= 50
    words = set(" ".join(narrow.splitlines()).split())
    assert {"wan.image_cross", "head_dim=128", "per_role['cross']"} <= words  # wrapped at spaces, never split
    whole = table(rows, ["role", "source", "call"], width=None)
    assert "platform default (CPU)" in whole and "cuda, bfloat16, head_dim=128" in whole


def test_fit_wraps_long_lines_under_their_indent():
    text = "short\n      - package 'sageattention' is not importable; to install: pip install 'diffusers-omni[sage]'"
    assert fit(text, None) == text
    lines = fit(text, 60).splitlines()
    assert lines[0] == "short" and all(len(line) <= 60 for line in lines)
    assert lines[1].startswith("      - package") and lines[2].startswith("        ")
    assert " ".join(" ".join(lines[1:]).split()) == " ".join(text.splitlines()[1].split())


@pytest.mark.parametrize("name", sorted(KNOWN_IMPORT_NOISE))
def test_quiet_imports_drops_only_the_known_notice_and_only_inside(name):
    samples = {
        "transformers.utils.import_utils": "`CLIPImageProcessor` requires torchvision (not installed); falling back to "
                                           "`CLIPImageProcessorPil`",
        "torchao": "Failed to load /venv/site-packages/torchao/_C_mxfp8.abi3.so: Could not load this library",
        "torch.utils._pytree": "<enum 'KernelPreference'> is an Enum subclass and is now natively supported by "
                               "torch.compile as an opaque value type.",
        "bitsandbytes.backends.cpu.ops": "Failed to load CPU gemm_4bit_forward from kernels-community: untrusted",
        "diffusers.quantizers.torchao.torchao_quantizer": "Unable to import `torchao` Tensor objects. This may affect",
        "kernels._internals.hf_hub": "Skipping publisher trust check for 'kernels-community/quantization-bitsandbytes' "
                                     "because Hugging Face Hub is in offline mode.",
    }
    logger = logging.getLogger(name)
    # A handler of the test's own on the logger itself: torch and Diffusers set their library loggers not to
    # propagate once their logging is configured, so records need not reach the root logger caplog listens on.
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        with quiet_third_party_imports():
            logger.warning(samples[name])
            logger.warning("something else went wrong")
        logger.warning(samples[name])
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    assert [r.getMessage() for r in records] == ["something else went wrong", samples[name]]


def test_tune_show_and_generate_help_fit_an_80_column_terminal():
    for args in (("tune", "--show"), ("generate", "--help"), ("compare", "--help"), ("tune", "--help")):
        text = run_in_terminal(*args)
        assert _too_wide(text, 80) == [], text
    assert "no table tuned in this environment" in run_in_terminal("tune", "--show")


def test_models_piped_into_head_stops_quietly():
    """``diffusers-omni models | head -3``: head exits after three lines; the CLI stops without a traceback or a
    "Broken pipe" message, with status 0 or the conventional SIGPIPE one (141)."""
    cli = subprocess.Popen([sys.executable, "-m", "diffusers_omni.cli.main", "models"], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, env={**os.environ, "COLUMNS": "80"})
    head = subprocess.run(["head", "-3"], stdin=cli.stdout, capture_output=True, timeout=300)
    cli.stdout.close()
    err = cli.stderr.read().decode()
    cli.wait(timeout=300)
    assert len(head.stdout.decode().splitlines()) == 3
    assert cli.returncode in (0, 141, -13), (cli.returncode, err)
    assert err == "", err


@pytest.mark.parametrize("command", [["models"], ["info"], ["models", "--json"]])
def test_a_reader_gone_before_the_output_stops_it_quietly(command):
    """The deterministic form of ``| head``: the pipe's reading end is closed before the CLI writes a byte."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        cli = subprocess.run([sys.executable, "-m", "diffusers_omni.cli.main", *command], stdout=write_end,
                             stderr=subprocess.PIPE, timeout=300)
    finally:
        os.close(write_end)
    err = cli.stderr.decode()
    assert cli.returncode in (0, 141), (cli.returncode, err)
    assert "Broken pipe" not in err and "Traceback" not in err and err == "", err


def test_explain_keeps_role_names_whole_in_an_80_column_terminal():
    config = '{"default": {"backend": "TORCH_SDPA"}, "per_role": {"cross": {"backend": "auto"}}}'
    text = run_in_terminal("explain", "--model", "tiny-wan-i2v", "--attention", config)
    assert _too_wide(text, 80) == [], text
    roles = [line.split()[0] for line in text.splitlines() if line.startswith("wan.")]
    assert roles == ["wan.self", "wan.image_cross", "wan.cross"], text
