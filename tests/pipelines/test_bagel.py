"""``BagelPipeline`` as its users run it (tiny config): text to image, deterministic with a generator; layerwise
offload bitwise equal to resident, model-level offload refused; inputs checked; both checkpoint layouts load."""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors.torch import save_file

import diffusers_omni
from diffusers_omni import omnify
from diffusers_omni.architectures.bagel import BagelPipeline
from diffusers_omni.pipelines.bagel import OmniBagelPipeline
from diffusers_omni.testing.tiny_bagel import TINY_BAGEL_VIT, tiny_bagel_llm, tiny_bagel_pipeline

CALL = {"prompt": "a red cube", "height": 16, "width": 12, "num_inference_steps": 3}


def _pipe(cls=None):
    pipe = tiny_bagel_pipeline(pipeline_cls=cls)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _run(pipe, **kwargs):
    return pipe(**{**CALL, "output_type": "pt", **kwargs}, generator=torch.Generator().manual_seed(0)).images


def test_exported_at_the_package_root_with_block_attributes():
    assert diffusers_omni.BagelPipeline is BagelPipeline
    assert diffusers_omni.OmniBagelPipeline is OmniBagelPipeline
    assert diffusers_omni.Qwen2MoTModel._layerwise_offload_blocks_attrs == ("layers",)
    assert OmniBagelPipeline._dit_modules == ("bagel.language_model.model",)
    assert OmniBagelPipeline._vae_modules == ("vae",)
    assert "bagel.time_embedder" in OmniBagelPipeline._resident_modules


def test_text_to_image_is_deterministic_and_the_prompt_matters():
    pipe = _pipe()
    image = _run(pipe)
    assert image.shape == (1, 3, 16, 12) and 0 <= image.min() and image.max() <= 1
    assert torch.equal(_run(pipe), image)
    assert not torch.equal(_run(pipe, prompt="a blue sphere"), image)
    pil = pipe(**CALL, generator=torch.Generator().manual_seed(0)).images[0]
    assert pil.size == (12, 16)
    two = pipe(**{**CALL, "prompt": ["a", "b"]}, output_type="latent", generator=torch.Generator().manual_seed(0))
    assert two.images.shape == (2, 4, 8, 6)


def test_given_latents_replace_the_generator():
    pipe = _pipe()
    noise = torch.randn(1, 12, 16, generator=torch.Generator().manual_seed(0))
    assert torch.equal(_run(pipe, latents=noise), _run(pipe))


def test_layerwise_offload_bitwise_equal_to_resident_over_repeated_calls():
    expected = _run(_pipe())
    pipe = omnify(_pipe(), "TORCH_SDPA")
    backend = pipe.enable_layerwise_offload(device="cpu")
    streamed = {label for label, _, _ in backend.members()}
    assert "bagel.language_model.model" in streamed
    for _ in range(2):
        assert torch.equal(_run(pipe), expected)
        assert not any(unit.onloaded for unit in backend._state.units)
    pipe.disable_omni_offload()
    assert torch.equal(_run(pipe), expected)


def test_model_level_offload_is_refused_with_nothing_enabled():
    pipe = omnify(_pipe(), "TORCH_SDPA")
    with pytest.raises(ValueError, match=r"model-level offload is not supported for BagelPipeline.*layerwise"):
        pipe.enable_model_level_offload(device="cpu")
    assert pipe.omni_offload_backend is None
    pipe.enable_layerwise_offload(device="cpu")  # still possible afterwards


@pytest.mark.parametrize("kwargs, message", [
    ({"height": 18}, r"height=18 is not allowed: BAGEL needs a positive multiple of 4 .* at most 64"),
    ({"width": 128}, r"width=128 is not allowed"),
    ({"num_inference_steps": 1}, r"num_inference_steps=1 is not allowed: .*at least 2"),
    ({"cfg_renorm_type": "none"}, r"cfg_renorm_type='none' is not allowed; allowed: \['global', 'channel', "),
    ({"cfg_interval": (0.8, 0.2)}, r"cfg_interval=\(0.8, 0.2\) is not allowed"),
    ({"output_type": "jpg"}, r"output_type='jpg' is not allowed; allowed: \['pil', 'np', 'pt', 'latent'\]"),
    ({"latents": torch.zeros(1, 5, 16)}, r"latents of shape \(1, 5, 16\) do not fit: \(1, 12, 16\)"),
])
def test_bad_inputs_are_refused_naming_the_value(kwargs, message):
    with pytest.raises(ValueError, match=message):
        _pipe()(**{**CALL, **kwargs})


def test_save_pretrained_round_trip(tmp_path):
    pipe = _pipe()
    expected = _run(pipe)
    pipe.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "model_index.json").read_text())["bagel"][1] == "BagelModel"
    loaded = BagelPipeline.from_pretrained(tmp_path)
    loaded.set_progress_bar_config(disable=True)
    assert torch.equal(_run(loaded), expected)


