"""Pickling and deep-copying an omnified pipeline (issue 39 item 8). Before: ``pickle.dumps(omnify(pipe))``
failed with "PicklingError: args[0] from __newobj__ args has the wrong class" (a routed attention processor
reduced itself as the stock processor it stands for). Now the copy is an Omni pipeline with omni attention
applied again (same config, same report) that gives the same output bitwise; an offloaded pipeline is refused
(tests/offload/test_misuse.py)."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch

from diffusers_omni import omnify
from diffusers_omni.attention.processors import is_omni_processor
from diffusers_omni.installer import is_attention_applied
from diffusers_omni.testing import tiny_flux_pipeline

ROUND_TRIPS = {
    "pickle": lambda obj: pickle.loads(pickle.dumps(obj)),
    "torch.save": None,  # filled below (needs a buffer)
    "deepcopy": copy.deepcopy,
}


def _torch_round_trip(obj):
    import io

    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


ROUND_TRIPS["torch.save"] = _torch_round_trip


def generate(pipe) -> torch.Tensor:
    return pipe(prompt="a red fox in the snow", num_inference_steps=2, generator=torch.Generator().manual_seed(0),
                output_type="latent", max_sequence_length=32, height=32, width=32, guidance_scale=3.5)[0]


def attention_modules(model):
    return {name: module for name, module in model.named_modules() if hasattr(module, "processor")}


@pytest.mark.parametrize("how", list(ROUND_TRIPS))
def test_an_omnified_pipeline_round_trips_with_omni_attention_and_the_same_output(how):
    pipe = omnify(tiny_flux_pipeline())  # omni attention on (the default), no offload
    reference = generate(pipe)
    clone = ROUND_TRIPS[how](pipe)
    assert type(clone) is type(pipe) and clone is not pipe and clone.transformer is not pipe.transformer
    assert is_attention_applied(clone.transformer)
    assert clone.omni_attention_report() == pipe.omni_attention_report()
    assert torch.equal(generate(clone), reference)
    processors = {n: type(m.processor) for n, m in attention_modules(clone.transformer).items()}
    assert processors == {n: type(m.processor) for n, m in attention_modules(pipe.transformer).items()}
    assert all(is_omni_processor(m.processor) for m in attention_modules(clone.transformer).values())
    # The clone's omni attention is its own: removing it restores Diffusers' processors there only.
    clone.disable_omni_attention()
    assert not any(is_omni_processor(m.processor) for m in attention_modules(clone.transformer).values())
    assert all(is_omni_processor(m.processor) for m in attention_modules(pipe.transformer).values())
    assert torch.equal(generate(clone), reference) and torch.equal(generate(pipe), reference)


def test_a_pickled_transformer_alone_runs_with_omni_attention_again():
    pipe = omnify(tiny_flux_pipeline())
    clone = pickle.loads(pickle.dumps(pipe.transformer))
    assert is_attention_applied(clone)
    assert clone.state_dict().keys() == pipe.transformer.state_dict().keys()
    assert all(torch.equal(a, b) for a, b in zip(clone.state_dict().values(), pipe.transformer.state_dict().values()))
    pipe.transformer = clone
    reference = generate(omnify(tiny_flux_pipeline()))
    assert torch.equal(generate(pipe), reference)
    assert all(is_omni_processor(m.processor) for m in attention_modules(clone).values())


def test_a_model_with_set_default_attn_processor_round_trips():
    """SDXL's UNet has ``set_default_attn_processor``, which omni attention reroutes on the instance: before, a
    local function there made pickling fail ("Can't pickle local object")."""
    from diffusers_omni.testing.tiny_sdxl import tiny_sdxl_pipeline

    def run(pipe):
        return pipe(prompt="a red fox", num_inference_steps=2, generator=torch.Generator().manual_seed(0),
                    output_type="latent", height=32, width=32).images

    pipe = omnify(tiny_sdxl_pipeline())
    # Pickled before a call: transformers' CLIP text encoder keeps a local output-capturing hook after one, which
    # no pickle takes (stock Diffusers' pipeline alike).
    clone = pickle.loads(pickle.dumps(pipe))
    reference = run(pipe)
    assert torch.equal(run(clone), reference)
    assert all(is_omni_processor(m.processor) for m in attention_modules(clone.unet).values())
    clone.unet.set_default_attn_processor()  # the clone's own: the original keeps omni attention
    assert not is_attention_applied(clone.unet) and is_attention_applied(pipe.unet)
    assert not any(is_omni_processor(m.processor) for m in attention_modules(clone.unet).values())
