"""``generate`` with an audio model: ``tiny-soulx-singer`` sings its example score into a .wav, byte-identical under
every offload strategy SoulX-Singer supports."""

from __future__ import annotations

import wave

import pytest

from diffusers_omni.cli.main import main


def _wav(path):
    with wave.open(str(path), "rb") as f:
        return f.getnchannels(), f.getsampwidth(), f.getframerate(), f.readframes(f.getnframes())


def test_tiny_soulx_singer_writes_the_same_wav_under_every_offload(tmp_path):
    outputs = {}
    for offload in ("none", "layerwise", "model-level"):
        output = tmp_path / f"{offload}.wav"
        args = ["generate", "--model", "tiny-soulx-singer", "--steps", "2", "--offload", offload, "--output",
                str(output)]
        assert main(args) == 0
        outputs[offload] = output.read_bytes()
    channels, width, rate, frames = _wav(tmp_path / "none.wav")
    assert (channels, width, rate) == (1, 2, 16000)
    assert len(frames) == 2 * 3200 and any(frames)  # 10 mel frames of 320 samples, 16-bit
    assert outputs["layerwise"] == outputs["none"] == outputs["model-level"]


def test_seed_changes_the_audio(tmp_path):
    for seed in ("0", "1"):
        assert main(["generate", "--model", "tiny-soulx-singer", "--steps", "1", "--seed", seed, "--output",
                     str(tmp_path / f"{seed}.wav")]) == 0
    assert (tmp_path / "0.wav").read_bytes() != (tmp_path / "1.wav").read_bytes()


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--height", "64"], "--height=64: tiny-soulx-singer sings its built-in example score"),
        (["--prompt", "a song"], "--prompt='a song': tiny-soulx-singer"),
        (["--output", "x.png"], "makes audio; use .wav"),
    ],
)
def test_audio_model_refuses_image_flags(extra, message, capsys):
    assert main(["generate", "--model", "tiny-soulx-singer", *extra]) == 2
    assert message in capsys.readouterr().err


def test_image_model_refuses_a_wav(tmp_path, capsys):
    assert main(["generate", "--output", str(tmp_path / "x.wav")]) == 2
    assert ".wav is for audio models" in capsys.readouterr().err


def test_explain_lists_the_soulx_singer_role(capsys):
    import json

    assert main(["explain", "--model", "tiny-soulx-singer", "--attention", "TORCH_SDPA", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {(row["role"], row["backend"]) for row in rows} == {("soulx_singer.self", "TORCH_SDPA")}
    assert sorted(row["module"] for row in rows) == [
        f"cfm_decoder.model.diff_estimator.layers.{i}.self_attn" for i in range(2)]
