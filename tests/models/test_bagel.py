"""BAGEL (``Qwen2MoTModel``): one grouped-query attention call per layer, routed by the forward's mode to
``bagel.understanding`` (the prompt, causal) or ``bagel.generation`` (the image tokens, bidirectional over the
prompt's cache)."""

from __future__ import annotations

import pytest
import torch
from diffusers.models.attention_processor import AttnProcessor2_0

from diffusers_omni import omnify
from diffusers_omni.architectures.bagel import BagelKVCache, BagelMoTAttnProcessor
from diffusers_omni.attention.processors import is_omni_processor
from diffusers_omni.models.base import blocks_attrs_for, declaration_for
from diffusers_omni.pipelines.bagel import OmniBagelPipeline
from diffusers_omni.testing.tiny_bagel import tiny_bagel_pipeline

from .harness import ModelCase, check_bitwise_parity, check_every_call_reaches_its_role, check_omnify_report

ROLES = {"bagel.understanding": "self", "bagel.generation": "self"}
CALL = {"prompt": "a red cube", "height": 16, "width": 12, "num_inference_steps": 3, "output_type": "latent"}


def _factory(pipeline_cls=None):
    pipe = tiny_bagel_pipeline(pipeline_cls=pipeline_cls)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _attention_modules(bagel):
    return {f"language_model.model.{name}": module for name, module in bagel.backbone.named_modules()
            if hasattr(module, "set_processor")}


CASE = ModelCase("bagel", _factory, OmniBagelPipeline, CALL, ROLES, dits=("bagel",),
                 attention_modules=_attention_modules)


def test_omnify_report_lists_every_attention_module():
    check_omnify_report(CASE)


def test_torch_sdpa_bitwise_equal_to_stock_pipeline():
    check_bitwise_parity(CASE)


def test_every_attention_call_reaches_its_role():
    check_every_call_reaches_its_role(CASE)


def test_declaration_covers_the_backbone_with_its_layers():
    pipe = _factory()
    backbone = pipe.bagel.backbone
    declaration = declaration_for(backbone)
    assert declaration.name == "bagel" and [r.role for r in declaration.roles] == list(ROLES)
    assert blocks_attrs_for(backbone) == ("layers",)
    assert set(OmniBagelPipeline._dit_modules) == {"bagel.language_model.model"}


def test_roles_get_their_own_backends_and_sources():
    pipe = omnify(_factory(), {"default": {"backend": "TORCH_SDPA"}, "per_role": {"bagel.generation": "TORCH_SDPA"}})
    sources = {entry["role"]: entry["source"] for entry in pipe.omni_attention_report()}
    assert sources == {"bagel.understanding": "default", "bagel.generation": "per_role['bagel.generation']"}
    with pytest.raises(ValueError, match="cross"):
        omnify(_factory(), {"default": {"backend": "TORCH_SDPA"}, "per_role": {"cross": "TORCH_SDPA"}})


def test_causal_prompt_and_bidirectional_generation_reach_the_backend(monkeypatch):
    from diffusers_omni.attention.backends.sdpa import backend as sdpa

    pipe = omnify(_factory(), "TORCH_SDPA")
    calls = []
    real = sdpa.sdpa_bshd

    def spy(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        calls.append((query.shape, key.shape, attn_mask, is_causal, enable_gqa))
        return real(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)

    monkeypatch.setattr(sdpa, "sdpa_bshd", spy)
    CASE.run(pipe)
    prompt = len(pipe.encode_prompt(CALL["prompt"]))
    tokens = (16 // 4) * (12 // 4) + 2  # generation tokens and the image's start and end markers
    prefill, steps = calls[:2], calls[2:]
    for q, k, mask, is_causal, gqa in prefill:  # one call per layer over the prompt alone
        assert is_causal and gqa and mask is None and q[1] == k[1] == prompt
        assert (q[2], k[2]) == (4, 2)
    # 2 Euler steps (t = 1 and 0.75 after the shift), both guided (t > 0.4): 2 forwards each, 2 layers each.
    assert len(steps) == 2 * 2 * 2
    for q, k, mask, is_causal, gqa in steps:
        assert not is_causal and gqa and mask is None and q[1] == tokens and k[1] in (tokens, tokens + prompt)


@torch.no_grad()
def test_text_extending_a_cache_sees_the_whole_cache_and_earlier_new_tokens():
    """Understanding mode after a cache: the same hidden states as running the whole text at once."""
    pipe = omnify(_factory(), "TORCH_SDPA")
    backbone = pipe.bagel.backbone
    ids = torch.tensor(pipe.encode_prompt("a red cube on a table"))
    whole, _ = backbone(backbone.embed_tokens(ids), torch.arange(len(ids)), mode="und")
    split = 5
    _, cache = backbone(backbone.embed_tokens(ids[:split]), torch.arange(split), mode="und", update_cache=True)
    assert isinstance(cache, BagelKVCache) and cache.length == split
    rest, extended = backbone(backbone.embed_tokens(ids[split:]), torch.arange(split, len(ids)), mode="und",
                              past_key_values=cache, update_cache=True)
    torch.testing.assert_close(rest, whole[split:], atol=1e-6, rtol=1e-5)
    assert extended.length == len(ids)


def test_bad_mode_and_missing_indexes_are_refused():
    backbone = _factory().bagel.backbone
    x = torch.zeros(3, 32)
    with pytest.raises(ValueError, match=r"mode='x' is not a BAGEL mode; allowed: \['und', 'gen'\]"):
        backbone(x, torch.arange(3), mode="x")
    with pytest.raises(ValueError, match="gen_indexes and text_indexes"):
        backbone(x, torch.arange(3), mode="gen")
    with pytest.raises(ValueError, match="update_cache=True is for mode='und'"):
        backbone(x, torch.arange(3), mode="gen", gen_indexes=torch.tensor([1]), text_indexes=torch.tensor([0, 2]),
                 update_cache=True)


def test_restored_stock_processors_are_replaced_again_and_unknown_ones_refused():
    expected = CASE.run(_factory())
    pipe = omnify(_factory(), "TORCH_SDPA")
    layers = pipe.bagel.backbone.layers
    for layer in layers:
        layer.self_attn.set_processor(layer.self_attn.processor.original)
    assert all(type(layer.self_attn.processor) is BagelMoTAttnProcessor for layer in layers)
    assert torch.equal(CASE.run(pipe), expected)
    assert all(is_omni_processor(layer.self_attn.processor) for layer in layers)
    layers[1].self_attn.set_processor(AttnProcessor2_0())
    with pytest.raises(TypeError, match=r"layers\.1\.self_attn.*AttnProcessor2_0"):
        CASE.run(pipe)
