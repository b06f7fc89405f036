"""BAGEL's models: the ``Qwen2MoTModel`` language backbone (a Qwen2 decoder whose every layer has a second set of
attention projections, norms and MLP for generation tokens: a mixture of transformers), the generation embedders
around it, and the SigLIP vision tower, as one ``BagelModel`` whose parameter names are those of the published
``ema.safetensors``.

Sequences are packed for one sample at a time: a forward takes the new tokens ``[N, hidden]`` with their rotary
positions, attends to them together with the keys and values already cached for that sample (the prompt), and
returns ``[N, hidden]``. Two modes, as in BAGEL:

* ``"und"`` (understanding): every token takes the understanding weights; attention is causal (a prompt extending
  the cache sees the whole cache and the prompt tokens before it). Its keys and values can extend the cache.
* ``"gen"`` (generation): the tokens at ``gen_indexes`` (image latents) take the ``*_moe_gen`` weights, the others
  (the image's start and end markers) the understanding weights; attention is bidirectional over the cache and
  every new token. The cache is read, not extended.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn as nn
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.models.attention import AttentionModuleMixin
from diffusers.models.attention_dispatch import dispatch_attention_fn
from diffusers.models.modeling_utils import ModelMixin
from transformers.activations import ACT2FN
from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

UNDERSTANDING = "und"
GENERATION = "gen"
MODES = (UNDERSTANDING, GENERATION)


@dataclass
class BagelKVCache:
    """Keys and values of one sample's context, per decoder layer (``[L, kv_heads, head_dim]`` each)."""

    keys: list[torch.Tensor | None] = field(default_factory=list)
    values: list[torch.Tensor | None] = field(default_factory=list)

    @classmethod
    def empty(cls, num_layers: int) -> "BagelKVCache":
        return cls([None] * num_layers, [None] * num_layers)

    @property
    def length(self) -> int:
        return 0 if not self.keys or self.keys[0] is None else int(self.keys[0].shape[0])


# Qwen2's RMS norm (statistics in float32, the result cast back before the weight multiplies it): Transformers' own.
Qwen2MoTRMSNorm = Qwen2RMSNorm


class Qwen2MoTMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str = "silu") -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.act_fn = ACT2FN[hidden_act]

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(hidden_states)) * self.up_proj(hidden_states))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x`` ``[N, heads, head_dim]``, ``cos``/``sin`` ``[N, head_dim]``."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + _rotate_half(x) * sin


def _split(layer_text: nn.Module, layer_gen: nn.Module, x: torch.Tensor, gen_indexes: torch.Tensor,
           text_indexes: torch.Tensor) -> torch.Tensor:
    """``layer_text`` on the rows ``text_indexes`` of ``x``, ``layer_gen`` on the rows ``gen_indexes``, gathered
    back into one tensor of ``x``'s dtype."""
    text_out = layer_text(x[text_indexes])
    gen_out = layer_gen(x[gen_indexes])
    out = x.new_zeros((x.shape[0], *gen_out.shape[1:]))
    out[text_indexes] = text_out.to(out.dtype)
    out[gen_indexes] = gen_out.to(out.dtype)
    return out


