"""Tiny, deterministic, fully local SoulX-Singer pipelines (SVS and SVC) for fast CPU tests.

Audio runs at 16 kHz with a 320-sample hop (50 mel frames a second, Whisper's encoder rate), 16 mel channels; the
estimator has hidden size 32, two heads and two layers; the vocoder two ConvNeXt blocks. Weights come from
:func:`soulx_singer_weight_init`, a rule keyed by parameter name (not by construction order), so a reference
implementation with the same parameter names gets the same weights.

:func:`tiny_soulx_singer_inputs` / :func:`tiny_soulx_singer_svc_inputs` give matching example inputs (prompt of 8
frames, target of 10).
"""

from __future__ import annotations

import math
import zlib
from typing import Any

import torch
import torch.nn as nn
from transformers import WhisperConfig, WhisperFeatureExtractor
from transformers.models.whisper.modeling_whisper import WhisperEncoder

from diffusers_omni.architectures.soulx_singer import (
    SoulXSingerCFMDecoder,
    SoulXSingerConditionEncoder,
    SoulXSingerMelSpectrogram,
    SoulXSingerPipeline,
    SoulXSingerSVCPipeline,
    SoulXSingerVocoder,
)

__all__ = [
    "TINY_AUDIO",
    "TINY_ENCODER",
    "TINY_FLOW_MATCHING",
    "TINY_VOCODER",
    "soulx_singer_weight_init",
    "tiny_soulx_singer_components",
    "tiny_soulx_singer_inputs",
    "tiny_soulx_singer_pipeline",
    "tiny_soulx_singer_svc_inputs",
    "tiny_soulx_singer_svc_pipeline",
]

# The sections of the published config.yaml, shrunk.
TINY_AUDIO = dict(sample_rate=16000, n_fft=640, num_mels=16, hop_size=320, win_size=640, fmin=0, fmax=8000,
                  mel_mean=-4.92, mel_var=8.14)
TINY_ENCODER = dict(vocab_size=40, text_dim=16, pitch_dim=16, type_dim=16, f0_bin=361, f0_dim=16, num_layers=2)
TINY_FLOW_MATCHING = dict(mel_dim=16, hidden_size=32, num_layers=2, num_heads=2, cond_codebook_size=16)
TINY_VOCODER = dict(input_channels=16, dim=32, intermediate_dim=64, num_layers=2, n_fft=640, hop_size=320)

# Buffers computed from the config, not weights.
_COMPUTED = ("mel_basis", "hann_window", "window")


@torch.no_grad()
def soulx_singer_weight_init(module: nn.Module, seed: int = 0) -> nn.Module:
    """Fill every parameter and persistent buffer of ``module`` (except the mel filter bank and STFT windows) with
    Gaussian values drawn from a generator seeded by ``crc32(f"{seed}:{name}")``: matrices with std
    ``1 / sqrt(fan_in)``, vectors with std 0.1. Returns ``module``."""
    for name, tensor in module.state_dict().items():
        if name.rsplit(".", 1)[-1] in _COMPUTED:
            continue
        generator = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{name}".encode()))
        values = torch.randn(tensor.shape, generator=generator, dtype=torch.float32)
        std = 1 / math.sqrt(tensor[0].numel()) if tensor.ndim >= 2 else 0.1
        tensor.copy_(values * std)
    return module.eval()


def _tiny_whisper_encoder(seed: int) -> nn.Module:
    config = WhisperConfig(
        d_model=TINY_ENCODER["f0_dim"], encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=32,
        num_mel_bins=8, max_source_positions=1500,
    )
    return soulx_singer_weight_init(WhisperEncoder(config), seed)


def _tiny_feature_extractor() -> WhisperFeatureExtractor:
    return WhisperFeatureExtractor(feature_size=8, sampling_rate=16000, hop_length=160, chunk_length=30, n_fft=400)


