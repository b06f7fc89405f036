"""``NextStep11Pipeline``: text-to-image with NextStep-1.1 (stepfun-ai), written in Diffusers' style.

The backbone reads the prompt, then writes the image one continuous token at a time: each step projects the last
hidden state (``image_out_projector``), samples a token with the flow-matching head, layer-normalises it when
``use_norm`` is set, and feeds it back through ``image_in_projector``. The tokens, unpatchified, are the VAE
latents. Classifier-free guidance runs the negative prompt as a second batch half through the backbone and mixes
the head's velocities.

``from_pretrained`` loads the published repository layout (``config.json`` and ``model*.safetensors`` at the root,
the tokenizer files, ``vae/config.json`` + ``vae/checkpoint.pt``) as well as a folder saved by ``save_pretrained``.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
import torch.nn.functional as F
from diffusers import AutoencoderKL, DiffusionPipeline
from diffusers.image_processor import VaeImageProcessor
from diffusers.pipelines.pipeline_utils import ImagePipelineOutput
from transformers import PreTrainedTokenizerBase

from .modeling_nextstep import NextStepKVCache, NextStepModel, config_from_published
from .vae import load_nextstep_vae, nextstep_vae_state_dict, published_vae_config

__all__ = ["IMAGE_AREA_TOKEN", "NextStep11Pipeline"]

IMAGE_AREA_TOKEN = "<|image_area|>"
CFG_SCHEDULES = ("constant", "linear")
OUTPUT_TYPES = ("pil", "np", "pt", "latent")


class NextStep11Pipeline(DiffusionPipeline):
    """Text-to-image with NextStep-1.1.

    Components: ``tokenizer`` (the published Qwen2 tokenizer with NextStep's image tokens), ``model``
    (:class:`NextStepModel`, the backbone with its flow-matching head) and ``vae`` (``AutoencoderKL``).
    """

    model_cpu_offload_seq = "model->vae"

    def __init__(self, tokenizer: PreTrainedTokenizerBase, model: NextStepModel, vae: AutoencoderKL):
        super().__init__()
        self.register_modules(tokenizer=tokenizer, model=model, vae=vae)
        self.vae_scale_factor = 2 ** (len(vae.config.block_out_channels) - 1) if vae is not None else 8
        self.image_processor = VaeImageProcessor(vae_scale_factor=self.vae_scale_factor)

    @property
    def down_factor(self) -> int:
        """Pixels per image token along each side (VAE downsampling times the latent patch size)."""
        return self.vae_scale_factor * self.model.config.latent_patch_size

    # -- loading the published layout ------------------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: str | os.PathLike, **kwargs: Any):
        """Load a pipeline saved by ``save_pretrained`` (``model_index.json``), or the published NextStep-1.1
        repository layout (a local folder or hub id holding ``config.json`` with ``model_type: nextstep``).

        Published-layout kwargs: ``torch_dtype``; others go to the tokenizer's ``from_pretrained``."""
        path = os.fspath(pretrained_model_name_or_path)
        if not os.path.isdir(path):
            from huggingface_hub import snapshot_download

            path = snapshot_download(path)
        if os.path.isfile(os.path.join(path, "model_index.json")):
            return super().from_pretrained(path, **kwargs)
        return cls.from_published(path, **kwargs)

    @classmethod
    def from_published(cls, path: str | os.PathLike, torch_dtype: torch.dtype | None = None, **tokenizer_kwargs):
        """Load the published layout from the local folder ``path``."""
        from safetensors.torch import load_file
        from transformers import AutoTokenizer

        path = os.fspath(path)
        config_path = os.path.join(path, "config.json")
        if not os.path.isfile(config_path):
            raise FileNotFoundError(f"{path!r} has neither model_index.json nor config.json")
        with open(config_path, encoding="utf-8") as f:
            published = json.load(f)
        if published.get("model_type") != "nextstep":
            raise ValueError(
                f"{config_path} has model_type={published.get('model_type')!r}; expected 'nextstep'"
            )
        index_path = os.path.join(path, "model.safetensors.index.json")
        if os.path.isfile(index_path):
            with open(index_path, encoding="utf-8") as f:
                shards = sorted(set(json.load(f)["weight_map"].values()))
        else:
            shards = ["model.safetensors"]
        state_dict: dict[str, torch.Tensor] = {}
        for shard in shards:
            state_dict.update(load_file(os.path.join(path, shard)))
        # The reference recomputes the generation position table from its config; a stored copy is not read.
        state_dict.pop("gen_pos_embed", None)

        with torch.device("meta"):
            model = NextStepModel(**config_from_published(published))
        model.load_state_dict(state_dict, strict=True, assign=True)
        for name, buffer in list(model.named_buffers()):
            if buffer.device.type == "meta":  # non-persistent buffers: real (empty) tensors, then computed
                module, _, attr = name.rpartition(".")
                owner = model.get_submodule(module) if module else model
                owner.register_buffer(attr, torch.empty_like(buffer, device="cpu"), persistent=False)
        model.reset_buffers()
        if torch_dtype is not None:
            model = model.to(torch_dtype)
        model.eval()

        vae_dir = published.get("vae_name_or_path") or "vae"
        if not os.path.isabs(vae_dir):
            vae_dir = os.path.join(path, vae_dir)
        vae = load_nextstep_vae(vae_dir, torch_dtype=torch_dtype)
        tokenizer = AutoTokenizer.from_pretrained(path, **tokenizer_kwargs)
        return cls(tokenizer=tokenizer, model=model, vae=vae)

    @staticmethod
    def skeleton_components(published_config: dict, published_vae_config: dict | None):
        """``(vae, model)`` built from the published configs alone (under ``torch.device("meta")`` they hold no
        storage), for tools that check arguments before loading weights."""
        from .vae import autoencoder_config_from_published

        vae = AutoencoderKL(**autoencoder_config_from_published(published_vae_config or {}))
        return vae, NextStepModel(**config_from_published(published_config))

    def save_published(self, path: str | os.PathLike, published_config: dict | None = None) -> None:
        """Write this pipeline in the published repository layout (what ``from_published`` reads)."""
        from safetensors.torch import save_file

        path = os.fspath(path)
        os.makedirs(os.path.join(path, "vae"), exist_ok=True)
        config = {"model_type": "nextstep", **{k: v for k, v in self.model.config.items() if not k.startswith("_")}}
        config.update(published_config or {})
        with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as f:
            json.dump(config, f, indent=2, sort_keys=True)
        save_file({k: v.contiguous() for k, v in self.model.state_dict().items()},
                  os.path.join(path, "model.safetensors"))
        with open(os.path.join(path, "vae", "config.json"), "w", encoding="utf-8") as f:
            json.dump(published_vae_config(self.vae), f, indent=2, sort_keys=True)
        torch.save(nextstep_vae_state_dict(self.vae), os.path.join(path, "vae", "checkpoint.pt"))
        self.tokenizer.save_pretrained(path)

    # -- prompts ---------------------------------------------------------------------------------------------

    def _image_prefix_ids(self, latent_h: int, latent_w: int) -> list[int]:
        """Token ids that open an image of ``latent_h`` x ``latent_w`` tokens: the area tag, ``"h*w"``, ``boi``."""
        encoded = self.tokenizer(f"{IMAGE_AREA_TOKEN}{latent_h}*{latent_w}", add_special_tokens=True)["input_ids"]
        if self.tokenizer.bos_token is not None and encoded[:1] == [self.tokenizer.bos_token_id]:
            encoded = encoded[1:]
        return list(encoded) + [self.model.config.boi]

    def check_inputs(self, prompt, height, width, guidance_scale, num_images_per_prompt, cfg_schedule, output_type):
        if not (isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt))):
            raise ValueError(f"prompt must be a string or a non-empty list of strings, got {prompt!r}")
        for name, value in (("height", height), ("width", width)):
            if not isinstance(value, int) or value <= 0 or value % self.down_factor:
                raise ValueError(
                    f"{name}={value!r} must be a positive multiple of {self.down_factor} (VAE factor "
                    f"{self.vae_scale_factor} x latent patch {self.model.config.latent_patch_size})"
                )
        if guidance_scale < 0:
            raise ValueError(f"guidance_scale={guidance_scale!r} must be ≥ 0")
        if not isinstance(num_images_per_prompt, int) or num_images_per_prompt < 1:
            raise ValueError(f"num_images_per_prompt={num_images_per_prompt!r} must be a positive integer")
        if cfg_schedule not in CFG_SCHEDULES:
            raise ValueError(f"cfg_schedule={cfg_schedule!r} is not one of {list(CFG_SCHEDULES)}")
        if output_type not in OUTPUT_TYPES:
            raise ValueError(f"output_type={output_type!r} is not one of {list(OUTPUT_TYPES)}")
        for key in ("boi", "image_placeholder_id"):
            if self.model.config.get(key) is None:
                raise ValueError(f"the model config has no {key}; the published config sets it")

    def encode_prompt(self, prompts: list[str], device: torch.device):
        """Token ids and the padding mask (left padded, as the backbone generates after the last position)."""
        if self.tokenizer.bos_token is not None:
            prompts = [self.tokenizer.bos_token + p for p in prompts]
        encoded = self.tokenizer(
            prompts, padding="longest", truncation=False, add_special_tokens=True, return_tensors="pt",
            padding_side="left",
        )
        return encoded.input_ids.to(device), encoded.attention_mask.to(device)

    # -- generation ------------------------------------------------------------------------------------------

    @torch.no_grad()
    def __call__(
        self,
        prompt: str | list[str],
        height: int | None = None,
        width: int | None = None,
        num_inference_steps: int = 28,
        guidance_scale: float = 7.5,
        negative_prompt: str | None = None,
        positive_prompt: str | None = None,
        num_images_per_prompt: int = 1,
        cfg_schedule: str = "constant",
        timesteps_shift: float = 1.0,
        use_norm: bool = False,
        generator: torch.Generator | None = None,
        output_type: str = "pil",
        return_dict: bool = True,
    ):
        """Generate images.

        Args:
            prompt: the caption(s).
            height, width: image size in pixels, multiples of ``down_factor`` (default 512).
            num_inference_steps: flow-matching steps of the head per image token.
            guidance_scale: classifier-free guidance; above 1 runs ``negative_prompt`` (default ``""``) too.
            positive_prompt: appended to every caption after a space (e.g. ``"masterpiece, best quality."``).
            num_images_per_prompt: images per caption; the head draws one noise row per image index, shared by the
                captions of the batch (as the reference does).
            cfg_schedule: ``"constant"``, or ``"linear"`` (guidance decays to 1 over the image tokens).
            timesteps_shift: shift of the head's time grid (1 = uniform).
            use_norm: layer-normalise each sampled token (no affine) before it is fed back.
            generator: the random source of the head's noise.
            output_type: ``"pil"``, ``"np"``, ``"pt"`` or ``"latent"``.
        """
        height = 512 if height is None else height
        width = 512 if width is None else width
        self.check_inputs(prompt, height, width, guidance_scale, num_images_per_prompt, cfg_schedule, output_type)
        device = self._execution_device
        model = self.model
        prompts = [prompt] if isinstance(prompt, str) else list(prompt)
        prompts = [p for p in prompts for _ in range(num_images_per_prompt)]
        if positive_prompt:
            prompts = [f"{p} {positive_prompt}" for p in prompts]
        samples = len(prompts)
        cfg_mult = 2 if guidance_scale > 1.0 else 1
        if cfg_mult == 2:
            prompts = prompts + [negative_prompt or ""] * samples

        latent_h, latent_w = height // self.down_factor, width // self.down_factor
        input_ids, attention_mask = self.encode_prompt(prompts, device)
        prefix = torch.tensor(self._image_prefix_ids(latent_h, latent_w), device=device, dtype=input_ids.dtype)
        input_ids = torch.cat([input_ids, prefix.expand(input_ids.shape[0], -1)], dim=1)
        attention_mask = torch.cat([attention_mask, attention_mask.new_ones(attention_mask.shape[0], prefix.numel())], 1)

        kv_cache = NextStepKVCache(len(model.layers))
        embeds = model.prepare_inputs_embeds(input_ids)
        hidden = model(embeds, attention_mask=attention_mask, kv_cache=kv_cache).last_hidden_state[:, -1:]
        use_pos = model.config.use_gen_pos_embed
        if use_pos:
            # The reference crops the table with the pixel height and width.
            positions = model.gen_pos_embed_with_ar(height, width)
            hidden = hidden + positions[:, 0:1].to(hidden)

        total = latent_h * latent_w
        tokens = []
        for step in self.progress_bar(range(total)):
            if cfg_schedule == "linear":
                scale = 1 + (guidance_scale - 1) * (total - step) / total
            else:
                scale = guidance_scale
            condition = model.image_out_projector(hidden).squeeze(1)
            token = model.image_head.sample(
                condition, cfg=scale, cfg_mult=cfg_mult, timesteps_shift=timesteps_shift,
                num_sampling_steps=num_inference_steps, noise_repeat=num_images_per_prompt, generator=generator,
            )
            if use_norm:
                token = F.layer_norm(token, token.shape[1:], None, None, 1e-6)
            tokens.append(token)
            if step == total - 1:
                break
            step_embeds = model.image_in_projector(token.unsqueeze(1))
            step_embeds = torch.cat([step_embeds] * cfg_mult, dim=0)
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones(attention_mask.shape[0], 1)], 1)
            hidden = model(step_embeds, attention_mask=attention_mask, kv_cache=kv_cache).last_hidden_state
            if use_pos:
                hidden = hidden + positions[:, step + 1 : step + 2].to(hidden)

        latents = model.unpatchify(torch.stack(tokens, dim=1), latent_h, latent_w)
        if output_type == "latent":
            image = latents
        else:
            latents = latents / self.vae.config.scaling_factor + self.vae.config.shift_factor
            image = self.vae.decode(latents.to(self.vae.dtype), return_dict=False)[0]
            image = self.image_processor.postprocess(image, output_type=output_type)
        self.maybe_free_model_hooks()
        if not return_dict:
            return (image,)
        return ImagePipelineOutput(images=image)
