#!/usr/bin/env python
"""Whole-pipeline offload benchmark (#29): prompt → image/video under several offload strategies on an emulated card.

One full-size pipeline (FLUX.1-dev, Qwen-Image or Wan2.2-T2V-A14B), built from the real configs written below (no
hub: bf16 random weights, tokenizers built locally), runs one prompt end to end under each strategy, every strategy
in its own child process of this script (so device peaks, pinned memory and host RSS do not leak from one into the
next; the parent only collects each child's JSON). A smaller card is emulated with
``torch.cuda.set_per_process_memory_fraction(card_gib · 2³⁰ / total device memory)``, set before the strategy is
enabled (every strategy but ``resident``). Strategies:

* ``resident``: the whole pipeline ``.to("cuda")``, no cap: the reference image and each phase's compute time
  (skipped where the weights would not fit the real device);
* ``omni``: ``omni = omnify(pipe); omni.enable_layerwise_offload(device="cuda")``, run on ``omni``;
  ``omni-budget``: the same with ``max_device_memory=--omni-budget`` (added after ``omni`` when the option is given);
  a budget sweep: ``--omni-budget`` with several comma-separated budgets, each a size or ``auto``
  (``4GiB,8GiB,11GiB,auto``), runs each in its own child in that order after ``omni`` (or in ``omni-budget``'s place
  in ``--strategies``), named ``omni-budget (4GiB)`` ... and ``omni-auto`` (``max_device_memory="auto"``: the budget
  read from the device after the card cap is set, ``diffusers_omni/offload/budget.py``); one size alone keeps the name
  ``omni-budget``, ``auto`` alone is ``omni-auto``. ``--omni-lossless`` (comma-separated: a size, ``auto`` or
  ``none``) runs those budgets again with ``compression="lossless"`` after the ``--omni-budget`` runs:
  ``omni-budget-lossless (8GiB)``, ``omni-auto-lossless``, ``omni-lossless`` (no budget). Every omni run records, right
  after enabling, its ``omni_plan``: the budget given and passed, the one it planned with (auto's choice), blocks
  resident and streamed, what auto chose and read (the offload stats' ``auto`` / ``auto_readings`` and the report's
  notes saying so) and the lossless store's host bytes ÷ bytes (``compression_ratio``); with any of these runs
  ``<out>.json`` has a ``budget_sweep`` section, ``<out>.md`` a "Budget sweep" table, and ``<out>.png`` plots end to
  end against the planned budget (sizes as a line, auto's choice starred, lossless runs as diamonds, omni without a
  budget and resident as horizontal lines). In a smoke run a single size is the tiny pipeline's weight bytes (as
  before), a sweep's sizes are placed on the tiny pipeline as on the card (the least budget it allows plus
  size ÷ ``--card-gib`` of the rest), and ``auto`` reads host memory (the CPU is the device);
  ``omni-host``: the host budget (``max_host_memory=--omni-host-budget``): the DiTs are first saved to
  ``--checkpoint-dir`` (safetensors, needs their bytes free on that disk) and loaded back as mmap views
  (``load_transformer_mmap``: no private copy in RAM), so the blocks beyond the budget are read from those files at
  every load; with ``--drop-page-cache`` (default) the files' cached pages are dropped
  (``posix_fadvise(DONTNEED)``) before every transformer forward, so those reads come from the disk, not RAM.
  ``omni-host-lossless``: the same with ``compression="lossless"`` and ``compression_cache_dir`` in
  ``--checkpoint-dir`` (``lossless-cache``): the blocks beyond the budget are read coded from the cache (its pages
  dropped too) and decoded on the device; its enable writes the cache, or reads it when a previous run left it;
  with ``--host-lossless-from-memory`` its DiTs stay as built (no checkpoint: the cache holds their code, checked
  against their bytes, as ``compression_cache_dir`` allows for a model built in memory) and the checkpoint an earlier
  omni-host left is removed first — for a disk that holds the DiTs' checkpoint or their cache, not both;
  ``--omni-attention`` chooses the attention ``omnify`` installs: ``off`` (default) keeps Diffusers' own processors,
  as every other strategy runs, so that only the offload differs (and the image can match ``resident`` bit for bit);
  ``auto`` is ``omnify(pipe)``'s default (omni attention with the platform's choice); any other value is passed on;
* ``diffusers-group``: ``pipe.enable_group_offload(block_level, num_blocks_per_group=1, use_stream=True,
  record_stream=True)`` (every component);
* ``diffusers-model`` / ``diffusers-sequential``: ``enable_model_cpu_offload()`` / ``enable_sequential_cpu_offload()``
  (the latter runs ``--sequential-steps`` steps);
* ``mmgp2`` / ``mmgp4``: ``mmgp.offload.profile(pipe, profile_type.HighRAM_LowVRAM / LowRAM_LowVRAM,
  quantizeTransformer=False)`` (mmgp 3.8; profile 4 quantizes the T5/UMT5 text encoder to int8 itself, as it does
  for its users: its image then differs from ``resident``).

Each child: the card cap, a 1 GiB pinned host→device copy (bandwidth), the pipeline built (parameters created on
the meta device, then each given its own storage copied from one shared random pool: fast, and every offloader sees
ordinary independent weights), the strategy enabled (timed), one warm-up call of ``--warmup-steps`` steps, then the
timed call with a fixed seed (``output_type="np"``; the sha256 of the final uint8 image/video, nothing saved).
Phases of the timed call come from forward pre/post hooks on the transformer(s) with ``torch.cuda.synchronize()``:
encode (call start → first transformer forward), denoise (→ end of the last transformer forward), decode (→ call
end). Recorded: device peak (``max_memory_allocated`` and ``max_memory_reserved``, reset before the timed call),
host RSS (``VmHWM`` reset before enabling, and ``VmRSS``), pinned host bytes (PyTorch's pinned host allocator and
diffusers-omni's ``cudaHostRegister``-ed bytes), enable / warm-up / end-to-end times. An out-of-memory error or any
other exception is that strategy's result (error type and first line); a child that dies (the host OOM killer) or
outlives the time budget is recorded as such; the parent never crashes on one.

``<out>.json`` holds the environment, the arguments, every component's parameter bytes (checked against the known
sizes: FLUX DiT ~23.8 GB, T5-XXL ~9.5 GB, Qwen-Image DiT ~40.9 GB, Qwen2.5-VL-7B ~16.6 GB, Wan expert ~28.6 GB,
UMT5-XXL ~11.4 GB) and every strategy's result; ``<out>.md`` a table, with a computed lower bound for omni: per phase
the larger of resident's compute time and the bytes omni streams in that phase ÷ the pinned bandwidth, summed.

Usage (one model per run; ``python -m benchmarks --list`` names the scenarios)::

    python -m benchmarks run pipeline-offload-flux            # on the H200: benchmarks/h200/run_all.sh
    python -m benchmarks run pipeline-offload-flux --smoke    # tiny configs on the CPU: checks the script's logic
    python -m benchmarks.pipeline_offload_bench --model flux --card-gib 12 --steps 28 \\
        --strategies resident,omni,diffusers-group,mmgp2,mmgp4 --omni-budget 8GiB --time-budget 450 --out /tmp/flux
    python -m benchmarks run pipeline-offload-flux-auto      # the budget sweep, auto and auto + lossless

``--smoke`` runs the same code path with tiny configs on the CPU (no card cap, no CUDA calls); the strategies that
need CUDA (Diffusers' offloads, mmgp) are reported as skipped there. ``--in-process`` (smoke only) runs every
strategy in the parent's process instead of a child each (one start-up: the tests' fast path).
"""

from __future__ import annotations

import argparse
import collections
import gc
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from benchmarks.offload_bench import (
    RssSampler, environment, host_rss, parameters_on_meta, reset_peak_rss, trim_host_heap,
)

GiB = 2**30
MiB = 2**20
STRATEGIES = ("resident", "omni", "omni-budget", "omni-host", "omni-host-lossless", "diffusers-group",
              "diffusers-model", "diffusers-sequential", "mmgp2", "mmgp4")
NEEDS_CUDA = {"diffusers-group", "diffusers-model", "diffusers-sequential", "mmgp2", "mmgp4"}
OMNI = ("omni", "omni-budget", "omni-host", "omni-host-lossless")
HOST = ("omni-host", "omni-host-lossless")  # runs under --omni-host-budget, reading blocks from disk
AUTO = "auto"
NO_BUDGET = "none"  # max_device_memory: every block streams (not given, a GPU run would plan with auto)
LOSSLESS = "lossless"
PHASES = ("encode", "denoise", "decode")
PROMPT = "A red fox sitting in a snowy forest at dawn, soft golden light, highly detailed photograph"
SEED = 0
# Resident runs only where the weights take at most this share of the real device (the rest: activations).
RESIDENT_FIT = 0.85
# Known parameter bytes (decimal GB, bf16) of the real checkpoints, and the tolerance of the check.
KNOWN_GB = {
    "flux": {"transformer": 23.8, "text_encoder_2": 9.5},
    "qwen": {"transformer": 40.9, "text_encoder": 16.6},
    "wan": {"transformer": 28.6, "transformer_2": 28.6, "text_encoder": 11.4},
}
SIZE_TOLERANCE = 0.02

# Real configs (the checkpoints' config.json, as from_pretrained reads them) ------------------------------------------

FLUX_DEV = {
    # black-forest-labs/FLUX.1-dev: transformer/config.json (FluxTransformer2DModel's defaults, guidance embeddings on)
    "transformer": {"patch_size": 1, "in_channels": 64, "num_layers": 19, "num_single_layers": 38,
                    "attention_head_dim": 128, "num_attention_heads": 24, "joint_attention_dim": 4096,
                    "pooled_projection_dim": 768, "guidance_embeds": True, "axes_dims_rope": [16, 56, 56]},
    # text_encoder_2: google/t5-v1_1-xxl's encoder
    "text_encoder_2": {"d_model": 4096, "d_ff": 10240, "d_kv": 64, "num_heads": 64, "num_layers": 24,
                       "vocab_size": 32128, "feed_forward_proj": "gated-gelu", "relative_attention_num_buckets": 32,
                       "relative_attention_max_distance": 128, "layer_norm_epsilon": 1e-6, "dropout_rate": 0.1,
                       "tie_word_embeddings": False, "pad_token_id": 0, "eos_token_id": 1,
                       "decoder_start_token_id": 0},
    # text_encoder: openai/clip-vit-large-patch14's text tower
    "text_encoder": {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 12,
                     "max_position_embeddings": 77, "vocab_size": 49408, "projection_dim": 768,
                     "hidden_act": "quick_gelu", "layer_norm_eps": 1e-5, "bos_token_id": 0, "eos_token_id": 2,
                     "pad_token_id": 1},
    "vae": {"in_channels": 3, "out_channels": 3, "latent_channels": 16, "block_out_channels": [128, 256, 512, 512],
            "down_block_types": ["DownEncoderBlock2D"] * 4, "up_block_types": ["UpDecoderBlock2D"] * 4,
            "layers_per_block": 2, "act_fn": "silu", "norm_num_groups": 32, "sample_size": 1024,
            "scaling_factor": 0.3611, "shift_factor": 0.1159, "use_quant_conv": False, "use_post_quant_conv": False,
            "force_upcast": True, "mid_block_add_attention": True},
    "scheduler": {"num_train_timesteps": 1000, "shift": 3.0, "use_dynamic_shifting": True, "base_shift": 0.5,
                  "max_shift": 1.15, "base_image_seq_len": 256, "max_image_seq_len": 4096},
}

QWEN_IMAGE = {
    # Qwen/Qwen-Image: transformer/config.json (QwenImageTransformer2DModel's defaults)
    "transformer": {"patch_size": 2, "in_channels": 64, "out_channels": 16, "num_layers": 60,
                    "attention_head_dim": 128, "num_attention_heads": 24, "joint_attention_dim": 3584,
                    "guidance_embeds": False, "axes_dims_rope": [16, 56, 56]},
    # text_encoder: Qwen2.5-VL-7B-Instruct
    "text_encoder": {
        "vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
        "num_attention_heads": 28, "num_key_value_heads": 4, "max_position_embeddings": 128000, "rope_theta": 1e6,
        "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]}, "rms_norm_eps": 1e-6, "hidden_act": "silu",
        "tie_word_embeddings": False, "sliding_window": 32768, "use_sliding_window": False, "max_window_layers": 28,
        "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151645, "vision_start_token_id": 151652,
        "vision_end_token_id": 151653, "vision_token_id": 151654, "image_token_id": 151655, "video_token_id": 151656,
        "vision_config": {"depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16,
                          "in_chans": 3, "out_hidden_size": 3584, "patch_size": 14, "spatial_merge_size": 2,
                          "spatial_patch_size": 14, "window_size": 112, "fullatt_block_indexes": [7, 15, 23, 31],
                          "tokens_per_second": 2, "temporal_patch_size": 2, "hidden_act": "silu"},
    },
    "vae": {},  # AutoencoderKLQwenImage's defaults are Qwen-Image's VAE
    "scheduler": {"num_train_timesteps": 1000, "shift": 1.0, "use_dynamic_shifting": True, "base_shift": 0.5,
                  "max_shift": 0.9, "base_image_seq_len": 256, "max_image_seq_len": 8192, "shift_terminal": 0.02,
                  "time_shift_type": "exponential", "invert_sigmas": False, "stochastic_sampling": False},
}