def tiny_soulx_singer_components(seed: int = 0, svc: bool = False) -> dict[str, Any]:
    """Components of a tiny ``SoulXSingerPipeline`` (``svc=True``: of a ``SoulXSingerSVCPipeline``)."""
    encoder = dict(TINY_ENCODER) if not svc else {k: TINY_ENCODER[k] for k in ("f0_bin", "f0_dim")}
    components: dict[str, Any] = {
        "condition_encoder": SoulXSingerConditionEncoder(use_score=not svc, **encoder),
        "cfm_decoder": SoulXSingerCFMDecoder(**TINY_FLOW_MATCHING),
        "mel": SoulXSingerMelSpectrogram(**TINY_AUDIO),
        "vocoder": SoulXSingerVocoder(**TINY_VOCODER),
    }
    for name, module in components.items():
        # Each component's names are the checkpoint's under its prefix; seed by the full checkpoint name.
        prefix = {"condition_encoder": "", "cfm_decoder": "cfm_decoder.", "mel": "mel.", "vocoder": "vocoder."}[name]
        _init_with_prefix(module, prefix, seed)
    if svc:
        components["whisper_encoder"] = _tiny_whisper_encoder(seed)
        components["feature_extractor"] = _tiny_feature_extractor()
    return components


@torch.no_grad()
def _init_with_prefix(module: nn.Module, prefix: str, seed: int) -> None:
    holder = nn.Module()
    if prefix:
        holder.add_module(prefix.rstrip("."), module)
        soulx_singer_weight_init(holder, seed)
    else:
        soulx_singer_weight_init(module, seed)
    module.eval()


def tiny_soulx_singer_pipeline(seed: int = 0) -> SoulXSingerPipeline:
    return SoulXSingerPipeline(**tiny_soulx_singer_components(seed))


def tiny_soulx_singer_svc_pipeline(seed: int = 0) -> SoulXSingerSVCPipeline:
    return SoulXSingerSVCPipeline(**tiny_soulx_singer_components(seed, svc=True))


def _wave(samples: int, freq: float, phase: float = 0.0) -> torch.Tensor:
    t = torch.arange(samples, dtype=torch.float64) / TINY_AUDIO["sample_rate"]
    return (0.3 * torch.sin(2 * math.pi * freq * t + phase) + 0.05 * torch.sin(2 * math.pi * 3.1 * freq * t)).float()


def tiny_soulx_singer_inputs(control: str = "melody") -> dict[str, Any]:
    """Inputs for a tiny SVS call: a prompt of 8 frames (3 notes) and a target of 10 frames (4 notes)."""
    hop = TINY_AUDIO["hop_size"]
    inputs: dict[str, Any] = {
        "prompt_audio": _wave(8 * hop, 220.0),
        "prompt_phonemes": torch.tensor([0, 5, 9, 12]),
        "prompt_note_type": torch.tensor([1, 2, 2, 3]),
        "prompt_mel2note": torch.tensor([1, 1, 2, 2, 2, 3, 3, 0]),
        "phonemes": torch.tensor([0, 7, 3, 21, 30]),
        "note_type": torch.tensor([1, 2, 3, 2, 2]),
        "mel2note": torch.tensor([1, 1, 2, 2, 3, 3, 3, 4, 4, 0]),
        "control": control,
    }
    if control == "melody":
        inputs["prompt_f0"] = torch.tensor([0.0, 220.0, 221.5, 246.9, 247.0, 0.0, 261.6, 262.0])
        inputs["f0"] = torch.tensor([196.0, 197.0, 0.0, 220.0, 233.1, 246.9, 0.0, 261.6, 293.7, 0.0])
    else:
        inputs["prompt_note_pitch"] = torch.tensor([0, 57, 59, 60])
        inputs["note_pitch"] = torch.tensor([0, 55, 57, 0, 62])
    return inputs


def tiny_soulx_singer_svc_inputs() -> dict[str, Any]:
    """Inputs for a tiny SVC call (16 kHz, so the Whisper content audio is the audio itself)."""
    hop = TINY_AUDIO["hop_size"]
    prompt, target = _wave(8 * hop, 220.0), _wave(10 * hop, 180.0, 0.5)
    return {
        "prompt_audio": prompt,
        "audio": target,
        "prompt_content": prompt,
        "content": target,
        "prompt_f0": torch.tensor([0.0, 220.0, 221.5, 246.9, 247.0, 0.0, 261.6, 262.0]),
        "f0": torch.tensor([196.0, 197.0, 0.0, 220.0, 233.1, 246.9, 0.0, 261.6, 293.7, 0.0]),
    }