class BagelMoTAttnProcessor:
    """Computes one layer's packed attention. Its attention call goes through Diffusers' ``dispatch_attention_fn``
    (``_attend``), with ``[1, S, heads, head_dim]`` tensors and grouped-query attention."""

    _attention_backend = None
    _parallel_config = None

    def __call__(
        self,
        attn: "BagelMoTAttention",
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        mode: str = UNDERSTANDING,
        gen_indexes: torch.Tensor | None = None,
        text_indexes: torch.Tensor | None = None,
        past_key_value: tuple[torch.Tensor, torch.Tensor] | None = None,
        causal: bool = True,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        heads, kv_heads, head_dim = attn.num_heads, attn.num_key_value_heads, attn.head_dim
        cos, sin = position_embeddings
        if mode == UNDERSTANDING:
            query = attn.q_norm(attn.q_proj(hidden_states).view(-1, heads, head_dim))
            key = attn.k_norm(attn.k_proj(hidden_states).view(-1, kv_heads, head_dim))
            value = attn.v_proj(hidden_states).view(-1, kv_heads, head_dim)
            query = apply_rotary(query, cos.to(query.dtype), sin.to(query.dtype))
            key = apply_rotary(key, cos.to(key.dtype), sin.to(key.dtype))
        else:
            # As BAGEL: the generation path normalises and rotates queries and keys in float32.
            def project(text, gen):
                return _split(text, gen, hidden_states, gen_indexes, text_indexes)

            query = project(attn.q_proj, attn.q_proj_moe_gen).view(-1, heads, head_dim)
            key = project(attn.k_proj, attn.k_proj_moe_gen).view(-1, kv_heads, head_dim)
            value = project(attn.v_proj, attn.v_proj_moe_gen).view(-1, kv_heads, head_dim)
            query = _split(attn.q_norm, attn.q_norm_moe_gen, query.float(), gen_indexes, text_indexes)
            key = _split(attn.k_norm, attn.k_norm_moe_gen, key.float(), gen_indexes, text_indexes)
            query, key = apply_rotary(query, cos, sin), apply_rotary(key, cos, sin)
            query, key = query.to(value.dtype), key.to(value.dtype)

        if past_key_value is not None:
            key = torch.cat([past_key_value[0], key], dim=0)
            value = torch.cat([past_key_value[1], value], dim=0)
        past = 0 if past_key_value is None else past_key_value[0].shape[0]

        attn_mask, is_causal = None, False
        if mode == UNDERSTANDING and causal:
            if past == 0:
                is_causal = True
            else:  # query i sees the whole cache and the new tokens up to itself
                attn_mask = torch.ones(query.shape[0], key.shape[0], dtype=torch.bool, device=query.device)
                attn_mask = attn_mask.tril(past)[None, None]
        out = self._attend(mode, query[None], key[None], value[None], attn_mask, is_causal)[0]
        out = out.reshape(-1, heads * head_dim)
        if mode == UNDERSTANDING:
            out = attn.o_proj(out)
        else:
            out = _split(attn.o_proj, attn.o_proj_moe_gen, out, gen_indexes, text_indexes)
        return out, (key, value)

    def _attend(self, mode: str, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attn_mask: torch.Tensor | None, is_causal: bool) -> torch.Tensor:
        return dispatch_attention_fn(
            query, key, value, attn_mask=attn_mask, is_causal=is_causal, enable_gqa=True,
            backend=self._attention_backend, parallel_config=self._parallel_config,
        )


class BagelMoTAttention(nn.Module, AttentionModuleMixin):
    """Qwen2 attention with query/key RMS norms and a second set of projections and norms (``*_moe_gen``) for
    generation tokens."""

    _default_processor_cls = BagelMoTAttnProcessor
    _available_processors = [BagelMoTAttnProcessor]
    _supports_qkv_fusion = False

    def __init__(self, hidden_size: int, num_heads: int, num_key_value_heads: int, eps: float,
                 processor: BagelMoTAttnProcessor | None = None) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.num_heads = num_heads
        self.num_key_value_heads = num_key_value_heads
        self.head_dim = hidden_size // num_heads
        kv_dim = num_key_value_heads * self.head_dim
        self.q_proj = nn.Linear(hidden_size, num_heads * self.head_dim, bias=True)
        self.k_proj = nn.Linear(hidden_size, kv_dim, bias=True)
        self.v_proj = nn.Linear(hidden_size, kv_dim, bias=True)
        self.o_proj = nn.Linear(num_heads * self.head_dim, hidden_size, bias=False)
        self.q_norm = Qwen2MoTRMSNorm(self.head_dim, eps)
        self.k_norm = Qwen2MoTRMSNorm(self.head_dim, eps)
        self.q_norm_moe_gen = Qwen2MoTRMSNorm(self.head_dim, eps)
        self.k_norm_moe_gen = Qwen2MoTRMSNorm(self.head_dim, eps)
        self.q_proj_moe_gen = nn.Linear(hidden_size, num_heads * self.head_dim, bias=True)
        self.k_proj_moe_gen = nn.Linear(hidden_size, kv_dim, bias=True)
        self.v_proj_moe_gen = nn.Linear(hidden_size, kv_dim, bias=True)
        self.o_proj_moe_gen = nn.Linear(num_heads * self.head_dim, hidden_size, bias=False)
        self.set_processor(processor or BagelMoTAttnProcessor())

    def forward(self, hidden_states, position_embeddings, mode=UNDERSTANDING, gen_indexes=None, text_indexes=None,
                past_key_value=None, causal=True):
        return self.processor(self, hidden_states, position_embeddings, mode=mode, gen_indexes=gen_indexes,
                              text_indexes=text_indexes, past_key_value=past_key_value, causal=causal)


class Qwen2MoTDecoderLayer(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, num_heads: int, num_key_value_heads: int,
                 eps: float, hidden_act: str = "silu") -> None:
        super().__init__()
        self.self_attn = BagelMoTAttention(hidden_size, num_heads, num_key_value_heads, eps)
        self.mlp = Qwen2MoTMLP(hidden_size, intermediate_size, hidden_act)
        self.mlp_moe_gen = Qwen2MoTMLP(hidden_size, intermediate_size, hidden_act)
        self.input_layernorm = Qwen2MoTRMSNorm(hidden_size, eps)
        self.input_layernorm_moe_gen = Qwen2MoTRMSNorm(hidden_size, eps)
        self.post_attention_layernorm = Qwen2MoTRMSNorm(hidden_size, eps)
        self.post_attention_layernorm_moe_gen = Qwen2MoTRMSNorm(hidden_size, eps)
        self.hidden_size = hidden_size

    def forward(self, hidden_states, position_embeddings, mode=UNDERSTANDING, gen_indexes=None, text_indexes=None,
                past_key_value=None, causal=True):
        residual = hidden_states
        if mode == UNDERSTANDING:
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states = _split(self.input_layernorm, self.input_layernorm_moe_gen, hidden_states, gen_indexes,
                                   text_indexes)
        hidden_states, key_value = self.self_attn(hidden_states, position_embeddings, mode=mode,
                                                  gen_indexes=gen_indexes, text_indexes=text_indexes,
                                                  past_key_value=past_key_value, causal=causal)
        hidden_states = residual + hidden_states
        residual = hidden_states
        if mode == UNDERSTANDING:
            hidden_states = self.mlp(self.post_attention_layernorm(hidden_states))
        else:
            normed = _split(self.post_attention_layernorm, self.post_attention_layernorm_moe_gen, hidden_states,
                            gen_indexes, text_indexes)
            hidden_states = _split(self.mlp, self.mlp_moe_gen, normed, gen_indexes, text_indexes)
        return residual + hidden_states, key_value


class Qwen2MoTModel(ModelMixin, ConfigMixin):
    """BAGEL's language backbone: token embeddings, ``layers`` of ``Qwen2MoTDecoderLayer`` and the final norms
    (``norm`` for understanding tokens, ``norm_moe_gen`` for generation tokens).

    ``forward`` runs new packed tokens of one sample against its cache (see the module docstring) and returns
    ``(hidden_states, new_cache)``; ``new_cache`` holds the keys and values of cache plus new tokens when
    ``update_cache`` is true, else ``None``. ``causal=False`` (understanding mode) lets the new tokens see each
    other both ways, as BAGEL runs an input image's ViT tokens.
    """

    _layerwise_offload_blocks_attrs = ("layers",)
    _no_split_modules = ["Qwen2MoTDecoderLayer"]

    @register_to_config
    def __init__(self, vocab_size: int = 152064, hidden_size: int = 3584, intermediate_size: int = 18944,
                 num_hidden_layers: int = 28, num_attention_heads: int = 28, num_key_value_heads: int = 4,
                 rms_norm_eps: float = 1e-6, rope_theta: float = 1000000.0, hidden_act: str = "silu",
                 max_position_embeddings: int = 32768) -> None:
        super().__init__()
        if hidden_size % num_attention_heads or num_attention_heads % num_key_value_heads:
            raise ValueError(
                f"hidden_size={hidden_size} must be a multiple of num_attention_heads={num_attention_heads}, and "
                f"num_attention_heads a multiple of num_key_value_heads={num_key_value_heads}"
            )
        self.embed_tokens = nn.Embedding(vocab_size, hidden_size)
        self.layers = nn.ModuleList(
            Qwen2MoTDecoderLayer(hidden_size, intermediate_size, num_attention_heads, num_key_value_heads,
                                 rms_norm_eps, hidden_act)
            for _ in range(num_hidden_layers)
        )
        self.norm = Qwen2MoTRMSNorm(hidden_size, rms_norm_eps)
        self.norm_moe_gen = Qwen2MoTRMSNorm(hidden_size, rms_norm_eps)

    def rotary_embeddings(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        head_dim = self.config.hidden_size // self.config.num_attention_heads
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=position_ids.device).float() / head_dim
        inv_freq = 1.0 / (self.config.rope_theta ** exponents)
        freqs = position_ids.float()[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_ids: torch.Tensor,
        mode: str = UNDERSTANDING,
        gen_indexes: torch.Tensor | None = None,
        text_indexes: torch.Tensor | None = None,
        past_key_values: BagelKVCache | None = None,
        update_cache: bool = False,
        causal: bool = True,
    ) -> tuple[torch.Tensor, BagelKVCache | None]:
        if mode not in MODES:
            raise ValueError(f"mode={mode!r} is not a BAGEL mode; allowed: {list(MODES)}")
        if mode == GENERATION and (gen_indexes is None or text_indexes is None):
            raise ValueError("mode='gen' needs gen_indexes and text_indexes (which rows take the generation weights)")
        if update_cache and mode != UNDERSTANDING:
            raise ValueError("update_cache=True is for mode='und' (generation tokens never extend the cache)")
        position_embeddings = self.rotary_embeddings(position_ids, hidden_states.dtype)
        new_cache = BagelKVCache.empty(len(self.layers)) if update_cache else None
        for index, layer in enumerate(self.layers):
            past = None
            if past_key_values is not None and past_key_values.keys[index] is not None:
                past = (past_key_values.keys[index], past_key_values.values[index])
            hidden_states, (key, value) = layer(hidden_states, position_embeddings, mode=mode,
                                                gen_indexes=gen_indexes, text_indexes=text_indexes,
                                                past_key_value=past, causal=causal)
            if new_cache is not None:
                new_cache.keys[index], new_cache.values[index] = key, value
        if mode == UNDERSTANDING:
            hidden_states = self.norm(hidden_states)
        else:
            hidden_states = _split(self.norm, self.norm_moe_gen, hidden_states, gen_indexes, text_indexes)
        return hidden_states, new_cache


class Qwen2MoTForCausalLM(nn.Module):
    """``model`` (the backbone) and ``lm_head`` (next-token logits of understanding outputs)."""

    def __init__(self, **config) -> None:
        super().__init__()
        self.model = Qwen2MoTModel(**config)
        self.lm_head = nn.Linear(self.model.config.hidden_size, self.model.config.vocab_size, bias=False)


class TimestepEmbedder(nn.Module):
    """Sinusoidal timestep features (cos first, 256 channels) through a two-layer SiLU MLP."""

    def __init__(self, hidden_size: int, frequency_embedding_size: int = 256) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(frequency_embedding_size, hidden_size), nn.SiLU(),
                                 nn.Linear(hidden_size, hidden_size))
        self.frequency_embedding_size = frequency_embedding_size

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        half = self.frequency_embedding_size // 2
        freqs = torch.exp(-math.log(10000) * torch.arange(half, dtype=torch.float32) / half).to(t.device)
        args = t[:, None].float() * freqs[None]
        features = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
        return self.mlp(features.to(self.mlp[0].weight.dtype))


