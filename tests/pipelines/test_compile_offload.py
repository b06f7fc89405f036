"""``torch.compile(fullgraph=True)`` on a component of an offloaded Omni pipeline (issue 39 item 8). Before: the
call ran the text encoders, then failed inside Dynamo with "Skip inlining `torch.compiler.disable()`d function"
(the offload hooks cannot be traced). Now the pipeline call, and enabling an offload over such a component, are
refused up front, before anything runs, naming the component and the ways out; compiling without fullgraph works.
A bare model called directly keeps Dynamo's refusal, whose reason says the same
(tests/offload/test_diffusers_features.py; docs/user_guide/offload.md)."""

from __future__ import annotations

import pytest
import torch

from diffusers_omni import OmniFluxPipeline
from diffusers_omni.offload.discovery import OffloadConflictError
from diffusers_omni.testing import tiny_flux_pipeline

WAY_OUT = ("torch.compile(model) (fullgraph=False", "compile_repeated_blocks(fullgraph=False)",
           "disable_omni_offload()")


def generate(pipe) -> torch.Tensor:
    return pipe(prompt="a red fox", num_inference_steps=1, generator=torch.Generator().manual_seed(0),
                output_type="latent", height=32, width=32, max_sequence_length=32)[0]


def compile_whole(pipe):
    pipe.transformer = torch.compile(pipe.transformer, fullgraph=True, backend="eager")


def compile_method(pipe):
    pipe.transformer.compile(fullgraph=True, backend="eager")


def compile_regional(pipe):
    pipe.transformer.compile_repeated_blocks(fullgraph=True, backend="eager")


HOW = {"torch.compile(model)": compile_whole, "model.compile()": compile_method,
       "compile_repeated_blocks": compile_regional}


def calls_text_encoder(pipe):
    calls = []
    handle = pipe.text_encoder.register_forward_pre_hook(lambda *_: calls.append(1))
    return calls, handle


@pytest.mark.parametrize("how", list(HOW))
def test_a_fullgraph_compiled_component_under_offload_is_refused_before_the_call_runs(how):
    torch._dynamo.reset()
    pipe = tiny_flux_pipeline(pipeline_cls=OmniFluxPipeline)
    pipe.enable_layerwise_offload(device="cpu")
    HOW[how](pipe)
    calls, handle = calls_text_encoder(pipe)
    with pytest.raises(OffloadConflictError) as caught:
        generate(pipe)
    handle.remove()
    message = str(caught.value)
    assert "'transformer'" in message and "fullgraph=True" in message, message
    assert all(way in message for way in WAY_OUT), message
    assert calls == []  # refused before the text encoders ran
    torch._dynamo.reset()


def test_enabling_offload_over_a_fullgraph_compiled_component_is_refused_and_graph_breaks_work():
    torch._dynamo.reset()
    pipe = tiny_flux_pipeline(pipeline_cls=OmniFluxPipeline)
    reference = generate(pipe)
    pipe.transformer.compile(fullgraph=True, backend="eager")
    with pytest.raises(OffloadConflictError, match=r"'transformer'.*fullgraph=True"):
        pipe.enable_layerwise_offload(device="cpu")
    assert pipe.omni_offload_backend is None
    torch._dynamo.reset()
    pipe.transformer.compile(backend="eager")  # the way out: graph breaks at the offload hooks
    pipe.enable_layerwise_offload(device="cpu")
    assert torch.equal(generate(pipe), reference)
    pipe.disable_omni_offload()
    torch._dynamo.reset()
