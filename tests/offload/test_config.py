"""OffloadConfig validation and backend selection."""

from __future__ import annotations

import logging

import pytest
import torch

from diffusers_omni import OffloadConfig, OffloadPlan, OffloadStrategy, get_offload_backend
from diffusers_omni.config.offload import parse_bytes


@pytest.mark.parametrize(
    ("value", "expected"),
    [("layerwise", "LAYERWISE"), ("Model-Level", "MODEL_LEVEL"), ("NONE", "NONE"), (OffloadStrategy.LAYERWISE, "LAYERWISE")],
)
def test_strategy_parses_case_insensitively(value, expected):
    assert OffloadConfig(value, device="cpu").strategy is OffloadStrategy[expected]


def test_unknown_strategy_names_field_value_and_allowed():
    with pytest.raises(ValueError, match=r"strategy='stream'.*allowed: none, model_level, layerwise"):
        OffloadConfig("stream", device="cpu")
    with pytest.raises(TypeError, match="strategy must be"):
        OffloadConfig(3, device="cpu")


@pytest.mark.parametrize(
    ("value", "expected"),
    [(1024, 1024), ("12GiB", 12 * 2**30), ("500MB", 500 * 10**6), ("1.5 gb", 1_500_000_000), ("64 KiB", 65536)],
)
def test_parse_bytes(value, expected):
    assert parse_bytes(value, "max_device_memory") == expected


@pytest.mark.parametrize("spelled", ["KB", "MB", "GB", "KiB", "MiB", "GiB"])
def test_parse_bytes_agrees_with_accelerate_on_its_units(spelled):
    from accelerate.utils import convert_file_size_to_int

    for number in ("0", "1", "7", "250", "1.5", "0.25"):
        assert parse_bytes(number + spelled, "x") == convert_file_size_to_int(number + spelled)


def test_parse_bytes_where_accelerate_differs():
    from accelerate.utils import convert_file_size_to_int

    # accelerate scales through a float; ours is exact.
    assert convert_file_size_to_int("4.1MB") == 4_099_999 and parse_bytes("4.1MB", "x") == 4_100_000
    # accelerate reads a lower-case "b" as bits; our units are case-insensitive bytes (as the docs say).
    assert convert_file_size_to_int("2Gb") == 250_000_000 and parse_bytes("2Gb", "x") == 2 * 10**9
    # Units accelerate lacks: bare bytes, B, TB, TiB.
    assert parse_bytes("12", "x") == 12 and parse_bytes("3 B", "x") == 3
    assert parse_bytes("2TB", "x") == 2 * 10**12 and parse_bytes("2tib", "x") == 2 * 2**40


@pytest.mark.parametrize("value", ["12 parsecs", "-1GiB", "GiB", -5])
def test_bad_byte_sizes_name_the_field(value):
    with pytest.raises(ValueError, match="max_device_memory="):
        OffloadConfig("layerwise", device="cpu", max_device_memory=value)


def test_field_type_errors():
    with pytest.raises(TypeError, match="max_device_memory must be"):
        OffloadConfig("layerwise", device="cpu", max_device_memory=1.5)
    with pytest.raises(TypeError, match="pin_memory must be a bool"):
        OffloadConfig("layerwise", device="cpu", pin_memory="yes")
    with pytest.raises(ValueError, match="prefetch_depth=0"):
        OffloadConfig("layerwise", device="cpu", prefetch_depth=0)
    with pytest.raises(ValueError, match="device='meta'"):
        OffloadConfig("layerwise", device="meta")
    with pytest.raises(TypeError, match="OffloadPlan.extra_streamed"):
        OffloadPlan(extra_streamed="transformer")


def test_budget_only_with_layerwise():
    with pytest.raises(ValueError, match="applies only to the layerwise strategy"):
        OffloadConfig("model_level", device="cpu", max_device_memory="1GiB")


def test_config_is_frozen():
    config = OffloadConfig("layerwise", device="cpu")
    with pytest.raises(AttributeError):
        config.device = torch.device("cuda")


def test_priority_picks_one_and_logs_dropped(caplog):
    config = OffloadConfig(["model_level", "layerwise"], device="cpu")
    assert config.strategy is OffloadStrategy.LAYERWISE
    assert config.dropped == (OffloadStrategy.MODEL_LEVEL,)
    with caplog.at_level(logging.INFO, logger="diffusers_omni"):
        backend = get_offload_backend(config)
    assert type(backend).__name__ == "LayerwiseOffloadBackend"
    assert "dropping ['model_level']" in caplog.text


def test_none_returns_no_backend():
    assert get_offload_backend(OffloadConfig("none", device="cpu")) is None
    assert get_offload_backend(None) is None


def test_distributed_without_process_group_is_a_clear_error():
    with pytest.raises(RuntimeError, match="initialised torch.distributed process group"):
        get_offload_backend(OffloadConfig(["distributed_layerwise", "layerwise"], device="cpu"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_unavailable_device_is_an_error():
    with pytest.raises(ValueError, match="device='cuda' is not available"):
        get_offload_backend(OffloadConfig("layerwise"))
