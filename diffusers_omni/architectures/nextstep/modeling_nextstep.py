"""NextStep-1.1's backbone (``NextStepModel``): a Qwen2-style causal decoder over text and continuous image tokens,
with image projectors and the flow-matching head that samples each image token.

Parameter names and shapes are those of the published checkpoint (``stepfun-ai/NextStep-1.1``, unprefixed keys
such as ``layers.0.self_attn.q_proj.weight`` and ``image_head.net.res_blocks.0.mlp.0.weight``). The attention
modules follow Diffusers' processor pattern: ``NextStepAttnProcessor`` calls ``dispatch_attention_fn`` once per
module and forward, so attention backends can be swapped per module.

The key/value cache is a plain per-layer list (``NextStepKVCache``); positions count every cached slot, left
padding included, as in the reference implementation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.models.attention import AttentionModuleMixin
from diffusers.models.attention_dispatch import dispatch_attention_fn
from diffusers.models.modeling_utils import ModelMixin
from diffusers.utils import BaseOutput
from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

__all__ = [
    "NextStepAttention",
    "NextStepAttnProcessor",
    "NextStepDecoderLayer",
    "NextStepFlowMatchingHead",
    "NextStepKVCache",
    "NextStepModel",
    "NextStepModelOutput",
]


class NextStepKVCache:
    """Keys and values of every decoder layer, ``[batch, tokens, kv_heads, head_dim]`` each, grown by concatenation."""

    def __init__(self, num_layers: int):
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers
        # Cached tokens before the running forward: its new keys go after them. An update repeated within one
        # forward (a tool re-running a processor) rewrites the same slots instead of appending twice.
        self.offset = 0

    def __len__(self) -> int:
        return len(self.keys)

    def seq_length(self) -> int:
        return 0 if self.keys[0] is None else int(self.keys[0].shape[1])

    def update(self, layer_idx: int, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.offset:
            key = torch.cat([self.keys[layer_idx][:, : self.offset].to(key.device), key], dim=1)
            value = torch.cat([self.values[layer_idx][:, : self.offset].to(value.device), value], dim=1)
        self.keys[layer_idx] = key
        self.values[layer_idx] = value
        return key, value


# NextStep's backbone is Qwen2.5's: its RMS norm is Transformers' Qwen2 one.
NextStepRMSNorm = Qwen2RMSNorm


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class NextStepAttnProcessor:
    """Grouped-query causal self-attention with rotary positions and an optional key/value cache.

    ``attention_mask``: ``None`` or a boolean ``[batch, 1, queries, keys]`` mask (``True`` attends); with
    ``is_causal`` the call is causal over a fresh sequence and carries no mask.
    """

    _attention_backend = None
    _parallel_config = None

    def __call__(
        self,
        attn: "NextStepAttention",
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None = None,
        is_causal: bool = False,
        kv_cache: NextStepKVCache | None = None,
    ) -> torch.Tensor:
        batch, length, _ = hidden_states.shape
        query = attn.q_proj(hidden_states).view(batch, length, attn.num_attention_heads, attn.head_dim)
        key = attn.k_proj(hidden_states).view(batch, length, attn.num_key_value_heads, attn.head_dim)
        value = attn.v_proj(hidden_states).view(batch, length, attn.num_key_value_heads, attn.head_dim)

        cos, sin = position_embeddings
        cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
        query = query * cos + _rotate_half(query) * sin
        key = key * cos + _rotate_half(key) * sin

        if kv_cache is not None:
            key, value = kv_cache.update(attn.layer_idx, key, value)

        hidden_states = dispatch_attention_fn(
            query,
            key,
            value,
            attn_mask=attention_mask,
            is_causal=is_causal,
            enable_gqa=attn.num_key_value_heads != attn.num_attention_heads,
            backend=self._attention_backend,
            parallel_config=self._parallel_config,
        )
        hidden_states = hidden_states.flatten(2, 3).to(query.dtype)
        return attn.o_proj(hidden_states)


class NextStepAttention(nn.Module, AttentionModuleMixin):
    _default_processor_cls = NextStepAttnProcessor
    _available_processors = [NextStepAttnProcessor]
    _supports_qkv_fusion = False

    def __init__(
        self,
        hidden_size: int,
        num_attention_heads: int,
        num_key_value_heads: int,
        head_dim: int,
        layer_idx: int,
        attention_bias: bool = True,
        o_attention_bias: bool = False,
        processor=None,
    ):
        super().__init__()
        self.hidden_size = hidden_size
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads
        self.head_dim = head_dim
        self.heads = num_attention_heads
        self.inner_dim = num_attention_heads * head_dim
        self.layer_idx = layer_idx
        self.q_proj = nn.Linear(hidden_size, num_attention_heads * head_dim, bias=attention_bias)
        self.k_proj = nn.Linear(hidden_size, num_key_value_heads * head_dim, bias=attention_bias)
        self.v_proj = nn.Linear(hidden_size, num_key_value_heads * head_dim, bias=attention_bias)
        self.o_proj = nn.Linear(num_attention_heads * head_dim, hidden_size, bias=o_attention_bias)
        self.set_processor(processor if processor is not None else self._default_processor_cls())

    def forward(self, hidden_states, position_embeddings, attention_mask=None, is_causal=False, kv_cache=None):
        return self.processor(self, hidden_states, position_embeddings, attention_mask, is_causal, kv_cache)


class NextStepMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class NextStepDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.self_attn = NextStepAttention(
            config.hidden_size,
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
            layer_idx,
            attention_bias=config.attention_bias,
            o_attention_bias=config.o_attention_bias,
        )
        self.mlp = NextStepMLP(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
        self.input_layernorm = NextStepRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = NextStepRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, position_embeddings, attention_mask=None, is_causal=False, kv_cache=None):
        residual = hidden_states
        hidden_states = self.self_attn(
            self.input_layernorm(hidden_states), position_embeddings, attention_mask, is_causal, kv_cache
        )
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.mlp(self.post_attention_layernorm(hidden_states))
        return residual + hidden_states


# ----------------------------------------------------------------------------------------------------------------
# Flow-matching head: an MLP with adaptive layer norm, conditioned on the projected hidden state and the time.
# ----------------------------------------------------------------------------------------------------------------


def _timestep_embedding(t: torch.Tensor, dim: int, max_period: float = 10000.0) -> torch.Tensor:
    half = dim // 2
    freqs = torch.exp(
        -math.log(max_period) * torch.arange(start=0, end=half, dtype=torch.float32, device=t.device) / half
    )
    args = t[:, None].float() * freqs[None]
    embedding = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
    if dim % 2:
        embedding = torch.cat([embedding, torch.zeros_like(embedding[:, :1])], dim=-1)
    return embedding


class _TimestepEmbedder(nn.Module):
    def __init__(self, hidden_size: int, frequency_embedding_size: int = 256):
        super().__init__()
        self.mlp = nn.Sequential(
            nn.Linear(frequency_embedding_size, hidden_size), nn.SiLU(), nn.Linear(hidden_size, hidden_size)
        )
        self.frequency_embedding_size = frequency_embedding_size

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        return self.mlp(_timestep_embedding(t, self.frequency_embedding_size).to(self.mlp[0].weight.dtype))


class _AdaLNResBlock(nn.Module):
    def __init__(self, channels: int, mlp_ratio: float = 1.0):
        super().__init__()
        inner = int(channels * mlp_ratio)
        self.in_ln = nn.LayerNorm(channels, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(channels, inner), nn.SiLU(), nn.Linear(inner, channels))
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(channels, 3 * channels))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        shift, scale, gate = self.adaLN_modulation(y).chunk(3, dim=-1)
        return x + gate * self.mlp(self.in_ln(x) * (1 + scale) + shift)


class _AdaLNFinalLayer(nn.Module):
    def __init__(self, channels: int, out_channels: int):
        super().__init__()
        self.norm_final = nn.LayerNorm(channels, elementwise_affine=False, eps=1e-6)
        self.linear = nn.Linear(channels, out_channels)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(channels, 2 * channels))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        shift, scale = self.adaLN_modulation(y).chunk(2, dim=-1)
        return self.linear(self.norm_final(x) * (1 + scale) + shift)


class _AdaLNMLP(nn.Module):
    def __init__(self, input_dim: int, cond_dim: int, dim: int, layers: int, mlp_ratio: float = 1.0):
        super().__init__()
        self.time_embed = _TimestepEmbedder(dim)
        self.cond_embed = nn.Linear(cond_dim, dim)
        self.input_proj = nn.Linear(input_dim, dim)
        self.res_blocks = nn.ModuleList([_AdaLNResBlock(dim, mlp_ratio) for _ in range(layers)])
        self.final_layer = _AdaLNFinalLayer(dim, input_dim)

    def forward(self, x: torch.Tensor, t: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        x = self.input_proj(x)
        y = self.time_embed(t) + self.cond_embed(c)
        for block in self.res_blocks:
            x = block(x, y)
        return self.final_layer(x, y)


class NextStepFlowMatchingHead(nn.Module):
    """Samples one image token per condition row by integrating a flow-matching SDE (Euler–Maruyama)."""

    def __init__(self, input_dim: int, cond_dim: int, dim: int, layers: int, mlp_ratio: float = 1.0):
        super().__init__()
        self.input_dim = input_dim
        self.net = _AdaLNMLP(input_dim, cond_dim, dim, layers, mlp_ratio)

    @staticmethod
    def _noise(rows: int, dim: int, noise_repeat: int, generator, device) -> torch.Tensor:
        if rows % noise_repeat:
            raise ValueError(f"noise_repeat={noise_repeat} must divide the number of samples ({rows})")
        noise = torch.randn((noise_repeat, dim), generator=generator, device=device, dtype=torch.float32)
        return noise.repeat(rows // noise_repeat, 1)

    @staticmethod
    def guide(velocity: torch.Tensor, cfg: float, cfg_img: float, cfg_mult: int) -> torch.Tensor:
        if cfg_mult == 2:
            cond, uncond = velocity.chunk(2, dim=0)
            return uncond + cfg * (cond - uncond)
        if cfg_mult == 3:
            cond, uncond_text, uncond = velocity.chunk(3, dim=0)
            return uncond + cfg_img * (uncond_text - uncond) + cfg * (cond - uncond_text)
        return velocity

    @torch.no_grad()
    def sample(
        self,
        c: torch.Tensor,
        cfg: float = 1.0,
        cfg_img: float = 1.0,
        cfg_mult: int = 1,
        timesteps_shift: float = 1.0,
        num_sampling_steps: int = 20,
        noise_repeat: int = 1,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """``c``: ``[cfg_mult * samples, cond_dim]`` (conditional rows first). Returns ``[samples, input_dim]``."""
        if c.shape[0] % cfg_mult:
            raise ValueError(f"cfg_mult={cfg_mult} must divide the condition batch ({c.shape[0]})")
        rows = c.shape[0] // cfg_mult
        device = self.net.input_proj.weight.device
        x = self._noise(rows, self.input_dim, noise_repeat, generator, device)
        timesteps = torch.linspace(0, 1, num_sampling_steps + 1, device=c.device)[:-1]
        timesteps = timesteps / (timesteps_shift - (timesteps_shift - 1) * timesteps)
        timesteps = torch.cat([timesteps, torch.ones(1, device=c.device)])
        for ti, tj in zip(timesteps[:-1], timesteps[1:]):
            dt = tj - ti
            velocity = self.net(torch.cat([x] * cfg_mult, dim=0).to(c.dtype), ti.expand(c.shape[0]).to(c), c)
            velocity = self.guide(velocity.to(torch.float32), cfg, cfg_img, cfg_mult)
            t = ti.expand(rows).to(x).view(rows, 1)
            # Score of the linear path x_t = t * x1 + (1 - t) * noise, from the velocity.
            score = (t * velocity - x) / ((1 - t) ** 2 + t * (1 - t))
            drift = velocity + (1 - t) * score
            dw = self._noise(rows, self.input_dim, noise_repeat, generator, device) * torch.sqrt(dt)
            x = x + drift * dt + torch.sqrt(2 * (1 - t)) * dw
        return x.to(c.dtype)


# ----------------------------------------------------------------------------------------------------------------
# The backbone
# ----------------------------------------------------------------------------------------------------------------


def sincos_2d_pos_embed(embed_dim: int, grid_size: int) -> np.ndarray:
    """2-D sine/cosine position table ``[grid_size**2, embed_dim]`` (row-major, height half first)."""
    grid_h = np.arange(grid_size, dtype=np.float32)
    grid_w = np.arange(grid_size, dtype=np.float32)
    grid = np.stack(np.meshgrid(grid_w, grid_h), axis=0).reshape(2, 1, grid_size, grid_size)

    def one_d(dim: int, pos: np.ndarray) -> np.ndarray:
        omega = np.arange(dim // 2, dtype=np.float64)
        omega /= dim / 2.0
        omega = 1.0 / 10000**omega
        out = np.einsum("m,d->md", pos.reshape(-1), omega)
        return np.concatenate([np.sin(out), np.cos(out)], axis=1)

    return np.concatenate([one_d(embed_dim // 2, grid[0]), one_d(embed_dim // 2, grid[1])], axis=1)


@dataclass
class NextStepModelOutput(BaseOutput):
    last_hidden_state: torch.Tensor
    kv_cache: NextStepKVCache | None = None


class NextStepModel(ModelMixin, ConfigMixin):
    """The NextStep-1.1 backbone: token embedding, ``layers`` (causal decoder layers), final norm, language-model
    head, image projectors and the flow-matching head (``image_head``).

    ``forward`` runs the decoder over ``inputs_embeds`` (use ``prepare_inputs_embeds`` for token ids) and returns
    the normalised hidden states; image tokens are sampled by the pipeline through ``image_out_projector`` and
    ``image_head.sample``.
    """

    _layerwise_offload_blocks_attrs = ["layers"]
    _no_split_modules = ["NextStepDecoderLayer"]
    _keys_to_ignore_on_load_unexpected = ["gen_pos_embed"]

    @register_to_config
    def __init__(
        self,
        vocab_size: int = 152064,
        hidden_size: int = 5120,
        intermediate_size: int = 13824,
        num_hidden_layers: int = 48,
        num_attention_heads: int = 40,
        num_key_value_heads: int = 8,
        head_dim: int | None = 128,
        rms_norm_eps: float = 1e-5,
        rope_theta: float = 1000000.0,
        attention_bias: bool = True,
        o_attention_bias: bool = False,
        mlp_bias: bool = False,
        pad_token_id: int | None = None,
        latent_channels: int = 16,
        latent_patch_size: int = 2,
        fm_head_dim: int = 1536,
        fm_head_layers: int = 12,
        use_gen_pos_embed: bool = False,
        base_image_grid_size: int = 64,
        boi: int | None = 151667,
        eoi: int | None = 151668,
        image_placeholder_id: int | None = 151669,
    ):
        super().__init__()
        if head_dim is None:
            head_dim = hidden_size // num_attention_heads
        if num_attention_heads % num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={num_attention_heads} must be a multiple of "
                f"num_key_value_heads={num_key_value_heads}"
            )
        self.embed_tokens = nn.Embedding(vocab_size, hidden_size, pad_token_id)
        layer_config = _LayerConfig(
            hidden_size, intermediate_size, num_attention_heads, num_key_value_heads, head_dim, rms_norm_eps,
            attention_bias, o_attention_bias, mlp_bias,
        )
        self.layers = nn.ModuleList([NextStepDecoderLayer(layer_config, i) for i in range(num_hidden_layers)])
        self.norm = NextStepRMSNorm(hidden_size, eps=rms_norm_eps)
        self.lm_head = nn.Linear(hidden_size, vocab_size, bias=False)
        token_dim = latent_channels * latent_patch_size**2
        self.image_in_projector = nn.Linear(token_dim, hidden_size)
        self.image_out_projector = nn.Linear(hidden_size, hidden_size)
        self.image_head = NextStepFlowMatchingHead(token_dim, hidden_size, fm_head_dim, fm_head_layers)
        self._head_dim = head_dim
        self.register_buffer("inv_freq", torch.empty(head_dim // 2), persistent=False)
        if use_gen_pos_embed:
            self.register_buffer(
                "gen_pos_embed", torch.empty(1, base_image_grid_size**2, hidden_size), persistent=False
            )
        self.reset_buffers()

    def reset_buffers(self) -> None:
        """Compute the non-persistent buffers (rotary frequencies, generation positions), e.g. after a load that
        built the model on the meta device."""
        device = self.inv_freq.device
        if device.type == "meta":
            return  # built on the meta device for a load: the loader calls this again with real buffers
        dim = self._head_dim
        exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float32) / dim
        self.inv_freq = 1.0 / (self.config.rope_theta**exponents)
        if self.config.use_gen_pos_embed:
            table = sincos_2d_pos_embed(self.config.hidden_size, self.config.base_image_grid_size)
            self.gen_pos_embed = torch.from_numpy(table).float().unsqueeze(0).to(device)

    @property
    def token_dim(self) -> int:
        return self.config.latent_channels * self.config.latent_patch_size**2

    def rotary_embedding(self, hidden_states: torch.Tensor, position_ids: torch.Tensor):
        inv_freq = self.inv_freq.to(hidden_states.device)
        inv_freq = inv_freq[None, :, None].float().expand(position_ids.shape[0], -1, 1)
        positions = position_ids[:, None, :].float()
        with torch.autocast(device_type=hidden_states.device.type if hidden_states.device.type != "mps" else "cpu",
                            enabled=False):
            freqs = (inv_freq.float() @ positions.float()).transpose(1, 2)
            emb = torch.cat((freqs, freqs), dim=-1)
            cos, sin = emb.cos(), emb.sin()
        return cos.to(hidden_states.dtype), sin.to(hidden_states.dtype)

    def gen_pos_embed_with_ar(self, h: int, w: int) -> torch.Tensor:
        """The generation position table cropped to ``h`` rows and ``w`` columns, flattened row-major."""
        _, hw, dim = self.gen_pos_embed.shape
        side = int(hw**0.5)
        return self.gen_pos_embed.reshape(1, side, side, dim)[:, :h, :w, :].reshape(1, -1, dim)

    def patchify(self, latents: torch.Tensor) -> torch.Tensor:
        """``[B, C, H, W]`` latents → ``[B, H*W/p², C*p²]`` tokens."""
        b, c, h, w = latents.shape
        p = self.config.latent_patch_size
        x = latents.reshape(b, c, h // p, p, w // p, p)
        x = torch.einsum("nchpwq->nhwcpq", x)
        return x.reshape(b, (h // p) * (w // p), c * p**2)

    def unpatchify(self, tokens: torch.Tensor, h: int, w: int) -> torch.Tensor:
        """``[B, h*w, C*p²]`` tokens → ``[B, C, h*p, w*p]`` latents."""
        b = tokens.shape[0]
        p, c = self.config.latent_patch_size, self.config.latent_channels
        if h * w != tokens.shape[1]:
            raise ValueError(f"{tokens.shape[1]} tokens do not form a {h}x{w} grid")
        x = tokens.reshape(b, h, w, c, p, p)
        x = torch.einsum("nhwcpq->nchpwq", x)
        return x.reshape(b, c, h * p, w * p)

    def prepare_inputs_embeds(self, input_ids: torch.LongTensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(
        self,
        inputs_embeds: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        kv_cache: NextStepKVCache | None = None,
        return_dict: bool = True,
    ):
        """Run the decoder layers.

        Args:
            inputs_embeds: ``[batch, new_tokens, hidden_size]``.
            attention_mask: ``[batch, cached + new_tokens]``, 1 for real tokens and 0 for (left) padding; ``None``
                when nothing is padded.
            kv_cache: the cache to read and extend (``None`` runs without one).
        """
        batch, length, _ = inputs_embeds.shape
        past = kv_cache.seq_length() if kv_cache is not None else 0
        if kv_cache is not None:
            kv_cache.offset = past
        device = inputs_embeds.device
        if attention_mask is not None and attention_mask.shape != (batch, past + length):
            raise ValueError(
                f"attention_mask has shape {tuple(attention_mask.shape)}; expected {(batch, past + length)} "
                "(cached plus new tokens)"
            )
        positions = torch.arange(past, past + length, device=device)
        position_embeddings = self.rotary_embedding(inputs_embeds, positions.unsqueeze(0))

        mask, is_causal = None, False
        padded = attention_mask is not None and not bool(attention_mask.to(torch.bool).all())
        if padded:
            keys = torch.arange(past + length, device=device)
            allowed = keys[None, :] <= positions[:, None]
            allowed = allowed[None] & attention_mask.to(device=device, dtype=torch.bool)[:, None, :]
            # A padding query attends to itself at least, so that every row stays finite; real tokens never
            # attend to padding, so these rows do not reach them.
            allowed = allowed | (keys[None, None, :] == positions[None, :, None])
            mask = allowed[:, None]
        elif length > 1:
            if past:
                keys = torch.arange(past + length, device=device)
                mask = (keys[None, :] <= positions[:, None])[None, None].expand(batch, 1, -1, -1)
            else:
                is_causal = True

        hidden_states = inputs_embeds
        for layer in self.layers:
            hidden_states = layer(hidden_states, position_embeddings, mask, is_causal, kv_cache)
        hidden_states = self.norm(hidden_states)
        if not return_dict:
            return hidden_states, kv_cache
        return NextStepModelOutput(last_hidden_state=hidden_states, kv_cache=kv_cache)


@dataclass(frozen=True)
class _LayerConfig:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    attention_bias: bool
    o_attention_bias: bool
    mlp_bias: bool


# Keys of the published config.json (a ``LlamaConfig`` with NextStep fields) that set this model's config.
_PUBLISHED_KEYS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta", "attention_bias", "o_attention_bias",
    "mlp_bias", "pad_token_id", "latent_channels", "latent_patch_size", "fm_head_dim", "fm_head_layers",
    "use_gen_pos_embed", "base_image_grid_size", "boi", "eoi", "image_placeholder_id",
)


def config_from_published(published: dict) -> dict:
    """``NextStepModel`` init arguments from the published ``config.json``.

    Absent keys take the reference's defaults (``NextStepConfig``/``LlamaConfig``): ``o_attention_bias`` follows
    ``attention_bias``; ``rope_theta`` may sit in ``rope_parameters``/``rope_scaling``; ``head_dim`` defaults to
    ``hidden_size // num_attention_heads``; ``num_key_value_heads`` to ``num_attention_heads``.
    """
    config = {key: published[key] for key in _PUBLISHED_KEYS if key in published}
    if "rope_theta" not in config:
        for holder in ("rope_parameters", "rope_scaling"):
            if isinstance(published.get(holder), dict) and "rope_theta" in published[holder]:
                config["rope_theta"] = published[holder]["rope_theta"]
                break
        else:
            config["rope_theta"] = 10000.0
    config.setdefault("attention_bias", False)
    config.setdefault("o_attention_bias", config["attention_bias"])
    if config.get("o_attention_bias") is None:
        config["o_attention_bias"] = config["attention_bias"]
    config.setdefault("mlp_bias", False)
    config.setdefault("head_dim", None)
    config.setdefault("num_key_value_heads", published.get("num_attention_heads", 40))
    config.setdefault("rms_norm_eps", 1e-6)
    config.setdefault("pad_token_id", None)
    for key in ("boi", "eoi", "image_placeholder_id"):
        config.setdefault(key, None)
    config.setdefault("use_gen_pos_embed", False)
    config.setdefault("latent_channels", 16)
    config.setdefault("latent_patch_size", 2)
    config.setdefault("fm_head_dim", 1536)
    config.setdefault("fm_head_layers", 12)
    return config
