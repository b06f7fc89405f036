import torch

from diffusers_omni import OmniFluxPipeline
from diffusers_omni.offload.model_level import ModelLevelOffloadBackend
from diffusers_omni.testing import tiny_flux_pipeline


class SplitModelPipeline(OmniFluxPipeline):
    """A pipeline that decides its own model-level swap points (as split models such as Cosmos3 do)."""

    delegated_configs = []

    def enable_omni_model_cpu_offload(self, config):
        type(self).delegated_configs.append(config)
        return ModelLevelOffloadBackend(config).enable(self)


def test_model_level_offload_is_delegated_to_the_pipeline():
    pipe = tiny_flux_pipeline(pipeline_cls=SplitModelPipeline)
    backend = pipe.enable_model_level_offload(device="cpu")
    assert SplitModelPipeline.delegated_configs and SplitModelPipeline.delegated_configs[-1].strategy.value == "model_level"
    assert pipe.omni_offload_backend is backend and backend.is_enabled()
    assert pipe._execution_device == torch.device("cpu")
    pipe.disable_omni_offload()
    assert not backend.is_enabled()


def test_layerwise_is_not_delegated():
    SplitModelPipeline.delegated_configs.clear()
    pipe = tiny_flux_pipeline(pipeline_cls=SplitModelPipeline)
    pipe.enable_layerwise_offload(device="cpu")
    assert SplitModelPipeline.delegated_configs == []
    pipe.disable_omni_offload()
