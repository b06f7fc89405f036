"""``--offload`` and the offload flags come from the registered offload configs: names, help, types and defaults."""

from __future__ import annotations

import dataclasses

import pytest

from diffusers_omni.cli.common import UsageError
from diffusers_omni.cli.main import build_parser, main
from diffusers_omni.cli.offload import offload_config, offload_flags
from diffusers_omni.config.offload import (
    DistributedLayerwiseOffloadConfig,
    LayerwiseOffloadConfig,
    ModelLevelOffloadConfig,
    NoOffloadConfig,
    offload_strategies,
)


def _help(command: str, capsys) -> str:
    with pytest.raises(SystemExit):
        build_parser().parse_args([command, "--help"])
    return " ".join(capsys.readouterr().out.split())


def test_generate_offers_every_registered_strategy_and_field(capsys):
    out = _help("generate", capsys)
    assert "--offload STRATEGY offload strategy: none, model-level, layerwise, distributed-layerwise; " \
           "distributed-layerwise runs under torchrun (default: none)" in out
    assert "--max-device-memory MAX_DEVICE_MEMORY layerwise: weight bytes allowed on the device, every component " \
           "counted, e.g. 12GiB (DiT blocks that fit stay)" in out
    assert "--dits-only layerwise: stream the DiTs only; text/image encoders and VAEs stay on the device" in out
    assert "--prefetch-depth PREFETCH_DEPTH layerwise, distributed-layerwise: blocks prefetched ahead of the running " \
           "one (default: 1)" in out
    assert "--no-allgather distributed-layerwise: a full host copy per rank instead of 1/N shards + all-gather" in out
    assert "--resident-layers RESIDENT_LAYERS distributed-layerwise: leading blocks of the main DiT kept on the " \
           "device (with --no-allgather) (default: 0)" in out
    # One flag per CLI field of the registered configs, and no other offload flag.
    fields = {f.name for entry in offload_strategies() for f in dataclasses.fields(entry.config)
              if f.init and f.metadata.get("cli")}
    assert {flag.field for flag in offload_flags()} == fields == {
        "max_device_memory", "prefetch_depth", "dits_only", "max_host_memory", "compression",
        "compression_cache_dir", "use_allgather", "resident_layers"}
    assert [flag.flag for flag in offload_flags()] == [
        "--max-device-memory", "--prefetch-depth", "--dits-only", "--max-host-memory", "--compression",
        "--compression-cache-dir", "--no-allgather", "--resident-layers"]


def test_tune_offers_the_strategies_of_one_process(capsys):
    out = _help("tune", capsys)
    assert "--offload STRATEGY run the pipeline offloaded while recording its calls (models larger than the GPU): " \
           "none, model-level, layerwise" in out
    assert "--max-device-memory" in out and "--prefetch-depth PREFETCH_DEPTH layerwise: blocks" in out
    assert "--no-allgather" not in out and "--resident-layers" not in out


@pytest.mark.parametrize(
    "argv, expected",
    [
        ([], NoOffloadConfig(device="cpu")),
        (["--offload", "model-level"], ModelLevelOffloadConfig(device="cpu")),
        (["--offload", "layerwise", "--max-device-memory", "12GiB", "--prefetch-depth", "2"],
         LayerwiseOffloadConfig(device="cpu", max_device_memory=12 * 2**30, prefetch_depth=2)),
        (["--offload", "distributed-layerwise"], DistributedLayerwiseOffloadConfig(device="cpu")),
        (["--offload", "distributed-layerwise", "--no-allgather", "--resident-layers", "2", "--prefetch-depth", "3"],
         DistributedLayerwiseOffloadConfig(device="cpu", use_allgather=False, resident_layers=2, prefetch_depth=3)),
    ],
)
def test_flags_build_the_strategys_config(argv, expected):
    assert offload_config(build_parser().parse_args(["generate", *argv]), "cpu") == expected


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--offload", "model-level", "--prefetch-depth", "2"],
         "--prefetch-depth=2 needs --offload layerwise or distributed-layerwise (got --offload model-level)"),
        (["--offload", "layerwise", "--resident-layers", "0"],
         "--resident-layers=0 needs --offload distributed-layerwise (got --offload layerwise)"),
        (["--offload", "distributed-layerwise", "--max-device-memory", "1GiB"],
         "--max-device-memory=1GiB needs --offload layerwise (got --offload distributed-layerwise)"),
        (["--offload", "distributed-layerwise", "--resident-layers", "2"],
         "--offload distributed-layerwise: resident_layers=2 needs full weights on each rank, but use_allgather=True "
         "keeps only 1/N of them; allowed: resident_layers=0, or use_allgather=False (flags: --no-allgather sets "
         "use_allgather=False, --resident-layers sets resident_layers)"),
        (["--offload", "distributed-layerwise", "--prefetch-depth", "2"],
         "--offload distributed-layerwise: prefetch_depth=2 does not apply with use_allgather=True"),
        (["--offload", "layerwise", "--max-device-memory", "2 PiB"],
         "--offload layerwise: max_device_memory='2 PiB' is not a byte size"),
    ],
)
def test_flags_a_strategy_does_not_read_or_refuses_are_usage_errors(argv, message):
    with pytest.raises(UsageError) as info:
        offload_config(build_parser().parse_args(["generate", *argv]), "cpu")
    assert message in str(info.value)


def test_generate_refuses_them_before_loading(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    argv = ["generate", "--steps", "1", "--offload", "distributed-layerwise", "--resident-layers", "2"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "resident_layers=2 needs full weights" in err and "--resident-layers" in err and "Traceback" not in err
    assert not list(tmp_path.iterdir())
