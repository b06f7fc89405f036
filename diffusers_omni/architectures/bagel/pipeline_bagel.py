"""``BagelPipeline``: BAGEL text-to-image in Diffusers' style.

The prompt is wrapped in ``<|im_start|>``/``<|im_end|>`` and run once through the language model in understanding
mode, filling a key/value cache. Each denoising step then runs the image's generation tokens
(``<|vision_start|>``, the packed latent patches, ``<|vision_end|>``) in generation mode against that cache, and,
for classifier-free guidance, against an empty cache; the two velocities combine with BAGEL's guidance
renormalisation. The Euler sampler walks BAGEL's shifted schedule from noise (t=1) to data (t=0); the FLUX-style
VAE decodes.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from diffusers import AutoencoderKL
from diffusers.image_processor import VaeImageProcessor
from diffusers.pipelines.pipeline_utils import DiffusionPipeline, ImagePipelineOutput
from diffusers.utils.torch_utils import randn_tensor

from .modeling_bagel import BagelKVCache, BagelModel

RENORM_TYPES = ("global", "channel", "text_channel")
OUTPUT_TYPES = ("pil", "np", "pt", "latent")
SPECIAL_TOKENS = ("<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>")


def bagel_timesteps(num_inference_steps: int, timestep_shift: float, device=None) -> torch.Tensor:
    """BAGEL's schedule: ``num_inference_steps`` points from 1 to 0, shifted by ``timestep_shift``
    (``s·t / (1 + (s - 1)·t)``). The sampler takes one Euler step between consecutive points."""
    timesteps = torch.linspace(1, 0, num_inference_steps, device=device)
    return timestep_shift * timesteps / (1 + (timestep_shift - 1) * timesteps)


def guided_velocity(v: torch.Tensor, v_uncond: torch.Tensor, scale: float, renorm_type: str,
                    renorm_min: float) -> torch.Tensor:
    """Text classifier-free guidance with BAGEL's renormalisation: the guided velocity is scaled down to at most
    the conditional velocity's norm (over everything for ``"global"``, per token for ``"channel"`` and
    ``"text_channel"``), and never below ``renorm_min`` times it."""
    guided = v_uncond + scale * (v - v_uncond)
    if renorm_type == "global":
        norm_v, norm_guided = torch.norm(v), torch.norm(guided)
    else:
        norm_v, norm_guided = torch.norm(v, dim=-1, keepdim=True), torch.norm(guided, dim=-1, keepdim=True)
    factor = (norm_v / (norm_guided + 1e-8)).clamp(min=renorm_min, max=1.0)
    return guided * factor


def _bagel_resize(size: tuple[int, int], longest: int, shortest: int, stride: int) -> tuple[int, int]:
    """BAGEL's input resize rule: ``(width, height)`` scaled so the long side is at most ``longest`` and the short
    side at least ``shortest``, each side rounded to a multiple of ``stride``, the long side capped again."""
    def scaled(w, h, scale):
        return (max(stride, int(round(round(w * scale) / stride) * stride)),
                max(stride, int(round(round(h * scale) / stride) * stride)))

    width, height = size
    scale = max(min(longest / max(width, height), 1.0), shortest / min(width, height))
    width, height = scaled(width, height, scale)
    if width * height > 14 * 14 * 9 * 1024:  # BAGEL's pixel budget
        width, height = scaled(width, height, 14 * 14 * 9 * 1024 / (width * height))
    if max(width, height) > longest:
        width, height = scaled(width, height, longest / max(width, height))
    return width, height


class BagelPipeline(DiffusionPipeline):
    """BAGEL (``ByteDance-Seed/BAGEL-7B-MoT``): text-to-image (``__call__``) and understanding (``understand``:
    an image and a prompt, or a prompt alone, to text).

    Components:
        bagel: ``BagelModel`` (the Qwen2 mixture-of-transformers language model with BAGEL's generation and vision
            modules).
        vae: the FLUX ``AutoencoderKL`` (16 latent channels, downsampling 8) BAGEL decodes with.
        tokenizer: BAGEL's Qwen2 tokenizer, holding ``<|im_start|>``, ``<|im_end|>``, ``<|vision_start|>`` and
            ``<|vision_end|>``.

    ``from_pretrained`` loads a Diffusers-layout directory (as ``save_pretrained`` writes it) or the published
    BAGEL layout (``config.json``, ``llm_config.json``, ``vit_config.json``, ``ema.safetensors``,
    ``ae.safetensors`` and the tokenizer files, a local directory: download the repository first); see
    ``from_bagel_checkpoint``.
    """

    model_cpu_offload_seq = "bagel->vae"
    _optional_components: list[str] = []

    def __init__(self, bagel: BagelModel, vae: AutoencoderKL, tokenizer: Any) -> None:
        super().__init__()
        self.register_modules(bagel=bagel, vae=vae, tokenizer=tokenizer)
        self.image_processor = VaeImageProcessor(vae_scale_factor=2 ** (len(vae.config.block_out_channels) - 1))

    # Loading ---------------------------------------------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, **kwargs):
        """Diffusers' ``from_pretrained`` for a Diffusers-layout directory; the published BAGEL layout (a
        directory with ``llm_config.json`` and ``ema.safetensors``, no ``model_index.json``) goes to
        ``from_bagel_checkpoint``."""
        import os

        path = str(pretrained_model_name_or_path)
        if (os.path.isdir(path) and not os.path.exists(os.path.join(path, "model_index.json"))
                and os.path.exists(os.path.join(path, "llm_config.json"))):
            unknown = set(kwargs) - {"torch_dtype"}
            if unknown:
                raise TypeError(f"from_pretrained on the published BAGEL layout takes torch_dtype only; got "
                                f"{sorted(unknown)}")
            return cls.from_bagel_checkpoint(path, torch_dtype=kwargs.get("torch_dtype"))
        return super().from_pretrained(pretrained_model_name_or_path, **kwargs)

    @classmethod
    def from_bagel_checkpoint(cls, path: str, torch_dtype: torch.dtype | None = None,
                              vae_config: dict | None = None) -> "BagelPipeline":
        """Build the pipeline from a directory in the published BAGEL layout. The language model's config is
        ``llm_config.json``; the vision tower's is ``vit_config.json`` less its last layer (BAGEL runs one layer
        fewer); ``latent_patch_size`` and ``vit_max_num_patch_per_side`` come from ``config.json`` and
        ``max_latent_size`` from the ``latent_pos_embed`` table in ``ema.safetensors`` (BAGEL's own loaders do
        the same: the value in ``config.json`` can be stale). ``ae.safetensors`` (FLUX's VAE in its original key
        names) is converted with Diffusers' LDM VAE conversion into an ``AutoencoderKL`` of ``vae_config``
        (default: FLUX's)."""
        import os

        from diffusers.loaders.single_file_utils import convert_ldm_vae_checkpoint
        from safetensors.torch import load_file
        from transformers import AutoTokenizer

        weights_path = os.path.join(path, "ema.safetensors")
        config = cls.bagel_config(path)
        with torch.device("meta"):
            bagel = BagelModel(**config)
        state = load_file(weights_path)
        missing, unexpected = bagel.load_state_dict(state, strict=False, assign=True)
        if missing or unexpected:
            raise ValueError(f"{weights_path} does not match BagelModel: missing {sorted(missing)[:8]}, "
                             f"unexpected {sorted(unexpected)[:8]}")
        for name, buffer in list(bagel.named_buffers()):
            # Buffers not in the checkpoint (SigLIP's position ids) were made on the meta device: make them here.
            if buffer.is_meta:
                if not name.endswith("position_ids"):
                    raise ValueError(f"BagelModel buffer {name!r} is not in {weights_path} and cannot be rebuilt")
                owner = bagel.get_submodule(name.rpartition(".")[0])
                owner.register_buffer("position_ids", torch.arange(buffer.shape[-1]).expand(buffer.shape),
                                      persistent=False)
        bagel.eval()
        vae = AutoencoderKL.from_config(vae_config or {
            "in_channels": 3, "out_channels": 3, "latent_channels": config["latent_channels"],
            "down_block_types": ["DownEncoderBlock2D"] * 4, "up_block_types": ["UpDecoderBlock2D"] * 4,
            "block_out_channels": [128, 256, 512, 512], "layers_per_block": 2, "scaling_factor": 0.3611,
            "shift_factor": 0.1159, "use_quant_conv": False, "use_post_quant_conv": False,
        })
        vae_state = convert_ldm_vae_checkpoint(load_file(os.path.join(path, "ae.safetensors")), vae.config)
        vae.load_state_dict(vae_state, strict=True)
        vae.eval()
        tokenizer = AutoTokenizer.from_pretrained(path)
        pipe = cls(bagel=bagel, vae=vae, tokenizer=tokenizer)
        if torch_dtype is not None:
            pipe.to(dtype=torch_dtype)
        return pipe

    @staticmethod
    def bagel_config(path: str) -> dict[str, Any]:
        """``BagelModel``'s arguments for a checkpoint directory, read from its config files alone: the published
        layout's (see ``from_bagel_checkpoint``; ``max_latent_size`` from the header of ``ema.safetensors``) or
        ``bagel/config.json`` of a Diffusers-layout directory."""
        import json
        import math
        import os

        from safetensors import safe_open

        def read(name):
            with open(os.path.join(path, name), encoding="utf-8") as handle:
                return json.load(handle)

        if os.path.exists(os.path.join(path, "model_index.json")):
            saved = read(os.path.join("bagel", "config.json"))
            return {key: value for key, value in saved.items() if not key.startswith("_")}
        llm, vit, top = read("llm_config.json"), read("vit_config.json"), read("config.json")
        llm_keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                    "num_key_value_heads", "rms_norm_eps", "rope_theta", "hidden_act", "max_position_embeddings")
        vit_keys = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_channels",
                    "image_size", "patch_size", "hidden_act", "layer_norm_eps")
        vit_config = {key: vit[key] for key in vit_keys if key in vit}
        vit_config["num_hidden_layers"] = vit_config["num_hidden_layers"] - 1
        weights_path = os.path.join(path, "ema.safetensors")
        with safe_open(weights_path, framework="pt") as handle:
            positions = handle.get_slice("latent_pos_embed.pos_embed").get_shape()[0]
        side = math.isqrt(positions)
        if side * side != positions:
            raise ValueError(f"latent_pos_embed.pos_embed has {positions} rows in {weights_path}; a square is needed")
        latent = top.get("vae_config") or {}
        return {
            "llm_config": {key: llm[key] for key in llm_keys if key in llm},
            "vit_config": vit_config,
            "latent_channels": int(latent.get("z_channels", 16)),
            "vae_downsample": int(latent.get("downsample", 8)),
            "latent_patch_size": int(top.get("latent_patch_size", 2)),
            "max_latent_size": side,
            "vit_max_num_patch_per_side": int(top.get("vit_max_num_patch_per_side", 70)),
            "connector_act": top.get("connector_act", "gelu_pytorch_tanh"),
        }

    @classmethod
    def meta_components(cls, path: str) -> dict[str, Any]:
        """The weight-holding components that run attention, built on the meta device from ``path``'s configs (no
        weights read): ``{"bagel": BagelModel}``."""
        with torch.device("meta"):
            return {"bagel": BagelModel(**cls.bagel_config(path))}

    # Pieces of a call ------------------------------------------------------------------------------------------

    def _special_ids(self) -> dict[str, int]:
        ids = {}
        for token in SPECIAL_TOKENS:
            index = self.tokenizer.convert_tokens_to_ids(token)
            if index is None or index == self.tokenizer.unk_token_id:
                raise ValueError(f"the tokenizer has no {token!r} token; BAGEL's tokenizer adds {list(SPECIAL_TOKENS)}")
            ids[token] = index
        return ids

    def encode_prompt(self, prompt: str) -> list[int]:
        """The prompt's token ids as BAGEL feeds them: ``<|im_start|>`` prompt ``<|im_end|>``."""
        special = self._special_ids()
        ids = self.tokenizer.encode(prompt, add_special_tokens=False)
        return [special["<|im_start|>"], *ids, special["<|im_end|>"]]

    def prefill(self, token_ids: list[int]) -> tuple[BagelKVCache, int]:
        """Run ``token_ids`` through the language model (understanding mode); returns the cache and the next
        rotary position."""
        device = self._execution_device
        cache = BagelKVCache.empty(len(self.bagel.backbone.layers))
        ids = torch.tensor(token_ids, dtype=torch.long, device=device)
        return self.bagel.prefill(ids, cache, 0), len(token_ids)

    def prepare_image(self, image) -> torch.Tensor:
        """An input image as BAGEL reads it for understanding: RGB, resized (bicubic) as its VAE transform resizes
        inputs (long side at most 1024, short side at least 512, multiples of 16), then as its ViT transform does
        (at most 980 and at least 224, multiples of the ViT patch, 14), scaled to [-1, 1]: ``[3, H, W]``. Those are
        the published model's sizes; they follow its tables (``max_latent_size`` × 16, ``vit_max_num_patch_per_side``
        × 14), so a smaller model gets proportionally smaller ones."""
        import numpy as np
        from PIL import Image

        if not isinstance(image, Image.Image):
            raise TypeError(f"image must be a PIL.Image.Image, got {type(image).__name__}")
        image = image.convert("RGB")
        patch = self.bagel.vit_model.config.patch_size
        vae_longest = self.bagel.max_latent_size * self.bagel.latent_downsample
        vit_longest = self.bagel.vit_max_num_patch_per_side * patch
        sizes = ((vae_longest, vae_longest // 2, self.bagel.latent_downsample),
                 (vit_longest, max(patch, round(vit_longest * 224 / 980)), patch))
        for longest, shortest, stride in sizes:
            image = image.resize(_bagel_resize(image.size, longest, shortest, stride), Image.BICUBIC)
        array = torch.from_numpy(np.asarray(image, dtype=np.float32).copy()) / 255.0
        return ((array - 0.5) / 0.5).permute(2, 0, 1).contiguous()

    @torch.no_grad()
    def understand(self, prompt: str, image=None, max_new_tokens: int = 500, do_sample: bool = False,
                   temperature: float = 0.3, generator: torch.Generator | None = None) -> str:
        """BAGEL's understanding path (vLLM-Omni's text output): answer ``prompt`` about ``image`` as text.

        ``image``: optional; a PIL image (resized as BAGEL resizes inputs, ``prepare_image``) or a ``[3, H, W]``
        tensor already in [-1, 1] with sides multiples of the ViT patch. The image (when given), then the prompt,
        fill the cache; decoding starts from ``<|im_start|>`` and stops at ``<|im_end|>`` or after
        ``max_new_tokens`` tokens (greedy, or sampled at ``temperature`` with ``do_sample``)."""
        if not isinstance(prompt, str):
            raise TypeError(f"prompt must be a str, got {type(prompt).__name__}")
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={max_new_tokens!r} is not allowed: a positive integer")
        if do_sample and not temperature > 0:
            raise ValueError(f"temperature={temperature!r} is not allowed with do_sample: it must be > 0")
        device = self._execution_device
        special = self._special_ids()
        cache, rope = BagelKVCache.empty(len(self.bagel.backbone.layers)), 0
        if image is not None:
            pixels = image if isinstance(image, torch.Tensor) else self.prepare_image(image)
            patch = self.bagel.vit_model.config.patch_size
            largest = patch * self.bagel.vit_max_num_patch_per_side
            if (pixels.ndim != 3 or pixels.shape[0] != 3 or pixels.shape[1] % patch or pixels.shape[2] % patch
                    or max(pixels.shape[1:]) > largest or min(pixels.shape[1:]) < patch):
                raise ValueError(f"image tensor of shape {tuple(pixels.shape)} is not allowed: [3, H, W] with H and W "
                                 f"multiples of {patch} (the ViT patch) between {patch} and {largest}")
            pixels = pixels.to(device)
            markers = torch.tensor([special["<|vision_start|>"], special["<|vision_end|>"]], device=device)
            cache, rope = self.bagel.prefill_image(pixels, markers, cache, rope), rope + 1
        ids = self.encode_prompt(prompt)
        cache = self.bagel.prefill(torch.tensor(ids, device=device), cache, rope)
        rope += len(ids)
        token = torch.tensor(special["<|im_start|>"], device=device)
        generated = []
        for _ in range(max_new_tokens):
            generated.append(int(token))
            logits, cache = self.bagel.next_token_logits(token, cache, rope)
            rope += 1
            if do_sample:
                probs = torch.softmax(logits.float() / temperature, dim=-1)
                token = torch.multinomial(probs.cpu(), num_samples=1, generator=generator)[0].to(device)
            else:
                token = torch.argmax(logits, dim=-1)
            if int(token) == special["<|im_end|>"]:
                break
        text = self.tokenizer.decode(generated)
        return text.split("<|im_end|>")[0].split("<|im_start|>")[-1]

    def denoise(self, latents: torch.Tensor, height: int, width: int, context: tuple[BagelKVCache, int],
                uncond_context: tuple[BagelKVCache, int] | None, num_inference_steps: int, timestep_shift: float,
                guidance_scale: float, cfg_interval: tuple[float, float], cfg_renorm_type: str,
                cfg_renorm_min: float, callback=None) -> torch.Tensor:
        """Euler steps over BAGEL's schedule from packed noise ``latents`` ``[tokens, patch_dim]`` (kept in float32,
        as BAGEL keeps them, whatever the model's dtype)."""
        device = latents.device
        special = self._special_ids()
        markers = torch.tensor([special["<|vision_start|>"], special["<|vision_end|>"]], device=device)
        positions = self.bagel.latent_position_ids(height, width).to(device)
        timesteps = bagel_timesteps(num_inference_steps, timestep_shift, device=device)
        dts = timesteps[:-1] - timesteps[1:]
        self._num_timesteps = len(dts)
        with self.progress_bar(total=len(dts)) as progress:
            for i, t in enumerate(timesteps[:-1]):
                v = self.bagel.predict_velocity(latents, t, markers, positions, context[1], context[0])
                guided = uncond_context is not None and cfg_interval[0] < t <= cfg_interval[1]
                if guided and guidance_scale > 1.0:
                    v_uncond = self.bagel.predict_velocity(latents, t, markers, positions, uncond_context[1],
                                                           uncond_context[0])
                    v = guided_velocity(v, v_uncond, guidance_scale, cfg_renorm_type, cfg_renorm_min)
                latents = latents - v.float() * dts[i]
                if callback is not None:
                    callback(i, t, latents)
                progress.update()
        return latents

    def unpack_latents(self, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """Packed tokens ``[h·w, p·p·c]`` to a VAE latent ``[1, c, h·p, w·p]``."""
        p, c = self.bagel.latent_patch_size, self.bagel.latent_channels
        h, w = height // self.bagel.latent_downsample, width // self.bagel.latent_downsample
        latents = latents.reshape(1, h, w, p, p, c)
        return torch.einsum("nhwpqc->nchpwq", latents).reshape(1, c, h * p, w * p)

    def check_inputs(self, prompt, height, width, num_inference_steps, guidance_scale, cfg_interval,
                     cfg_renorm_type, cfg_renorm_min, output_type, latents) -> None:
        if not isinstance(prompt, (str, list)) or (isinstance(prompt, list) and
                                                   not all(isinstance(p, str) for p in prompt)):
            raise TypeError(f"prompt must be a str or a list of str, got {type(prompt).__name__}")
        stride = self.bagel.latent_downsample
        largest = self.bagel.max_latent_size * stride
        for name, value in (("height", height), ("width", width)):
            if not isinstance(value, int) or value <= 0 or value % stride or value > largest:
                raise ValueError(f"{name}={value!r} is not allowed: BAGEL needs a positive multiple of {stride} "
                                 f"(VAE downsampling × latent patch size) of at most {largest} (max_latent_size "
                                 f"{self.bagel.max_latent_size} × {stride})")
        if not isinstance(num_inference_steps, int) or num_inference_steps < 2:
            raise ValueError(f"num_inference_steps={num_inference_steps!r} is not allowed: BAGEL's schedule has "
                             "num_inference_steps points from t=1 to t=0, so at least 2 (one Euler step)")
        if guidance_scale < 0:
            raise ValueError(f"guidance_scale={guidance_scale!r} is not allowed: at least 0 (1 or less: no guidance)")
        if len(cfg_interval) != 2 or not 0 <= cfg_interval[0] <= cfg_interval[1] <= 1:
            raise ValueError(f"cfg_interval={tuple(cfg_interval)!r} is not allowed: (low, high) with "
                             "0 <= low <= high <= 1")
        if cfg_renorm_type not in RENORM_TYPES:
            raise ValueError(f"cfg_renorm_type={cfg_renorm_type!r} is not allowed; allowed: {list(RENORM_TYPES)}")
        if not 0 <= cfg_renorm_min <= 1:
            raise ValueError(f"cfg_renorm_min={cfg_renorm_min!r} is not allowed: between 0 and 1")
        if output_type not in OUTPUT_TYPES:
            raise ValueError(f"output_type={output_type!r} is not allowed; allowed: {list(OUTPUT_TYPES)}")
        if latents is not None:
            count = 1 if isinstance(prompt, str) else len(prompt)
            tokens = (height // stride) * (width // stride)
            patch = self.bagel.latent_patch_size**2 * self.bagel.latent_channels
            if tuple(latents.shape) != (count, tokens, patch):
                raise ValueError(f"latents of shape {tuple(latents.shape)} do not fit: ({count}, {tokens}, {patch}) "
                                 "(prompts, generation tokens, patch channels) is needed")

    @torch.no_grad()
    def __call__(
        self,
        prompt: str | list[str],
        height: int = 1024,
        width: int = 1024,
        num_inference_steps: int = 50,
        guidance_scale: float = 4.0,
        timestep_shift: float = 3.0,
        cfg_interval: tuple[float, float] = (0.4, 1.0),
        cfg_renorm_type: str = "global",
        cfg_renorm_min: float = 0.0,
        generator: torch.Generator | list[torch.Generator] | None = None,
        latents: torch.Tensor | None = None,
        output_type: str = "pil",
        return_dict: bool = True,
        callback_on_step_end: Callable[[Any, int, torch.Tensor, dict], Any] | None = None,
    ):
        """Generate one image per prompt.

        Args:
            prompt: the prompt, or a list (one image each, generated one after another).
            height: a multiple of 16 up to 1024 for the published checkpoint (``max_latent_size`` 64).
            width: as ``height``.
            num_inference_steps: points of BAGEL's schedule (its ``num_timesteps``): ``num_inference_steps - 1``
                Euler steps, each one model forward (two while guidance applies).
            guidance_scale: BAGEL's ``cfg_text_scale``: guidance against the empty context; 1 or less turns it
                off.
            timestep_shift: the schedule's shift.
            cfg_interval: guidance applies at timesteps ``low < t <= high``.
            cfg_renorm_type: BAGEL's renormalisation of the guided velocity (see ``guided_velocity``):
                ``"global"``, ``"channel"`` or ``"text_channel"``.
            cfg_renorm_min: the least the renormalisation may scale the guided velocity by.
            return_dict: an ``ImagePipelineOutput`` (else a tuple).
            generator: seeds the packed noise (``[tokens, patch_dim]`` per image, drawn in prompt order).
            latents: packed noise ``[prompts, tokens, patch_dim]`` instead of drawing it.
            output_type: ``"pil"``, ``"np"``, ``"pt"`` or ``"latent"`` (the VAE latents ``[prompts, c, h, w]``).
            callback_on_step_end: ``callback(pipe, step, timestep, {"latents": packed})`` after each step.
        """
        self.check_inputs(prompt, height, width, num_inference_steps, guidance_scale, cfg_interval, cfg_renorm_type,
                          cfg_renorm_min, output_type, latents)
        prompts = [prompt] if isinstance(prompt, str) else list(prompt)
        device = self._execution_device
        stride = self.bagel.latent_downsample
        tokens = (height // stride) * (width // stride)
        patch = self.bagel.latent_patch_size**2 * self.bagel.latent_channels
        uncond = (BagelKVCache.empty(len(self.bagel.backbone.layers)), 0) if guidance_scale > 1.0 else None
        results = []
        for index, text in enumerate(prompts):
            if latents is None:
                gen = generator[index] if isinstance(generator, list) else generator
                noise = randn_tensor((tokens, patch), generator=gen, device=device, dtype=torch.float32)
            else:
                noise = latents[index].to(device=device, dtype=torch.float32)
            context = self.prefill(self.encode_prompt(text))
            callback = None
            if callback_on_step_end is not None:
                def callback(step, t, packed):
                    callback_on_step_end(self, step, t, {"latents": packed})
            packed = self.denoise(noise, height, width, context, uncond, num_inference_steps,
                                  timestep_shift, guidance_scale, tuple(cfg_interval), cfg_renorm_type,
                                  cfg_renorm_min, callback)
            results.append(self.unpack_latents(packed, height, width))
        latent = torch.cat(results)
        if output_type == "latent":
            images = latent
        else:
            vae_latent = latent.to(self.vae.dtype) / self.vae.config.scaling_factor + self.vae.config.shift_factor
            decoded = self.vae.decode(vae_latent, return_dict=False)[0]
            images = self.image_processor.postprocess(decoded, output_type=output_type)
        self.maybe_free_model_hooks()
        if not return_dict:
            return (images,)
        return ImagePipelineOutput(images=images)
