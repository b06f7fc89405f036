"""``DiffLlama``: SoulX-Singer's flow-matching estimator, a bidirectional Llama decoder stack with adaptive RMS norms.

Every decoder layer is a Llama layer (rotary self-attention without biases, SwiGLU MLP of width ``4 * hidden_size``)
whose two RMS norms take their per-channel scale from the diffusion-step embedding (``to_weight``, a linear map of
that embedding). The input is ``mel_mlp(x) + cond_mlp(cond)``; the output is ``mel_out_mlp`` of the final adaptive
norm. Attention is bidirectional over the whole ``[prompt, target]`` frame sequence; a ``[B, S]`` frame mask, when
given, hides the masked frames as keys.

Parameter names and shapes are those of the published checkpoint under ``cfm_decoder.model.diff_estimator``.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.models.attention import AttentionModuleMixin
from diffusers.models.attention_dispatch import dispatch_attention_fn
from diffusers.models.modeling_utils import ModelMixin

__all__ = ["DiffLlama", "DiffLlamaAttention", "DiffLlamaAttnProcessor", "DiffLlamaDecoderLayer"]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


class DiffLlamaRotaryEmbedding(nn.Module):
    """Llama rotary position embedding (``cos``, ``sin`` of shape ``[B, S, head_dim]``), computed in float32."""

    def __init__(self, head_dim: int, theta: float = 10000.0) -> None:
        super().__init__()
        self.theta = theta
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq = self.inv_freq[None, :, None].float().expand(position_ids.shape[0], -1, 1)
        positions = position_ids[:, None, :].float()
        freqs = (inv_freq.to(x.device) @ positions).transpose(1, 2)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype=x.dtype), emb.sin().to(dtype=x.dtype)


class DiffLlamaAttnProcessor:
    """Projections, rotary embedding and one bidirectional attention call through ``dispatch_attention_fn``.

    ``attention_mask`` is the ``[B, S]`` boolean frame mask (``True`` = attend) or ``None``; it reaches the kernel
    as ``[B, 1, 1, S]``.
    """

    _attention_backend = None
    _parallel_config = None

    def __call__(
        self,
        attn: "DiffLlamaAttention",
        hidden_states: torch.Tensor,
        rotary_emb: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        batch, length, _ = hidden_states.shape
        shape = (batch, length, attn.heads, attn.head_dim)
        query = attn.q_proj(hidden_states).view(shape)
        key = attn.k_proj(hidden_states).view(shape)
        value = attn.v_proj(hidden_states).view(shape)

        cos, sin = rotary_emb
        cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)  # [B, S, 1, D]
        query = query * cos + _rotate_half(query) * sin
        key = key * cos + _rotate_half(key) * sin

        mask = None if attention_mask is None else attention_mask[:, None, None, :]
        hidden_states = dispatch_attention_fn(
            query, key, value, attn_mask=mask, backend=self._attention_backend, parallel_config=self._parallel_config
        )
        hidden_states = hidden_states.reshape(batch, length, attn.heads * attn.head_dim).to(query.dtype)
        return attn.o_proj(hidden_states)


class DiffLlamaAttention(nn.Module, AttentionModuleMixin):
    """Llama self-attention (``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``, no biases) with a Diffusers processor."""

    _default_processor_cls = DiffLlamaAttnProcessor
    _available_processors = [DiffLlamaAttnProcessor]
    _supports_qkv_fusion = False

    def __init__(self, hidden_size: int, heads: int, processor=None) -> None:
        super().__init__()
        if hidden_size % heads:
            raise ValueError(f"hidden_size={hidden_size} is not a multiple of num_heads={heads}")
        self.heads = heads
        self.head_dim = hidden_size // heads
        self.inner_dim = hidden_size
        self.q_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.k_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.v_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.o_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.set_processor(processor or self._default_processor_cls())

    def forward(self, hidden_states, rotary_emb, attention_mask=None):
        return self.processor(self, hidden_states, rotary_emb, attention_mask)


class DiffLlamaMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class AdaptiveRMSNorm(nn.Module):
    """RMS norm whose per-channel scale is ``to_weight(cond)`` (variance in float32, output in the input dtype)."""

    def __init__(self, hidden_size: int, cond_dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.to_weight = nn.Linear(cond_dim, hidden_size)
        self.eps = eps

    def forward(self, hidden_states: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        dtype = hidden_states.dtype
        variance = hidden_states.to(torch.float32).pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.eps)
        weight = self.to_weight(cond)
        if weight.ndim == 2:
            weight = weight.unsqueeze(1)
        return (weight * hidden_states).to(dtype)


class DiffLlamaDecoderLayer(nn.Module):
    def __init__(self, hidden_size: int, heads: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.self_attn = DiffLlamaAttention(hidden_size, heads)
        self.mlp = DiffLlamaMLP(hidden_size, 4 * hidden_size)
        self.input_layernorm = AdaptiveRMSNorm(hidden_size, hidden_size, eps)
        self.post_attention_layernorm = AdaptiveRMSNorm(hidden_size, hidden_size, eps)

    def forward(self, hidden_states, step_emb, rotary_emb, attention_mask=None):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states, step_emb)
        hidden_states = residual + self.self_attn(hidden_states, rotary_emb, attention_mask)
        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states, step_emb)
        return residual + self.mlp(hidden_states)


def _mlp(in_dim: int, hidden: int, out_dim: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(in_dim, hidden), nn.SiLU(), nn.Linear(hidden, out_dim))


def sinusoidal_step_embedding(t: torch.Tensor, dim: int) -> torch.Tensor:
    """``[sin, cos]`` embedding of the flow time ``t`` (``[B]``), ``dim // 2`` log-spaced frequencies each."""
    half = dim // 2
    scale = math.log(10000) / (half - 1)
    freqs = torch.exp(torch.arange(half, device=t.device) * -scale)
    args = t[:, None] * freqs[None, :] * 1.0
    return torch.cat((args.sin(), args.cos()), dim=-1)


