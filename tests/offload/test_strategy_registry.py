"""The registry of offload strategies: a new strategy is its config class, its backend and one registration, and
then works everywhere (``OffloadConfig("<name>")``, ``apply_offload``, the CLI's choices and flags)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch

from diffusers_omni import OffloadConfig, apply_offload, get_offload_backend, register_offload_strategy
from diffusers_omni.cli.main import build_parser
from diffusers_omni.cli.common import UsageError
from diffusers_omni.cli.offload import offload_config
from diffusers_omni.config.offload import (
    LayerwiseOffloadConfig,
    offload_option,
    offload_strategies,
    unregister_offload_strategy,
)
from diffusers_omni.offload.factory import offload_backend_class, register_offload_backend
from diffusers_omni.offload.layerwise import LayerwiseOffloadBackend

from offload_helpers import bare_flux, flux_inputs


@dataclass(frozen=True, kw_only=True)
class SidewaysOffloadConfig(OffloadConfig):
    """A test strategy: layerwise streaming without a budget, plus a field of its own."""

    strategy: ClassVar[str] = "sideways"

    prefetch_depth: int = offload_option(1, minimum=1, help="blocks prefetched ahead of the running one")
    lanes: int = offload_option(2, minimum=1, help="test-only: a count of its own")
    keep_going: bool = offload_option(True, help="test-only: what --no-keep-going turns off")


class SidewaysOffloadBackend(LayerwiseOffloadBackend):
    strategy = "sideways"
    max_device_memory = None  # this strategy has no budget: every block streams


@pytest.fixture
def sideways():
    register_offload_strategy(SidewaysOffloadConfig, SidewaysOffloadBackend, priority=15)
    try:
        yield SidewaysOffloadConfig
    finally:
        unregister_offload_strategy("sideways")
    assert "sideways" not in [entry.name for entry in offload_strategies()]


def test_a_registered_strategy_is_built_by_name_and_applied_bitwise(sideways):
    config = OffloadConfig("Sideways", device="cpu", prefetch_depth=2, lanes=3)
    assert type(config) is SidewaysOffloadConfig and config.strategy == "sideways" and config.lanes == 3
    assert [entry.name for entry in offload_strategies()] == [
        "none", "model_level", "sideways", "layerwise", "distributed_layerwise"]
    assert offload_backend_class("sideways") is SidewaysOffloadBackend
    assert offload_backend_class(SidewaysOffloadConfig) is SidewaysOffloadBackend
    # Priority places it among the others when several are requested.
    assert type(OffloadConfig(["model_level", "sideways"], device="cpu")) is SidewaysOffloadConfig
    assert type(OffloadConfig(["layerwise", "sideways"], device="cpu")) is LayerwiseOffloadConfig

    model = bare_flux()
    with torch.no_grad():
        reference = model(**flux_inputs())[0]
    backend = apply_offload(model, config)
    try:
        assert type(backend) is SidewaysOffloadBackend and backend.config is config
        assert repr(backend) == "SidewaysOffloadBackend(strategy='sideways', device='cpu', enabled)"
        assert backend.stats.slot_count == 3 and backend.stats.streamed_blocks == 7
        with torch.no_grad():
            assert torch.equal(model(**flux_inputs())[0], reference)
    finally:
        backend.disable()


def test_its_fields_are_refused_elsewhere_and_others_refused_by_it(sideways):
    with pytest.raises(ValueError, match=r"lanes=3 applies only to the sideways strategy \(SidewaysOffloadConfig\), "
                                         r"got strategy='layerwise'"):
        LayerwiseOffloadConfig(lanes=3)
    with pytest.raises(ValueError, match=r"prefetch_depth=2 applies only to the sideways, layerwise and "
                                         r"distributed_layerwise strategies"):
        OffloadConfig("model_level", prefetch_depth=2)
    with pytest.raises(ValueError, match=r"max_device_memory=5 applies only to the layerwise strategy.*got "
                                         r"strategy='sideways'"):
        SidewaysOffloadConfig(max_device_memory=5)


def test_it_appears_in_the_cli_choices_and_flags(sideways, capsys):
    parser = build_parser()
    args = parser.parse_args(["generate", "--offload", "sideways", "--lanes", "4", "--prefetch-depth", "2",
                              "--no-keep-going"])
    config = offload_config(args, "cpu")
    assert config == SidewaysOffloadConfig(device="cpu", lanes=4, prefetch_depth=2, keep_going=False)
    # Its flags are refused for the strategies that do not read them, naming the ones that do.
    args = parser.parse_args(["generate", "--offload", "layerwise", "--lanes", "4"])
    with pytest.raises(UsageError, match=r"--lanes=4 needs --offload sideways \(got --offload layerwise\)"):
        offload_config(args, "cpu")
    args = parser.parse_args(["generate", "--offload", "sideways", "--max-device-memory", "1GiB"])
    with pytest.raises(UsageError, match=r"--max-device-memory=1GiB needs --offload layerwise \(got --offload "
                                         r"sideways\)"):
        offload_config(args, "cpu")
    # Its field's type and minimum make the flag's type.
    with pytest.raises(SystemExit):
        parser.parse_args(["generate", "--offload", "sideways", "--lanes", "0"])
    assert "argument --lanes: must be a positive integer, got '0'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parser.parse_args(["generate", "--offload", "sidways"])
    assert "invalid choice: 'sidways' (did you mean 'sideways'?)" in capsys.readouterr().err

    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--offload STRATEGY offload strategy: none, model-level, sideways, layerwise, distributed-layerwise" in out
    assert "--lanes LANES sideways: test-only: a count of its own (default: 2)" in out
    assert "--no-keep-going sideways: test-only: what --no-keep-going turns off" in out
    assert "--prefetch-depth PREFETCH_DEPTH sideways, layerwise, distributed-layerwise: blocks prefetched" in out
    # tune runs in one process: it offers every strategy that is not collective, this one included.
    with pytest.raises(SystemExit):
        build_parser().parse_args(["tune", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "larger than the GPU): none, model-level, sideways, layerwise" in out and "--lanes" in out
    assert "--no-allgather" not in out


def test_unregistered_it_is_gone_everywhere(sideways):
    unregister_offload_strategy("sideways")
    try:
        with pytest.raises(ValueError, match="strategy='sideways' is not an offload strategy; allowed: none, "
                                             "model_level, layerwise, distributed_layerwise"):
            OffloadConfig("sideways")
        with pytest.raises(ValueError, match="SidewaysOffloadConfig is not a registered offload config"):
            get_offload_backend(SidewaysOffloadConfig(device="cpu"))
        with pytest.raises(SystemExit):
            build_parser().parse_args(["generate", "--lanes", "2"])
    finally:
        register_offload_strategy(SidewaysOffloadConfig, SidewaysOffloadBackend, priority=15)


def test_register_offload_backend_swaps_the_handler(sideways):
    class Recording(SidewaysOffloadBackend):
        pass

    register_offload_backend(SidewaysOffloadConfig, Recording)
    assert type(get_offload_backend(SidewaysOffloadConfig(device="cpu"))) is Recording
    register_offload_backend("sideways", f"{__name__}:SidewaysOffloadBackend")
    assert offload_backend_class("sideways") is SidewaysOffloadBackend


def test_registration_errors():
    @dataclass(frozen=True, kw_only=True)
    class BadName(OffloadConfig):
        strategy: ClassVar[str] = "Bad Name"

    @dataclass(frozen=True, kw_only=True)
    class Clash(OffloadConfig):
        strategy: ClassVar[str] = "clash"
        prefetch_depth: int = offload_option(2, minimum=1, help="a different default")

    @dataclass(frozen=True, kw_only=True)
    class SecondLayerwise(OffloadConfig):
        strategy: ClassVar[str] = "layerwise"

    for config, handler, error, match in (
        (dict, None, TypeError, "config must be a dataclass subclassing OffloadConfig"),
        (BadName, None, ValueError, r"BadName.strategy='Bad Name' must be a lower-case name"),
        (Clash, None, ValueError, r"Clash.prefetch_depth differs from LayerwiseOffloadConfig.prefetch_depth"),
        (SecondLayerwise, None, ValueError, "strategy 'layerwise' is already registered by LayerwiseOffloadConfig"),
        (SidewaysOffloadConfig, "no_colon", ValueError, "handler='no_colon' must look like 'package.module:ClassName'"),
        (SidewaysOffloadConfig, 3, TypeError, "handler must be an OffloadBackend subclass"),
    ):
        with pytest.raises(error, match=match):
            register_offload_strategy(config, handler, priority=1)
    assert "sideways" not in [entry.name for entry in offload_strategies()]
    with pytest.raises(TypeError, match="declares no strategy"):
        @dataclass(frozen=True, kw_only=True)
        class Nameless(OffloadConfig):
            pass

        Nameless()
