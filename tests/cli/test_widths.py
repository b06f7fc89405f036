"""Terminal behaviour in one process (#39 item 12): ``--platform`` names a real compute capability, every help text
fits 80 columns, error lines fit 80 columns, and table cells keep the first column's names whole (rows are named by
it: a role cut in two reads as two roles)."""

from __future__ import annotations

import argparse

import pytest

from diffusers_omni.cli.main import build_parser, main
from diffusers_omni.utils.text import table


@pytest.mark.parametrize("value", ["sm_999", "sm_91", "sm_05", "sm_1000"])
def test_a_platform_no_gpu_has_is_refused(value, capsys):
    assert main(["explain", "--platform", value]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert f"--platform={value!r}" in line and "sm_90" in line and "sm_120" in line


@pytest.mark.parametrize("value", ["sm_80", "sm_90,cudnn=91900", "sm_100", "sm_120", "cpu"])
def test_real_platforms_are_accepted(value, capsys):
    assert main(["explain", "--platform", value, "--json"]) == 0


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def test_every_help_fits_80_columns(monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    parser = build_parser()
    texts = {"diffusers-omni": parser.format_help()}
    texts.update({name: sub.format_help() for name, sub in _subparsers(parser).items()})
    wide = {name: [line for line in text.splitlines() if len(line) > 80] for name, text in texts.items()}
    assert {name: lines for name, lines in wide.items() if lines} == {}
    assert "--offload STRATEGY" in texts["generate"] and "distributed-layerwise" in texts["generate"]


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a machine without CUDA")
def test_a_warmup_error_fits_80_columns(capsys):
    assert main(["warmup"]) == 2  # no CUDA device on this machine
    [line] = capsys.readouterr().err.strip().splitlines()
    assert len(line) <= 80 and "CUDA" in line


@pytest.mark.parametrize("width", [70, 80])
def test_table_cells_keep_role_names_whole(width):
    rows = [{"role": role, "category": "cross", "backend": "TORCH_SDPA", "lossy": "False",
             "source": "per_role['cross'] auto → platform default (Hopper sm_90, cuDNN 91900)", "modules": "1",
             "call": "cuda, float32, head_dim=12"} for role in ("wan.self", "wan.image_cross", "wan.cross")]
    text = table(rows, ["role", "category", "backend", "lossy", "source", "modules", "call"], width=width,
                 keep=["backend"])
    assert max(len(line) for line in text.splitlines()) <= width, text
    lines = text.splitlines()
    body = lines[next(i for i, line in enumerate(lines) if line.startswith("─")) + 1:]
    first = [line.split()[0] for line in body if line and not line.startswith(" ")]
    assert first == ["wan.self", "wan.image_cross", "wan.cross"], text
    assert text.count("TORCH_SDPA") == 3, text  # backend names whole too


def test_a_long_dotted_cell_breaks_after_a_separator():
    rows = [{"role": "flux.single", "modules": "1", "rel_err max": "0.00e+00", "rel_err mean": "0.00e+00",
             "local max": "0.00e+00", "worst module": "transformer.single_transformer_blocks.0.attn"}]
    text = table(rows, list(rows[0]), width=80)
    assert max(len(line) for line in text.splitlines()) <= 80, text
    column = next(line for line in text.splitlines() if "worst module" in line).index("worst module")
    lines = text.splitlines()
    body = lines[next(i for i, line in enumerate(lines) if line.startswith("─")) + 1:]
    pieces = [line[column:].strip() for line in body if line[column:].strip()]
    assert "".join(pieces) == "transformer.single_transformer_blocks.0.attn"
    assert all(piece[-1] in "._" for piece in pieces[:-1]), pieces  # broken after '.' or '_', never mid-word
