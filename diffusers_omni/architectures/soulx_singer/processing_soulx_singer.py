"""``SoulXSingerScoreProcessor``: SoulX-Singer's metadata (one segment of the reference preprocessing's JSON) to the
tensors ``SoulXSingerPipeline`` takes.

A segment lists per note its ``duration`` (seconds), ``phoneme`` (``zh_...``/``yue_...`` one phoneme, ``en_A-B-C`` an
English word's phonemes, ``<SP>``/``<AP>`` silence), MIDI ``note_pitch``, ``note_type`` and optionally the frame-level
``f0`` (Hz), all as space-separated strings. Consecutive silences of the same type and pitch merge into one. Each note
becomes ``<BOW>``, its phoneme(s) (English words end with ``<SEP>``) and ``<EOW>``, all with the note's pitch and type;
the sequence starts with ``<PAD>``. ``mel2note`` gives each mel frame its token: the note's first frame its ``<BOW>``,
the following frames cycle through its phonemes, its last frame its ``<EOW>``; frames before the first note point at
``<PAD>``.
"""

from __future__ import annotations

import json
import os
from typing import Any, Mapping, Sequence

import torch

__all__ = ["SoulXSingerScoreProcessor"]


class SoulXSingerScoreProcessor:
    """Metadata segments to pipeline tensors.

    Args:
        phone_set: the checkpoint's phone set: the list of phonemes (a phoneme's id is its index), or a mapping
            phoneme → id.
        sample_rate: audio sample rate (24000 for the published checkpoints).
        hop_size: samples per mel frame (480).
    """

    PHONE_SET_FILES = ("phoneme/phone_set.json", "phone_set.json")

    def __init__(self, phone_set: Sequence[str] | Mapping[str, int], sample_rate: int = 24000,
                 hop_size: int = 480) -> None:
        self.phone_to_id = dict(phone_set) if isinstance(phone_set, Mapping) else {p: i for i, p in enumerate(phone_set)}
        self.sample_rate = sample_rate
        self.hop_size = hop_size

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: str, **kwargs: Any) -> "SoulXSingerScoreProcessor":
        """The phone set of a checkpoint folder or hub repository (``phoneme/phone_set.json`` or ``phone_set.json``;
        the reference repository keeps it at ``soulxsinger/utils/phoneme/phone_set.json``: pass that list to the
        constructor where the checkpoint has none)."""
        root = str(pretrained_model_name_or_path)
        if os.path.isdir(root):
            for name in cls.PHONE_SET_FILES:
                path = os.path.join(root, name)
                if os.path.isfile(path):
                    break
            else:
                raise FileNotFoundError(f"{root} has no phone set; looked for {list(cls.PHONE_SET_FILES)}")
        else:
            from huggingface_hub import hf_hub_download
            from huggingface_hub.utils import EntryNotFoundError

            for name in cls.PHONE_SET_FILES:
                try:
                    path = hf_hub_download(root, name, **kwargs)
                    break
                except EntryNotFoundError:
                    continue
            else:
                raise FileNotFoundError(f"{root} has no phone set; looked for {list(cls.PHONE_SET_FILES)}")
        with open(path, encoding="utf-8") as f:
            return cls(json.load(f))

    @staticmethod
    def _notes(meta: Mapping[str, Any]) -> list[tuple[str, float, int, int]]:
        for key in ("duration", "phoneme", "note_pitch", "note_type"):
            if key not in meta:
                raise ValueError(f"metadata has no {key!r}; found {sorted(meta)}")
        durations = [float(x) for x in str(meta["duration"]).split()]
        phonemes = [x.replace("<AP>", "<SP>") for x in str(meta["phoneme"]).split()]
        pitches = [int(x) for x in str(meta["note_pitch"]).split()]
        types = [int(x) for x in str(meta["note_type"]).split()]
        lengths = {"duration": len(durations), "phoneme": len(phonemes), "note_pitch": len(pitches),
                   "note_type": len(types)}
        if len(set(lengths.values())) != 1:
            raise ValueError(f"metadata fields list different numbers of notes: {lengths}")
        notes: list[list] = []
        for phoneme, duration, pitch, kind in zip(phonemes, durations, pitches, types):
            kind = 1 if phoneme == "<SP>" else kind
            if notes and phoneme == "<SP>" and notes[-1][0] == "<SP>" and notes[-1][2:] == [pitch, kind]:
                notes[-1][1] += duration
            else:
                notes.append([phoneme, duration, pitch, kind])
        return [tuple(n) for n in notes]

    def _ids(self, tokens: list[str]) -> torch.Tensor:
        unknown = sorted({t for t in tokens if t not in self.phone_to_id})
        if unknown:
            raise ValueError(f"phonemes not in the phone set: {unknown[:10]}")
        return torch.tensor([self.phone_to_id[t] for t in tokens])

    def __call__(self, meta: Mapping[str, Any]) -> dict[str, torch.Tensor | None]:
        """``phonemes``, ``note_pitch``, ``note_type`` (``[tokens]``), ``mel2note`` and ``f0`` (``[frames]``; ``f0``
        ``None`` when the segment has none; with one, both are cut to the shorter of the two)."""
        notes = self._notes(meta)
        frames_per_second = self.sample_rate / self.hop_size
        total = int(sum(n[1] for n in notes) * frames_per_second)
        mel2note = torch.zeros(total, dtype=torch.long)
        tokens, origin, spans = [], [], []  # spans: (first frame, phonemes) per note
        elapsed = 0.0
        for index, (phoneme, duration, _, _) in enumerate(notes):
            start = min(int(round(elapsed * frames_per_second)), total - 1)
            inner = ([f"en_{p}" for p in phoneme[3:].split("-")] + ["<SEP>"]) if phoneme.startswith("en_") else [phoneme]
            tokens += ["<BOW>", *inner, "<EOW>"]
            origin += [index] * (len(inner) + 2)
            spans.append((start, max(1, len(inner))))
            elapsed += duration
        token = 1
        for index, (first, count) in enumerate(spans):
            end = spans[index + 1][0] if index + 1 < len(spans) else total
            if first >= total or first + count > total:
                break
            while first < total and mel2note[first] > 0:  # a note starting on a frame the previous one took
                first += 1
            if first >= total:
                raise ValueError(f"note {index} has no frame left (the segment's {total} frames are taken)")
            mel2note[first] = token
            frame = first + 1
            while frame + count < end:
                mel2note[frame:frame + count] = torch.arange(token, token + count) + 1
                frame += count
            mel2note[end - 1] = token + count + 1
            token += count + 2
        result: dict[str, torch.Tensor | None] = {
            "phonemes": self._ids(["<PAD>", *tokens]),
            "note_pitch": torch.tensor([0] + [notes[i][2] for i in origin]),
            "note_type": torch.tensor([1] + [notes[i][3] for i in origin]),
            "mel2note": mel2note,
            "f0": None,
        }
        f0 = [float(x) for x in str(meta.get("f0", "")).split()]
        if f0:
            frames = min(total, len(f0))
            result["f0"] = torch.tensor(f0[:frames], dtype=torch.float32)
            result["mel2note"] = mel2note[:frames]
        return result

    def pipeline_inputs(self, prompt_meta: Mapping[str, Any], target_meta: Mapping[str, Any],
                        prompt_audio: torch.Tensor, control: str = "melody") -> dict[str, Any]:
        """Keyword arguments for ``SoulXSingerPipeline.__call__``: the prompt's and the target's tensors, and the
        prompt audio (``[samples]`` at ``sample_rate``) cut to the prompt's frames."""
        prompt, target = self(prompt_meta), self(target_meta)
        audio = torch.as_tensor(prompt_audio).reshape(-1)
        frames = prompt["mel2note"].shape[0]
        if audio.shape[0] < frames * self.hop_size:
            raise ValueError(f"prompt_audio has {audio.shape[0]} samples; the prompt's metadata covers {frames} "
                             f"frames of {self.hop_size}")
        inputs: dict[str, Any] = {
            "prompt_audio": audio[: frames * self.hop_size],
            "prompt_phonemes": prompt["phonemes"], "prompt_note_type": prompt["note_type"],
            "prompt_mel2note": prompt["mel2note"],
            "phonemes": target["phonemes"], "note_type": target["note_type"], "mel2note": target["mel2note"],
            "control": control,
        }
        if control == "melody":
            for name, item in (("prompt", prompt), ("target", target)):
                if item["f0"] is None:
                    raise ValueError(f"control='melody' needs the {name} metadata's 'f0'")
            inputs.update(prompt_f0=prompt["f0"], f0=target["f0"])
        else:
            inputs.update(prompt_note_pitch=prompt["note_pitch"], note_pitch=target["note_pitch"])
        return inputs
