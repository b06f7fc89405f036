"""BAGEL numerics against the reference implementation (ByteDance-Seed/Bagel), on a tiny random config.

The golden tensors in ``data/bagel_golden.safetensors`` were made with the reference code (``golden_gen_bagel.py``
says how; ``data/README.md`` what was changed to run it on CPU). Our ``BagelModel`` gets the same weights from the
parameter names, so any name that differs from the reference's, or any arithmetic that differs, shows here. Both
sides run in float32; the reference's attention ran as plain softmax attention, ours through Diffusers' dispatch
(SDPA), so results agree to float32 rounding rather than bitwise.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from diffusers_omni.architectures.bagel import BagelKVCache, BagelPipeline
from diffusers_omni.testing.tiny_bagel import tiny_bagel_components, tiny_bagel_model

from .bagel_helpers import GOLDEN, fill_golden_weights

# float32 with a different attention kernel on each side: rounding-level differences only.
ATOL = RTOL = 2e-5


@pytest.fixture(scope="module")
def golden():
    return load_file(GOLDEN)


@pytest.fixture(scope="module")
def pipe():  # noqa: D103
    components = tiny_bagel_components()
    bagel = tiny_bagel_model(len(components["tokenizer"]), max_latent_size=8).eval()  # the goldens' config
    fill_golden_weights(bagel)
    components["bagel"] = bagel
    pipe = BagelPipeline(**components)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def test_golden_prompt_uses_the_tokenizers_bagel_tokens(pipe, golden):
    ids = golden["prompt_ids"].tolist()
    assert ids[0] == pipe.tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert ids[-1] == pipe.tokenizer.convert_tokens_to_ids("<|im_end|>")


@torch.no_grad()
def test_understanding_hidden_states_and_logits_match_reference(pipe, golden):
    ids = golden["prompt_ids"]
    backbone = pipe.bagel.backbone
    hidden, cache = backbone(backbone.embed_tokens(ids), torch.arange(len(ids)), mode="und")
    assert cache is None
    torch.testing.assert_close(hidden, golden["und_hidden"], atol=ATOL, rtol=RTOL)
    logits = pipe.bagel.language_model.lm_head(hidden[-1:])
    torch.testing.assert_close(logits, golden["und_logits"], atol=ATOL, rtol=RTOL)


@torch.no_grad()
def test_generation_velocity_matches_reference(pipe, golden):
    context = pipe.prefill(golden["prompt_ids"].tolist())
    assert context[1] == len(golden["prompt_ids"]) and context[0].length == len(golden["prompt_ids"])
    markers = torch.tensor([pipe.tokenizer.convert_tokens_to_ids(t) for t in ("<|vision_start|>", "<|vision_end|>")])
    v = pipe.bagel.predict_velocity(golden["noise"], torch.tensor(1.0), markers,
                                    pipe.bagel.latent_position_ids(16, 12), context[1], context[0])
    torch.testing.assert_close(v, golden["v_cond_t1"], atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("name, scale, renorm", [
    ("latents_nocfg", 1.0, "global"),
    ("latents_cfg4_global", 4.0, "global"),
    ("latents_cfg4_channel", 4.0, "channel"),
])
@torch.no_grad()
def test_denoising_loop_matches_reference(pipe, golden, name, scale, renorm):
    context = pipe.prefill(golden["prompt_ids"].tolist())
    uncond = (BagelKVCache.empty(2), 0)
    latents = pipe.denoise(golden["noise"].clone(), 16, 12, context, uncond, num_inference_steps=4,
                           timestep_shift=3.0, guidance_scale=scale, cfg_interval=(0.4, 1.0), cfg_renorm_type=renorm,
                           cfg_renorm_min=0.0)
    torch.testing.assert_close(latents, golden[name], atol=ATOL, rtol=RTOL)
    # The guidance is real: it moves the result away from the unguided one.
    if scale > 1:
        assert not torch.allclose(latents, golden["latents_nocfg"], atol=1e-3)


def _golden_prompt(pipe, golden, monkeypatch) -> str:
    """A prompt that encodes to the goldens' ids (the tokenizer's byte mapping is not what is compared here)."""
    ids = golden["prompt_ids"].tolist()
    monkeypatch.setattr(pipe, "encode_prompt", lambda text: ids if text == "golden prompt" else None)
    return "golden prompt"


def _reference_answer(pipe, ids) -> str:
    # The reference decodes the generated ids (starting with <|im_start|>) and keeps what follows it.
    return pipe.tokenizer.decode(ids.tolist()).split("<|im_end|>")[0].split("<|im_start|>")[1]


@torch.no_grad()
def test_image_understanding_matches_reference(pipe, golden, monkeypatch):
    """An image through the SigLIP tower and the connector, then the prompt, then greedy decoding."""
    pixels = torch.rand(3, 28, 42, generator=torch.Generator().manual_seed(99)) * 2 - 1  # as golden_gen_bagel.py
    special = pipe._special_ids()
    markers = torch.tensor([special["<|vision_start|>"], special["<|vision_end|>"]])
    cache = pipe.bagel.prefill_image(pixels, markers, BagelKVCache.empty(2), 0)
    assert cache.length == 2 * 3 + 2
    ids = golden["prompt_ids"]
    cache = pipe.bagel.prefill(ids, cache, 1)  # the image takes one rotary position
    logits, _ = pipe.bagel.next_token_logits(torch.tensor(special["<|im_start|>"]), cache, 1 + len(ids))
    torch.testing.assert_close(logits[None], golden["image_first_logits"], atol=ATOL, rtol=RTOL)
    answer = pipe.understand(_golden_prompt(pipe, golden, monkeypatch), image=pixels, max_new_tokens=8)
    assert answer == _reference_answer(pipe, golden["image_text_ids"])


@torch.no_grad()
def test_text_understanding_matches_reference(pipe, golden, monkeypatch):
    answer = pipe.understand(_golden_prompt(pipe, golden, monkeypatch), max_new_tokens=8)
    assert answer == _reference_answer(pipe, golden["text_text_ids"])
