"""One config per offload strategy: each validates its own fields, refuses another strategy's fields naming the
strategies that take them, and ``OffloadConfig(strategy, ...)`` builds the same config."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from diffusers_omni import (
    DistributedLayerwiseOffloadConfig,
    LayerwiseOffloadConfig,
    ModelLevelOffloadConfig,
    NoOffloadConfig,
    OffloadConfig,
    OffloadPlan,
    OffloadStrategy,
    get_offload_backend,
)

CONFIGS = [NoOffloadConfig, ModelLevelOffloadConfig, LayerwiseOffloadConfig, DistributedLayerwiseOffloadConfig]
SHARED = ["device", "pin_memory", "plan", "show_progress"]


def _fields(config_type) -> list[str]:
    return [f.name for f in dataclasses.fields(config_type) if f.init]


def test_each_config_holds_the_shared_fields_and_only_its_own():
    assert _fields(NoOffloadConfig) == SHARED
    assert _fields(ModelLevelOffloadConfig) == SHARED
    assert _fields(LayerwiseOffloadConfig) == SHARED + ["max_device_memory", "prefetch_depth", "dits_only",
                                                        "max_host_memory", "compression",
                                                        "compression_cache_dir"]
    assert _fields(DistributedLayerwiseOffloadConfig) == SHARED + [
        "use_allgather", "resident_layers", "prefetch_depth", "tensor_parallel_size", "hsdp", "process_group",
        "compression", "compression_cache_dir"]
    for config_type, strategy in zip(CONFIGS, OffloadStrategy):
        assert config_type.strategy is strategy
        assert issubclass(config_type, OffloadConfig)
        assert dataclasses.is_dataclass(config_type) and config_type.__dataclass_params__.frozen
    assert [c.collective for c in CONFIGS] == [False, False, False, True]


@pytest.mark.parametrize("config_type", CONFIGS)
def test_shared_fields_validate_in_every_config(config_type):
    config = config_type(device="cpu", pin_memory=False, plan=OffloadPlan(resident=("x",)), show_progress=True)
    assert config.device == torch.device("cpu") and config.requested == (config_type.strategy,)
    assert config.dropped == ()
    for kwargs, error, match in (
        ({"device": "meta"}, ValueError, "device='meta' cannot run a model"),
        ({"device": "gpu"}, ValueError, "device='gpu' is not a torch device"),
        ({"device": 0}, TypeError, "device must be a str or torch.device, got int: 0"),
        ({"pin_memory": "yes"}, TypeError, "pin_memory must be a bool, got str: 'yes'"),
        ({"plan": {"blocks": {}}}, TypeError, "plan must be an OffloadPlan or None, got dict"),
        ({"show_progress": 1}, TypeError, "show_progress must be a bool or None, got int: 1"),
    ):
        with pytest.raises(error, match=match):
            config_type(**kwargs)
    with pytest.raises(AttributeError):
        config.device = torch.device("cuda")


def test_configs_take_keywords_only():
    with pytest.raises(TypeError, match=r"LayerwiseOffloadConfig takes keyword arguments only .*got 1 positional: "
                                        r"\('cpu',\)"):
        LayerwiseOffloadConfig("cpu")


def test_layerwise_config_validates_budget_and_depth():
    config = LayerwiseOffloadConfig(device="cpu", max_device_memory="1.5 GiB", prefetch_depth=3)
    assert config.max_device_memory == 3 * 2**29 and config.prefetch_depth == 3
    for kwargs, error, match in (
        ({"max_device_memory": "lots"}, ValueError, "max_device_memory='lots' is not a byte size"),
        ({"max_device_memory": 1.5}, TypeError, "max_device_memory must be"),
        ({"max_device_memory": -1}, ValueError, "max_device_memory=-1 is negative"),
        ({"prefetch_depth": 0}, ValueError, r"prefetch_depth=0 is out of range; allowed: an int >= 1"),
        ({"prefetch_depth": "2"}, TypeError, "prefetch_depth must be an int >= 1, got str: '2'"),
        ({"prefetch_depth": True}, TypeError, "prefetch_depth must be an int >= 1, got bool: True"),
    ):
        with pytest.raises(error, match=match):
            LayerwiseOffloadConfig(device="cpu", **kwargs)


def test_distributed_config_validates_its_fields_and_combinations():
    config = DistributedLayerwiseOffloadConfig(device="cpu", use_allgather=False, resident_layers=2, prefetch_depth=2,
                                               tensor_parallel_size=2, hsdp=True)
    assert (config.resident_layers, config.prefetch_depth, config.tensor_parallel_size) == (2, 2, 2)
    group = object()
    with_group = DistributedLayerwiseOffloadConfig(device="cpu", process_group=group)
    assert with_group.process_group is group
    assert with_group == DistributedLayerwiseOffloadConfig(device="cpu")  # the group is not compared
    for kwargs, error, match in (
        ({"use_allgather": 1}, TypeError, "use_allgather must be a bool, got int: 1"),
        ({"hsdp": "no"}, TypeError, "hsdp must be a bool, got str: 'no'"),
        ({"resident_layers": -1}, ValueError, "resident_layers=-1 is out of range; allowed: an int >= 0"),
        ({"tensor_parallel_size": 0}, ValueError, "tensor_parallel_size=0 is out of range; allowed: an int >= 1"),
        ({"resident_layers": 2}, ValueError, "resident_layers=2 needs full weights on each rank"),
        ({"tensor_parallel_size": 2}, ValueError, "tensor_parallel_size=2 with use_allgather=True"),
        ({"hsdp": True}, ValueError, "hsdp=True with use_allgather=True"),
        ({"prefetch_depth": 2}, ValueError, "prefetch_depth=2 does not apply with use_allgather=True"),
    ):
        with pytest.raises(error, match=match):
            DistributedLayerwiseOffloadConfig(device="cpu", **kwargs)


@pytest.mark.parametrize(
    "config_type, field, value, takers",
    [
        (ModelLevelOffloadConfig, "max_device_memory", "1GiB", r"the layerwise strategy \(LayerwiseOffloadConfig\)"),
        (NoOffloadConfig, "prefetch_depth", 2, r"the layerwise and distributed_layerwise strategies "
                                               r"\(LayerwiseOffloadConfig, DistributedLayerwiseOffloadConfig\)"),
        (LayerwiseOffloadConfig, "use_allgather", False, r"the distributed_layerwise strategy"),
        (DistributedLayerwiseOffloadConfig, "max_device_memory", None, r"the layerwise strategy"),
    ],
)
def test_a_field_of_another_strategy_names_the_strategies_that_take_it(config_type, field, value, takers):
    with pytest.raises(ValueError) as info:
        config_type(device="cpu", **{field: value})
    message = str(info.value)
    assert message.startswith(f"{field}={value!r} applies only to ")
    assert re.search(takers, message), message
    assert f"got strategy={str(config_type.strategy)!r}" in message
    assert f"{config_type.__name__} (strategy={str(config_type.strategy)!r}) takes: {', '.join(_fields(config_type))}" \
        in message


def test_an_unknown_field_is_a_type_error_with_a_suggestion():
    with pytest.raises(TypeError, match=r"ModelLevelOffloadConfig \(strategy='model_level'\) has no field "
                                        r"'prefech_depth'; did you mean 'prefetch_depth'\?; allowed: device, "
                                        r"pin_memory, plan, show_progress"):
        ModelLevelOffloadConfig(prefech_depth=2)


def test_offload_config_builds_the_strategys_config():
    built = OffloadConfig("Layerwise", device="cpu", max_device_memory="1MiB", prefetch_depth=2)
    assert type(built) is LayerwiseOffloadConfig
    assert built == LayerwiseOffloadConfig(device="cpu", max_device_memory=2**20, prefetch_depth=2)
    assert isinstance(built, OffloadConfig)
    assert type(OffloadConfig("model-level", device="cpu")) is ModelLevelOffloadConfig
    assert type(OffloadConfig(strategy=OffloadStrategy.NONE, device="cpu")) is NoOffloadConfig
    distributed = OffloadConfig("distributed_layerwise", device="cpu", use_allgather=False, resident_layers=1)
    assert type(distributed) is DistributedLayerwiseOffloadConfig and distributed.resident_layers == 1
    with pytest.raises(TypeError, match="OffloadConfig needs a strategy"):
        OffloadConfig(device="cpu")
    with pytest.raises(TypeError, match="strategy twice"):
        OffloadConfig("layerwise", strategy="layerwise")


def test_offload_config_leaves_out_other_strategies_fields_at_their_defaults_only():
    # What the flat config accepted without asking for anything: another strategy's field at its default.
    config = OffloadConfig("model_level", device="cpu", max_device_memory=None, prefetch_depth=1, use_allgather=True,
                           resident_layers=0, tensor_parallel_size=1, hsdp=False, process_group=None)
    assert config == ModelLevelOffloadConfig(device="cpu")
    for field, value in (("max_device_memory", 0), ("prefetch_depth", 2), ("use_allgather", False),
                         ("use_allgather", 1), ("hsdp", True), ("resident_layers", 1)):
        with pytest.raises(ValueError, match=f"{field}={value!r} applies only to"):
            OffloadConfig("model_level", device="cpu", **{field: value})
    with pytest.raises(TypeError, match="has no field 'budget'"):
        OffloadConfig("layerwise", device="cpu", budget=None)


def test_several_strategies_build_the_highest_priority_one(caplog):
    config = OffloadConfig(["none", "model_level", "layerwise"], device="cpu", prefetch_depth=2)
    assert type(config) is LayerwiseOffloadConfig and config.prefetch_depth == 2
    assert config.requested == (OffloadStrategy.LAYERWISE, OffloadStrategy.MODEL_LEVEL)  # "none" loses to any
    assert config.dropped == (OffloadStrategy.MODEL_LEVEL,)
    assert OffloadConfig(["none"], device="cpu").requested == (OffloadStrategy.NONE,)
    with pytest.raises(ValueError, match=r"strategy=\[\] is empty"):
        OffloadConfig([], device="cpu")
    # A field of the strategy that lost is not taken by the one that won.
    with pytest.raises(ValueError, match="max_device_memory=5 applies only to the layerwise strategy"):
        OffloadConfig(["layerwise", "distributed_layerwise"], device="cpu", max_device_memory=5)


def test_the_no_offload_config_installs_nothing():
    assert get_offload_backend(NoOffloadConfig(device="cpu")) is None
    with pytest.raises(TypeError, match="config must be an offload config"):
        get_offload_backend({"strategy": "layerwise"})


def test_replace_keeps_validating():
    config = LayerwiseOffloadConfig(device="cpu", prefetch_depth=2)
    assert dataclasses.replace(config, show_progress=False).show_progress is False
    with pytest.raises(ValueError, match="prefetch_depth=0"):
        dataclasses.replace(config, prefetch_depth=0)