def _sincos_1d(dim: int, positions):
    import numpy as np

    omega = np.arange(dim // 2, dtype=np.float64) / (dim / 2.0)
    omega = 1.0 / 10000**omega
    out = np.einsum("m,d->md", positions.reshape(-1), omega)
    return np.concatenate([np.sin(out), np.cos(out)], axis=1)


def sincos_2d(dim: int, grid_size: int) -> torch.Tensor:
    """The fixed 2D sine-cosine table BAGEL initialises its position embeddings with (``[grid², dim]``)."""
    import numpy as np

    grid_h = np.arange(grid_size, dtype=np.float32)
    grid_w = np.arange(grid_size, dtype=np.float32)
    grid = np.stack(np.meshgrid(grid_w, grid_h), axis=0).reshape(2, 1, grid_size, grid_size)
    table = np.concatenate([_sincos_1d(dim // 2, grid[0]), _sincos_1d(dim // 2, grid[1])], axis=1)
    return torch.from_numpy(table).float()


class PositionEmbedding(nn.Module):
    """A ``[max_num_patch_per_side², hidden]`` table (frozen, sine-cosine initialised) indexed by flattened 2D
    positions."""

    def __init__(self, max_num_patch_per_side: int, hidden_size: int) -> None:
        super().__init__()
        self.max_num_patch_per_side = max_num_patch_per_side
        self.pos_embed = nn.Parameter(torch.zeros(max_num_patch_per_side**2, hidden_size), requires_grad=False)
        if self.pos_embed.device.type != "meta":
            with torch.no_grad():
                self.pos_embed.copy_(sincos_2d(hidden_size, max_num_patch_per_side))

    def forward(self, position_ids: torch.Tensor) -> torch.Tensor:
        return self.pos_embed[position_ids]


class MLPConnector(nn.Module):
    def __init__(self, in_dim: int, out_dim: int, hidden_act: str) -> None:
        super().__init__()
        self.fc1 = nn.Linear(in_dim, out_dim)
        self.fc2 = nn.Linear(out_dim, out_dim)
        self.activation_fn = ACT2FN[hidden_act]

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.activation_fn(self.fc1(hidden_states)))


class BagelVisionModel(nn.Module):
    """BAGEL's SigLIP vision tower under ``vision_model``: Transformers' SigLIP vision transformer without its
    pooling head, its patch convolution stored as the ``Linear`` BAGEL's checkpoint holds (``[hidden,
    patch² · channels]``, channel-last patches)."""

    def __init__(self, vit_config: dict) -> None:
        super().__init__()
        from transformers import SiglipVisionConfig, SiglipVisionModel

        config = SiglipVisionConfig(**{**vit_config, "vision_use_head": False})
        model = SiglipVisionModel(config)
        # Transformers 4 nests the transformer under ``vision_model``; Transformers 5 is the transformer itself.
        self.vision_model = getattr(model, "vision_model", model)
        self.config = config
        self.vision_model.embeddings.patch_embedding = nn.Linear(config.num_channels * config.patch_size**2,
                                                                 config.hidden_size)

    def forward(self, patches: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """One image's patches ``[N, patch² · channels]`` (channel-last) at flattened positions ``[N]`` (rows of
        ``vit_max_num_patch_per_side``) to ``[N, hidden]``: every patch attends to every other."""
        embeddings = self.vision_model.embeddings
        hidden = embeddings.patch_embedding(patches) + embeddings.position_embedding(position_ids)
        hidden = self.vision_model.encoder(inputs_embeds=hidden[None]).last_hidden_state[0]
        return self.vision_model.post_layernorm(hidden)


class BagelModel(ModelMixin, ConfigMixin):
    """BAGEL: the ``language_model`` (``Qwen2MoTForCausalLM``), the generation modules (``time_embedder``,
    ``vae2llm``, ``llm2vae``, ``latent_pos_embed``) and the understanding modules (``vit_model``, ``connector``,
    ``vit_pos_embed``). Parameter names and shapes are those of the published ``ema.safetensors``.

    Args:
        llm_config: ``Qwen2MoTModel`` arguments (BAGEL's ``llm_config.json`` keys that the model uses).
        vit_config: ``SiglipVisionConfig`` arguments, with the layer count BAGEL runs (one less than its
            ``vit_config.json`` says: BAGEL drops SigLIP's last layer).
        latent_channels: the VAE's latent channels.
        vae_downsample: the VAE's spatial downsampling.
        latent_patch_size: latent pixels per side of one generation token.
        max_latent_size: generation tokens per side of the largest image (``latent_pos_embed`` has its square).
        vit_max_num_patch_per_side: the same for ViT patches (``vit_pos_embed``).
        connector_act: activation of the ViT-to-LLM connector.
    """

    _no_split_modules = ["Qwen2MoTDecoderLayer"]

    @register_to_config
    def __init__(self, llm_config: dict | None = None, vit_config: dict | None = None, latent_channels: int = 16,
                 vae_downsample: int = 8, latent_patch_size: int = 2, max_latent_size: int = 64,
                 vit_max_num_patch_per_side: int = 70, connector_act: str = "gelu_pytorch_tanh") -> None:
        super().__init__()
        llm_config = dict(llm_config or {})
        self.language_model = Qwen2MoTForCausalLM(**llm_config)
        hidden = self.language_model.model.config.hidden_size
        self.hidden_size = hidden
        self.latent_patch_size = latent_patch_size
        self.latent_channels = latent_channels
        self.latent_downsample = vae_downsample * latent_patch_size
        self.max_latent_size = max_latent_size
        patch_dim = latent_patch_size**2 * latent_channels
        self.time_embedder = TimestepEmbedder(hidden)
        self.vae2llm = nn.Linear(patch_dim, hidden)
        self.llm2vae = nn.Linear(hidden, patch_dim)
        self.latent_pos_embed = PositionEmbedding(max_latent_size, hidden)
        vit_config = dict(vit_config or {"hidden_size": 1152, "intermediate_size": 4304, "num_hidden_layers": 26,
                                         "num_attention_heads": 16, "image_size": 980, "patch_size": 14,
                                         "hidden_act": "gelu_pytorch_tanh", "layer_norm_eps": 1e-6})
        self.vit_model = BagelVisionModel(vit_config)
        self.connector = MLPConnector(self.vit_model.config.hidden_size, hidden, connector_act)
        self.vit_pos_embed = PositionEmbedding(vit_max_num_patch_per_side, hidden)
        self.vit_max_num_patch_per_side = vit_max_num_patch_per_side

    @property
    def backbone(self) -> Qwen2MoTModel:
        return self.language_model.model

    def latent_position_ids(self, height: int, width: int) -> torch.Tensor:
        """Flattened positions of an image's generation tokens in ``latent_pos_embed`` (row-major over a
        ``max_latent_size``-wide grid)."""
        rows, cols = height // self.latent_downsample, width // self.latent_downsample
        return (torch.arange(rows)[:, None] * self.max_latent_size + torch.arange(cols)).flatten()

    def prefill(self, token_ids: torch.Tensor, cache: BagelKVCache, rope_start: int) -> BagelKVCache:
        """Run text tokens (understanding mode, causal) after ``cache``; returns the extended cache."""
        embeds = self.backbone.embed_tokens(token_ids)
        positions = torch.arange(rope_start, rope_start + token_ids.shape[0], device=token_ids.device)
        _, new_cache = self.backbone(embeds, positions, mode=UNDERSTANDING, past_key_values=cache,
                                     update_cache=True)
        return new_cache

    def prefill_image(self, pixel_values: torch.Tensor, marker_ids: torch.Tensor, cache: BagelKVCache,
                      rope_position: int) -> BagelKVCache:
        """Run an image ``[channels, H, W]`` (normalised to [-1, 1], sides multiples of the ViT patch) through the
        vision tower and, as ``[start_of_image, ViT tokens..., end_of_image]`` (``marker_ids``) all at rotary
        position ``rope_position``, through the language model in understanding mode, bidirectionally after
        ``cache``; returns the extended cache (the image takes one rotary position)."""
        patch = self.vit_model.config.patch_size
        channels, height, width = pixel_values.shape
        rows, cols = height // patch, width // patch
        patches = pixel_values.reshape(channels, rows, patch, cols, patch)
        patches = torch.einsum("chpwq->hwpqc", patches).reshape(-1, patch * patch * channels)
        device = pixel_values.device
        position_ids = (torch.arange(rows, device=device)[:, None] * self.vit_max_num_patch_per_side
                        + torch.arange(cols, device=device)).flatten()
        dtype = self.connector.fc1.weight.dtype
        tokens = self.connector(self.vit_model(patches.to(dtype), position_ids)) + self.vit_pos_embed(position_ids)
        markers = self.backbone.embed_tokens(marker_ids)
        num = tokens.shape[0]
        sequence = markers.new_zeros((num + 2, self.hidden_size))
        sequence[torch.tensor([0, num + 1], device=device)] = markers
        sequence[1:num + 1] = tokens.to(sequence.dtype)
        positions = torch.full((num + 2,), rope_position, dtype=torch.long, device=device)
        _, new_cache = self.backbone(sequence, positions, mode=UNDERSTANDING, past_key_values=cache,
                                     update_cache=True, causal=False)
        return new_cache

    def next_token_logits(self, token_id: torch.Tensor, cache: BagelKVCache,
                          rope_position: int) -> tuple[torch.Tensor, BagelKVCache]:
        """Logits ``[vocab]`` after one more text token (understanding mode), and the cache extended by it."""
        embeds = self.backbone.embed_tokens(token_id.reshape(1))
        positions = torch.tensor([rope_position], device=embeds.device)
        hidden, new_cache = self.backbone(embeds, positions, mode=UNDERSTANDING, past_key_values=cache,
                                          update_cache=True)
        return self.language_model.lm_head(hidden)[0], new_cache

    def predict_velocity(self, latents: torch.Tensor, timestep: torch.Tensor, marker_ids: torch.Tensor,
                         latent_position_ids: torch.Tensor, rope_position: int,
                         cache: BagelKVCache) -> torch.Tensor:
        """The flow velocity of packed latent tokens ``[N, patch_dim]`` at ``timestep`` (a scalar tensor),
        attending to ``cache``. The query sequence is ``[start_of_image, latents..., end_of_image]``
        (``marker_ids``), all at rotary position ``rope_position``."""
        num = latents.shape[0]
        device = latents.device
        markers = self.backbone.embed_tokens(marker_ids)
        sequence = markers.new_zeros((num + 2, self.hidden_size))
        text_indexes = torch.tensor([0, num + 1], device=device)
        gen_indexes = torch.arange(1, num + 1, device=device)
        sequence[text_indexes] = markers
        t = timestep.expand(num)
        tokens = self.vae2llm(latents.to(self.vae2llm.weight.dtype)) + self.time_embedder(t) + self.latent_pos_embed(latent_position_ids)
        sequence[gen_indexes] = tokens.to(sequence.dtype)
        positions = torch.full((num + 2,), rope_position, dtype=torch.long, device=device)
        hidden, _ = self.backbone(sequence, positions, mode=GENERATION, gen_indexes=gen_indexes,
                                  text_indexes=text_indexes, past_key_values=cache)
        return self.llm2vae(hidden)[gen_indexes]
