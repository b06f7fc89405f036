"""The registry of offload strategies: one entry per strategy, looked up by ``get_offload_backend``."""

import pytest

from diffusers_omni import OffloadConfig, OffloadStrategy, get_offload_backend
from diffusers_omni.offload.distributed import AllGatherLayerwiseOffloadBackend, DistributedLayerwiseOffloadBackend
from diffusers_omni.offload.factory import offload_backend_class, register_offload_backend
from diffusers_omni.offload.model_level import ModelLevelOffloadBackend


def test_every_strategy_but_none_has_a_backend_declaring_it():
    for strategy in OffloadStrategy:
        if strategy is OffloadStrategy.NONE:
            continue
        assert offload_backend_class(strategy).strategy is strategy
    assert offload_backend_class("model-level") is ModelLevelOffloadBackend


def test_a_registered_backend_serves_its_strategy():
    class Recording(ModelLevelOffloadBackend):
        pass

    register_offload_backend(OffloadStrategy.MODEL_LEVEL, Recording)
    try:
        assert type(get_offload_backend(OffloadConfig("model_level", device="cpu"))) is Recording
    finally:
        register_offload_backend(OffloadStrategy.MODEL_LEVEL, ModelLevelOffloadBackend)
    assert type(get_offload_backend(OffloadConfig("model_level", device="cpu"))) is ModelLevelOffloadBackend


@pytest.mark.parametrize(
    "strategy, backend, error, match",
    [
        ("none", ModelLevelOffloadBackend, ValueError, "strategy 'none' installs nothing"),
        ("layerwise", "no_colon_path", ValueError, "backend='no_colon_path' must look like 'package.module:ClassName'"),
        ("layerwise", object, TypeError, "must be an OffloadBackend subclass"),
        ("sideways", ModelLevelOffloadBackend, ValueError, "sideways"),
    ],
)
def test_registration_errors(strategy, backend, error, match):
    with pytest.raises(error, match=match):
        register_offload_backend(strategy, backend)


def test_distributed_variants_are_two_classes_picked_by_use_allgather():
    assert AllGatherLayerwiseOffloadBackend.use_allgather and not DistributedLayerwiseOffloadBackend.use_allgather
    assert issubclass(AllGatherLayerwiseOffloadBackend, DistributedLayerwiseOffloadBackend)
    # Built directly with the other mode's config, a variant refuses (before it needs a process group).
    config = OffloadConfig("distributed_layerwise", device="cpu", use_allgather=True)
    with pytest.raises(ValueError, match="serves use_allgather=False, got use_allgather=True.*for_config"):
        DistributedLayerwiseOffloadBackend(config)
    config = OffloadConfig("distributed_layerwise", device="cpu", use_allgather=False)
    with pytest.raises(ValueError, match="serves use_allgather=True, got use_allgather=False"):
        AllGatherLayerwiseOffloadBackend(config)
