"""SoulX-Singer's classes against the published checkpoint layout and against the reference implementation.

* The manifest (data/soulx_singer/manifest.json) lists the published checkpoint's names and shapes, taken from the
  reference built on the meta device; our components built on meta at the published config give exactly those.
* The goldens (data/soulx_singer/golden_soulx_singer.pt, made by golden_gen_soulx_singer.py there) are the
  reference's outputs on the tiny config with the name-keyed tiny weights; ours match within float32 tolerance
  (attention runs through SDPA here and through an explicit softmax there).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from diffusers_omni.architectures.soulx_singer import (
    DiffLlama,
    SoulXSingerCFMDecoder,
    SoulXSingerConditionEncoder,
    SoulXSingerMelSpectrogram,
    SoulXSingerPipeline,
    SoulXSingerSVCPipeline,
    SoulXSingerVocoder,
    f0_to_coarse,
    slaney_mel_filterbank,
)
from diffusers_omni.testing.tiny_soulx_singer import (
    TINY_AUDIO,
    tiny_soulx_singer_inputs,
    tiny_soulx_singer_pipeline,
    tiny_soulx_singer_svc_inputs,
    tiny_soulx_singer_svc_pipeline,
)

DATA = Path(__file__).parent / "data" / "soulx_singer"
SEED = 1234  # the golden script's
ATOL = 1e-6  # float32: the estimator differs from the reference by about one ulp (SDPA vs explicit softmax)


@pytest.fixture(scope="module")
def manifest() -> dict:
    return json.loads((DATA / "manifest.json").read_text())


@pytest.fixture(scope="module")
def golden() -> dict:
    return torch.load(DATA / "golden_soulx_singer.pt", weights_only=True)


@pytest.fixture(scope="module")
def svs() -> SoulXSingerPipeline:
    pipe = tiny_soulx_singer_pipeline()
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _published_components(manifest: dict, use_score: bool) -> dict[str, torch.nn.Module]:
    cfg = manifest["config"]
    audio, enc, fm = cfg["audio"], cfg["model"]["encoder"], cfg["model"]["flow_matching"]
    encoder = {k: enc[k] for k in ("f0_bin", "f0_dim")}
    if use_score:
        encoder.update({k: enc[k] for k in ("vocab_size", "text_dim", "pitch_dim", "type_dim", "num_layers")})
    with torch.device("meta"):
        return {
            "": SoulXSingerConditionEncoder(use_score=use_score, **encoder),
            "cfm_decoder.": SoulXSingerCFMDecoder(**{k: fm[k] for k in ("mel_dim", "hidden_size", "num_layers",
                                                                        "num_heads", "cond_codebook_size")}),
            "mel.": SoulXSingerMelSpectrogram(**{k: audio[k] for k in ("sample_rate", "n_fft", "num_mels", "hop_size",
                                                                       "win_size", "fmin", "fmax")}),
            "vocoder.": SoulXSingerVocoder(**manifest["vocoder"]),
        }


def _names_and_shapes(components: dict[str, torch.nn.Module]) -> dict[str, list[int]]:
    return {prefix + name: list(t.shape) for prefix, module in components.items()
            for name, t in module.state_dict().items()}


def test_svs_components_have_the_published_names_and_shapes(manifest):
    ours = _names_and_shapes(_published_components(manifest, use_score=True))
    assert ours == manifest["svs"]
    assert len(ours) == 587


def test_svc_components_have_the_published_svc_names_and_shapes(manifest):
    ours = _names_and_shapes(_published_components(manifest, use_score=False))
    expected = {k: v for k, v in manifest["svs"].items() if k.split(".")[0] in manifest["svc_prefixes"]}
    assert ours == expected


def test_estimator_at_the_published_config_is_a_22_layer_diffllama(manifest):
    fm = manifest["config"]["model"]["flow_matching"]
    with torch.device("meta"):
        decoder = SoulXSingerCFMDecoder(mel_dim=fm["mel_dim"], hidden_size=fm["hidden_size"],
                                        num_layers=fm["num_layers"], num_heads=fm["num_heads"])
    estimator = decoder.model.diff_estimator
    assert isinstance(estimator, DiffLlama)
    assert len(estimator.layers) == 22 and estimator._layerwise_offload_blocks_attrs == ("layers",)
    assert sum(p.numel() for p in estimator.parameters()) == sum(
        torch.Size(s).numel() for k, s in manifest["svs"].items() if k.startswith("cfm_decoder.model.diff_estimator."))


def test_mel_filterbank_matches_the_reference(golden):
    ours = slaney_mel_filterbank(TINY_AUDIO["sample_rate"], TINY_AUDIO["n_fft"], TINY_AUDIO["num_mels"],
                                 TINY_AUDIO["fmin"], TINY_AUDIO["fmax"])
    torch.testing.assert_close(ours, golden["mel_basis"], atol=1e-8, rtol=1e-5)


@torch.no_grad()
@pytest.mark.parametrize("masked", [False, True])
def test_estimator_matches_the_reference(svs, golden, masked):
    estimator = svs.cfm_decoder.model.diff_estimator
    mask = golden["est_mask"] if masked else None
    out = estimator(golden["est_x"], golden["est_t"], golden["est_cond"], mask)
    expected = golden["est_out_masked" if masked else "est_out"]
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=1e-6)
    if masked:  # the mask changes the output (it is not ignored)
        assert not torch.allclose(out, golden["est_out"], atol=1e-4)


@torch.no_grad()
def test_vocoder_matches_the_reference(svs, golden):
    out = svs.vocoder(golden["vocoder_in"]).reshape(-1)
    assert out.shape == golden["vocoder_out"].shape == (3 * TINY_AUDIO["hop_size"],)
    # The same arithmetic, bit for bit where oneDNN runs the convolutions with the same instructions as the machine
    # that wrote the goldens (AVX2); with AVX-512 (ONEDNN_MAX_CPU_ISA unset on such a CPU) they differ by an ulp.
    torch.testing.assert_close(out, golden["vocoder_out"], atol=ATOL, rtol=1e-6)


def _with_reference_mel_basis(pipe, golden):
    pipe.mel.model.mel_basis.copy_(golden["mel_basis"])
    return pipe


@pytest.mark.parametrize("control", ["melody", "score"])
@pytest.mark.parametrize("shift", [0, 2])
def test_svs_matches_the_reference(svs, golden, control, shift):
    _with_reference_mel_basis(svs, golden)
    out = svs(**tiny_soulx_singer_inputs(control), pitch_shift=shift, num_inference_steps=3, guidance_scale=3.0,
              generator=torch.Generator().manual_seed(SEED), output_type="mel")
    torch.testing.assert_close(out.audios, golden[f"svs_{control}_shift{shift}"], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("shift", [0, 2])
def test_svc_matches_the_reference(golden, shift):
    pipe = _with_reference_mel_basis(tiny_soulx_singer_svc_pipeline(), golden)
    pipe.set_progress_bar_config(disable=True)
    out = pipe(**tiny_soulx_singer_svc_inputs(), pitch_shift=shift, num_inference_steps=3, guidance_scale=3.0,
               generator=torch.Generator().manual_seed(SEED), output_type="mel")
    torch.testing.assert_close(out.audios, golden[f"svc_shift{shift}"], atol=1e-5, rtol=1e-5)


def test_f0_to_coarse_bins():
    f0 = torch.tensor([[0.0, -1.0, 32.7031956625, 65.4063913251, 10000.0]])
    assert f0_to_coarse(f0).tolist() == [[0, 0, 1, 61, 360]]
    assert f0_to_coarse(f0, shift_bins=10).tolist() == [[0, 0, 11, 71, 360]]


def test_svs_writes_audio_deterministically(svs):
    kwargs = dict(num_inference_steps=2, output_type="pt")
    first = svs(**tiny_soulx_singer_inputs(), generator=torch.Generator().manual_seed(0), **kwargs)
    again = svs(**tiny_soulx_singer_inputs(), generator=torch.Generator().manual_seed(0), **kwargs)
    other = svs(**tiny_soulx_singer_inputs(), generator=torch.Generator().manual_seed(1), **kwargs)
    assert first.audios.shape == (1, 10 * TINY_AUDIO["hop_size"]) and first.sample_rate == TINY_AUDIO["sample_rate"]
    assert torch.equal(first.audios, again.audios)
    assert not torch.equal(first.audios, other.audios)
    assert torch.isfinite(first.audios).all()


def test_svc_output_has_the_target_length():
    pipe = tiny_soulx_singer_svc_pipeline()
    pipe.set_progress_bar_config(disable=True)
    inputs = tiny_soulx_singer_svc_inputs()
    out = pipe(**inputs, num_inference_steps=1, generator=torch.Generator().manual_seed(0))
    assert out.audios.shape == (1, inputs["audio"].shape[-1])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"control": "lyrics"}, "control='lyrics'; allowed: ['melody', 'score']"),
        ({"output_type": "pil"}, "output_type='pil'; allowed: ['np', 'pt', 'mel']"),
        ({"num_inference_steps": 0}, "num_inference_steps=0"),
        ({"guidance_rescale": 1.5}, "guidance_rescale=1.5"),
        ({"f0": None}, "control='melody' needs prompt_f0 and f0"),
        ({"mel2note": torch.tensor([1, 1, 9, 0, 0, 0, 0, 0, 0, 0])}, "mel2note points at note 13 but there are 9 notes"),
        ({"prompt_audio": torch.zeros(7 * TINY_AUDIO["hop_size"])}, "prompt_audio gives 7 mel frames"),
    ],
)
def test_svs_refuses_bad_input(svs, kwargs, message):
    inputs = {**tiny_soulx_singer_inputs(), "num_inference_steps": 1, **kwargs}
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("(", r"\(")):
        svs(**inputs)


def _write_published_layout(pipe, folder: Path, checkpoint: str, use_score: bool) -> None:
    """A folder laid out as the published repository: config.yaml and a single-file {"state_dict": ...}."""
    state = {}
    for prefix, name in (("", "condition_encoder"), ("cfm_decoder.", "cfm_decoder"), ("mel.", "mel"),
                         ("vocoder.", "vocoder")):
        state.update({prefix + k: v for k, v in getattr(pipe, name).state_dict().items()})
    enc, fm, voc = pipe.condition_encoder.config, pipe.cfm_decoder.config, pipe.vocoder.config
    config = {
        "infer": {"n_steps": 32, "cfg": 3},
        "audio": {**{k: v for k, v in pipe.mel.config.items() if not k.startswith("_")}, "max_length": 36000},
        "model": {
            "encoder": {k: enc[k] for k in ("vocab_size", "text_dim", "pitch_dim", "type_dim", "f0_bin", "f0_dim",
                                            "num_layers")},
            "flow_matching": {**{k: fm[k] for k in ("mel_dim", "hidden_size", "num_layers", "num_heads",
                                                    "cond_codebook_size")},
                              "cfg_drop_prob": 0.2, "use_embedding": False, "cond_scale_factor": 1, "sigma": 1e-5,
                              "time_scheduler": "cos"},
            # Not in the published config (the reference's Vocos defaults apply there): the tiny vocoder's sizes.
            "vocoder": {k: v for k, v in voc.items() if not k.startswith("_")},
        },
    }
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.yaml").write_text(yaml.safe_dump(config))
    torch.save({"state_dict": state}, folder / checkpoint)


def test_from_pretrained_reads_the_published_layout(svs, tmp_path):
    _write_published_layout(svs, tmp_path / "published", "model.pt", use_score=True)
    loaded = SoulXSingerPipeline.from_pretrained(tmp_path / "published")
    loaded.set_progress_bar_config(disable=True)
    for name in ("condition_encoder", "cfm_decoder", "mel", "vocoder"):
        ours, theirs = getattr(svs, name).state_dict(), getattr(loaded, name).state_dict()
        assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    kwargs = dict(num_inference_steps=2, output_type="pt")
    a = svs(**tiny_soulx_singer_inputs(), generator=torch.Generator().manual_seed(3), **kwargs).audios
    b = loaded(**tiny_soulx_singer_inputs(), generator=torch.Generator().manual_seed(3), **kwargs).audios
    assert torch.equal(a, b)


def test_from_pretrained_names_missing_published_files(tmp_path):
    (tmp_path / "config.yaml").write_text("audio: {}\nmodel: {}\n")
    with pytest.raises(FileNotFoundError, match="model.pt"):
        SoulXSingerPipeline.from_pretrained(tmp_path)


def test_published_svc_layout_needs_whisper(tmp_path):
    with pytest.raises(ValueError, match="openai/whisper-base"):
        (tmp_path / "config.yaml").write_text("audio: {}\nmodel: {}\n")
        (tmp_path / "model-svc.pt").write_bytes(b"")
        SoulXSingerSVCPipeline.from_pretrained(tmp_path)


def test_diffusers_layout_round_trip(svs, tmp_path):
    svs.save_pretrained(tmp_path / "diffusers")
    loaded = SoulXSingerPipeline.from_pretrained(tmp_path / "diffusers")
    loaded.set_progress_bar_config(disable=True)
    kwargs = dict(num_inference_steps=2, output_type="pt")
    a = svs(**tiny_soulx_singer_inputs(), generator=torch.Generator().manual_seed(3), **kwargs).audios
    b = loaded(**tiny_soulx_singer_inputs(), generator=torch.Generator().manual_seed(3), **kwargs).audios
    assert torch.equal(a, b)


@pytest.mark.parametrize(("key", "orig"), [("y_24k_16k", 24000), ("y_16k_16k", 16000), ("y_44k_16k", 44100)])
def test_resample_matches_torchaudio(key, orig):
    """golden_resample.pt: ``torchaudio.functional.resample`` (2.11.1, its Python code run alone: the package's
    compiled part does not load beside this torch) on 480 random samples (``torch.randn`` seeded 1234, times 0.3)."""
    from diffusers_omni.architectures.soulx_singer.pipeline_soulx_singer import resample

    data = torch.load(DATA / "golden_resample.pt", weights_only=True)
    out = resample(data["x"], orig, 16000)
    assert out.shape == data[key].shape
    assert torch.equal(out, data[key])  # the same arithmetic: bitwise


def test_svc_resamples_the_recordings_when_no_content_audio_is_given():
    pipe = tiny_soulx_singer_svc_pipeline()
    pipe.set_progress_bar_config(disable=True)
    inputs = tiny_soulx_singer_svc_inputs()  # 16 kHz: resampling to Whisper's rate is the identity
    kwargs = dict(num_inference_steps=1, output_type="mel")
    given = pipe(**inputs, generator=torch.Generator().manual_seed(0), **kwargs).audios
    derived = pipe(**{k: v for k, v in inputs.items() if "content" not in k}, generator=torch.Generator().manual_seed(0),
                   **kwargs).audios
    assert torch.equal(given, derived)


def test_bfloat16_decoder_runs_with_float32_audio_modules():
    pipe = tiny_soulx_singer_pipeline()
    pipe.set_progress_bar_config(disable=True)
    kwargs = dict(num_inference_steps=2, output_type="pt")
    full = pipe(**tiny_soulx_singer_inputs(), generator=torch.Generator().manual_seed(0), **kwargs).audios
    pipe.condition_encoder.to(torch.bfloat16)
    pipe.cfm_decoder.to(torch.bfloat16)
    half = pipe(**tiny_soulx_singer_inputs(), generator=torch.Generator().manual_seed(0), **kwargs).audios
    assert half.dtype == torch.float32 and pipe.vocoder.dtype == pipe.mel.dtype == torch.float32
    assert torch.isfinite(half).all() and not torch.equal(half, full)
    torch.testing.assert_close(half, full, atol=2e-3, rtol=0)


def test_svc_refuses_recordings_longer_than_whispers_window():
    pipe = tiny_soulx_singer_svc_pipeline()
    inputs = {**tiny_soulx_singer_svc_inputs(), "content": torch.zeros(16000 * 31)}
    with pytest.raises(ValueError, match=r"the target recording is 31\.0 s; SoulXSingerSVCPipeline takes at most 30 s"):
        pipe(**inputs, num_inference_steps=1)


def test_published_layout_missing_a_tensor_is_refused(svs, tmp_path):
    folder = tmp_path / "published"
    _write_published_layout(svs, folder, "model.pt", use_score=True)
    checkpoint = torch.load(folder / "model.pt", weights_only=True)
    del checkpoint["state_dict"]["vocoder.model.head.out.bias"]
    torch.save(checkpoint, folder / "model.pt")
    with pytest.raises(ValueError, match=r"does not fit component vocoder: missing \['model.head.out.bias'\]"):
        SoulXSingerPipeline.from_pretrained(folder)


def test_step_callback_sees_and_may_replace_the_latents(svs):
    seen = []

    def callback(pipe, step, t, tensors):
        seen.append((step, round(float(t[0]), 4), tuple(tensors["latents"].shape)))
        return {"latents": torch.zeros_like(tensors["latents"])} if step == 1 else {}

    out = svs(**tiny_soulx_singer_inputs(), num_inference_steps=2, guidance_scale=0.0, output_type="mel",
              generator=torch.Generator().manual_seed(0), callback_on_step_end=callback)
    assert seen == [(0, 0.25, (1, 10, 16)), (1, 0.75, (1, 10, 16))]
    assert torch.equal(out.audios, torch.zeros(1, 10, 16))


@pytest.mark.parametrize("control", ["melody", "score"])
def test_svs_auto_shift_matches_the_reference(svs, golden, control):
    _with_reference_mel_basis(svs, golden)
    out = svs(**tiny_soulx_singer_inputs(control), auto_shift=True, num_inference_steps=3, guidance_scale=3.0,
              generator=torch.Generator().manual_seed(SEED), output_type="mel")
    assert out.pitch_shift != 0  # the tiny prompt sits above the target: a real shift was chosen
    torch.testing.assert_close(out.audios, golden[f"svs_{control}_auto"], atol=1e-5, rtol=1e-5)
