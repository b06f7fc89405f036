"""SoulX-Singer's models besides the estimator: the condition encoder, the flow-matching decoder, the mel front end
and the Vocos vocoder.

Parameter (and persistent buffer) names under each class are those of the published checkpoint under the prefix the
pipeline gives the component: ``SoulXSingerConditionEncoder`` holds the checkpoint's top-level ``note_*_encoder``,
``f0_encoder`` and ``preflow``; ``SoulXSingerCFMDecoder`` is ``cfm_decoder``; ``SoulXSingerMelSpectrogram`` is
``mel``; ``SoulXSingerVocoder`` is ``vocoder``.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.models.modeling_utils import ModelMixin

from .modeling_diffllama import DiffLlama

__all__ = [
    "SoulXSingerCFMDecoder",
    "SoulXSingerConditionEncoder",
    "SoulXSingerMelSpectrogram",
    "SoulXSingerVocoder",
    "f0_to_coarse",
    "slaney_mel_filterbank",
]

F0_MIN = 32.7031956625  # C1 in Hz: bin 1 of the coarse F0 scale (20 cents per bin)


def f0_to_coarse(f0: torch.Tensor, f0_bin: int = 361, shift_bins: int = 0) -> torch.Tensor:
    """Continuous F0 (Hz, ``<= 0`` unvoiced) to SoulX-Singer's coarse bins: 0 for unvoiced, else
    ``round(cents above C1 / 20) + 1`` clamped to ``[1, f0_bin - 1]``; ``shift_bins`` then moves voiced bins (5 bins a
    semitone), clamped again."""
    unvoiced = f0 <= 0
    cents = 1200 * torch.log2(torch.maximum(f0, torch.tensor(F0_MIN)) / F0_MIN)
    coarse = torch.clamp(torch.round(cents / 20 + 1).long(), min=1, max=f0_bin - 1)
    coarse[unvoiced] = 0
    if shift_bins:
        voiced = coarse > 0
        coarse[voiced] = torch.clamp(coarse[voiced] + shift_bins, 1, f0_bin - 1)
    return coarse


# Condition encoder --------------------------------------------------------------------------------------------------


class GlobalResponseNorm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.gamma = nn.Parameter(torch.zeros(1, 1, dim))
        self.beta = nn.Parameter(torch.zeros(1, 1, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        norm = torch.norm(x, p=2, dim=1, keepdim=True)
        scaled = norm / (norm.mean(dim=-1, keepdim=True) + 1e-6)
        return self.gamma * (x * scaled) + self.beta + x


class ConvNeXtV2Block(nn.Module):
    """1-D ConvNeXt-V2 block on ``[B, T, C]`` (depthwise conv, LayerNorm, pointwise MLP with GRN, residual)."""

    def __init__(self, dim: int, intermediate_dim: int) -> None:
        super().__init__()
        self.dwconv = nn.Conv1d(dim, dim, kernel_size=7, padding=3, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pwconv1 = nn.Linear(dim, intermediate_dim)
        self.act = nn.GELU()
        self.grn = GlobalResponseNorm(intermediate_dim)
        self.pwconv2 = nn.Linear(intermediate_dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        residual = x
        x = self.dwconv(x.transpose(1, 2)).transpose(1, 2)
        x = self.pwconv2(self.grn(self.act(self.pwconv1(self.norm(x)))))
        return residual + x


class SoulXSingerConditionEncoder(ModelMixin, ConfigMixin):
    """Frame conditions of the flow-matching decoder.

    Score mode (``use_score=True``, the SVS checkpoint): per-note phoneme, pitch and type embeddings summed, refined
    by ``num_layers`` ConvNeXt-V2 blocks (``preflow``), expanded to mel frames by ``mel2note``, plus the embedding of
    the coarse F0 of each frame. Without the score (``use_score=False``, the SVC checkpoint) only ``f0_encoder``
    exists; :meth:`encode_f0` embeds the coarse F0 that the pipeline adds to its content features.
    """

    @register_to_config
    def __init__(
        self,
        vocab_size: int = 3000,
        text_dim: int = 512,
        pitch_dim: int = 512,
        type_dim: int = 512,
        f0_bin: int = 361,
        f0_dim: int = 512,
        num_layers: int = 4,
        use_score: bool = True,
    ) -> None:
        super().__init__()
        if use_score:
            if not text_dim == pitch_dim == type_dim == f0_dim:
                raise ValueError(
                    f"text_dim={text_dim}, pitch_dim={pitch_dim}, type_dim={type_dim} and f0_dim={f0_dim} must be "
                    "equal: the note embeddings and the F0 embedding are summed"
                )
            self.note_text_encoder = nn.Embedding(vocab_size, text_dim)
            self.note_pitch_encoder = nn.Embedding(256, pitch_dim)
            self.note_type_encoder = nn.Embedding(256, type_dim)
        self.f0_encoder = nn.Embedding(f0_bin, f0_dim)
        if use_score:
            self.preflow = nn.Sequential(*[ConvNeXtV2Block(text_dim, 2 * text_dim) for _ in range(num_layers)])

    def encode_f0(self, f0_coarse: torch.Tensor) -> torch.Tensor:
        return self.f0_encoder(f0_coarse)

    def forward(
        self,
        phonemes: torch.Tensor,
        note_pitch: torch.Tensor,
        note_type: torch.Tensor,
        mel2note: torch.Tensor,
        f0_coarse: torch.Tensor,
    ) -> torch.Tensor:
        """``phonemes``/``note_pitch``/``note_type`` ``[B, N]`` note tokens, ``mel2note`` ``[B, F]`` the note index of
        each frame, ``f0_coarse`` ``[B, F]`` coarse F0 bins; returns ``[B, F, f0_dim]``."""
        if not self.config.use_score:
            raise ValueError("this SoulXSingerConditionEncoder has use_score=False (SVC): it has no note encoders")
        notes = (self.note_pitch_encoder(note_pitch) + self.note_type_encoder(note_type)
                 + self.note_text_encoder(phonemes))
        notes = self.preflow(notes)
        index = mel2note[..., None].repeat(1, 1, notes.shape[-1])
        frames = torch.gather(notes, 1, index)
        return frames + self.f0_encoder(f0_coarse)


# Flow-matching decoder ----------------------------------------------------------------------------------------------


class _FlowMatchingTransformer(nn.Module):
    def __init__(self, mel_dim: int, hidden_size: int, num_heads: int, num_layers: int, cond_codebook_size: int):
        super().__init__()
        self.cond_emb = nn.Linear(cond_codebook_size, hidden_size)
        self.diff_estimator = DiffLlama(
            mel_dim=mel_dim, hidden_size=hidden_size, num_heads=num_heads, num_layers=num_layers
        )


class SoulXSingerCFMDecoder(ModelMixin, ConfigMixin):
    """The conditional flow-matching decoder: ``model.cond_emb`` projects the frame conditions to the estimator's
    width, ``model.diff_estimator`` (:class:`DiffLlama`) predicts the flow. The sampling loop is the pipeline's.

    Args mirror the checkpoint's ``model.flow_matching`` config (``mel_dim``, ``hidden_size``, ``num_layers``,
    ``num_heads``, ``cond_codebook_size``).
    """

    @register_to_config
    def __init__(
        self,
        mel_dim: int = 128,
        hidden_size: int = 1024,
        num_layers: int = 22,
        num_heads: int = 16,
        cond_codebook_size: int = 512,
    ) -> None:
        super().__init__()
        self.model = _FlowMatchingTransformer(mel_dim, hidden_size, num_heads, num_layers, cond_codebook_size)

    @property
    def estimator(self) -> DiffLlama:
        return self.model.diff_estimator

    def embed_condition(self, cond: torch.Tensor) -> torch.Tensor:
        return self.model.cond_emb(cond)

    def forward(self, x, timestep, cond_emb, attention_mask=None):
        return self.model.diff_estimator(x, timestep, cond_emb, attention_mask)


# Mel front end ------------------------------------------------------------------------------------------------------


def _hz_to_slaney_mel(hz: torch.Tensor) -> torch.Tensor:
    f_sp = 200.0 / 3
    min_log_hz, logstep = 1000.0, math.log(6.4) / 27.0
    linear = hz / f_sp
    log = min_log_hz / f_sp + torch.log(torch.clamp(hz, min=1e-10) / min_log_hz) / logstep
    return torch.where(hz >= min_log_hz, log, linear)


def _slaney_mel_to_hz(mel: torch.Tensor) -> torch.Tensor:
    f_sp = 200.0 / 3
    min_log_hz, logstep = 1000.0, math.log(6.4) / 27.0
    min_log_mel = min_log_hz / f_sp
    return torch.where(mel >= min_log_mel, min_log_hz * torch.exp(logstep * (mel - min_log_mel)), f_sp * mel)


def slaney_mel_filterbank(sample_rate: int, n_fft: int, n_mels: int, fmin: float, fmax: float) -> torch.Tensor:
    """``[n_mels, n_fft // 2 + 1]`` triangular filters on the Slaney mel scale with Slaney (area) normalisation —
    the filter bank of ``librosa.filters.mel``'s defaults, computed in float64 and returned in float32."""
    cpu = torch.device("cpu")  # computed on the CPU even under a meta default device (the values need reading)
    fft_freqs = torch.arange(n_fft // 2 + 1, dtype=torch.float64, device=cpu) * (sample_rate / n_fft)
    bounds = torch.tensor([fmin, fmax], dtype=torch.float64, device=cpu)
    mel_lo, mel_hi = _hz_to_slaney_mel(bounds)
    mel_f = _slaney_mel_to_hz(torch.linspace(float(mel_lo), float(mel_hi), n_mels + 2, dtype=torch.float64,
                                             device=cpu))
    fdiff = mel_f[1:] - mel_f[:-1]
    ramps = mel_f[:, None] - fft_freqs[None, :]
    lower = -ramps[:-2] / fdiff[:-1, None]
    upper = ramps[2:] / fdiff[1:, None]
    weights = torch.clamp(torch.minimum(lower, upper), min=0)
    weights = weights * (2.0 / (mel_f[2:] - mel_f[:-2]))[:, None]
    return weights.to(torch.float32)


class _MelTransform(nn.Module):
    def __init__(self, sample_rate, n_fft, num_mels, hop_size, win_size, fmin, fmax) -> None:
        super().__init__()
        self.register_buffer("mel_basis", slaney_mel_filterbank(sample_rate, n_fft, num_mels, fmin, fmax))
        self.register_buffer("hann_window", torch.hann_window(win_size))


class SoulXSingerMelSpectrogram(ModelMixin, ConfigMixin):
    """Waveform ``[B, L]`` to normalised log-mel frames ``[B, L // hop_size, num_mels]``: reflect padding of
    ``(n_fft - hop_size) / 2`` each side, an uncentred STFT with a Hann window, magnitudes, the mel filter bank
    (``model.mel_basis``, a checkpoint buffer), ``log(max(x, 1e-5))``, then ``(x - mel_mean) / sqrt(mel_var)``."""

    @register_to_config
    def __init__(
        self,
        sample_rate: int = 24000,
        n_fft: int = 1920,
        num_mels: int = 128,
        hop_size: int = 480,
        win_size: int = 1920,
        fmin: float = 0,
        fmax: float = 12000,
        mel_mean: float = -4.92,
        mel_var: float = 8.14,
    ) -> None:
        super().__init__()
        self.model = _MelTransform(sample_rate, n_fft, num_mels, hop_size, win_size, fmin, fmax)

    def forward(self, waveform: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        pad = int((cfg.n_fft - cfg.hop_size) / 2)
        y = F.pad(waveform.unsqueeze(1), (pad, pad), mode="reflect").squeeze(1)
        spec = torch.stft(
            y, cfg.n_fft, hop_length=cfg.hop_size, win_length=cfg.win_size, window=self.model.hann_window,
            center=False, pad_mode="reflect", normalized=False, onesided=True, return_complex=True,
        )
        spec = torch.view_as_real(spec)
        spec = torch.sqrt(spec.pow(2).sum(-1) + 1e-9)
        spec = torch.matmul(self.model.mel_basis, spec)
        spec = torch.log(torch.clamp(spec, min=1e-5)).transpose(1, 2)
        return (spec - cfg.mel_mean) / math.sqrt(cfg.mel_var)


# Vocoder ------------------------------------------------------------------------------------------------------------


class _VocosBlock(nn.Module):
    def __init__(self, dim: int, intermediate_dim: int, layer_scale: float) -> None:
        super().__init__()
        self.dwconv = nn.Conv1d(dim, dim, kernel_size=7, padding=3, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pwconv1 = nn.Linear(dim, intermediate_dim)
        self.act = nn.GELU()
        self.pwconv2 = nn.Linear(intermediate_dim, dim)
        self.gamma = nn.Parameter(layer_scale * torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        residual = x
        x = self.dwconv(x).transpose(1, 2)
        x = self.gamma * self.pwconv2(self.act(self.pwconv1(self.norm(x))))
        return residual + x.transpose(1, 2)


class _VocosBackbone(nn.Module):
    def __init__(self, input_channels: int, dim: int, intermediate_dim: int, num_layers: int) -> None:
        super().__init__()
        self.embed = nn.Conv1d(input_channels, dim, kernel_size=7, padding=3)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.convnext = nn.ModuleList(_VocosBlock(dim, intermediate_dim, 1 / num_layers) for _ in range(num_layers))
        self.final_layer_norm = nn.LayerNorm(dim, eps=1e-6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(self.embed(x).transpose(1, 2)).transpose(1, 2)
        for block in self.convnext:
            x = block(x)
        return self.final_layer_norm(x.transpose(1, 2))


class _ISTFT(nn.Module):
    """Inverse STFT with "same" padding (overlap-add by ``fold``, divided by the window envelope)."""

    def __init__(self, n_fft: int, hop_length: int) -> None:
        super().__init__()
        self.n_fft = n_fft
        self.hop_length = hop_length
        self.register_buffer("window", torch.hann_window(n_fft))

    def forward(self, spec: torch.Tensor) -> torch.Tensor:
        pad = (self.n_fft - self.hop_length) // 2
        frames = spec.shape[-1]
        ifft = torch.fft.irfft(spec, self.n_fft, dim=1, norm="backward") * self.window[None, :, None]
        size = (frames - 1) * self.hop_length + self.n_fft
        fold = dict(output_size=(1, size), kernel_size=(1, self.n_fft), stride=(1, self.hop_length))
        y = F.fold(ifft, **fold)[:, 0, 0, pad:-pad]
        envelope = F.fold(self.window.square().expand(1, frames, -1).transpose(1, 2), **fold).squeeze()[pad:-pad]
        if not bool((envelope > 1e-11).all()):
            raise RuntimeError("the inverse STFT window envelope has zeros; n_fft and hop_size do not overlap-add")
        return y / envelope


class _ISTFTHead(nn.Module):
    def __init__(self, dim: int, n_fft: int, hop_length: int) -> None:
        super().__init__()
        self.out = nn.Linear(dim, n_fft + 2)
        self.istft = _ISTFT(n_fft, hop_length)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.out(x).transpose(1, 2)
        magnitude, phase = x.chunk(2, dim=1)
        magnitude = torch.clip(torch.exp(magnitude), max=1e2)
        return self.istft(magnitude * (torch.cos(phase) + 1j * torch.sin(phase)))


class _Vocos(nn.Module):
    def __init__(self, input_channels, dim, intermediate_dim, num_layers, n_fft, hop_size) -> None:
        super().__init__()
        self.backbone = _VocosBackbone(input_channels, dim, intermediate_dim, num_layers)
        self.head = _ISTFTHead(dim, n_fft, hop_size)


class SoulXSingerVocoder(ModelMixin, ConfigMixin):
    """Vocos vocoder: mel frames ``[B, input_channels, T]`` (normalised log-mel, channels first) to a waveform
    ``[B, 1, T * hop_size]`` (ConvNeXt backbone, then an ISTFT head predicting magnitude and phase)."""

    @register_to_config
    def __init__(
        self,
        input_channels: int = 128,
        dim: int = 1024,
        intermediate_dim: int = 4096,
        num_layers: int = 30,
        n_fft: int = 1920,
        hop_size: int = 480,
    ) -> None:
        super().__init__()
        self.model = _Vocos(input_channels, dim, intermediate_dim, num_layers, n_fft, hop_size)

    def forward(self, mel: torch.Tensor) -> torch.Tensor:
        return self.model.head(self.model.backbone(mel))[:, None, :]
