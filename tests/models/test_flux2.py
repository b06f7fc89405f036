"""FLUX.2 Klein: joint + parallel single-stream attention, the KV-cache variant's two calls per processor, and
omni attention staying applied when ``Flux2KleinKVPipeline`` swaps the shared transformer's processors."""

from __future__ import annotations

import torch
from diffusers import Flux2KleinInpaintPipeline, Flux2KleinKVPipeline
from diffusers.models.transformers.transformer_flux2 import Flux2KVAttnProcessor
from PIL import Image

import diffusers_omni
from diffusers_omni import omnify
from diffusers_omni.attention.backends.sdpa import TorchSDPABackend
from diffusers_omni.attention.processors import is_omni_processor
from diffusers_omni.models.flux2 import OmniFlux2KVAttnProcessor, OmniFlux2KVParallelSelfAttnProcessor
from diffusers_omni.pipelines.flux2 import (
    OmniFlux2KleinInpaintPipeline,
    OmniFlux2KleinKVPipeline,
    OmniFlux2KleinPipeline,
)
from diffusers_omni.testing.tiny_flux2 import TINY_FLUX2_TEXT_LAYERS, tiny_flux2_klein_pipeline

from .harness import ModelCase, standard_tests

REFERENCE = Image.new("RGB", (64, 64), (120, 60, 30))  # FLUX.2 refuses reference images under 64 px
MASK = Image.new("L", (64, 64), 0)
MASK.paste(255, (16, 16, 48, 48))
SMALL = {
    "prompt": "a red fox",
    "height": 32,
    "width": 32,
    "num_inference_steps": 2,
    "output_type": "latent",
    "max_sequence_length": 16,
    "text_encoder_out_layers": TINY_FLUX2_TEXT_LAYERS,
}
EDIT = {**SMALL, "image": REFERENCE}
ROLES = {"flux2.joint": "self", "flux2.single": "self"}
KV_ROLES = {**ROLES, "flux2.reference": "self"}


def _klein(pipeline_cls):
    return lambda pipeline_cls_=None: tiny_flux2_klein_pipeline(pipeline_cls=pipeline_cls)


CASES = [
    ModelCase("klein", tiny_flux2_klein_pipeline, OmniFlux2KleinPipeline, SMALL, ROLES),
    ModelCase("klein_edit", tiny_flux2_klein_pipeline, OmniFlux2KleinPipeline, EDIT, ROLES),
    ModelCase(
        "klein_inpaint",
        _klein(Flux2KleinInpaintPipeline),
        OmniFlux2KleinInpaintPipeline,
        {**EDIT, "mask_image": MASK, "strength": 0.7, "num_inference_steps": 3},
        ROLES,
    ),
    ModelCase("klein_kv", _klein(Flux2KleinKVPipeline), OmniFlux2KleinKVPipeline, EDIT, KV_ROLES),
]

globals().update(standard_tests(CASES))


def _run(pipe, call=EDIT) -> torch.Tensor:
    return pipe(**call, generator=torch.Generator().manual_seed(0)).images


class _CountingSDPA(TorchSDPABackend):
    name = "COUNTING_FLUX2_TEST"
    calls: list = []

    def __call__(self, query, key, value, *args, **kwargs):
        type(self).calls.append((query.shape[1], key.shape[1]))
        return super().__call__(query, key, value, *args, **kwargs)


def test_kv_pipeline_routes_the_reference_self_attention_through_its_own_role():
    expected = _run(tiny_flux2_klein_pipeline(pipeline_cls=Flux2KleinKVPipeline))
    diffusers_omni.register_backend(_CountingSDPA.name, _CountingSDPA)
    _CountingSDPA.calls = []
    try:
        pipe = omnify(
            tiny_flux2_klein_pipeline(pipeline_cls=Flux2KleinKVPipeline),
            {"default": "TORCH_SDPA", "per_role": {"flux2.reference": _CountingSDPA.name}},
        )
        assert torch.equal(_run(pipe), expected)
    finally:
        from diffusers_omni.attention.registry import reset_backend

        reset_backend(_CountingSDPA.name)
    # Only the first (extract) step makes the reference call: once per block, reference tokens over themselves.
    ref_tokens = (64 // 4) ** 2
    assert _CountingSDPA.calls == [(ref_tokens, ref_tokens)] * 2


def test_kv_pipeline_built_on_an_omni_transformer_reapplies_omni_attention():
    expected = _run(tiny_flux2_klein_pipeline(pipeline_cls=Flux2KleinKVPipeline))

    pipe = omnify(tiny_flux2_klein_pipeline(), "TORCH_SDPA")
    kv = Flux2KleinKVPipeline(**pipe.components)  # a plain Diffusers pipeline: swaps the shared processors
    attn = pipe.transformer.transformer_blocks[0].attn
    assert type(attn.processor) is Flux2KVAttnProcessor

    assert torch.equal(_run(kv), expected)
    assert type(attn.processor) is OmniFlux2KVAttnProcessor
    assert type(pipe.transformer.single_transformer_blocks[0].attn.processor) is OmniFlux2KVParallelSelfAttnProcessor
    assert {e["role"] for e in pipe.omni_attention_report()} == set(KV_ROLES)
    assert all(is_omni_processor(p) for p in pipe.transformer.attn_processors.values())

    # The Klein pipeline sharing that transformer now runs the KV processors without KV arguments: as stock does.
    stock = tiny_flux2_klein_pipeline()
    Flux2KleinKVPipeline(**stock.components)
    assert torch.equal(_run(pipe, SMALL), _run(stock, SMALL))