class DiffLlama(ModelMixin, ConfigMixin):
    """SoulX-Singer's flow-matching estimator (the DiT of ``SoulXSingerPipeline``).

    Args:
        mel_dim: mel channels of the frames it predicts the flow of (128).
        hidden_size: width of the decoder layers (1024).
        num_heads: attention heads (16).
        num_layers: decoder layers (22).
        rms_norm_eps: epsilon of the adaptive RMS norms.
        rope_theta: rotary embedding base.

    ``forward(x, timestep, cond, attention_mask=None)``: ``x`` ``[B, S, mel_dim]`` frames, ``timestep`` ``[B]`` flow
    time in ``[0, 1]``, ``cond`` ``[B, S, hidden_size]`` frame conditions, ``attention_mask`` an optional ``[B, S]``
    frame mask (``True``/1 = valid). Returns the predicted flow ``[B, S, mel_dim]``.
    """

    _supports_gradient_checkpointing = False
    _no_split_modules = ["DiffLlamaDecoderLayer"]
    _layerwise_offload_blocks_attrs = ("layers",)
    _layerwise_offload_tail_attrs = ("norm", "mel_out_mlp")

    @register_to_config
    def __init__(
        self,
        mel_dim: int = 128,
        hidden_size: int = 1024,
        num_heads: int = 16,
        num_layers: int = 22,
        rms_norm_eps: float = 1e-6,
        rope_theta: float = 10000.0,
    ) -> None:
        super().__init__()
        self.layers = nn.ModuleList(DiffLlamaDecoderLayer(hidden_size, num_heads, rms_norm_eps)
                                    for _ in range(num_layers))
        self.norm = AdaptiveRMSNorm(hidden_size, hidden_size, rms_norm_eps)
        self.rotary_emb = DiffLlamaRotaryEmbedding(hidden_size // num_heads, rope_theta)
        self.diff_step_mlp = _mlp(hidden_size, 4 * hidden_size, hidden_size)
        self.cond_mlp = _mlp(hidden_size, 4 * hidden_size, hidden_size)
        self.mel_mlp = _mlp(mel_dim, 4 * hidden_size, hidden_size)
        self.mel_out_mlp = _mlp(hidden_size, 4 * hidden_size, mel_dim)

    def forward(
        self,
        x: torch.Tensor,
        timestep: torch.Tensor,
        cond: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        batch, length, _ = x.shape
        hidden_states = self.mel_mlp(x) + self.cond_mlp(cond)
        step = sinusoidal_step_embedding(timestep, self.config.hidden_size).to(hidden_states.device, x.dtype)
        step = self.diff_step_mlp(step)

        position_ids = torch.arange(length, device=x.device).unsqueeze(0)
        rotary_emb = self.rotary_emb(hidden_states, position_ids)
        if attention_mask is not None:
            if attention_mask.shape != (batch, length):
                raise ValueError(
                    f"attention_mask has shape {tuple(attention_mask.shape)}; expected [batch, frames] = "
                    f"{[batch, length]}"
                )
            attention_mask = attention_mask.to(device=x.device, dtype=torch.bool)

        for layer in self.layers:
            hidden_states = layer(hidden_states, step, rotary_emb, attention_mask)
        hidden_states = self.norm(hidden_states, step)
        return self.mel_out_mlp(hidden_states)