_WAN_EXPERT = {"patch_size": [1, 2, 2], "num_attention_heads": 40, "attention_head_dim": 128, "in_channels": 16,
               "out_channels": 16, "text_dim": 4096, "freq_dim": 256, "ffn_dim": 13824, "num_layers": 40,
               "cross_attn_norm": True, "qk_norm": "rms_norm_across_heads", "eps": 1e-6, "image_dim": None,
               "added_kv_proj_dim": None, "rope_max_seq_len": 1024, "pos_embed_seq_len": None}
WAN_A14B = {
    # Wan-AI/Wan2.2-T2V-A14B-Diffusers: two experts (high noise: transformer, low noise: transformer_2)
    "transformer": dict(_WAN_EXPERT),
    "transformer_2": dict(_WAN_EXPERT),
    # text_encoder: google/umt5-xxl's encoder
    "text_encoder": {"d_model": 4096, "d_ff": 10240, "d_kv": 64, "num_heads": 64, "num_layers": 24,
                     "vocab_size": 256384, "feed_forward_proj": "gated-gelu", "relative_attention_num_buckets": 32,
                     "relative_attention_max_distance": 128, "layer_norm_epsilon": 1e-6, "dropout_rate": 0.1,
                     "tie_word_embeddings": False, "pad_token_id": 0, "eos_token_id": 1,
                     "decoder_start_token_id": 0},
    "vae": {"base_dim": 96, "z_dim": 16},  # AutoencoderKLWan's defaults (the Wan 2.1 VAE the A14B models use)
    # flow_shift 3.0: Diffusers' Wan docs for 480P
    "scheduler": {"prediction_type": "flow_prediction", "use_flow_sigmas": True, "flow_shift": 3.0,
                  "num_train_timesteps": 1000, "solver_order": 2, "solver_type": "bh2", "predict_x0": True,
                  "lower_order_final": True, "final_sigmas_type": "zero", "timestep_spacing": "linspace"},
}

# Tiny configs (--smoke): the same builders, CPU-sized -----------------------------------------------------------

_TINY_T5 = {"d_model": 32, "d_ff": 37, "d_kv": 8, "num_heads": 4, "num_layers": 2, "vocab_size": 1024,
            "feed_forward_proj": "gated-gelu", "relative_attention_num_buckets": 8, "tie_word_embeddings": False,
            "pad_token_id": 0, "eos_token_id": 1, "decoder_start_token_id": 0}
FLUX_TINY = {
    "transformer": {"patch_size": 1, "in_channels": 16, "num_layers": 1, "num_single_layers": 2,
                    "attention_head_dim": 16, "num_attention_heads": 2, "joint_attention_dim": 32,
                    "pooled_projection_dim": 32, "guidance_embeds": True, "axes_dims_rope": [4, 4, 8]},
    "text_encoder_2": dict(_TINY_T5),
    "text_encoder": {"hidden_size": 32, "intermediate_size": 37, "num_hidden_layers": 2, "num_attention_heads": 4,
                     "max_position_embeddings": 77, "vocab_size": 1024, "projection_dim": 32,
                     "hidden_act": "quick_gelu", "bos_token_id": 0, "eos_token_id": 2, "pad_token_id": 1},
    "vae": {"in_channels": 3, "out_channels": 3, "latent_channels": 4, "block_out_channels": [4, 8],
            "down_block_types": ["DownEncoderBlock2D"] * 2, "up_block_types": ["UpDecoderBlock2D"] * 2,
            "layers_per_block": 1, "norm_num_groups": 4, "sample_size": 32, "scaling_factor": 0.3611,
            "shift_factor": 0.1159, "use_quant_conv": False, "use_post_quant_conv": False},
    "scheduler": FLUX_DEV["scheduler"],
}
QWEN_TINY = {
    "transformer": {"patch_size": 2, "in_channels": 16, "out_channels": 4, "num_layers": 2, "attention_head_dim": 16,
                    "num_attention_heads": 2, "joint_attention_dim": 32, "guidance_embeds": False,
                    "axes_dims_rope": [4, 6, 6]},
    "text_encoder": {
        "vocab_size": 1024, "hidden_size": 32, "intermediate_size": 37, "num_hidden_layers": 2,
        "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 2048, "rope_theta": 1e6,
        "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]}, "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "vision_config": {"depth": 2, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2, "in_chans": 3,
                          "out_hidden_size": 32, "patch_size": 14, "spatial_merge_size": 2, "window_size": 112,
                          "fullatt_block_indexes": [1], "temporal_patch_size": 2},
    },
    "vae": {"base_dim": 24, "z_dim": 4, "dim_mult": [1, 2, 4], "num_res_blocks": 1,
            "temperal_downsample": [False, True], "latents_mean": [0.0] * 4, "latents_std": [1.0] * 4},
    "scheduler": QWEN_IMAGE["scheduler"],
}
_WAN_TINY_EXPERT = {"patch_size": [1, 2, 2], "num_attention_heads": 2, "attention_head_dim": 12, "in_channels": 16,
                    "out_channels": 16, "text_dim": 32, "freq_dim": 256, "ffn_dim": 32, "num_layers": 2,
                    "cross_attn_norm": True, "qk_norm": "rms_norm_across_heads", "rope_max_seq_len": 32}
WAN_TINY = {
    "transformer": dict(_WAN_TINY_EXPERT),
    "transformer_2": dict(_WAN_TINY_EXPERT),
    "text_encoder": dict(_TINY_T5),
    "vae": {"base_dim": 3, "z_dim": 16, "dim_mult": [1, 1, 1, 1], "num_res_blocks": 1,
            "temperal_downsample": [False, True, True]},
    "scheduler": WAN_A14B["scheduler"],
}


@dataclass(frozen=True)
class ModelSpec:
    """One pipeline: its class, components (name → builder kind and class), configs, and how it is called."""

    pipeline: str
    components: dict[str, tuple[str, str]]  # name → (kind, class): dit / encoder / vae / scheduler
    configs: dict[str, dict[str, Any]]
    tiny: dict[str, dict[str, Any]]
    transformers: tuple[str, ...]
    default_steps: int
    call: dict[str, Any]  # full-size call kwargs (height, width, ...)
    tiny_call: dict[str, Any]
    vae_dtype: torch.dtype = torch.bfloat16
    pipeline_kwargs: dict[str, Any] = field(default_factory=dict)
    notes: tuple[str, ...] = ()


MODELS: dict[str, ModelSpec] = {
    "flux": ModelSpec(
        "FluxPipeline",
        {"transformer": ("dit", "FluxTransformer2DModel"), "text_encoder": ("encoder", "CLIPTextModel"),
         "text_encoder_2": ("encoder", "T5EncoderModel"), "vae": ("vae", "AutoencoderKL"),
         "scheduler": ("scheduler", "FlowMatchEulerDiscreteScheduler")},
        FLUX_DEV, FLUX_TINY, ("transformer",), 28,
        {"height": 1024, "width": 1024, "guidance_scale": 3.5, "max_sequence_length": 512},
        {"height": 32, "width": 32, "guidance_scale": 3.5, "max_sequence_length": 512},
        notes=("FLUX.1-dev: 1024×1024, guidance 3.5 (guidance-distilled: one transformer forward per step), T5 "
               "max_sequence_length 512, CLIP 77.",),
    ),
    "qwen": ModelSpec(
        "QwenImagePipeline",
        {"transformer": ("dit", "QwenImageTransformer2DModel"),
         "text_encoder": ("encoder", "Qwen2_5_VLForConditionalGeneration"), "vae": ("vae", "AutoencoderKLQwenImage"),
         "scheduler": ("scheduler", "FlowMatchEulerDiscreteScheduler")},
        QWEN_IMAGE, QWEN_TINY, ("transformer",), 50,
        {"height": 1328, "width": 1328},
        {"height": 32, "width": 32},
        notes=("Qwen-Image: 1328×1328, the pipeline's own defaults otherwise (true_cfg_scale 4.0 takes effect only "
               "with a negative prompt: none is passed unless --true-cfg, so one transformer forward per step).",),
    ),
    "wan": ModelSpec(
        "WanPipeline",
        {"transformer": ("dit", "WanTransformer3DModel"), "transformer_2": ("dit", "WanTransformer3DModel"),
         "text_encoder": ("encoder", "UMT5EncoderModel"), "vae": ("vae", "AutoencoderKLWan"),
         "scheduler": ("scheduler", "UniPCMultistepScheduler")},
        WAN_A14B, WAN_TINY, ("transformer", "transformer_2"), 40,
        {"height": 480, "width": 832, "num_frames": 81, "guidance_scale": 4.0, "guidance_scale_2": 3.0},
        {"height": 32, "width": 32, "num_frames": 5, "guidance_scale": 4.0, "guidance_scale_2": 3.0},
        vae_dtype=torch.float32, pipeline_kwargs={"boundary_ratio": 0.875},
        notes=("Wan2.2-T2V-A14B: 480×832, 81 frames, two experts (boundary_ratio 0.875), guidance 4.0 / 3.0 "
               "(classifier-free: two forwards per step, the negative prompt the pipeline's empty default), "
               "UniPC flow_shift 3.0, VAE in float32 as Diffusers' Wan docs load it.",),
    ),
}


# Building ---------------------------------------------------------------------------------------------------------


@contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Build under ``dtype`` as transformers' ``from_pretrained(dtype=...)`` does (buffers made in the default
    dtype take it; those a model makes in float32 explicitly keep it)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def check_config(cls: type, config: dict[str, Any]) -> list[str]:
    """Keys of ``config`` the installed Diffusers class does not take (``from_config`` would ignore them)."""
    import inspect

    accepted = set(inspect.signature(cls.__init__).parameters) - {"self"}
    return sorted(k for k in config if not k.startswith("_") and k not in accepted)


def transformers_config(class_name: str, config: dict[str, Any]) -> Any:
    import transformers

    config_class = {"CLIPTextModel": "CLIPTextConfig", "T5EncoderModel": "T5Config", "UMT5EncoderModel": "UMT5Config",
                    "Qwen2_5_VLForConditionalGeneration": "Qwen2_5_VLConfig"}[class_name]
    return getattr(transformers, config_class)(**config)


def _norm_like(module: nn.Module) -> bool:
    return "norm" in type(module).__name__.lower() and not isinstance(module, (nn.Linear, nn.Embedding))


def keep_fp32(model: nn.Module, dtype: torch.dtype) -> Callable[[str], bool]:
    """Which parameters ``from_pretrained(torch_dtype=dtype)`` keeps in float32: Diffusers' ``_keep_in_fp32_modules``
    (any dtype: a name part matching, e.g. Wan's time embedder, norms and scale-shift tables); transformers'
    ``_keep_in_fp32_modules_strict`` for bf16/fp16 and ``_keep_in_fp32_modules`` for fp16 only (transformers 5: T5's
    ``wo`` stays bf16 in a bf16 load)."""
    from diffusers import ModelMixin

    if isinstance(model, ModelMixin):
        keep = list(getattr(model, "_keep_in_fp32_modules", None) or [])
    else:
        keep = list(getattr(model, "_keep_in_fp32_modules_strict", None) or [])
        if dtype == torch.float16:
            keep += list(getattr(model, "_keep_in_fp32_modules", None) or [])
    return lambda name: any(part in name.split(".") for part in keep)


def materialize(model: nn.Module, pool: torch.Tensor | None, dtype: torch.dtype, state: dict[str, int]) -> None:
    """Give every meta parameter its own host storage: norms' weights 1 and biases 0 (as their init), every other
    floating parameter copied from a window of ``pool`` (a copy, not a view); float32 where ``keep_fp32`` says,
    ``dtype`` otherwise (transformers models keep the dtype they were built in). Tied parameters stay tied.
    ``state["offset"]`` is where the next window starts (so two models built in a row differ). ``pool=None``:
    sizes only, every parameter stays on meta in the dtype the load would give it."""
    from diffusers import ModelMixin

    diffusers_model = isinstance(model, ModelMixin)
    fp32 = keep_fp32(model, dtype)
    made: dict[int, nn.Parameter] = {}
    for prefix, module in model.named_modules():
        for name, param in list(module._parameters.items()):
            if param is None or not param.is_meta:
                continue
            if id(param) in made:
                module._parameters[name] = made[id(param)]
                continue
            full = f"{prefix}.{name}" if prefix else name
            if not param.is_floating_point():
                target = param.dtype
            elif fp32(full):
                target = torch.float32
            else:
                target = dtype if diffusers_model else param.dtype
            if pool is None:  # sizes only: the dtype the load would give, no storage
                made[id(param)] = module._parameters[name] = nn.Parameter(
                    torch.empty(param.shape, dtype=target, device="meta"), requires_grad=False)
                continue
            data = torch.empty(param.shape, dtype=target)
            if not param.is_floating_point():
                data.zero_()
            elif _norm_like(module):
                data.fill_(1.0 if name == "weight" else 0.0)
            else:
                flat, filled = data.view(-1), 0
                while filled < flat.numel():
                    offset = state["offset"]
                    count = min(flat.numel() - filled, pool.numel() - offset)
                    flat[filled:filled + count].copy_(pool[offset:offset + count])
                    filled += count
                    state["offset"] = (offset + count) % pool.numel()
                state["offset"] = (state["offset"] + 7919) % pool.numel()
            new = nn.Parameter(data, requires_grad=False)
            made[id(param)] = new
            module._parameters[name] = new
    left = [n for n, p in model.named_parameters() if p.is_meta]
    if left and pool is not None:
        raise RuntimeError(f"materialize: parameters still on meta: {left[:5]}")


