"""SoulX-Singer pipelines: zero-shot singing voice synthesis (``SoulXSingerPipeline``) and singing voice conversion
(``SoulXSingerSVCPipeline``).

Both run the same conditional flow matching: the prompt's mel frames are given, the target's frames start as
Gaussian noise and follow the estimator's flow over ``num_inference_steps`` Euler steps at ``t = (i + 0.5) / n``.
Classifier-free guidance runs the estimator a second time on the target frames alone with zero conditions, and the
guided flow is rescaled towards the conditional flow's standard deviation (``guidance_rescale``). The vocoder turns
the generated mel frames into a 24 kHz waveform.

``from_pretrained`` reads a Diffusers layout (``model_index.json``) or the published one: a folder (or hub repo)
with ``config.yaml`` and the single-file checkpoint ``model.pt`` (SVS) or ``model-svc.pt`` (SVC), whose state dict
is split among the components by prefix.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch
import torch.nn.functional as F
from diffusers import DiffusionPipeline
from diffusers.utils import BaseOutput
from diffusers.utils.torch_utils import randn_tensor

from .modeling_diffllama import DiffLlamaRotaryEmbedding
from .modeling_soulx_singer import (
    SoulXSingerCFMDecoder,
    SoulXSingerConditionEncoder,
    SoulXSingerMelSpectrogram,
    SoulXSingerVocoder,
    f0_to_coarse,
)

logger = logging.getLogger(__name__)

__all__ = ["SoulXSingerPipeline", "SoulXSingerPipelineOutput", "SoulXSingerSVCPipeline", "resample"]

OUTPUT_TYPES = ("np", "pt", "mel")
CONTROLS = ("melody", "score")


@dataclass
class SoulXSingerPipelineOutput(BaseOutput):
    """``audios``: the generated waveform, ``[1, samples]`` (numpy float32 for ``output_type="np"``, a tensor for
    ``"pt"``), or the generated normalised mel frames ``[1, frames, num_mels]`` for ``"mel"``. ``sample_rate``: Hz.
    ``pitch_shift``: the semitone shift applied to the target (chosen when ``auto_shift=True``)."""

    audios: Any
    sample_rate: int
    pitch_shift: int = 0


def _as_batch(name: str, value: Any, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    tensor = torch.as_tensor(value)
    if tensor.ndim == 1:
        tensor = tensor.unsqueeze(0)
    if tensor.ndim != 2 or tensor.shape[0] != 1:
        raise ValueError(f"{name} has shape {tuple(tensor.shape)}; expected [length] or [1, length] (one item a call)")
    return tensor.to(device=device, dtype=dtype)


class _FlowMatchingSampler:
    """The sampling loop shared by both pipelines (a mixin of methods over ``self.cfm_decoder``)."""

    _optional_components: list[str] = []

    @staticmethod
    def _check_common(num_inference_steps: int, guidance_scale: float, guidance_rescale: float,
                      output_type: str) -> None:
        if not isinstance(num_inference_steps, int) or num_inference_steps < 1:
            raise ValueError(f"num_inference_steps={num_inference_steps!r}; expected an integer >= 1")
        if guidance_scale < 0:
            raise ValueError(f"guidance_scale={guidance_scale}; expected >= 0 (0 disables guidance)")
        if not 0 <= guidance_rescale <= 1:
            raise ValueError(f"guidance_rescale={guidance_rescale}; expected a value in [0, 1]")
        if output_type not in OUTPUT_TYPES:
            raise ValueError(f"output_type={output_type!r}; allowed: {list(OUTPUT_TYPES)}")

    @property
    def sample_rate(self) -> int:
        return int(self.mel.config.sample_rate)

    def _sample_mel(
        self,
        prompt_mel: torch.Tensor,
        cond: torch.Tensor,
        num_inference_steps: int,
        guidance_scale: float,
        guidance_rescale: float,
        generator: torch.Generator | list[torch.Generator] | None,
        callback_on_step_end: Callable | None,
    ) -> torch.Tensor:
        decoder = self.cfm_decoder
        estimator = decoder.model.diff_estimator
        cond = decoder.embed_condition(cond)
        prompt_len = prompt_mel.shape[1]
        target_len = cond.shape[1] - prompt_len
        if target_len <= 0:
            raise ValueError(
                f"the conditions cover {cond.shape[1]} frames but the prompt audio alone has {prompt_len}: the target "
                "needs at least one frame"
            )
        mel_dim = decoder.config.mel_dim
        xt = randn_tensor((cond.shape[0], target_len, mel_dim), generator=generator, device=cond.device,
                          dtype=cond.dtype)
        h = 1.0 / num_inference_steps
        uncond = torch.zeros_like(cond)[:, :target_len, :] if guidance_scale > 0 else None
        self._num_timesteps = num_inference_steps
        with self.progress_bar(total=num_inference_steps) as progress:
            for i in range(num_inference_steps):
                t = (0 + (i + 0.5) * h) * torch.ones(xt.shape[0], dtype=xt.dtype, device=xt.device)
                flow = estimator(torch.cat([prompt_mel, xt], dim=1), t, cond)[:, prompt_len:, :]
                if guidance_scale > 0:
                    flow_uncond = estimator(xt, t, uncond)
                    std = flow.std()
                    guided = flow + guidance_scale * (flow - flow_uncond)
                    rescaled = guided * std / guided.std()
                    flow = guidance_rescale * rescaled + (1 - guidance_rescale) * guided
                xt = xt + flow * h
                if callback_on_step_end is not None:  # Diffusers' convention: it may return new latents
                    returned = callback_on_step_end(self, i, t, {"latents": xt}) or {}
                    xt = returned.get("latents", xt)
                progress.update()
        return xt

    def _finish(self, mel: torch.Tensor, output_type: str, return_dict: bool, pitch_shift: int,
                length: int | None = None):
        if output_type == "mel":
            audio = mel
        else:
            audio = self.vocoder(mel.transpose(1, 2).to(self.vocoder.dtype))[:, 0, :].float()
            if length is not None:
                audio = audio[:, :length] if audio.shape[-1] >= length else F.pad(audio, (0, length - audio.shape[-1]))
            if output_type == "np":
                audio = audio.cpu().numpy()
        self.maybe_free_model_hooks()
        if not return_dict:
            return (audio,)
        return SoulXSingerPipelineOutput(audios=audio, sample_rate=self.sample_rate, pitch_shift=pitch_shift)


def resample(waveform: torch.Tensor, orig_freq: int, new_freq: int, lowpass_filter_width: int = 6,
             rolloff: float = 0.99) -> torch.Tensor:
    """Band-limited resampling of ``waveform`` (``[..., samples]``) by windowed-sinc interpolation with a Hann
    window: the algorithm of ``torchaudio.functional.resample``'s default method, which the reference uses to feed
    Whisper (equal to it on the values tested)."""
    if orig_freq <= 0 or new_freq <= 0 or int(orig_freq) != orig_freq or int(new_freq) != new_freq:
        raise ValueError(f"orig_freq={orig_freq}, new_freq={new_freq}: expected positive integers")
    if orig_freq == new_freq:
        return waveform
    step = math.gcd(int(orig_freq), int(new_freq))
    down, up = int(orig_freq) // step, int(new_freq) // step
    cutoff = min(down, up) * rolloff
    width = math.ceil(lowpass_filter_width * down / cutoff)
    # The filter is computed in the waveform's dtype, as torchaudio does.
    factory = dict(dtype=waveform.dtype, device=waveform.device)
    taps = torch.arange(-width, width + down, **factory)[None, None] / down
    phases = torch.arange(0, -up, -1, **factory)[:, None, None] / up
    t = ((phases + taps) * cutoff).clamp(-lowpass_filter_width, lowpass_filter_width)
    window = torch.cos(t * math.pi / lowpass_filter_width / 2) ** 2
    t = t * math.pi
    kernel = torch.where(t == 0, torch.tensor(1.0).to(t), t.sin() / t) * (window * (cutoff / down))
    shape = waveform.shape
    flat = F.pad(waveform.reshape(-1, shape[-1]), (width, width + down))
    out = F.conv1d(flat[:, None], kernel, stride=down).transpose(1, 2).reshape(flat.shape[0], -1)
    length = int(torch.ceil(torch.as_tensor(up * shape[-1] / down)))
    return out[..., :length].reshape(*shape[:-1], -1)


def _published_files(pretrained: str, checkpoint: str, **kwargs) -> tuple[str, str] | None:
    """``(config.yaml, checkpoint)`` paths of the published layout, or ``None`` for a Diffusers layout."""
    if os.path.isdir(pretrained):
        if os.path.isfile(os.path.join(pretrained, "model_index.json")):
            return None
        config, ckpt = os.path.join(pretrained, "config.yaml"), os.path.join(pretrained, checkpoint)
        missing = [p for p in (config, ckpt) if not os.path.isfile(p)]
        if missing:
            raise FileNotFoundError(
                f"{pretrained} has neither model_index.json (Diffusers layout) nor the published SoulX-Singer files: "
                f"missing {missing}"
            )
        return config, ckpt
    from huggingface_hub import hf_hub_download
    from huggingface_hub.utils import EntryNotFoundError

    hub = {k: kwargs[k] for k in ("revision", "cache_dir", "token", "local_files_only") if k in kwargs}
    try:
        hf_hub_download(pretrained, "model_index.json", **hub)
        return None
    except EntryNotFoundError:
        pass
    return hf_hub_download(pretrained, "config.yaml", **hub), hf_hub_download(pretrained, checkpoint, **hub)


def _read_published(config_path: str, checkpoint_path: str) -> tuple[dict, dict[str, torch.Tensor]]:
    import yaml

    with open(config_path, encoding="utf-8") as f:
        config = yaml.safe_load(f)
    for key in ("audio", "model"):
        if key not in config:
            raise ValueError(f"{config_path} has no {key!r} section; found {sorted(config)}")
    checkpoint = torch.load(checkpoint_path, map_location="cpu", weights_only=True)
    if not isinstance(checkpoint, dict) or "state_dict" not in checkpoint:
        found = sorted(checkpoint) if isinstance(checkpoint, dict) else type(checkpoint).__name__
        raise ValueError(f"{checkpoint_path} has no 'state_dict' entry; found {found}")
    return config, checkpoint["state_dict"]


def _split_state_dict(state_dict: dict[str, torch.Tensor], prefixes: dict[str, tuple[str, ...]],
                      ) -> dict[str, dict[str, torch.Tensor]]:
    """Checkpoint keys by component: ``prefixes`` maps a component to the checkpoint prefixes it holds, the prefix
    kept (``cfm_decoder.model.x`` → ``model.x`` of ``cfm_decoder``; ``f0_encoder.weight`` stays as it is in the
    condition encoder, which owns the top-level note/F0 modules)."""
    parts: dict[str, dict[str, torch.Tensor]] = {name: {} for name in prefixes}
    unknown = []
    for key, value in state_dict.items():
        top = key.split(".", 1)[0]
        for component, tops in prefixes.items():
            if top in tops:
                parts[component][key if top != component else key.split(".", 1)[1]] = value
                break
        else:
            unknown.append(key)
    if unknown:
        raise ValueError(f"the checkpoint has keys no component holds: {unknown[:5]} ({len(unknown)} in all)")
    return parts


def _load_component(module: torch.nn.Module, state: dict[str, torch.Tensor], name: str) -> None:
    """Load a component built on the meta device: the checkpoint's tensors become its parameters and persistent
    buffers (no random initialisation of weights that are overwritten anyway); the rotary frequencies, the one
    buffer the checkpoint does not hold, are computed."""
    missing, unexpected = module.load_state_dict(state, strict=False, assign=True)
    if missing or unexpected:
        raise ValueError(f"checkpoint does not fit component {name}: missing {missing[:5]}, unexpected "
                         f"{unexpected[:5]}")
    for sub in module.modules():
        if isinstance(sub, DiffLlamaRotaryEmbedding):
            sub.inv_freq = DiffLlamaRotaryEmbedding(sub.inv_freq.shape[0] * 2, sub.theta).inv_freq
    left = [n for n, t in (*module.named_parameters(), *module.named_buffers()) if t.is_meta]
    if left:
        raise ValueError(f"checkpoint does not fit component {name}: no values for {left[:5]}")


def _components_from_published(config: dict, state_dict: dict, use_score: bool, dtype: torch.dtype | None):
    audio, enc, fm = config["audio"], config["model"]["encoder"], config["model"]["flow_matching"]
    encoder_kwargs = {k: enc[k] for k in ("f0_bin", "f0_dim")}
    if use_score:
        encoder_kwargs.update({k: enc[k] for k in ("vocab_size", "text_dim", "pitch_dim", "type_dim", "num_layers")})
    for key in ("use_embedding", "cond_scale_factor"):
        if key in fm and fm[key] not in (False, 1):
            raise ValueError(f"model.flow_matching.{key}={fm[key]!r} is not supported (the published config has "
                             f"{'False' if key == 'use_embedding' else 1})")
    with torch.device("meta"):
        components = _build_published(audio, fm, config, use_score, encoder_kwargs)
    encoder_tops = ("note_text_encoder", "note_pitch_encoder", "note_type_encoder", "f0_encoder", "preflow")
    prefixes = {"condition_encoder": encoder_tops, "cfm_decoder": ("cfm_decoder",), "mel": ("mel",),
                "vocoder": ("vocoder",)}
    for name, state in _split_state_dict(state_dict, prefixes).items():
        _load_component(components[name], state, name)
    for name, module in components.items():
        module.eval()
        if dtype is not None and name in ("condition_encoder", "cfm_decoder"):
            module.to(dtype)  # the mel front end and the vocoder stay in float32, as the reference keeps them
    return components


def _build_published(audio, fm, config, use_score, encoder_kwargs):
    return {
        "condition_encoder": SoulXSingerConditionEncoder(use_score=use_score, **encoder_kwargs),
        "cfm_decoder": SoulXSingerCFMDecoder(
            mel_dim=fm["mel_dim"], hidden_size=fm["hidden_size"], num_layers=fm["num_layers"],
            num_heads=fm["num_heads"], cond_codebook_size=fm["cond_codebook_size"],
        ),
        "mel": SoulXSingerMelSpectrogram(
            sample_rate=audio["sample_rate"], n_fft=audio["n_fft"], num_mels=audio["num_mels"],
            hop_size=audio["hop_size"], win_size=audio["win_size"], fmin=audio["fmin"], fmax=audio["fmax"],
            mel_mean=audio["mel_mean"], mel_var=audio["mel_var"],
        ),
        # The published config has no vocoder section: its sizes are the reference's built-in Vocos defaults (this
        # class's); a ``model.vocoder`` section, where present, sets them.
        "vocoder": SoulXSingerVocoder(**{
            "input_channels": audio["num_mels"], "n_fft": audio["n_fft"], "hop_size": audio["hop_size"],
            **config["model"].get("vocoder", {}),
        }),
    }


class SoulXSingerPipeline(_FlowMatchingSampler, DiffusionPipeline):
    """Zero-shot singing voice synthesis: sing a target score (phonemes, notes, and optionally an F0 contour) in the
    voice of a prompt recording whose score is given too.

    Components:
        condition_encoder (:class:`SoulXSingerConditionEncoder`, ``use_score=True``): note and F0 embeddings.
        cfm_decoder (:class:`SoulXSingerCFMDecoder`): the flow-matching decoder; its estimator
            ``cfm_decoder.model.diff_estimator`` (:class:`DiffLlama`) is the pipeline's DiT.
        mel (:class:`SoulXSingerMelSpectrogram`): the prompt audio's mel frames.
        vocoder (:class:`SoulXSingerVocoder`): mel frames to audio.

    Inputs are the reference preprocessor's tensors: phoneme ids (indices into the checkpoint's phone set), MIDI
    note pitches (0 = rest), note types, ``mel2note`` (the note index of every mel frame, 0 = padding note) and F0
    in Hz per frame (0 = unvoiced), for the prompt and for the target.
    """

    model_cpu_offload_seq = "condition_encoder->mel->cfm_decoder->vocoder"
    _checkpoint_file = "model.pt"
    _use_score = True

    def __init__(self, condition_encoder: SoulXSingerConditionEncoder, cfm_decoder: SoulXSingerCFMDecoder,
                 mel: SoulXSingerMelSpectrogram, vocoder: SoulXSingerVocoder) -> None:
        super().__init__()
        self.register_modules(condition_encoder=condition_encoder, cfm_decoder=cfm_decoder, mel=mel, vocoder=vocoder)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, **kwargs):
        """A Diffusers folder/repo (``model_index.json``), or the published layout (``config.yaml`` and
        ``model.pt``/``model-svc.pt``, e.g. ``Soul-AILab/SoulX-Singer``). ``torch_dtype`` applies to the condition
        encoder and the decoder; the mel front end and the vocoder stay float32."""
        files = _published_files(str(pretrained_model_name_or_path), cls._checkpoint_file, **kwargs)
        if files is None:
            return super().from_pretrained(pretrained_model_name_or_path, **kwargs)
        extra = set(kwargs) - {"torch_dtype", "revision", "cache_dir", "token", "local_files_only"}
        if extra:
            raise TypeError(f"{cls.__name__}.from_pretrained of the published layout takes no {sorted(extra)}")
        config, state_dict = _read_published(*files)
        return cls(**_components_from_published(config, state_dict, cls._use_score, kwargs.get("torch_dtype")))

    @staticmethod
    def _auto_pitch_shift(target: torch.Tensor, prompt: torch.Tensor, *, from_f0: bool) -> int:
        if from_f0:
            target, prompt = target[target > 0], prompt[prompt > 0]
            if not len(target) or not len(prompt):
                return 0
            return int(torch.round(torch.log2(torch.median(prompt) / torch.median(target)) * 1200 / 100).int())
        target, prompt = target[target >= 1], prompt[prompt >= 1]
        if not len(target) or not len(prompt):
            return 0
        return int(torch.round(torch.median(prompt) - torch.median(target)).int())

    @torch.no_grad()
    def __call__(
        self,
        prompt_audio: torch.Tensor | np.ndarray,
        prompt_phonemes: torch.Tensor,
        prompt_note_type: torch.Tensor,
        prompt_mel2note: torch.Tensor,
        phonemes: torch.Tensor,
        note_type: torch.Tensor,
        mel2note: torch.Tensor,
        prompt_f0: torch.Tensor | None = None,
        f0: torch.Tensor | None = None,
        prompt_note_pitch: torch.Tensor | None = None,
        note_pitch: torch.Tensor | None = None,
        control: str = "melody",
        pitch_shift: int = 0,
        auto_shift: bool = False,
        num_inference_steps: int = 32,
        guidance_scale: float = 3.0,
        guidance_rescale: float = 0.75,
        generator: torch.Generator | list[torch.Generator] | None = None,
        output_type: str = "np",
        return_dict: bool = True,
        callback_on_step_end: Callable | None = None,
    ) -> SoulXSingerPipelineOutput | tuple:
        """Sing the target score in the prompt's voice.

        Args:
            prompt_audio: the prompt recording at ``mel.config.sample_rate`` (24 kHz), ``[samples]`` or
                ``[1, samples]``; its mel frames (``samples // hop_size``) must match ``prompt_mel2note``'s length.
            prompt_phonemes, prompt_note_type, prompt_mel2note: the prompt's notes and frame alignment.
            phonemes, note_type, mel2note: the target's.
            prompt_f0, f0: per-frame F0 in Hz (0 = unvoiced), required for ``control="melody"``.
            prompt_note_pitch, note_pitch: MIDI note pitch of each note (0 = rest), required for ``"score"``.
            control: ``"melody"`` (follow the F0 contour) or ``"score"`` (follow the note pitches).
            pitch_shift: semitones added to the target's pitch; ``auto_shift`` (with ``pitch_shift=0``) picks the
                shift that moves the target's median pitch to the prompt's.
            num_inference_steps: Euler steps of the flow (32 in the reference config).
            guidance_scale: classifier-free guidance scale (3 in the reference config; 0 disables it).
            guidance_rescale: share of the guided flow rescaled to the conditional flow's std (0.75).
            generator: the noise of the target frames.
            output_type: ``"np"``, ``"pt"`` (waveform) or ``"mel"`` (skip the vocoder).
        """
        self._check_common(num_inference_steps, guidance_scale, guidance_rescale, output_type)
        if control not in CONTROLS:
            raise ValueError(f"control={control!r}; allowed: {list(CONTROLS)}")
        device = self._execution_device
        long = torch.long
        prompt_phonemes = _as_batch("prompt_phonemes", prompt_phonemes, long, device)
        prompt_note_type = _as_batch("prompt_note_type", prompt_note_type, long, device)
        prompt_mel2note = _as_batch("prompt_mel2note", prompt_mel2note, long, device)
        phonemes = _as_batch("phonemes", phonemes, long, device)
        note_type = _as_batch("note_type", note_type, long, device)
        mel2note = _as_batch("mel2note", mel2note, long, device)
        for name, notes, types in (("prompt", prompt_phonemes, prompt_note_type), ("target", phonemes, note_type)):
            if notes.shape != types.shape:
                raise ValueError(f"{name} phonemes {tuple(notes.shape)} and note types {tuple(types.shape)} differ")

        if control == "melody":
            if prompt_f0 is None or f0 is None:
                raise ValueError("control='melody' needs prompt_f0 and f0 (per-frame F0 in Hz)")
            prompt_f0 = _as_batch("prompt_f0", prompt_f0, torch.float32, device)
            f0 = _as_batch("f0", f0, torch.float32, device)
            prompt_note_pitch = torch.zeros_like(prompt_note_type, dtype=torch.int32)
            note_pitch = torch.zeros_like(note_type, dtype=torch.int32)
        else:
            if prompt_note_pitch is None or note_pitch is None:
                raise ValueError("control='score' needs prompt_note_pitch and note_pitch (MIDI pitch per note)")
            prompt_note_pitch = _as_batch("prompt_note_pitch", prompt_note_pitch, long, device)
            note_pitch = _as_batch("note_pitch", note_pitch, long, device)
            prompt_f0 = torch.zeros_like(prompt_mel2note, dtype=torch.float32)
            f0 = torch.zeros_like(mel2note, dtype=torch.float32)
        for name, frames, ref in (("prompt_f0", prompt_f0, prompt_mel2note), ("f0", f0, mel2note)):
            if frames.shape != ref.shape:
                raise ValueError(f"{name} has {frames.shape[1]} frames but its mel2note has {ref.shape[1]}")

        if auto_shift and pitch_shift == 0:
            if control == "score":
                pitch_shift = self._auto_pitch_shift(note_pitch, prompt_note_pitch, from_f0=False)
            else:
                pitch_shift = self._auto_pitch_shift(f0, prompt_f0, from_f0=True)

        audio = _as_batch("prompt_audio", prompt_audio, torch.float32, device)
        prompt_mel = self.mel(audio.to(self.mel.dtype))

        n_prompt_notes = prompt_note_pitch.shape[1]
        n_prompt_frames = prompt_f0.shape[1]
        all_pitch = torch.cat([prompt_note_pitch, note_pitch], 1)
        all_phonemes = torch.cat([prompt_phonemes, phonemes], 1)
        all_types = torch.cat([prompt_note_type, note_type], 1)
        all_mel2note = torch.cat([prompt_mel2note, mel2note + n_prompt_notes], 1)
        coarse = torch.cat([f0_to_coarse(prompt_f0), f0_to_coarse(f0, shift_bins=pitch_shift * 5)], 1)
        voiced = all_pitch > 0
        all_pitch[voiced] = all_pitch[voiced] + pitch_shift
        all_pitch = torch.clamp(all_pitch, 0, 255)
        top = int(all_mel2note.max())
        if top > all_phonemes.shape[1] - 1:
            raise ValueError(f"mel2note points at note {top} but there are {all_phonemes.shape[1]} notes "
                             "(prompt and target together)")

        cond = self.condition_encoder(all_phonemes, all_pitch.long(), all_types, all_mel2note, coarse)
        cond = cond.to(self.cfm_decoder.dtype)
        if prompt_mel.shape[1] != n_prompt_frames:
            raise ValueError(
                f"prompt_audio gives {prompt_mel.shape[1]} mel frames (hop {self.mel.config.hop_size}) but "
                f"prompt_mel2note has {n_prompt_frames}; they must match"
            )
        mel = self._sample_mel(prompt_mel.to(cond.dtype), cond, num_inference_steps, guidance_scale,
                               guidance_rescale, generator, callback_on_step_end)
        return self._finish(mel, output_type, return_dict, pitch_shift)


class SoulXSingerSVCPipeline(_FlowMatchingSampler, DiffusionPipeline):
    """Singing voice conversion: re-sing a target recording in the voice of a prompt recording.

    The content of both recordings is read by a Whisper encoder (``openai/whisper-base`` in the reference, run on
    16 kHz audio; not part of the checkpoint), the pitch from their F0 contours. Components as
    :class:`SoulXSingerPipeline`, with ``condition_encoder`` holding only ``f0_encoder`` (``use_score=False``),
    plus ``whisper_encoder`` (a Transformers ``WhisperEncoder``) and ``feature_extractor``
    (``WhisperFeatureExtractor``).

    The Whisper encoder reads the recordings resampled to the feature extractor's rate (16 kHz) by
    :func:`resample`; ``prompt_content`` / ``content`` give those waveforms instead.
    """

    model_cpu_offload_seq = "whisper_encoder->condition_encoder->mel->cfm_decoder->vocoder"
    _checkpoint_file = "model-svc.pt"
    _use_score = False
    WHISPER_FRAMES = 3000  # 30 s of 10 ms log-mel frames: Whisper's fixed input

    def __init__(self, condition_encoder: SoulXSingerConditionEncoder, cfm_decoder: SoulXSingerCFMDecoder,
                 mel: SoulXSingerMelSpectrogram, vocoder: SoulXSingerVocoder, whisper_encoder: Any,
                 feature_extractor: Any) -> None:
        super().__init__()
        self.register_modules(condition_encoder=condition_encoder, cfm_decoder=cfm_decoder, mel=mel, vocoder=vocoder,
                              whisper_encoder=whisper_encoder, feature_extractor=feature_extractor)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, whisper_encoder=None, feature_extractor=None, **kwargs):
        """As :meth:`SoulXSingerPipeline.from_pretrained`; the published layout also needs ``whisper_encoder`` and
        ``feature_extractor`` (``openai/whisper-base``'s, loaded with Transformers), which it does not hold."""
        files = _published_files(str(pretrained_model_name_or_path), cls._checkpoint_file, **kwargs)
        if files is None:
            extra = {k: v for k, v in (("whisper_encoder", whisper_encoder), ("feature_extractor", feature_extractor))
                     if v is not None}
            return super().from_pretrained(pretrained_model_name_or_path, **extra, **kwargs)
        if whisper_encoder is None or feature_extractor is None:
            raise ValueError(
                "the published SoulX-Singer SVC checkpoint has no Whisper weights: pass whisper_encoder="
                "WhisperModel.from_pretrained('openai/whisper-base').encoder and feature_extractor="
                "WhisperFeatureExtractor.from_pretrained('openai/whisper-base')"
            )
        extra = set(kwargs) - {"torch_dtype", "revision", "cache_dir", "token", "local_files_only"}
        if extra:
            raise TypeError(f"{cls.__name__}.from_pretrained of the published layout takes no {sorted(extra)}")
        config, state_dict = _read_published(*files)
        components = _components_from_published(config, state_dict, cls._use_score, kwargs.get("torch_dtype"))
        return cls(**components, whisper_encoder=whisper_encoder, feature_extractor=feature_extractor)

    def encode_content(self, waveform_16k: torch.Tensor, frames: int) -> torch.Tensor:
        """Whisper encoder states of a 16 kHz waveform ``[samples]``, ``frames`` of them (50 a second, zero-padded
        or cut), as ``[1, frames, d_model]``."""
        fe = self.feature_extractor
        inputs = fe(waveform_16k.detach().cpu().float().numpy(), sampling_rate=fe.sampling_rate, return_tensors="pt",
                    padding=False, truncation=False, return_attention_mask=True)
        features = inputs.input_features
        if features.shape[-1] < self.WHISPER_FRAMES:
            features = F.pad(features, (0, self.WHISPER_FRAMES - features.shape[-1]))
        else:
            features = features[..., : self.WHISPER_FRAMES]
        encoder = self.whisper_encoder
        states = encoder(features.to(device=self._execution_device, dtype=encoder.dtype)).last_hidden_state
        valid = min(int((inputs.attention_mask.sum(dim=1)[0] + 1) // 2), states.shape[1])
        states = states[:, :valid]
        states = F.pad(states, (0, 0, 0, max(0, frames - states.shape[1])))[:, :frames]
        return states

    @torch.no_grad()
    def __call__(
        self,
        prompt_audio: torch.Tensor | np.ndarray,
        audio: torch.Tensor | np.ndarray,
        prompt_f0: torch.Tensor,
        f0: torch.Tensor,
        prompt_content: torch.Tensor | np.ndarray | None = None,
        content: torch.Tensor | np.ndarray | None = None,
        pitch_shift: int = 0,
        auto_shift: bool = False,
        num_inference_steps: int = 32,
        guidance_scale: float = 3.0,
        guidance_rescale: float = 0.75,
        generator: torch.Generator | list[torch.Generator] | None = None,
        output_type: str = "np",
        return_dict: bool = True,
        callback_on_step_end: Callable | None = None,
    ) -> SoulXSingerPipelineOutput | tuple:
        """Convert ``audio`` (the target recording, 24 kHz) to the voice of ``prompt_audio`` (24 kHz).

        Args:
            prompt_f0, f0: per-frame F0 in Hz (0 = unvoiced) of the prompt and of the target, at the mel frame rate.
            prompt_content, content: the same two recordings at the Whisper feature extractor's rate (16 kHz);
                by default the pipeline resamples ``prompt_audio`` and ``audio``.
            Other arguments as :meth:`SoulXSingerPipeline.__call__`. The output has the target's length.
        """
        self._check_common(num_inference_steps, guidance_scale, guidance_rescale, output_type)
        device = self._execution_device
        prompt_audio = _as_batch("prompt_audio", prompt_audio, torch.float32, device)
        audio = _as_batch("audio", audio, torch.float32, device)
        prompt_f0 = _as_batch("prompt_f0", prompt_f0, torch.float32, device)
        f0 = _as_batch("f0", f0, torch.float32, device)
        content_rate = int(self.feature_extractor.sampling_rate)
        if prompt_content is None:
            prompt_content = resample(prompt_audio, self.sample_rate, content_rate)
        if content is None:
            content = resample(audio, self.sample_rate, content_rate)
        prompt_content = _as_batch("prompt_content", prompt_content, torch.float32, device)[0]
        content = _as_batch("content", content, torch.float32, device)[0]
        limit = self.WHISPER_FRAMES * self.feature_extractor.hop_length  # 30 s: Whisper's window
        for name, wav in (("prompt", prompt_content), ("target", content)):
            if wav.shape[-1] > limit:
                raise ValueError(
                    f"the {name} recording is {wav.shape[-1] / content_rate:.1f} s; SoulXSingerSVCPipeline takes at "
                    f"most {limit / content_rate:.0f} s a call (Whisper's window): split it (the reference splits "
                    "long recordings at silences) and convert the parts"
                )
        if auto_shift and pitch_shift == 0:
            pitch_shift = SoulXSingerPipeline._auto_pitch_shift(f0, prompt_f0, from_f0=True)

        prompt_mel = self.mel(prompt_audio.to(self.mel.dtype))
        n_prompt = prompt_mel.shape[1]
        prompt_f0 = F.pad(prompt_f0, (0, max(0, n_prompt - prompt_f0.shape[1])))[:, :n_prompt]
        coarse_prompt = f0_to_coarse(prompt_f0)
        coarse_target = f0_to_coarse(f0, shift_bins=pitch_shift * 5)
        content_feat = torch.cat([self.encode_content(prompt_content, coarse_prompt.shape[1]),
                                  self.encode_content(content, coarse_target.shape[1])], 1)
        coarse = torch.cat([coarse_prompt, coarse_target], 1)
        cond = content_feat.to(self.condition_encoder.dtype) + self.condition_encoder.encode_f0(coarse)
        cond = cond.to(self.cfm_decoder.dtype)
        mel = self._sample_mel(prompt_mel.to(cond.dtype), cond, num_inference_steps, guidance_scale,
                               guidance_rescale, generator, callback_on_step_end)
        return self._finish(mel, output_type, return_dict, pitch_shift, length=audio.shape[-1])
