"""NextStep-1.1 (``diffusers_omni.architectures.nextstep``) against vllm-omni 0.30.0's implementation.

``data/nextstep_golden.safetensors`` holds the reference's outputs for the tiny pipeline of
``diffusers_omni.testing.tiny_nextstep`` (seed 0), loaded into the reference model; ``data/README.md`` says how they
were made. ``data/nextstep_manifest.json`` lists the published checkpoint's parameter names and shapes.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from diffusers_omni.architectures.nextstep import NextStep11Pipeline, NextStepKVCache, NextStepModel
from diffusers_omni.architectures.nextstep.modeling_nextstep import config_from_published
from diffusers_omni.testing.tiny_nextstep import tiny_nextstep_pipeline

DATA = Path(__file__).parent / "data"


@pytest.fixture(scope="module")
def golden():
    return load_file(DATA / "nextstep_golden.safetensors")


@pytest.fixture(scope="module")
def pipe():
    pipe = tiny_nextstep_pipeline(0)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def test_published_names_and_shapes_match_the_manifest():
    manifest = json.loads((DATA / "nextstep_manifest.json").read_text())
    with torch.device("meta"):
        model = NextStepModel(**config_from_published(manifest["config"]))
    ours = {name: list(tensor.shape) for name, tensor in model.state_dict().items()}
    assert ours == manifest["parameters"]


def test_backbone_matches_reference_with_padding_and_cache(pipe, golden):
    model = pipe.model
    embeds, mask = golden["backbone.embeds"], golden["backbone.mask"]
    cache = NextStepKVCache(len(model.layers))
    with torch.no_grad():
        prefill = model(embeds[:, :6], attention_mask=mask[:, :6], kv_cache=cache).last_hidden_state
        step1 = model(embeds[:, 6:7], attention_mask=mask[:, :7], kv_cache=cache).last_hidden_state
        step2 = model(embeds[:, 7:8], attention_mask=mask[:, :8], kv_cache=cache).last_hidden_state
    # Left-padding rows (batch 0, tokens 0-1) carry no meaning in either implementation.
    torch.testing.assert_close(prefill[0, 2:], golden["backbone.prefill"][0, 2:], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(prefill[1], golden["backbone.prefill"][1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(step1, golden["backbone.step1"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(step2, golden["backbone.step2"], rtol=1e-5, atol=1e-5)


def test_flow_matching_head_matches_reference(pipe, golden):
    sample = pipe.model.image_head.sample(
        golden["head.cond"], cfg=3.0, cfg_mult=2, timesteps_shift=2.0, num_sampling_steps=4,
        generator=torch.Generator().manual_seed(7),
    )
    torch.testing.assert_close(sample, golden["head.sample"], rtol=1e-5, atol=1e-5)


def test_vae_decode_matches_reference(pipe, golden):
    with torch.no_grad():
        decoded = pipe.vae.decode(golden["vae.latents"]).sample
    torch.testing.assert_close(decoded, golden["vae.decoded"], rtol=1e-4, atol=1e-4)


CASES = {
    "cfg": dict(guidance_scale=3.0, negative_prompt="blurry", use_norm=True, timesteps_shift=1.0),
    "linear": dict(guidance_scale=4.0, use_norm=False, timesteps_shift=2.0, cfg_schedule="linear"),
    "nocfg": dict(guidance_scale=1.0, use_norm=True, timesteps_shift=1.0),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_text_to_image_matches_reference(pipe, golden, case):
    image = pipe(
        "a red cat", positive_prompt="best quality.", height=16, width=16, num_inference_steps=2,
        generator=torch.Generator().manual_seed(0), output_type="pt", **CASES[case],
    ).images
    torch.testing.assert_close(image, golden[f"pipeline.{case}"], rtol=1e-4, atol=1e-4)


def test_same_generator_same_bits_and_output_types(pipe):
    kwargs = dict(height=16, width=16, num_inference_steps=2, guidance_scale=2.0)
    again = pipe("a cat", generator=torch.Generator().manual_seed(3), output_type="pt", **kwargs).images
    first = pipe("a cat", generator=torch.Generator().manual_seed(3), output_type="pt", **kwargs).images
    assert torch.equal(first, again)
    latents = pipe("a cat", generator=torch.Generator().manual_seed(3), output_type="latent", **kwargs).images
    assert latents.shape == (1, 16, 8, 8)
    pil = pipe(["a cat", "a dog"], generator=torch.Generator().manual_seed(3), **kwargs).images
    assert [im.size for im in pil] == [(16, 16), (16, 16)]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(height=18), "height=18 must be a positive multiple of 4"),
        (dict(width=0), "width=0 must be a positive multiple of 4"),
        (dict(cfg_schedule="cosine"), "cfg_schedule='cosine' is not one of ['constant', 'linear']"),
        (dict(output_type="tensor"), "output_type='tensor' is not one of"),
        (dict(num_images_per_prompt=0), "num_images_per_prompt=0 must be a positive integer"),
    ],
)
def test_bad_arguments_are_refused(pipe, kwargs, message):
    base = dict(height=16, width=16, num_inference_steps=1)
    with pytest.raises(ValueError) as info:
        pipe("a cat", **{**base, **kwargs})
    assert message in str(info.value)


@pytest.mark.parametrize("omni", [False, True])
def test_published_layout_round_trip(pipe, tmp_path, omni):
    from diffusers_omni.pipelines.nextstep import OmniNextStep11Pipeline

    pipe.save_published(tmp_path)
    assert sorted(p.name for p in (tmp_path / "vae").iterdir()) == ["checkpoint.pt", "config.json"]
    loaded = (OmniNextStep11Pipeline if omni else NextStep11Pipeline).from_pretrained(tmp_path)
    assert type(loaded) is (OmniNextStep11Pipeline if omni else NextStep11Pipeline)
    loaded.set_progress_bar_config(disable=True)
    public = lambda config: {k: v for k, v in config.items() if not k.startswith("_")}  # noqa: E731
    assert public(loaded.model.config) == public(pipe.model.config)
    for name, tensor in pipe.model.state_dict().items():
        assert torch.equal(loaded.model.state_dict()[name], tensor), name
    kwargs = dict(height=16, width=16, num_inference_steps=2, guidance_scale=2.0, output_type="pt")
    a = pipe("a cat", generator=torch.Generator().manual_seed(5), **kwargs).images
    b = loaded("a cat", generator=torch.Generator().manual_seed(5), **kwargs).images
    assert torch.equal(a, b)


def test_published_layout_needs_nextstep_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match="model_type='llama'; expected 'nextstep'"):
        NextStep11Pipeline.from_pretrained(tmp_path)


@pytest.mark.parametrize("omni", [False, True])
def test_save_pretrained_round_trip(pipe, tmp_path, omni):
    from diffusers_omni.pipelines.nextstep import OmniNextStep11Pipeline

    pipe.save_pretrained(tmp_path)
    loaded = (OmniNextStep11Pipeline if omni else NextStep11Pipeline).from_pretrained(tmp_path)
    loaded.set_progress_bar_config(disable=True)
    kwargs = dict(height=16, width=16, num_inference_steps=2, guidance_scale=2.0, output_type="pt")
    a = pipe("a cat", generator=torch.Generator().manual_seed(5), **kwargs).images
    b = loaded("a cat", generator=torch.Generator().manual_seed(5), **kwargs).images
    assert torch.equal(a, b)


def test_a_processor_run_twice_in_one_forward_leaves_the_cache_as_once(pipe, golden):
    """Tools that re-run an attention module on the same inputs (``diffusers-omni compare``) must not grow the
    cache twice."""
    model = pipe.model
    embeds, mask = golden["backbone.embeds"], golden["backbone.mask"]
    attention = model.layers[0].self_attn

    def again(module, args, kwargs, output):
        module.processor(module, *args, **kwargs)

    def run():
        cache = NextStepKVCache(len(model.layers))
        with torch.no_grad():
            model(embeds[:, :6], attention_mask=mask[:, :6], kv_cache=cache)
            out = model(embeds[:, 6:7], attention_mask=mask[:, :7], kv_cache=cache).last_hidden_state
        return out, cache.seq_length()

    expected = run()
    handle = attention.register_forward_hook(again, with_kwargs=True)
    try:
        twice = run()
    finally:
        handle.remove()
    assert twice[1] == expected[1] == 7
    assert torch.equal(twice[0], expected[0])


def test_published_layout_loads_in_the_dtype_asked(pipe, tmp_path):
    pipe.save_published(tmp_path)
    loaded = NextStep11Pipeline.from_pretrained(tmp_path, torch_dtype=torch.bfloat16)
    assert {p.dtype for p in loaded.model.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in loaded.vae.parameters()} == {torch.bfloat16}
    image = loaded("a cat", height=16, width=16, num_inference_steps=1, output_type="pt",
                   generator=torch.Generator().manual_seed(0)).images
    assert image.shape == (1, 3, 16, 16) and torch.isfinite(image).all()


def test_generation_position_table_matches_reference(golden):
    pipe = tiny_nextstep_pipeline(0, use_gen_pos_embed=True)
    pipe.set_progress_bar_config(disable=True)
    image = pipe(
        "a red cat", positive_prompt="best quality.", height=16, width=16, num_inference_steps=2,
        generator=torch.Generator().manual_seed(0), output_type="pt", **CASES["cfg"],
    ).images
    torch.testing.assert_close(image, golden["pipeline.gen_pos_embed"], rtol=1e-4, atol=1e-4)