def build_model(kind: str, class_name: str, config: dict[str, Any], *, materialize_with: torch.Tensor | None,
                state: dict[str, int], vae_dtype: torch.dtype, notes: list[str]) -> nn.Module:
    """One model at ``config``: parameters on the meta device (then materialized from the pool unless
    ``materialize_with`` is None, which keeps them on meta: sizes only). VAEs are small and built normally (their
    own init, seeded) in ``vae_dtype``."""
    import diffusers

    if kind == "vae":
        cls = getattr(diffusers, class_name)
        unknown = check_config(cls, config)
        if unknown:
            notes.append(f"{class_name}: config keys the installed class does not take: {unknown}")
        if materialize_with is None:
            with parameters_on_meta():
                return nn.Module.to(cls.from_config(config), vae_dtype).eval()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(SEED)
            vae = cls.from_config(config)
        return nn.Module.to(vae, vae_dtype).eval()  # Diffusers' own .to() warns about an empty fp32 list
    if kind == "dit":
        cls = getattr(diffusers, class_name)
        unknown = check_config(cls, config)
        if unknown:
            notes.append(f"{class_name}: config keys the installed class does not take: {unknown}")
        with parameters_on_meta():
            model = cls.from_config(config)
    else:
        import transformers

        cls = getattr(transformers, class_name)
        hf_config = transformers_config(class_name, config)
        with default_dtype(torch.bfloat16), parameters_on_meta():
            model = cls(hf_config)
        # parameters_on_meta gives every registration its own meta tensor: tie what the model ties (T5's
        # encoder.embed_tokens is shared), as its own __init__ and from_pretrained do.
        model.tie_weights()
    materialize(model, materialize_with, torch.bfloat16, state)
    return model.eval()


