"""`generate`'s height, width, steps, guidance and frames default to the pipeline's own (#29 item 4): what its
``__call__`` would use when not given, read from its configs before any weights load; the tiny models keep their
small sizes so that the README's first command stays fast on a CPU."""

import argparse
import inspect
import json

import pytest
from diffusers import FluxPipeline, WanPipeline

from diffusers_omni import testing
from diffusers_omni.cli import common
from diffusers_omni.cli.generate import TINY_DEFAULTS, pipeline_defaults, preflight
from diffusers_omni.cli.main import main


def _args(model: str, **given) -> argparse.Namespace:
    flags = {"steps": None, "height": None, "width": None, "frames": None, "guidance_scale": None,
             "negative_prompt": None, "image": None, "output": None}
    return argparse.Namespace(model=model, **{**flags, **given})


def _signature_default(cls, name):
    return inspect.signature(cls.__call__).parameters[name].default


@pytest.fixture(scope="module")
def flux_dir(tmp_path_factory):
    """A saved tiny FLUX pipeline: a local model, not one of the tiny names, so it gets the pipeline's defaults."""
    root = tmp_path_factory.mktemp("flux-local")
    testing.tiny_flux_pipeline().save_pretrained(root)
    return root


@pytest.fixture(scope="module")
def wan_configs(tmp_path_factory):
    """A saved tiny Wan pipeline, configs only (no weights): what the defaults are read from."""
    root = tmp_path_factory.mktemp("wan-configs")
    testing.tiny_wan_pipeline().save_pretrained(root)
    for weights in [*root.rglob("*.safetensors"), *root.rglob("*.bin")]:
        weights.unlink()
    # Wan's own table (1024 rows), so that its default 480 × 832 fits; the tiny model's holds 32.
    config = root / "transformer" / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "rope_max_seq_len": 1024}))
    return root


@pytest.fixture
def no_load(monkeypatch):
    def load_pipeline(*args, **kwargs):
        raise AssertionError("a pipeline was loaded; the defaults must come from the configs")

    monkeypatch.setattr(common, "load_pipeline", load_pipeline)


def test_flux_defaults_are_the_pipelines_own_from_its_configs(flux_dir, no_load):
    args = _args(str(flux_dir))
    preflight(args, "cpu", None)
    pipe = testing.tiny_flux_pipeline()
    # What FluxPipeline.__call__ computes when given nothing: default_sample_size × vae_scale_factor (128 × 8 =
    # 1024 for FLUX.1-dev's VAE; the tiny VAE downsamples by 2), and its signature's steps and guidance.
    side = pipe.default_sample_size * pipe.vae_scale_factor
    assert (args.height, args.width) == (side, side) == (256, 256)
    assert args.steps == _signature_default(FluxPipeline, "num_inference_steps") == 28
    assert args.guidance_scale == _signature_default(FluxPipeline, "guidance_scale") == 3.5
    assert args.frames is None  # an image pipeline takes no num_frames


def test_flux_1_dev_size_is_1024_from_its_real_vae_scale():
    # FLUX.1-dev's VAE has four stages: a scale factor of 8, so 128 × 8.
    pipe = testing.tiny_flux_pipeline()
    pipe.vae_scale_factor = 8
    assert pipeline_defaults(FluxPipeline, pipe) == {"steps": 28, "guidance_scale": 3.5, "height": 1024,
                                                     "width": 1024}


def test_wan_defaults_come_from_its_call_signature(wan_configs, no_load):
    args = _args(str(wan_configs))
    preflight(args, "cpu", None)
    assert (args.height, args.width, args.frames) == (480, 832, 81)
    assert (args.steps, args.guidance_scale) == (50, 5.0)
    assert (args.height, args.width, args.frames, args.steps) == tuple(
        _signature_default(WanPipeline, name) for name in ("height", "width", "num_frames", "num_inference_steps"))


@pytest.mark.parametrize("model", ["tiny-flux", "tiny-wan"])
def test_tiny_models_keep_their_small_sizes(model, no_load):
    args = _args(model)
    preflight(args, "cpu", None)
    assert (args.height, args.width, args.steps) == (TINY_DEFAULTS["height"], TINY_DEFAULTS["width"],
                                                     TINY_DEFAULTS["steps"]) == (64, 64, 4)
    assert args.frames == (5 if model == "tiny-wan" else None)


def test_given_values_are_kept(flux_dir, no_load):
    args = _args(str(flux_dir), steps=2, height=32, width=48, guidance_scale=1.5)
    preflight(args, "cpu", None)
    assert (args.steps, args.height, args.width, args.guidance_scale) == (2, 32, 48, 1.5)


def test_generate_runs_at_the_local_pipelines_default_size(flux_dir, tmp_path, capsys):
    output = tmp_path / "out.png"
    assert main(["generate", "--model", str(flux_dir), "--steps", "1", "--output", str(output), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert (summary["height"], summary["width"], summary["steps"], summary["guidance_scale"]) == (256, 256, 1, 3.5)
    assert __import__("PIL.Image").Image.open(output).size == (256, 256)


def test_readme_default_command_stays_small(tmp_path, capsys):
    output = tmp_path / "omni.png"
    assert main(["generate", "--output", str(output), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert (summary["height"], summary["width"], summary["steps"]) == (64, 64, 4)


def test_help_states_the_defaults(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "default: the pipeline's, e.g. 28 for FLUX.1-dev; 4 for the tiny models" in text
    assert "e.g. 1024 for FLUX.1-dev; 64 for the tiny models" in text


def test_dtype_casts_a_tiny_pipeline(tmp_path, capsys):
    """``--dtype`` applies to the tiny pipelines too (built in float32, cast as ``torch_dtype`` would load them)."""
    assert main(["generate", "--model", "tiny-flux", "--dtype", "bfloat16", "--output", str(tmp_path / "a.png")]) == 0
    assert "(OmniFluxPipeline, bfloat16)" in capsys.readouterr().out
    assert main(["generate", "--model", "tiny-flux", "--output", str(tmp_path / "b.png")]) == 0
    assert "(OmniFluxPipeline, float32)" in capsys.readouterr().out