def _ldm_vae_state(vae) -> dict[str, torch.Tensor]:
    """The VAE's weights under the original (LDM / FLUX ``ae.safetensors``) key names, attention as 1×1 convs."""
    levels = len(vae.config.block_out_channels)
    out = {}
    for key, value in vae.state_dict().items():
        new = key.replace("conv_norm_out", "norm_out").replace("conv_shortcut", "nin_shortcut")
        new = re.sub(r"down_blocks\.(\d+)\.resnets\.", r"down.\1.block.", new)
        new = re.sub(r"down_blocks\.(\d+)\.downsamplers\.0\.", r"down.\1.downsample.", new)
        new = re.sub(r"up_blocks\.(\d+)\.resnets\.", lambda m: f"up.{levels - 1 - int(m[1])}.block.", new)
        new = re.sub(r"up_blocks\.(\d+)\.upsamplers\.0\.", lambda m: f"up.{levels - 1 - int(m[1])}.upsample.", new)
        new = re.sub(r"mid_block\.resnets\.(\d+)\.", lambda m: f"mid.block_{int(m[1]) + 1}.", new)
        if "mid_block.attentions.0." in new:
            new = new.replace("mid_block.attentions.0.", "mid.attn_1.").replace("group_norm", "norm")
            new = new.replace("to_q", "q").replace("to_k", "k").replace("to_v", "v").replace("to_out.0", "proj_out")
            if value.ndim == 2:
                value = value[:, :, None, None]
        out[new] = value.contiguous()
    return out


def test_published_bagel_layout_loads(tmp_path):
    """A directory laid out as ``ByteDance-Seed/BAGEL-7B-MoT`` publishes it (config, llm and vit configs, EMA
    weights, the VAE in its original key names, the tokenizer) loads into the same pipeline."""
    pipe = _pipe()
    expected = _run(pipe)
    vocab = len(pipe.tokenizer)
    llm = {**tiny_bagel_llm(vocab), "model_type": "qwen2", "tie_word_embeddings": False}
    vit = {**TINY_BAGEL_VIT, "num_hidden_layers": TINY_BAGEL_VIT["num_hidden_layers"] + 1, "model_type": "siglip"}
    (tmp_path / "llm_config.json").write_text(json.dumps(llm))
    (tmp_path / "vit_config.json").write_text(json.dumps(vit))
    # max_latent_size as stale as BAGEL's own config.json can be: the weights decide.
    top = {"latent_patch_size": 2, "max_latent_size": 32, "vit_max_num_patch_per_side": 4,
           "vae_config": {"z_channels": 4, "downsample": 2}}
    (tmp_path / "config.json").write_text(json.dumps(top))
    save_file({k: v.contiguous() for k, v in pipe.bagel.state_dict().items()}, tmp_path / "ema.safetensors")
    save_file(_ldm_vae_state(pipe.vae), tmp_path / "ae.safetensors")
    pipe.tokenizer.save_pretrained(tmp_path)
    vae_config = dict(pipe.vae.config)

    loaded = BagelPipeline.from_bagel_checkpoint(str(tmp_path), vae_config=vae_config)
    loaded.set_progress_bar_config(disable=True)
    assert loaded.bagel.max_latent_size == 16
    assert torch.equal(_run(loaded), expected)


def test_understanding_answers_text_deterministically_and_reads_the_image():
    from PIL import Image

    pipe = _pipe()
    image = Image.fromarray((torch.rand(50, 100, 3, generator=torch.Generator().manual_seed(0)) * 255).byte().numpy())
    pixels = pipe.prepare_image(image)
    # Published sizes scaled to the tiny tables: VAE resize to at most 64 (short side 32), then ViT to at most 56.
    assert pixels.shape == (3, 28, 56) and -1 <= pixels.min() and pixels.max() <= 1
    answer = pipe.understand("what is this?", image=image, max_new_tokens=6)
    assert isinstance(answer, str)
    assert pipe.understand("what is this?", image=image, max_new_tokens=6) == answer
    assert pipe.understand("what is this?", image=pixels, max_new_tokens=6) == answer
    text_only = pipe.understand("what is this?", max_new_tokens=6)
    assert isinstance(text_only, str)
    sampled = pipe.understand("what is this?", max_new_tokens=6, do_sample=True, temperature=1.0,
                              generator=torch.Generator().manual_seed(1))
    assert sampled == pipe.understand("what is this?", max_new_tokens=6, do_sample=True, temperature=1.0,
                                      generator=torch.Generator().manual_seed(1))


def test_understanding_under_layerwise_offload_gives_the_same_answer():
    from PIL import Image

    image = Image.new("RGB", (40, 30), (200, 30, 90))
    expected = _pipe().understand("describe", image=image, max_new_tokens=6)
    pipe = omnify(_pipe(), "TORCH_SDPA")
    pipe.enable_layerwise_offload(device="cpu")
    assert pipe.understand("describe", image=image, max_new_tokens=6) == expected


@pytest.mark.parametrize("kwargs, error, message", [
    ({"max_new_tokens": 0}, ValueError, r"max_new_tokens=0 is not allowed"),
    ({"do_sample": True, "temperature": 0.0}, ValueError, r"temperature=0.0 is not allowed with do_sample"),
    ({"image": torch.zeros(3, 20, 28)}, ValueError, r"image tensor of shape \(3, 20, 28\) is not allowed"),
    ({"image": "cat.png"}, TypeError, r"image must be a PIL.Image.Image, got str"),
])
def test_understanding_refuses_bad_inputs(kwargs, error, message):
    with pytest.raises(error, match=message):
        _pipe().understand("hi", **kwargs)


def test_step_callback_sees_every_step_and_the_packed_latents():
    seen = []

    def callback(pipe, step, timestep, tensors):
        seen.append((step, float(timestep), tuple(tensors["latents"].shape)))

    _pipe()(**CALL, output_type="latent", callback_on_step_end=callback)
    # 3 schedule points, shift 3: Euler steps at t = 1 and t = 0.75; 12 packed tokens of 16 channels.
    assert seen == [(0, 1.0, (12, 16)), (1, 0.75, (12, 16))]
