"""``SoulXSingerScoreProcessor`` against the reference's ``DataProcessor`` on its example metadata (Mandarin prompt,
English target whose words split into phonemes): data/soulx_singer/golden_score_processor.pt, made by
golden_gen_score_processor.py there."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from diffusers_omni.architectures.soulx_singer import SoulXSingerScoreProcessor

GOLDEN = Path(__file__).parent / "data" / "soulx_singer" / "golden_score_processor.pt"


@pytest.fixture(scope="module")
def golden() -> dict:
    return torch.load(GOLDEN, weights_only=True)


@pytest.fixture(scope="module")
def processor(golden) -> SoulXSingerScoreProcessor:
    return SoulXSingerScoreProcessor(json.loads(golden["phone_subset"]))


@pytest.mark.parametrize("name", ["zh_prompt", "en_target"])
def test_tensors_equal_the_references(golden, processor, name):
    out = processor(json.loads(golden["metas"])[name])
    for ours, theirs in (("phonemes", "phoneme"), ("note_pitch", "note_pitch"), ("note_type", "note_type"),
                         ("mel2note", "mel2note")):
        assert torch.equal(out[ours], golden[f"{name}.{theirs}"].long()), ours
    assert torch.equal(out["f0"], golden[f"{name}.f0"])


def test_pipeline_inputs_cut_the_prompt_audio_and_pick_the_control(golden, processor):
    metas = json.loads(golden["metas"])
    frames = golden["zh_prompt.mel2note"].shape[0]
    audio = torch.zeros(frames * 480 + 100)
    melody = processor.pipeline_inputs(metas["zh_prompt"], metas["en_target"], audio)
    assert melody["prompt_audio"].shape == (frames * 480,) and melody["control"] == "melody"
    assert torch.equal(melody["f0"], golden["en_target.f0"]) and "note_pitch" not in melody
    score = processor.pipeline_inputs(metas["zh_prompt"], metas["en_target"], audio, control="score")
    assert torch.equal(score["note_pitch"], golden["en_target.note_pitch"].long()) and "f0" not in score
    with pytest.raises(ValueError, match=f"prompt_audio has 10 samples; the prompt's metadata covers {frames}"):
        processor.pipeline_inputs(metas["zh_prompt"], metas["en_target"], torch.zeros(10))


def test_unknown_phonemes_and_ragged_metadata_are_refused(processor):
    meta = {"duration": "0.5 0.5", "phoneme": "<SP> zh_nope9", "note_pitch": "0 60", "note_type": "1 2"}
    with pytest.raises(ValueError, match=r"phonemes not in the phone set: \['zh_nope9'\]"):
        processor(meta)
    with pytest.raises(ValueError, match="different numbers of notes"):
        processor({**meta, "note_type": "1"})
    with pytest.raises(ValueError, match="metadata has no 'duration'"):
        processor({k: v for k, v in meta.items() if k != "duration"})