def qwen_tokenizer(texts: list[str]) -> Any:
    """A small byte-level BPE ``Qwen2Tokenizer`` (Qwen's pre-tokenizer), trained here on ``texts`` so every word of
    the prompt template is one token, as with the real tokenizer: the template's system prefix is then about
    ``prompt_template_encode_start_idx`` (34) tokens, which the pipeline drops. Ids stay far below 152064."""
    from tokenizers import pre_tokenizers, trainers
    from transformers import Qwen2Tokenizer

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    backend = Qwen2Tokenizer().backend_tokenizer
    trainer = trainers.BpeTrainer(vocab_size=1000, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(texts, trainer=trainer)
    model = json.loads(backend.to_str())["model"]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    tokenizer = Qwen2Tokenizer(vocab=model["vocab"], merges=merges, model_max_length=32768)
    tokenizer.add_tokens(specials[1:], special_tokens=True)  # never split (the real tokenizer's added tokens)
    return tokenizer


def tokenizers_for(name: str) -> dict[str, Any]:
    from diffusers_omni.testing.tiny import tiny_clip_tokenizer, tiny_t5_tokenizer

    if name == "flux":
        return {"tokenizer": tiny_clip_tokenizer(), "tokenizer_2": tiny_t5_tokenizer()}
    if name == "wan":
        return {"tokenizer": tiny_t5_tokenizer()}
    return {"tokenizer": qwen_tokenizer([QWEN_TEMPLATE.format(PROMPT), PROMPT, QWEN_TEMPLATE.format("")])}


# QwenImagePipeline.__init__ sets this template (and drops its first 34 tokens); checked against the installed
# pipeline in build_pipeline.
QWEN_TEMPLATE = ("<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, "
                 "spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n"
                 "<|im_start|>assistant\n")


def component_bytes(module: nn.Module) -> dict[str, Any]:
    """Parameter and buffer bytes of ``module`` (meta tensors counted by shape), per dtype; tied counted once."""
    seen: set[int] = set()
    params = buffers = count = 0
    by_dtype: dict[str, int] = collections.Counter()
    for tensor in module.parameters():
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        nbytes = tensor.numel() * tensor.element_size()
        params += nbytes
        count += tensor.numel()
        by_dtype[str(tensor.dtype).removeprefix("torch.")] += nbytes
    for tensor in module.buffers():
        if tensor is not None and id(tensor) not in seen:
            seen.add(id(tensor))
            buffers += tensor.numel() * tensor.element_size()
    return {"param_bytes": params, "buffer_bytes": buffers, "params": count, "by_dtype": dict(by_dtype)}


def build_pipeline(name: str, smoke: bool, materialize_weights: bool = True) -> tuple[Any, dict[str, Any]]:
    """The pipeline of ``name`` (tiny configs with ``smoke``), and a build record: per-component bytes, config
    notes, build time. ``materialize_weights=False`` keeps the big models' parameters on meta (sizes only)."""
    import diffusers

    spec = MODELS[name]
    configs = spec.tiny if smoke else spec.configs
    start = time.perf_counter()
    notes: list[str] = []
    pool = None
    if materialize_weights:
        from benchmarks.offload_lifecycle_bench import random_pool

        pool = random_pool((2**16 if smoke else 2**26) + 7919, torch.bfloat16)
    state = {"offset": 0}
    components: dict[str, Any] = {}
    for component, (kind, class_name) in spec.components.items():
        config = configs[component]
        if kind == "scheduler":
            cls = getattr(diffusers, class_name)
            unknown = check_config(cls, config)
            if unknown:
                notes.append(f"{class_name}: config keys the installed class does not take: {unknown}")
            components[component] = cls.from_config(config)
            continue
        components[component] = build_model(kind, class_name, config, materialize_with=pool, state=state,
                                             vae_dtype=spec.vae_dtype, notes=notes)
    del pool
    components.update(tokenizers_for(name))
    pipeline_cls = getattr(diffusers, spec.pipeline)
    pipe = pipeline_cls(**components, **spec.pipeline_kwargs)
    if name == "qwen":
        if getattr(pipe, "prompt_template_encode", QWEN_TEMPLATE) != QWEN_TEMPLATE:
            notes.append("QwenImagePipeline's prompt template differs from the one the tokenizer was trained on")
        prefix = QWEN_TEMPLATE.split("{}")[0]
        n_prefix = len(pipe.tokenizer(prefix)["input_ids"])
        notes.append(f"Qwen tokenizer (built here, {len(pipe.tokenizer)} tokens): the template's system prefix is "
                     f"{n_prefix} tokens; the pipeline drops {pipe.prompt_template_encode_start_idx}")
    gc.collect()
    trim_host_heap()
    sizes = {c: component_bytes(m) for c, m in components.items() if isinstance(m, nn.Module)}
    return pipe, {"build_s": time.perf_counter() - start, "components": sizes, "notes": notes}


def size_check(name: str, sizes: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Each component with a known size: its parameter bytes against the real checkpoint's (±2 %)."""
    rows = {}
    for component, known in KNOWN_GB.get(name, {}).items():
        got = sizes[component]["param_bytes"] / 1e9
        rows[component] = {"param_gb": round(got, 3), "known_gb": known,
                           "ok": abs(got - known) <= SIZE_TOLERANCE * known}
    return rows


# Strategies -------------------------------------------------------------------------------------------------------


def is_omni(strategy: str) -> bool:
    """Whether ``strategy`` runs diffusers-omni's layerwise offload (``omni``, ``omni-budget``, a sweep's
    ``omni-budget (8GiB)`` / ``omni-auto`` / ``omni-auto-lossless`` ..., ``omni-host``)."""
    return strategy == "omni" or strategy.startswith("omni-")


def parse_budgets(text: str | None, option: str, allow_none: bool = False) -> list[str]:
    """``--omni-budget`` / ``--omni-lossless``: comma-separated budgets, each a size (``8GiB``) or ``auto`` (and for
    ``--omni-lossless`` also ``none``: no budget); as given (sizes keep their text: it labels the run)."""
    if text is None:
        return []
    from diffusers_omni.config.offload_base import parse_bytes

    budgets = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        if item.lower() in (AUTO, "none"):
            if item.lower() == "none" and not allow_none:
                raise ValueError(f"{option}: none is no budget: that run is omni itself")
            item = item.lower()
        else:
            parse_bytes(item, option)  # refuses what max_device_memory would refuse, naming the option
        if item in budgets:
            raise ValueError(f"{option}: {item} given twice")
        budgets.append(item)
    if not budgets:
        raise ValueError(f"{option}: no budget given")
    return budgets


def omni_runs(budgets: list[str], lossless: list[str]) -> dict[str, dict[str, str | None]]:
    """The omni runs ``--omni-budget`` and ``--omni-lossless`` add, in the order they run: name → its budget (as
    given, ``auto``, or None) and compression. One size alone keeps the name ``omni-budget`` (the scenarios that
    compare one budget); several, each ``omni-budget (SIZE)``; ``auto`` is ``omni-auto``; each ``--omni-lossless``
    budget is the same run with ``compression="lossless"``: ``omni-lossless`` (no budget), ``omni-auto-lossless``,
    ``omni-budget-lossless (SIZE)``."""
    runs: dict[str, dict[str, str | None]] = {}
    single = len(budgets) == 1 and budgets[0] != AUTO
    for budget in budgets:
        name = "omni-auto" if budget == AUTO else "omni-budget" if single else f"omni-budget ({budget})"
        runs[name] = {"budget": budget, "compression": None}
    for budget in lossless:
        name = {"none": "omni-lossless", AUTO: "omni-auto-lossless"}.get(budget, f"omni-budget-lossless ({budget})")
        runs[name] = {"budget": None if budget == "none" else budget, "compression": LOSSLESS}
    return runs


def sweep_runs(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The results of the runs a sweep added (every ``--omni-budget`` / ``--omni-lossless`` run but a single size's
    ``omni-budget``, whose table and docs rows are the ones it always had)."""
    runs = report["args"].get("omni_runs") or {}
    return [r for r in report["strategies"] if r["strategy"] in runs and r["strategy"] != "omni-budget"]


def least_budget(omni: Any, device: torch.device, **options: Any) -> int:
    """The least budget layerwise offload allows with ``options`` (one of them a 1-byte ``max_device_memory`` or
    ``max_host_memory``): read from the error that budget raises (nothing is changed by a refused enable)."""
    try:
        omni.enable_layerwise_offload(device=str(device), **options)
    except ValueError as error:
        found = re.search(r"at least (\d+)", str(error))
        if found:
            return int(found.group(1))
        raise
    omni.disable_omni_offload()
    return 1


def least_device_budget(omni: Any, device: torch.device, compression: str | None) -> int:
    """The least ``max_device_memory`` the pipeline allows."""
    return least_budget(omni, device, max_device_memory=1, **({"compression": compression} if compression else {}))


def omni_budget(args: argparse.Namespace, strategy: str = "omni-budget", least: Callable[[], int] | None = None
                ) -> str | int | None:
    """``max_device_memory`` of an omni run: its ``--omni-budget`` / ``--omni-lossless`` budget. In a smoke run, a
    single size (``omni-budget``) is the tiny pipeline's weight bytes (then part of the tiny DiT stays resident and
    the rest streams, as a budget does at full size); a sweep's sizes are placed on the tiny pipeline as on the card:
    ``least + (weight bytes - least) · size / --card-gib`` (``least()``: the least budget it allows), so each plans a
    different split; ``auto`` stays ``auto`` (on the CPU it reads host memory)."""
    run = (args.omni_runs or {}).get(strategy)
    budget = None if run is None else run["budget"]
    if budget is None or budget == AUTO or not args.smoke:
        return budget
    if strategy == "omni-budget":
        return args.expected_weight_bytes
    from diffusers_omni.config.offload_base import parse_bytes

    share = min(parse_bytes(budget, "--omni-budget") / (args.card_gib * GiB), 1.0)
    floor = least() if least is not None else 0
    return floor + int(max(args.expected_weight_bytes - floor, 0) * share)


def omni_plan(omni: Any, backend: Any, run: dict[str, Any] | None, passed: Any) -> dict[str, Any]:
    """What an omni run planned, read right after enabling (kept if the call then fails): the budget as given and as
    passed, the budget it planned with (``auto`` resolved), and from its stats and report what auto read and chose
    and the lossless store's ratio (see ``plan_summary``)."""
    from dataclasses import asdict, is_dataclass

    stats = getattr(backend, "stats", None)
    stats = {} if stats is None else asdict(stats) if is_dataclass(stats) else dict(vars(stats))
    notes = list(getattr(omni.omni_offload_report(), "notes", []))
    planned = getattr(backend, "max_device_memory", None)
    return {"budget": None if run is None else run["budget"], "compression": None if run is None else run["compression"],
            "max_device_memory": passed, "planned_budget_bytes": planned if isinstance(planned, int) else None,
            **plan_summary(stats, notes)}


def plan_summary(stats: dict[str, Any], notes: list[str]) -> dict[str, Any]:
    """From an offload's stats (``LayerwiseStats`` as a dict) and its report's notes: what ``auto`` chose
    (``stats.auto``: each budget's explanation) and read (``stats.auto_readings``) and the report's lines saying so;
    blocks resident and streamed; and, where a lossless store holds streamed blocks, its host bytes over their
    logical bytes (``compression_ratio``, below 1 when it saves)."""
    store_bytes, held = stats.get("store_bytes") or {}, stats.get("store_host_bytes") or {}
    coded = held.get(LOSSLESS)
    logical = store_bytes.get(LOSSLESS)
    return {
        "auto": list(stats.get("auto") or []), "auto_readings": dict(stats.get("auto_readings") or {}),
        "report_notes": [n for n in notes if n.startswith(("auto", "lossless", "streamed blocks by store"))],
        "resident_blocks": stats.get("resident_blocks"), "streamed_blocks": stats.get("streamed_blocks"),
        "streamed_bytes_per_pass": stats.get("streamed_bytes_per_pass"),
        "lossless_blocks": (stats.get("store_blocks") or {}).get(LOSSLESS),
        "lossless_logical_bytes": logical, "lossless_host_bytes": coded,
        "compression_ratio": coded / logical if coded is not None and logical else None,
    }


def memory_events(stats: dict[str, Any]) -> list[str]:
    """What an omni run did when device memory ran out (from its stats after the timed call): resident blocks that
    left for the VAE, resident blocks that stream since a step ran out of memory, a window shrunk to one block, VAEs
    switched to tiling. Empty when nothing ran out (what auto as the default must show)."""
    events = []
    if stats.get("residents_left"):
        events.append(f"resident blocks left the device {stats['residents_left']}× to make room for the VAE "
                      f"({_gib(stats.get('residents_left_bytes') or 0)})")
    if stats.get("residents_shrunk"):
        events.append(f"{stats['residents_shrunk']} resident blocks stream since a step ran out of memory "
                      f"({_gib(stats.get('residents_shrunk_bytes') or 0)})")
    if stats.get("window_shrunk"):
        events.append("the streaming window holds one block since a step ran out of memory with nothing resident")
    for label in dict.fromkeys(stats.get("tiled_vaes") or ()):
        events.append(f"{label} switched to tiling after running out of memory (its image may differ)")
    return events


def headroom_notes(stats: dict[str, Any]) -> list[str]:
    """What auto's per-shape headroom measured and moved (``diffusers_omni/offload/headroom.py``): each measured
    shape's bytes beside the resident weights, and the blocks it kept on the device or streamed first."""
    notes = []
    if stats.get("headroom"):
        notes.append("auto measured beside the resident weights: " + ", ".join(
            f"{shape} {_gib(nbytes)}" for shape, nbytes in stats["headroom"].items()))
    if stats.get("headroom_kept") or stats.get("headroom_streamed"):
        notes.append(f"auto kept {stats.get('headroom_kept', 0)} streamed blocks on the device "
                     f"({_gib(stats.get('headroom_kept_bytes') or 0)}) and streamed "
                     f"{stats.get('headroom_streamed', 0)} resident ones first "
                     f"({_gib(stats.get('headroom_streamed_bytes') or 0)})")
    return notes


def lossless_cache_dir(args: argparse.Namespace) -> str:
    """omni-host-lossless's ``compression_cache_dir``: beside the DiTs' checkpoint (removed with it)."""
    return str(Path(args.checkpoint_dir) / "lossless-cache")


def host_budget(omni: Any, device: torch.device, args: argparse.Namespace, **options: Any) -> str | int:
    """``max_host_memory`` of omni-host: ``--omni-host-budget``; in a smoke run, the least the tiny pipeline allows
    with ``options`` (the run's compression: read from the error a 1-byte budget raises), so that blocks go to disk
    there too."""
    if not args.smoke:
        return args.omni_host_budget
    return least_budget(omni, device, max_host_memory=1, **options)


def clear_checkpoint(names: list[str], args: argparse.Namespace) -> Path:
    """``--checkpoint-dir`` without the DiTs ``names`` saved there (an earlier omni-host run's, or what a run killed
    before its end, which removes the folder, left behind); the folder, made if needed."""
    import shutil

    folder = Path(args.checkpoint_dir)
    for name in names:
        shutil.rmtree(folder / name, ignore_errors=True)
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def remove_checkpoint(spec: "ModelSpec", args: argparse.Namespace) -> dict[str, Any]:
    """omni-host-lossless with ``--host-lossless-from-memory``: the DiTs stay as built; the checkpoint an earlier
    omni-host run left in ``--checkpoint-dir`` is removed, so that the disk holds the cache alone."""
    folder = clear_checkpoint(list(spec.transformers), args)
    return {"folder": str(folder), "bytes": 0, "save_and_load_s": 0.0, "files": [], "from_memory": True}


def disk_checkpoint(pipe: Any, spec: "ModelSpec", args: argparse.Namespace) -> dict[str, Any]:
    """omni-host: save each DiT to ``--checkpoint-dir`` and put it back into ``pipe`` loaded as mmap views of those
    files (its built copy is dropped). Refuses, before writing anything, when the disk has not room for them."""
    import shutil

    from diffusers_omni.offload.loading import load_transformer_mmap

    names = [t for t in spec.transformers if getattr(pipe, t, None) is not None]
    folder = clear_checkpoint(names, args)
    need = sum(p.numel() * p.element_size() for t in names for p in getattr(pipe, t).parameters())
    free = shutil.disk_usage(folder).free
    if need * 1.02 + GiB > free:
        raise RuntimeError(f"the DiTs' checkpoint needs {need / GiB:.1f} GiB on disk and {folder} has "
                           f"{free / GiB:.1f} GiB free; give --checkpoint-dir on a larger disk")
    start = time.perf_counter()
    for name in names:
        model = getattr(pipe, name)
        model.save_pretrained(folder / name, max_shard_size="10GB")
        cls = type(model)
        by_dtype: dict[torch.dtype, int] = collections.Counter()
        for p in model.parameters():
            by_dtype[p.dtype] += p.numel()
        dtype = max(by_dtype, key=by_dtype.get)  # as from_pretrained(torch_dtype=...): fp32-kept modules stay fp32
        del model
        setattr(pipe, name, None)
        gc.collect()
        trim_host_heap()
        setattr(pipe, name, load_transformer_mmap(cls, folder, name, torch_dtype=dtype).eval())
    files = sorted(str(p) for p in folder.rglob("*.safetensors"))
    return {"folder": str(folder), "bytes": need, "save_and_load_s": time.perf_counter() - start, "files": files}


class PageCacheDropper:
    """Drops the page cache of the checkpoint files (``posix_fadvise(POSIX_FADV_DONTNEED)``, which needs no
    privileges for clean pages) before each transformer forward, so omni-host's reads come from the disk. Each file
    is flushed first (``fsync``): pages written just before (the cache files an enable wrote) are dirty, and
    ``DONTNEED`` leaves dirty pages in the cache, where the next forward would read them without the disk."""

    def __init__(self, files: list[str]) -> None:
        self.files = files
        self.handles: list[Any] = []
        self.drops = 0

    def drop(self) -> None:
        for path in self.files:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        self.drops += 1

    def attach(self, modules: dict[str, nn.Module]) -> None:
        for module in modules.values():
            self.handles.append(module.register_forward_pre_hook(lambda *_: self.drop(), prepend=True))

    def detach(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []


def enable_strategy(strategy: str, pipe: Any, device: torch.device, args: argparse.Namespace) -> tuple[Any, Any]:
    """Enable ``strategy`` on ``pipe``; returns (the object to call, the offload handle if any)."""
    if strategy == "resident":
        pipe.to(device)
        return pipe, None
    if is_omni(strategy):
        from diffusers_omni import omnify

        if args.omni_attention == "off":
            omni = omnify(pipe, enable_attention=False)
        else:
            omni = omnify(pipe, None if args.omni_attention == "auto" else args.omni_attention)
        if strategy in HOST:
            kwargs = {}
            if strategy == "omni-host-lossless":
                kwargs = {"compression": LOSSLESS, "compression_cache_dir": lossless_cache_dir(args)}
            backend = omni.enable_layerwise_offload(device=str(device), max_device_memory=NO_BUDGET,
                                                    max_host_memory=host_budget(omni, device, args, **kwargs),
                                                    **kwargs)
            return omni, backend
        run = (args.omni_runs or {}).get(strategy)
        if strategy != "omni" and run is None:
            raise ValueError(f"unknown strategy {strategy!r}: no --omni-budget / --omni-lossless run of that name")
        compression = None if run is None else run["compression"]
        budget = omni_budget(args, strategy, lambda: least_device_budget(omni, device, compression))
        kwargs = {"compression": compression} if compression else {}
        backend = omni.enable_layerwise_offload(device=str(device), max_device_memory=NO_BUDGET if budget is None else budget,
                                                **kwargs)
        args.omni_passed_budget = budget  # recorded by the child (omni_plan)
        return omni, backend
    if strategy == "diffusers-group":
        pipe.enable_group_offload(onload_device=device, offload_device=torch.device("cpu"), offload_type="block_level",
                                  num_blocks_per_group=1, use_stream=True, record_stream=True)
        return pipe, None
    if strategy == "diffusers-model":
        pipe.enable_model_cpu_offload(device=device)
        return pipe, None
    if strategy == "diffusers-sequential":
        pipe.enable_sequential_cpu_offload(device=device)
        return pipe, None
    if strategy in ("mmgp2", "mmgp4"):
        from mmgp import offload, profile_type

        profile = profile_type.HighRAM_LowVRAM if strategy == "mmgp2" else profile_type.LowRAM_LowVRAM
        handle = offload.profile(pipe, profile, quantizeTransformer=False)
        return pipe, handle
    raise ValueError(f"unknown strategy {strategy!r}; allowed: {', '.join(STRATEGIES)}")


class PhaseClock:
    """Forward pre/post hooks on the transformers: when the first forward of a call starts and the last one ends
    (synchronised), how many forwards each ran and how long each took."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.handles: list[Any] = []
        self.reset()

    def reset(self) -> None:
        self.t0 = self.t1 = 0.0
        self.first: float | None = None
        self.last_end: float | None = None
        self.started: float | None = None
        self.forwards: dict[str, int] = collections.Counter()
        self.forward_s: dict[str, list[float]] = collections.defaultdict(list)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def attach(self, modules: dict[str, nn.Module]) -> None:
        for name, module in modules.items():
            self.handles.append(module.register_forward_pre_hook(lambda *_: self._pre(), prepend=True))
            self.handles.append(module.register_forward_hook(lambda *_, n=name: self._post(n)))

    def detach(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def _pre(self) -> None:
        self._sync()
        self.started = time.perf_counter()
        if self.first is None:
            self.first = self.started

    def _post(self, name: str) -> None:
        self._sync()
        self.last_end = time.perf_counter()
        self.forwards[name] += 1
        if self.started is not None:
            self.forward_s[name].append(round(self.last_end - self.started, 4))

    def begin(self) -> None:
        self.reset()
        self._sync()
        self.t0 = time.perf_counter()

    def end(self) -> None:
        self._sync()
        self.t1 = time.perf_counter()

    def phases(self) -> dict[str, float | None]:
        if self.first is None or self.last_end is None:
            return {"encode_s": None, "denoise_s": None, "decode_s": None}
        return {"encode_s": self.first - self.t0, "denoise_s": self.last_end - self.first,
                "decode_s": self.t1 - self.last_end}


def call_kwargs(name: str, args: argparse.Namespace, steps: int) -> dict[str, Any]:
    spec = MODELS[name]
    kwargs = dict(spec.tiny_call if args.smoke else spec.call)
    kwargs.update(prompt=PROMPT, num_inference_steps=steps, output_type="np")
    if name == "qwen" and args.true_cfg:
        kwargs["negative_prompt"] = " "
    return kwargs


def fingerprint(output: Any) -> dict[str, Any]:
    """sha256 of the final uint8 image/video (as Diffusers turns ``np`` output into PIL: ×255, rounded), its shape,
    mean and standard deviation, and the share of NaN values in the float output."""
    import numpy as np

    array = getattr(output, "frames", None)
    if array is None:
        array = output.images
    array = np.asarray(array)
    nan = float(np.isnan(array).mean()) if array.dtype.kind == "f" else 0.0
    pixels = (np.nan_to_num(array) * 255).round().clip(0, 255).astype(np.uint8)
    return {"sha256": hashlib.sha256(pixels.tobytes()).hexdigest(), "shape": list(pixels.shape),
            "mean": float(pixels.mean()), "std": float(pixels.std()), "nan_fraction": nan}


def pinned_bytes(pipe: Any, device: torch.device) -> dict[str, Any]:
    """Page-locked host memory now: PyTorch's pinned host allocator (``pin_memory()``: Diffusers' group offload,
    mmgp), the bytes diffusers-omni registered with ``cudaHostRegister``, and the pinned storages among the
    components' parameters and buffers (and Diffusers' group-offload host copies)."""
    from benchmarks.offload_bench import pinned_host_bytes
    from diffusers_omni.offload.memory import registered_host_bytes

    stats: dict[str, Any] = {}
    if device.type == "cuda":
        try:
            raw = torch.cuda.memory.host_memory_stats()
            stats = {k: v for k, v in raw.items() if "bytes" in k}
        except (AttributeError, RuntimeError) as error:
            stats = {"error": f"{type(error).__name__}: {error}"}
    allocator = stats.get("allocated_bytes.current", stats.get("reserved_bytes.current"))
    components = 0
    for module in getattr(pipe, "components", {}).values():
        if isinstance(module, nn.Module):
            components += pinned_host_bytes(module)["pinned_host_bytes"]
    registered = registered_host_bytes()
    total = (allocator if isinstance(allocator, int) else components) + registered
    return {"host_allocator_bytes": allocator, "registered_host_bytes": registered,
            "component_pinned_bytes": components, "pinned_total_bytes": total, "host_allocator_stats": stats}


def omni_record(omni: Any, backend: Any, forwards: dict[str, int], transformers: tuple[str, ...]) -> dict[str, Any]:
    """What omni streamed: its stats, its report (per component: bytes on the device at rest, placement) and the
    bytes brought to the device per phase of one call (a streamed/swapped component's weights not resident at
    rest: encoders once, each DiT once per forward, the VAE once)."""
    from dataclasses import asdict, is_dataclass

    record: dict[str, Any] = {}
    stats = getattr(backend, "stats", None)
    if stats is not None:
        record["stats"] = asdict(stats) if is_dataclass(stats) else dict(vars(stats))
    report = omni.omni_offload_report()
    record["report"] = report.to_dict()
    streamed = dict.fromkeys(PHASES, 0)
    for entry in report.components:
        if entry.placement == "resident":
            continue
        moved = max(entry.weight_bytes - entry.bytes.get("device", 0), 0)
        if entry.kind == "transformer":
            streamed["denoise"] += moved * forwards.get(entry.component, 0)
        elif entry.kind in ("text encoder", "image encoder"):
            streamed["encode"] += moved
        elif entry.kind == "VAE":
            streamed["decode"] += moved
    record["streamed_bytes"] = streamed
    missing = [t for t in transformers if t not in {e.component for e in report.components}]
    if missing:
        record["note"] = f"the report has no component {missing}"
    return record


def _error(stage: str, error: BaseException) -> dict[str, str]:
    text = str(error).strip().splitlines()
    return {"stage": stage, "type": type(error).__name__, "message": text[0] if text else ""}


def run_child(args: argparse.Namespace) -> int:
    """One strategy in this process; writes its result to ``--child-out`` after every stage (so a kill keeps what
    was measured) and exits 0 whatever happened to the strategy."""
    strategy, name, spec = args.child, args.model, MODELS[args.model]
    out = Path(args.child_out)
    device = torch.device("cpu") if args.smoke else torch.device("cuda", 0)
    result: dict[str, Any] = {"strategy": strategy, "status": "running", "stage": "setup", "error": None,
                              "notes": []}

    def save() -> None:
        out.write_text(json.dumps(result, indent=1, default=str))

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    stage = "setup"
    try:
        result["environment"] = environment(device)
        steps = args.steps
        if strategy == "diffusers-sequential" and args.sequential_steps:
            steps = min(args.steps, args.sequential_steps)
        if strategy in HOST and args.host_steps:
            steps = args.host_steps
        warmup_steps = min(args.warmup_steps, steps)
        result.update(steps=steps, warmup_steps=warmup_steps)
        if device.type == "cuda":
            total = torch.cuda.get_device_properties(device).total_memory
            result["device_total_bytes"] = total
            if strategy == "resident":
                if args.expected_weight_bytes > RESIDENT_FIT * total:
                    result.update(status="skipped", skip_reason=(
                        f"the weights ({args.expected_weight_bytes / GiB:.1f} GiB) would not fit the device "
                        f"({total / GiB:.1f} GiB) with room for activations"))
                    save()
                    return 0
                result["card_bytes"] = None
            else:
                fraction = min(args.card_gib * GiB / total, 1.0)
                torch.cuda.set_per_process_memory_fraction(fraction, device)
                result.update(card_bytes=int(args.card_gib * GiB), memory_fraction=fraction)
        result["alloc_conf"] = os.environ.get("PYTORCH_CUDA_ALLOC_CONF")
        stage = result["stage"] = "bandwidth"
        save()
        from benchmarks.offload_bench import free_memory, measure_bandwidth

        result["bandwidth_bytes"] = args.bandwidth_bytes
        result["bandwidth_bytes_per_s"] = measure_bandwidth(device, args.bandwidth_bytes)
        free_memory(device)
        save()

        stage = result["stage"] = "build"
        save()
        pipe, build = build_pipeline(name, args.smoke)
        pipe.set_progress_bar_config(disable=True)
        result["build_s"] = build["build_s"]
        result["build_notes"] = build["notes"]
        rss = host_rss()
        result["rss"] = {"after_build": rss["rss"], "build_peak": rss["hwm"]}
        save()
        print(f"built in {build['build_s']:.1f} s; host RSS {rss['rss'] / GiB:.1f} GiB", flush=True)
        dropper = None
        if strategy == "omni-host-lossless" and args.host_lossless_from_memory:
            result["checkpoint"] = remove_checkpoint(spec, args)
            if args.drop_page_cache:
                dropper = PageCacheDropper([])  # the cache's files, once its enable wrote them
            save()
        elif strategy in HOST:
            stage = result["stage"] = "checkpoint"
            save()
            result["checkpoint"] = disk_checkpoint(pipe, spec, args)
            rss = host_rss()
            result["rss"]["after_checkpoint"] = rss["rss"]
            print(f"DiTs saved and loaded back as mmap views in {result['checkpoint']['save_and_load_s']:.1f} s; "
                  f"host RSS {rss['rss'] / GiB:.1f} GiB", flush=True)
            if args.drop_page_cache:
                dropper = PageCacheDropper(result["checkpoint"]["files"])
                dropper.drop()
            save()

        stage = result["stage"] = "enable"
        save()
        peak_reset = reset_peak_rss()
        result["rss"]["peak_reset"] = peak_reset
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        start = time.perf_counter()
        with RssSampler() as sampled:
            target, handle = enable_strategy(strategy, pipe, device, args)
            sync()
        target.set_progress_bar_config(disable=True)
        result["enable_s"] = time.perf_counter() - start
        rss = host_rss()
        result["rss"].update(after_enable=rss["rss"], enable_peak=rss["hwm"], enable_anon_peak=sampled.anon,
                             enable_file_peak=sampled.file)
        if device.type == "cuda":
            result["enable_device_peak"] = torch.cuda.max_memory_allocated(device)
        result["pinned_after_enable"] = pinned_bytes(pipe, device)
        if strategy in HOST:
            result["max_host_memory"] = handle.config.max_host_memory
            if dropper is not None and strategy == "omni-host-lossless":  # the coded blocks are read from the cache
                dropper.files += sorted(str(p) for p in Path(lossless_cache_dir(args)).glob("*.safetensors"))
                dropper.drop()
            cache = handle.stats.cache_counters
            if cache:
                result["lossless_cache"] = dict(cache)
                result["lossless_cache_seconds"] = dict(handle.stats.cache_seconds)
                print(f"compression_cache_dir: read {cache['cache blocks read']} blocks, wrote "
                      f"{cache['cache blocks written']}; " + ", ".join(
                          f"{what} {value:.1f} s" for what, value in handle.stats.cache_seconds.items()), flush=True)
        elif is_omni(strategy):
            result["omni_plan"] = omni_plan(target, handle, (args.omni_runs or {}).get(strategy),
                                            getattr(args, "omni_passed_budget", None))
            plan = result["omni_plan"]
            if plan["auto"]:
                print("; ".join(plan["auto"]), flush=True)
            if plan["compression_ratio"] is not None:
                print(f"lossless: {plan['lossless_blocks']} streamed blocks held at {plan['compression_ratio']:.3f} of "
                      "their bytes", flush=True)
        print(f"enabled in {result['enable_s']:.1f} s; host RSS {rss['rss'] / GiB:.1f} GiB (peak "
              f"{rss['hwm'] / GiB:.1f}), pinned {result['pinned_after_enable']['pinned_total_bytes'] / GiB:.1f} GiB",
              flush=True)
        if strategy in ("mmgp2", "mmgp4"):
            from mmgp import offload as mmgp_offload

            result["mmgp"] = {"total_pinned_bytes": getattr(mmgp_offload, "total_pinned_bytes", None),
                              "max_pinnable_bytes": getattr(mmgp_offload, "max_pinnable_bytes", None)}
            if strategy == "mmgp4":
                result["notes"].append("mmgp profile 4 (LowRAM_LowVRAM) quantizes the T5/UMT5 text encoder to int8 "
                                       "(optimum-quanto) as its default; the transformer stays bf16")
        save()

        modules = {t: getattr(pipe, t) for t in spec.transformers if getattr(pipe, t, None) is not None}
        clock = PhaseClock(device)
        clock.attach(modules)
        if dropper is not None:
            dropper.attach(modules)  # registered after the clock's (prepended) hook: it runs first, untimed

        stage = result["stage"] = "warmup"
        save()
        generator = torch.Generator("cpu").manual_seed(SEED)
        start = time.perf_counter()
        target(**call_kwargs(name, args, warmup_steps), generator=generator)
        sync()
        result["warmup_s"] = time.perf_counter() - start
        save()
        print(f"warm-up ({warmup_steps} steps) {result['warmup_s']:.1f} s", flush=True)

        stage = result["stage"] = "call"
        save()
        gc.collect()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            reset_host = getattr(torch.cuda.memory, "reset_peak_host_memory_stats", None)
            if reset_host is not None:
                try:
                    reset_host()
                except RuntimeError:
                    pass
        result["rss"]["warmup_peak"] = host_rss()["hwm"]  # since the reset before enabling: enable + warm-up
        call_peak_reset = reset_peak_rss()
        generator = torch.Generator("cpu").manual_seed(SEED)
        with RssSampler() as sampled:
            clock.begin()
            output = target(**call_kwargs(name, args, steps), generator=generator)
            clock.end()
        result["rss"].update(call_anon_peak=sampled.anon, call_file_peak=sampled.file)
        result["end_to_end_s"] = clock.t1 - clock.t0
        result["phases"] = clock.phases()
        result["forwards"] = dict(clock.forwards)
        result["forward_s"] = {k: v for k, v in clock.forward_s.items()}
        if device.type == "cuda":
            result["device_peak_allocated"] = torch.cuda.max_memory_allocated(device)
            result["device_peak_reserved"] = torch.cuda.max_memory_reserved(device)
        rss = host_rss()
        result["rss"].update(after_call=rss["rss"], call_peak=rss["hwm"] if call_peak_reset else None,
                             peak=max(result["rss"]["warmup_peak"], rss["hwm"]))
        result["pinned"] = pinned_bytes(pipe, device)
        result["image"] = fingerprint(output)
        result["sha256"] = result["image"]["sha256"]
        if is_omni(strategy):
            stage = result["stage"] = "report"
            result["omni"] = omni_record(target, handle, dict(clock.forwards), spec.transformers)
        if dropper is not None:
            result["page_cache_drops"] = dropper.drops
            dropper.detach()
        result["status"] = "ok"
        clock.detach()
    except Exception as error:  # noqa: BLE001 - recorded as this strategy's result
        traceback.print_exc()
        result.update(status="error", error=_error(stage, error))
        if device.type == "cuda":
            try:
                result["device_peak_allocated"] = torch.cuda.max_memory_allocated(device)
                result["device_peak_reserved"] = torch.cuda.max_memory_reserved(device)
            except Exception:  # noqa: BLE001 - a broken context: nothing more to read
                pass
    save()
    print(f"result: {result['status']}" + (f": {result['error']['type']}: {result['error']['message']}"
                                          if result["error"] else ""), flush=True)
    return 0


# Parent ------------------------------------------------------------------------------------------------------------


def spawn(strategy: str, argv: list[str], out: Path, timeout: float | None) -> dict[str, Any]:
    """Run ``strategy`` in a child process of this script, echo its output, and return its result (or what
    happened to it: killed at the time budget, died without a result)."""
    command = [sys.executable, "-m", "benchmarks.pipeline_offload_bench", *argv, "--child", strategy,
               "--child-out", str(out)]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    start = time.perf_counter()
    tail: collections.deque[str] = collections.deque(maxlen=20)
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True, cwd=Path(__file__).resolve().parents[1])

    def echo() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            tail.append(line.rstrip("\n"))
            print(f"  [{strategy}] {line}", end="", flush=True)

    reader = threading.Thread(target=echo, daemon=True)
    reader.start()
    killed = False
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        killed = True
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    reader.join(timeout=10)
    wall = time.perf_counter() - start
    result: dict[str, Any] = {"strategy": strategy}
    if out.is_file():
        try:
            result = json.loads(out.read_text())
        except json.JSONDecodeError:
            pass
    result["child_wall_s"] = wall
    result["exit_status"] = proc.returncode
    if killed and result.get("status") != "ok":
        result.update(status="error", error={"stage": result.get("stage", "setup"), "type": "TimeBudget",
                                             "message": f"killed after {wall:.0f} s: the time budget was spent"})
    elif killed:
        result.setdefault("notes", []).append(f"killed at the time budget after {wall:.0f} s, after its result")
    elif result.get("status") in (None, "running"):
        rc = proc.returncode
        why = " (SIGKILL: the host's out-of-memory killer?)" if rc == -signal.SIGKILL else ""
        result.update(status="error", error={"stage": result.get("stage", "setup"), "type": "ChildDied",
                                             "message": f"exit status {rc}{why} with no result"},
                      output_tail=list(tail)[-8:])
    return result


def run_in_process(strategy: str, argv: list[str], out: Path) -> dict[str, Any]:
    """``--in-process`` (smoke only): ``strategy`` run by ``run_child`` in this process, its result as ``spawn``
    returns a child's (every strategy still builds its own pipeline)."""
    start = time.perf_counter()
    run_child(parse_args([*argv, "--child", strategy, "--child-out", str(out)]))
    gc.collect()
    result = json.loads(out.read_text()) if out.is_file() else {"strategy": strategy, "status": "error", "error": {
        "stage": "setup", "type": "NoResult", "message": "run_child wrote no result"}}
    result["child_wall_s"] = time.perf_counter() - start
    result["exit_status"] = None
    return result


def lower_bounds(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """For each omni run: per phase the larger of resident's time and the bytes omni streams ÷ its measured pinned
    bandwidth, summed (None with the reason where resident did not run)."""
    resident = next((r for r in results if r["strategy"] == "resident"), None)
    bounds = []
    for r in results:
        if not is_omni(r["strategy"]) or r["strategy"] in HOST or r.get("status") != "ok" or "omni" not in r:
            continue  # omni-host reads from the disk: its own bound is in host_budget_summary
        row: dict[str, Any] = {"strategy": r["strategy"], "streamed_bytes": r["omni"]["streamed_bytes"],
                               "bandwidth_bytes_per_s": r["bandwidth_bytes_per_s"]}
        if resident is None or resident.get("status") != "ok":
            why = "not run" if resident is None else (resident.get("skip_reason") or resident.get("status"))
            row.update(lower_bound_s=None, reason=f"the resident run was skipped or failed ({why})")
        elif resident.get("steps") != r.get("steps"):
            row.update(lower_bound_s=None, reason="resident ran a different number of steps")
        else:
            phases = {}
            for phase in PHASES:
                compute = resident["phases"][f"{phase}_s"] or 0.0
                copy = r["omni"]["streamed_bytes"][phase] / r["bandwidth_bytes_per_s"]
                phases[phase] = {"resident_s": compute, "copy_s": copy, "bound_s": max(compute, copy)}
            row.update(phases=phases, lower_bound_s=sum(p["bound_s"] for p in phases.values()),
                       measured_s=r["end_to_end_s"])
            row["ratio"] = r["end_to_end_s"] / row["lower_bound_s"] if row["lower_bound_s"] else None
        bounds.append(row)
    return bounds


def _gib(nbytes: float | None) -> str:
    return "n/a" if nbytes is None else f"{nbytes / GiB:.2f} GiB"


def _bytes(nbytes: int) -> str:
    """Decimal units, as the known checkpoint sizes are quoted."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes} B"


def _size(nbytes: int | None) -> str:
    """Binary units that fit the size (the tiny smoke budgets are KiB): diffusers-omni's ``format_bytes``."""
    from diffusers_omni.config.offload_base import format_bytes

    return "n/a" if nbytes is None else format_bytes(nbytes)


def _s(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds:.2f} s" if seconds < 10 else f"{seconds:.1f} s"


def same_image(result: dict[str, Any], reference: dict[str, Any] | None) -> str:
    if result["strategy"] == "resident":
        return "reference"
    if reference is None or reference.get("status") != "ok":
        return "n/a (no resident run)"
    if result.get("steps") != reference.get("steps"):
        return f"n/a ({result.get('steps')} steps)"
    return "yes" if result.get("sha256") == reference.get("sha256") else "NO"


def _planned_bytes(r: dict[str, Any]) -> int | None:
    """The device budget ``r`` planned with: auto's choice, a size as passed; None without one."""
    plan = r.get("omni_plan") or {}
    if plan.get("planned_budget_bytes") is not None:
        return plan["planned_budget_bytes"]
    budget = plan.get("max_device_memory")
    if isinstance(budget, int):
        return budget
    if isinstance(budget, str) and budget != AUTO:
        from diffusers_omni.config.offload_base import parse_bytes

        return parse_bytes(budget, "max_device_memory")
    return None


def auto_label(r: dict[str, Any]) -> str:
    """``omni-auto`` → ``omni-auto (chose 9.61 GiB)`` where the run planned (its label as is otherwise)."""
    plan = r.get("omni_plan") or {}
    if plan.get("budget") == AUTO and plan.get("planned_budget_bytes") is not None:
        return f"{r['strategy']} (chose {_size(plan['planned_budget_bytes'])})"
    return r["strategy"]


def budget_sweep(report: dict[str, Any]) -> dict[str, Any]:
    """The sweep's rows: omni without a budget, then every run the sweep added, each with its budget as given and
    as planned (auto's choice), its split, the lossless ratio, and its times; and what each auto run read."""
    rows = []
    runs = [r for r in report["strategies"] if r["strategy"] == "omni"] + sweep_runs(report)
    resident = next((r for r in report["strategies"] if r["strategy"] == "resident" and r.get("status") == "ok"), None)
    for r in runs:
        plan = r.get("omni_plan") or {}
        given = (report["args"].get("omni_runs") or {}).get(r["strategy"], {})
        rows.append({
            "strategy": r["strategy"], "status": r.get("status"), "budget": given.get("budget"),
            "compression": given.get("compression"), "max_device_memory": plan.get("max_device_memory"),
            "planned_budget_bytes": _planned_bytes(r), "end_to_end_s": r.get("end_to_end_s"),
            "denoise_s": (r.get("phases") or {}).get("denoise_s"), "enable_s": r.get("enable_s"),
            "device_peak_allocated": r.get("device_peak_allocated"), "resident_blocks": plan.get("resident_blocks"),
            "streamed_blocks": plan.get("streamed_blocks"), "streamed_bytes_per_pass": plan.get("streamed_bytes_per_pass"),
            "compression_ratio": plan.get("compression_ratio"), "auto": plan.get("auto") or [],
            "auto_readings": plan.get("auto_readings") or {},
            "same_image": None if resident is None or r.get("sha256") is None else r["sha256"] == resident["sha256"],
            "why_not": None if r.get("status") == "ok" else (r.get("skip_reason") or (r.get("error") or {}).get("type")),
        })
    return {"rows": rows}


def auto_against_sweep(rows: list[dict[str, Any]]) -> str | None:
    """Auto's end to end against the fastest sized run of the same sweep (#40: within 1.05), plain and lossless
    apart; None where the run has no auto row or no sized row that finished."""
    found = []
    for compression in (None, "lossless"):
        ok = [row for row in rows if row["status"] == "ok" and row["end_to_end_s"] is not None
              and row["compression"] == compression]
        auto = next((row for row in ok if row["budget"] == AUTO), None)
        sized = [row for row in ok if row["budget"] not in (None, AUTO)]
        if auto is None or not sized:
            continue
        fastest = min(sized, key=lambda row: row["end_to_end_s"])
        text = (f"{auto['strategy']} {_s(auto['end_to_end_s'])} against the sweep's fastest, "
                f"{fastest['strategy']} {_s(fastest['end_to_end_s'])}: "
                f"**{auto['end_to_end_s'] / fastest['end_to_end_s']:.3f}×** (of {len(sized)} sized runs)")
        differ = [row["strategy"] for row in [auto, *sized] if row.get("same_image") is False]
        exact = [row for row in sized if row.get("same_image") is True]
        if differ:
            text += f"; images not the resident one: {', '.join(differ)}"
            if exact:
                best = min(exact, key=lambda row: row["end_to_end_s"])
                text += (f"; the fastest sized run with the resident image, {best['strategy']} "
                         f"{_s(best['end_to_end_s'])}: auto {auto['end_to_end_s'] / best['end_to_end_s']:.3f}× of it")
        found.append(text)
    return "; ".join(found) + "." if found else None


def sweep_chart(report: dict[str, Any], path: Path) -> str | None:
    """End to end against the planned device budget: the sized runs as a line, auto's choice starred, lossless runs
    as diamonds, omni without a budget (and resident) as horizontal lines. Returns the name of the file written
    (None without matplotlib)."""
    from benchmarks.common import pyplot, save_figure

    plt = pyplot()
    if plt is None:
        print("matplotlib not installed; no plot", flush=True)
        return None
    rows = (report.get("budget_sweep") or budget_sweep(report))["rows"]
    ok = [row for row in rows if row["status"] == "ok" and row["end_to_end_s"] is not None]
    fig, ax = plt.subplots(figsize=(8, 4.8))
    sized = sorted((row for row in ok if row["planned_budget_bytes"] is not None and row["budget"] not in (None, AUTO)
                    and row["compression"] is None), key=lambda row: row["planned_budget_bytes"])
    if sized:
        ax.plot([row["planned_budget_bytes"] / GiB for row in sized], [row["end_to_end_s"] for row in sized], "o-",
                color="tab:green", label="max_device_memory=SIZE")
        for row in sized:
            ax.annotate(row["budget"], (row["planned_budget_bytes"] / GiB, row["end_to_end_s"]),
                        textcoords="offset points", xytext=(0, 6), ha="center", fontsize=7)
    for row in ok:
        if row["planned_budget_bytes"] is None or not (row["budget"] == AUTO or row["compression"]):
            continue
        x, y = row["planned_budget_bytes"] / GiB, row["end_to_end_s"]
        auto = row["budget"] == AUTO
        lossless = bool(row["compression"])
        ax.plot([x], [y], "D" if lossless else "*", markersize=8 if lossless else 14,
                color="tab:purple" if lossless else "tab:red", linestyle="none",
                label=row["strategy"] + (f" (chose {_size(row['planned_budget_bytes'])})" if auto else ""))
        text = f"auto chose {_size(row['planned_budget_bytes'])}" if auto else row["strategy"]
        if lossless:
            text += "\nlossless" + (f", host bytes ×{row['compression_ratio']:.3f}" if row["compression_ratio"] else "")
        ax.annotate(text, (x, y), textcoords="offset points", xytext=(8, -16 if lossless else 6), fontsize=7)
    lines = [(r, style, color) for r, style, color in
             ((next((row for row in ok if row["strategy"] == "omni"), None), "--", "tab:blue"),
              (next((r for r in report["strategies"] if r["strategy"] == "resident" and r.get("status") == "ok"), None),
               ":", "tab:gray"))]
    for r, style, color in lines:
        if r is not None:
            name = "omni, no budget (two-block window)" if r["strategy"] == "omni" else "resident (no card limit)"
            ax.axhline(r["end_to_end_s"], linestyle=style, color=color, label=f"{name}: {_s(r['end_to_end_s'])}")
    args = report["args"]
    if not args["smoke"]:
        ax.axvline(args["card_gib"], color="black", linewidth=0.8, label=f"the card: {args['card_gib']:g} GiB")
    xs = [row["planned_budget_bytes"] for row in ok if row["planned_budget_bytes"]]
    if xs and max(xs) / min(xs) > 100:  # smoke: tiny sizes against auto's reading of host memory
        ax.set_xscale("log")
    missing = [f"{row['strategy']}: {row['why_not']}" for row in rows if row["status"] != "ok"]
    if missing:
        ax.text(0.01, 0.01, "not in the plot: " + "; ".join(missing), transform=ax.transAxes, fontsize=6,
                va="bottom", wrap=True)
    ax.set_xlabel("max_device_memory planned (GiB)")
    ax.set_ylabel(f"end to end, {report['steps']} steps (s)")
    ax.set_ylim(bottom=0)
    card = "CPU smoke run" if args["smoke"] else f"{args['card_gib']:g} GiB card"
    ax.set_title(f"{MODELS[args['model']].pipeline}: end to end against the device budget ({card})", fontsize=10)
    ax.legend(fontsize=7, loc="best")
    save_figure(plt, fig, path)
    return path.name


def markdown(report: dict[str, Any]) -> str:
    env = report.get("environment") or {}
    args = report["args"]
    spec = MODELS[args["model"]]
    card = "no cap (CPU smoke run)" if args["smoke"] else f"{args['card_gib']:g} GiB card emulated"
    weights = "tiny configs (smoke)" if args["smoke"] else "bf16 random weights at the real sizes"
    measured = [r for r in report["strategies"] if r.get("bandwidth_bytes_per_s")]
    measured.sort(key=lambda r: not is_omni(r["strategy"]))
    bandwidth = "no bandwidth measured" if not measured else (
        f"{'host copy' if args['smoke'] else 'pinned host→device'} {measured[0]['bandwidth_bytes_per_s'] / 1e9:.1f} "
        f"GB/s ({_bytes(measured[0]['bandwidth_bytes'])} copy in the {measured[0]['strategy']} run)")
    lines = [
        f"# Whole-pipeline offload: {spec.pipeline} ({args['model']})",
        "",
        f"{env.get('device_name', 'unknown device')}, torch {env.get('torch', '?')}, diffusers "
        f"{env.get('diffusers', '?')}; {card} (set_per_process_memory_fraction before enabling; resident uncapped); "
        f"{report['steps']} steps (warm-up call: {args['warmup_steps']}); one prompt, seed {SEED}, {weights}; "
        f"{bandwidth}. Phases from synchronised transformer forward hooks.",
        "",
        *[f"- {note}" for note in spec.notes],
        "",
        "| strategy | end to end | encode / denoise / decode | device peak (allocated / reserved) | host RSS peak | "
        "pinned | enable | same image as resident |",
        "|---|---|---|---|---|---|---|---|",
    ]
    results = report["strategies"]
    reference = next((r for r in results if r["strategy"] == "resident"), None)
    for r in results:
        label = r["strategy"]
        if label == "omni-budget":
            budget = report["omni_budget"]
            label += f" ({_bytes(budget) if isinstance(budget, int) else budget})"
        else:
            label = auto_label(r)
        if r.get("status") == "skipped":
            lines.append(f"| {label} | skipped: {r.get('skip_reason', '')} | | | | | | |")
            continue
        if r.get("status") != "ok":
            err = r.get("error") or {}
            lines.append(f"| {label} | {err.get('type', 'error')} ({err.get('stage', '?')}) | | "
                         f"{_gib(r.get('device_peak_allocated'))} / {_gib(r.get('device_peak_reserved'))} | "
                         f"{_gib((r.get('rss') or {}).get('enable_peak'))} | "
                         f"{_gib((r.get('pinned_after_enable') or {}).get('pinned_total_bytes'))} | "
                         f"{_s(r.get('enable_s'))} | |")
            continue
        if r.get("steps") != report["steps"]:
            label += f" ({r['steps']} steps)"
        p = r["phases"]
        lines.append(
            f"| {label} | {_s(r['end_to_end_s'])} | {_s(p['encode_s'])} / {_s(p['denoise_s'])} / {_s(p['decode_s'])} | "
            f"{_gib(r.get('device_peak_allocated'))} / {_gib(r.get('device_peak_reserved'))} | "
            f"{_gib(r['rss'].get('peak'))} | {_gib(r['pinned']['pinned_total_bytes'])} | {_s(r['enable_s'])} | "
            f"{same_image(r, reference)} |")
    for bound in report["lower_bounds"]:
        if bound["lower_bound_s"] is None:
            lines.append(f"| lower bound for {bound['strategy']} | n/a: {bound['reason']} | | | | | | |")
            continue
        ph = bound["phases"]
        lines.append(f"| lower bound for {bound['strategy']} | {_s(bound['lower_bound_s'])} | "
                     f"{_s(ph['encode']['bound_s'])} / {_s(ph['denoise']['bound_s'])} / {_s(ph['decode']['bound_s'])}"
                     f" | | | | | measured ÷ bound {bound['ratio']:.2f} |")
    lines += [
        "",
        "Device peak: `torch.cuda.max_memory_allocated` / `max_memory_reserved` over the timed call. Host RSS peak: "
        "VmHWM from enabling to the end of the timed call (reset before enabling where the kernel allows it). "
        "Pinned: PyTorch's pinned host allocator plus the bytes diffusers-omni registered (`cudaHostRegister`). "
        "Lower bound: per phase max(resident's time, bytes omni streams ÷ pinned host→device bandwidth, measured in "
        "that omni run with a 1 GiB copy), summed.",
        "",
        "## Components",
        "",
        "| component | parameters | bytes | known size | check |",
        "|---|---|---|---|---|",
    ]
    for component, entry in report["components"].items():
        known = report["size_check"].get(component)
        check = "" if known is None else ("ok" if known["ok"] else "MISMATCH")
        dtypes = ", ".join(f"{k} {_bytes(v)}" for k, v in entry["by_dtype"].items())
        lines.append(f"| {component} | {entry['params']:,} | {_bytes(entry['param_bytes'])} ({dtypes}) | "
                     f"{'' if known is None else str(known['known_gb']) + ' GB'} | {check} |")
    notes = []
    for r in results:
        if r.get("status") == "error":
            err = r["error"]
            notes.append(f"- {r['strategy']}: {err.get('type')} in {err.get('stage')}: {err.get('message')}")
        for note in r.get("notes", []):
            notes.append(f"- {r['strategy']}: {note}")
        stats = (r.get("omni") or {}).get("stats") or {}
        events = memory_events(stats)
        if events:
            notes.append(f"- {r['strategy']}: {'; '.join(events)}")
        fitted = headroom_notes(stats)
        if fitted:
            notes.append(f"- {r['strategy']}: {'; '.join(fitted)}")
    notes += [f"- {note}" for note in report.get("notes", [])]
    for key, name, title in (
            ("host_budget", "omni-host", "## Host budget (omni-host against omni)"),
            ("host_budget_lossless", "omni-host-lossless",
             "## Host budget, coded blocks read from compression_cache_dir (omni-host-lossless against omni)")):
        summary = report.get(key)
        if not summary:
            continue
        lines += ["", title, "",
                  f"| max_host_memory | pinned | host RSS peak | denoise forward (median): {name} / omni | "
                  f"denoise step (mean): {name} / omni | first forward of each DiT / the others (median) | "
                  "shared buffers | disk blocks | read from disk per pass | disk reads: bytes / seconds / bandwidth | "
                  "loads that waited | page cache |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        ratio = summary.get("forward_ratio")
        denoise_ratio = summary.get("denoise_ratio")
        lines.append(
            f"| {summary['budget']} | {_gib(summary['pinned_bytes'])} | {_gib(summary['rss_peak'])} | "
            f"{_s(summary['forward_s'])} / {_s(summary['omni_forward_s'])}"
            f"{'' if ratio is None else f' ({ratio:.2f}×)'} | "
            f"{_s(summary.get('denoise_s'))} / {_s(summary.get('omni_denoise_s'))}"
            f"{'' if denoise_ratio is None else f' ({denoise_ratio:.2f}×)'} | "
            f"{_s(summary.get('switch_forward_s'))} / {_s(summary.get('other_forward_s'))} | "
            f"{summary.get('shared_buffers') or 0}, {_gib(summary.get('shared_bytes') or 0)} | {summary['disk_blocks']} | "
            f"{_gib(summary['disk_bytes_per_pass'])} | {_gib(summary['disk_read_bytes'])} / "
            f"{_s(summary['disk_read_seconds'])} / {_gib(summary['disk_bandwidth'])}/s | {summary['disk_waits']} | "
            f"{'dropped before every forward' if summary['page_cache_dropped'] else 'kept'} |")
        cache = summary.get("lossless_cache")
        if cache:
            lines += ["", f"{name}: enable {_s(summary.get('enable_s'))}; compression_cache_dir read "
                      f"{cache['cache blocks read']} blocks ({_gib(cache['cache bytes read'])}), wrote "
                      f"{cache['cache blocks written']} ({_gib(cache['cache bytes written'])})"
                      + "".join(f"; {what} {_s(value)}" for what, value in
                                (summary.get("lossless_cache_seconds") or {}).items()) + "."]
    sweep = report.get("budget_sweep")
    if sweep and sweep["rows"]:
        lines += ["", "## Budget sweep", "",
                  "| run | max_device_memory | planned (auto: its choice) | blocks resident / streamed | streamed per "
                  "pass | lossless: host bytes ÷ bytes | end to end | denoise | device peak (allocated) | enable |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for row in sweep["rows"]:
            passed = row["max_device_memory"]
            given = row["budget"] or "none (two-block window)"
            if isinstance(passed, int) and row["budget"] not in (None, AUTO):
                given += f" (passed {_size(passed)})"  # smoke: placed on the tiny pipeline
            planned = "" if row["planned_budget_bytes"] is None else _size(row["planned_budget_bytes"])
            if row["budget"] == AUTO and planned:
                planned = f"auto chose {planned}"
            split = ("" if row["resident_blocks"] is None else f"{row['resident_blocks']} / {row['streamed_blocks']}")
            ratio = "" if row["compression_ratio"] is None else f"{row['compression_ratio']:.3f}"
            if row["compression"] and row["compression_ratio"] is None:
                ratio = "no block streamed through the lossless store" if row["status"] == "ok" else ""
            if row["status"] != "ok":
                lines.append(f"| {row['strategy']} | {given} | {planned} | {split} | | {ratio} | not run: "
                             f"{row['why_not']} | | | |")
                continue
            lines.append(f"| {row['strategy']} | {given} | {planned} | {split} | "
                         f"{_size(row['streamed_bytes_per_pass'])} | {ratio} | {_s(row['end_to_end_s'])} | "
                         f"{_s(row['denoise_s'])} | {_gib(row['device_peak_allocated'])} | {_s(row['enable_s'])} |")
        verdict = auto_against_sweep(sweep["rows"])
        if verdict:
            lines += ["", verdict]
        for row in sweep["rows"]:
            for chosen in row["auto"]:
                lines.append(f"\n{row['strategy']}: {chosen}.")
            if row["auto_readings"]:
                lines.append(f"{row['strategy']}: auto read " +
                             ", ".join(f"{k} {v}" for k, v in row["auto_readings"].items()) + ".")
        if report.get("plot"):
            lines += ["", "Plot: the .png beside this report (end to end against the planned budget)."]
    if notes:
        lines += ["", "## Notes", "", *dict.fromkeys(notes)]
    return "\n".join(lines) + "\n"


def host_budget_summary(results: list[dict[str, Any]], args: argparse.Namespace,
                        strategy: str = "omni-host") -> dict[str, Any] | None:
    """``strategy`` (omni-host or omni-host-lossless) against omni (all host copies pinned) in the same run: pinned
    bytes, host RSS peak, the median transformer forward of each, and what the disk delivered (the reader thread's
    bytes and time)."""
    import statistics

    host = next((r for r in results if r["strategy"] == strategy and r.get("status") == "ok"), None)
    if host is None:
        return None
    omni = next((r for r in results if r["strategy"] == "omni" and r.get("status") == "ok"), None)

    def median_forward(r: dict[str, Any] | None) -> float | None:
        times = [t for values in (r or {}).get("forward_s", {}).values() for t in values]
        return statistics.median(times) if times else None

    def denoise(r: dict[str, Any] | None) -> float | None:
        """The denoise phase per step (runs may differ in steps: omni-host's --host-steps)."""
        total = ((r or {}).get("phases") or {}).get("denoise_s")
        return total / r["steps"] if total is not None and r.get("steps") else None

    # The timed call runs each DiT in one stretch (Wan 2.2: the high-noise expert, then the low-noise one): the
    # first forward of each is the one that reads its shared buffers back from disk.
    firsts = [values[0] for values in host.get("forward_s", {}).values() if values]
    rest = [t for values in host.get("forward_s", {}).values() for t in values[1:]]
    stats = host["omni"].get("stats", {})
    forward, omni_forward = median_forward(host), median_forward(omni)
    seconds = stats.get("disk_read_seconds") or 0.0
    return {
        "budget": _bytes(host["max_host_memory"]) if host.get("max_host_memory") else args.omni_host_budget,
        "pinned_bytes": host["pinned"]["pinned_total_bytes"],
        "rss_peak": host["rss"]["peak"], "forward_s": forward, "omni_forward_s": omni_forward,
        "denoise_s": denoise(host), "omni_denoise_s": denoise(omni),  # per step
        "steps": host.get("steps"), "omni_steps": (omni or {}).get("steps"),
        "denoise_ratio": denoise(host) / denoise(omni) if denoise(host) and denoise(omni) else None,
        "switch_forward_s": statistics.mean(firsts) if firsts else None,
        "other_forward_s": statistics.median(rest) if rest else None,
        "shared_buffers": stats.get("shared_buffers"), "shared_bytes": stats.get("shared_bytes"),
        "shared_hits": stats.get("shared_hits"),
        # Sampled: what of the peak while enabling is the process's own memory and what is mapped file pages.
        "enable_anon_peak": host["rss"].get("enable_anon_peak"), "enable_file_peak": host["rss"].get("enable_file_peak"),
        "call_anon_peak": host["rss"].get("call_anon_peak"),
        "forward_ratio": forward / omni_forward if forward and omni_forward else None,
        "disk_blocks": stats.get("disk_blocks"), "disk_bytes_per_pass": stats.get("disk_bytes_per_pass"),
        "disk_read_bytes": stats.get("disk_read_bytes"), "disk_read_seconds": seconds,
        "disk_bandwidth": (stats.get("disk_read_bytes") or 0) / seconds if seconds else None,
        "disk_waits": stats.get("disk_waits"), "page_cache_dropped": bool(host.get("page_cache_drops")),
        "strategy": strategy, "enable_s": host.get("enable_s"), "lossless_cache": host.get("lossless_cache"),
        "lossless_cache_seconds": host.get("lossless_cache_seconds"),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, choices=sorted(MODELS))
    parser.add_argument("--card-gib", type=float, default=24.0, help="the emulated card's memory (GiB)")
    parser.add_argument("--steps", type=int, default=None, help="denoising steps (default: the pipeline's)")
    parser.add_argument("--warmup-steps", type=int, default=2, help="steps of the warm-up call")
    parser.add_argument("--sequential-steps", type=int, default=None,
                        help="steps for diffusers-sequential (very slow; default: --steps)")
    parser.add_argument("--strategies", default="resident,omni,diffusers-group,mmgp2,mmgp4",
                        help=f"comma-separated, run in this order: {', '.join(STRATEGIES)}")
    parser.add_argument("--omni-budget", default=None,
                        help="max_device_memory for omni-budget (e.g. 8GiB); given, omni-budget runs after omni. "
                             "Comma-separated sizes and auto (e.g. 4GiB,8GiB,auto): a sweep, each its own run "
                             "(omni-budget (4GiB), ..., omni-auto) in that order, and a plot PREFIX.png")
    parser.add_argument("--omni-lossless", default=None,
                        help="comma-separated budgets (a size, auto, or none: no budget), each run again with "
                             "compression=lossless after the --omni-budget runs: omni-budget-lossless (SIZE), "
                             "omni-auto-lossless, omni-lossless")
    parser.add_argument("--omni-host-budget", default=None,
                        help="max_host_memory for omni-host (e.g. 32GiB); given, omni-host runs after omni")
    parser.add_argument("--checkpoint-dir", default=None,
                        help="omni-host: where the DiTs are saved (default: a folder under the temporary directory)")
    parser.add_argument("--host-lossless-from-memory", action="store_true",
                        help="omni-host-lossless: no checkpoint (the DiTs stay as built, the cache alone on disk; any "
                             "checkpoint omni-host left is removed first): for a disk too small for both")
    parser.add_argument("--keep-page-cache", dest="drop_page_cache", action="store_false",
                        help="omni-host: leave the checkpoint's pages cached (default: dropped before each forward)")
    parser.add_argument("--omni-attention", default="off",
                        help="attention omnify installs: off (Diffusers' processors, as the other strategies run), "
                             "auto (omnify's default) or a backend name")
    parser.add_argument("--true-cfg", action="store_true",
                        help="qwen: pass negative_prompt=' ' so true_cfg_scale (4.0) takes effect")
    parser.add_argument("--time-budget", type=float, default=None,
                        help="seconds: no strategy starts after they are spent (nor with less than --min-left "
                             "left), and a running one is stopped at the budget plus --kill-grace")
    parser.add_argument("--min-left", type=float, default=60.0, help="seconds of budget a strategy needs to start")
    parser.add_argument("--kill-grace", type=float, default=30.0)
    parser.add_argument("--bandwidth-bytes", type=int, default=GiB, help="pinned host→device copy for the bandwidth")
    parser.add_argument("--host-steps", type=int, default=None,
                        help="denoising steps of omni-host's timed call (default: --steps); its mean step is compared "
                             "with omni's")
    parser.add_argument("--smoke", action="store_true", help="tiny configs on the CPU (checks the script, not speed)")
    parser.add_argument("--in-process", action="store_true",
                        help="with --smoke: run every strategy in this process, one after the other, not each in a "
                             "child (one start-up instead of one per strategy: the tests' fast path)")
    parser.add_argument("--out", required=True, help="output prefix: PREFIX.json and PREFIX.md (the runner, python "
                                                     "-m benchmarks run, chooses it)")
    # Internal: the parent starts each strategy as a child of this script with these.
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--child-out", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--expected-weight-bytes", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.steps is None:
        args.steps = MODELS[args.model].default_steps
    strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    unknown = sorted(set(strategies) - set(STRATEGIES))
    if unknown:
        parser.error(f"--strategies: unknown {unknown}; allowed: {', '.join(STRATEGIES)}")
    if "omni-budget" in strategies and args.omni_budget is None:
        parser.error("--strategies omni-budget needs --omni-budget (e.g. 8GiB)")
    try:
        budgets = parse_budgets(args.omni_budget, "--omni-budget")
        lossless = parse_budgets(args.omni_lossless, "--omni-lossless", allow_none=True)
    except ValueError as error:
        parser.error(str(error))
    args.omni_runs = omni_runs(budgets, lossless)
    if args.in_process and not args.smoke:
        parser.error("--in-process is for --smoke runs (on the device every strategy needs its own process)")
    # --omni-budget's runs take omni-budget's place in --strategies, else they follow omni; --omni-lossless's follow
    # them (or omni).
    budget_runs = [n for n, r in args.omni_runs.items() if r["compression"] is None]
    lossless_runs = [n for n, r in args.omni_runs.items() if r["compression"] is not None]
    if budget_runs:
        at = strategies.index("omni-budget") if "omni-budget" in strategies else (
            strategies.index("omni") + 1 if "omni" in strategies else len(strategies))
        strategies[at:at + ("omni-budget" in strategies)] = budget_runs
    if lossless_runs:
        anchor = budget_runs[-1] if budget_runs else "omni" if "omni" in strategies else None
        at = strategies.index(anchor) + 1 if anchor is not None else len(strategies)
        strategies[at:at] = lossless_runs
    if args.omni_host_budget is not None and "omni-host" not in strategies:
        strategies.append("omni-host")
    if set(HOST) & set(strategies) and args.omni_host_budget is None and not args.smoke:
        parser.error("--strategies omni-host / omni-host-lossless need --omni-host-budget (e.g. 32GiB)")
    if args.checkpoint_dir is None:
        args.checkpoint_dir = str(Path(tempfile.gettempdir()) / f"omni-pipeline-checkpoint-{args.model}")
    args.strategies = list(dict.fromkeys(strategies))
    if args.smoke:
        args.steps = min(args.steps, 3)
        args.warmup_steps = min(args.warmup_steps, 1)
        args.bandwidth_bytes = min(args.bandwidth_bytes, 16 * MiB)
    return args


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.child:
        return run_child(args)
    started = time.perf_counter()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    # Sizes from the meta build (no weights, no CUDA in this process: the children own the device).
    print(f"[{args.model}] component sizes (parameters on meta)", flush=True)
    try:
        pipe, build = build_pipeline(args.model, args.smoke, materialize_weights=False)
        del pipe
    except Exception as error:  # noqa: BLE001 - the children will report it too; the run goes on
        traceback.print_exc()
        build = {"components": {}, "notes": [f"the meta build for the sizes failed: {type(error).__name__}: {error}"]}
    gc.collect()
    sizes = build["components"]
    checks = {} if args.smoke else size_check(args.model, sizes)
    for component, entry in sizes.items():
        check = checks.get(component)
        mark = "" if check is None else (f" (known {check['known_gb']} GB: {'ok' if check['ok'] else 'MISMATCH'})")
        dtypes = ", ".join(f"{k} {_bytes(v)}" for k, v in entry["by_dtype"].items())
        print(f"  {component:15} {entry['params']:>15,} parameters, {_bytes(entry['param_bytes']):>9} ({dtypes}){mark}",
              flush=True)
    weight_bytes = sum(e["param_bytes"] + e["buffer_bytes"] for e in sizes.values())
    report: dict[str, Any] = {
        "environment": None, "args": vars(args), "model": args.model, "pipeline": MODELS[args.model].pipeline,
        "steps": args.steps, "components": sizes, "size_check": checks, "weight_bytes": weight_bytes,
        "notes": build["notes"] + (["CPU (smoke): tiny configs, no card cap, no device peaks, no pinned memory; "
                                    "omni-budget's budget is the tiny pipeline's weight bytes"] if args.smoke else []),
        "strategies": [], "lower_bounds": [],
        "omni_budget": weight_bytes if args.smoke and "omni-budget" in args.omni_runs else args.omni_budget,
    }
    sweep = [n for n in args.omni_runs if n != "omni-budget"]
    if args.in_process:
        report["notes"].append("--in-process: every strategy ran in the parent's process, one after the other")
    if args.host_lossless_from_memory and "omni-host-lossless" in args.strategies:
        report["notes"].append(
            "omni-host-lossless: its DiTs stayed as built (no checkpoint on disk, --host-lossless-from-memory: the "
            "disk holds the checkpoint or the cache, not both); the blocks beyond the budget are read coded from the "
            "cache, whose pages are dropped before every forward")
    if args.smoke and sweep:
        report["notes"].append(
            "CPU (smoke): a sweep's sizes are placed on the tiny pipeline as on the card (the least budget it allows "
            "plus size ÷ --card-gib of the rest of its weight bytes); auto reads host memory (the CPU is the device)")
    child_argv = [a for a in argv]
    child_argv += ["--expected-weight-bytes", str(weight_bytes)]
    scratch = Path(tempfile.mkdtemp(prefix="pipeline_offload_"))

    def write(final: bool = False) -> None:
        report["lower_bounds"] = lower_bounds(report["strategies"])
        report["host_budget"] = host_budget_summary(report["strategies"], args)
        report["host_budget_lossless"] = host_budget_summary(report["strategies"], args, "omni-host-lossless")
        report["budget_sweep"] = budget_sweep(report) if sweep else None
        if final and sweep:
            report["plot"] = sweep_chart(report, out.with_suffix(".png"))
        out.with_suffix(".json").write_text(json.dumps(report, indent=1, default=str))
        out.with_suffix(".md").write_text(markdown(report))

    for strategy in args.strategies:
        elapsed = time.perf_counter() - started
        if args.smoke and strategy in NEEDS_CUDA:
            report["strategies"].append({"strategy": strategy, "status": "skipped",
                                         "skip_reason": "needs CUDA (smoke run on the CPU)"})
            write()
            continue
        timeout = None
        if args.time_budget is not None:
            left = args.time_budget - elapsed
            if left < args.min_left:
                report["strategies"].append({"strategy": strategy, "status": "skipped", "skip_reason": (
                    f"time budget: {elapsed:.0f} s of {args.time_budget:.0f} s spent")})
                write()
                continue
            timeout = left + args.kill_grace
        print(f"[{args.model}] {strategy}: starting ({elapsed:.0f} s in)", flush=True)
        child_out = scratch / (re.sub(r"[^A-Za-z0-9_.-]+", "_", strategy).strip("_") + ".json")
        if args.in_process:
            result = run_in_process(strategy, child_argv, child_out)
        else:
            result = spawn(strategy, child_argv, child_out, timeout)
        if report["environment"] is None and result.get("environment"):
            report["environment"] = result["environment"]
        report["strategies"].append(result)
        write()
        summary = (f"{result['end_to_end_s']:.2f} s end to end" if result.get("status") == "ok" else
                   result.get("skip_reason") or f"{result['error']['type']}: {result['error']['message']}")
        print(f"[{args.model}] {strategy}: {result.get('status')}: {summary}", flush=True)
    if report["environment"] is None:
        report["environment"] = environment(torch.device("cpu"))
    report["wall_s"] = time.perf_counter() - started
    write(final=True)
    for path in scratch.iterdir():
        path.unlink()
    scratch.rmdir()
    if set(HOST) & set(args.strategies):  # the DiTs' checkpoint written for omni-host: tens of GB at full size
        import shutil

        shutil.rmtree(args.checkpoint_dir, ignore_errors=True)
    print(out.with_suffix(".md").read_text())
    print(f"wrote {out.with_suffix('.json')} and .md" + (" and .png" if report.get("plot") else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
