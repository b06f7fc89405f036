"""`generate` refuses, before any weights load, every argument the pipeline's configs already rule out (#30 item 5),
checks devices and sizes before use, and prints every error as one line with exit status 2 (#28 item 7)."""

import sys

import pytest
import torch

from diffusers_omni import testing
from diffusers_omni.cli import common
from diffusers_omni.cli.main import main


@pytest.fixture
def no_load(monkeypatch):
    """Loading a pipeline fails the test: what is checked here must be refused before any model is built."""

    def load_pipeline(*args, **kwargs):
        raise AssertionError("a pipeline was loaded before the arguments were checked")

    monkeypatch.setattr(common, "load_pipeline", load_pipeline)


def _one_line_error(argv, capsys) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("diffusers-omni generate: error: "), err
    return lines[0]


@pytest.fixture(scope="module")
def configs_only(tmp_path_factory):
    """A saved tiny FLUX pipeline with every weight file removed: model_index.json and the configs only."""
    root = tmp_path_factory.mktemp("flux-configs-only")
    testing.tiny_flux_pipeline().save_pretrained(root)
    for weights in [*root.rglob("*.safetensors"), *root.rglob("*.bin")]:
        weights.unlink()
    assert (root / "transformer" / "config.json").is_file() and not list(root.rglob("*.safetensors"))
    return root


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--frames", "5"], "--frames=5: OmniFluxPipeline takes no num_frames"),
        (["--height", "30"], "--height=30: OmniFluxPipeline needs a multiple of 4 (VAE scale 2 × patch 2)"),
        (["--output", "video.mp4"], "--output='video.mp4': this pipeline makes an image"),
        (["--image", "__IMAGE__"], "takes no image"),
    ],
)
def test_local_directory_without_weights_is_refused_from_its_configs(configs_only, argv, message, capsys, tmp_path,
                                                                      monkeypatch):
    # Without weights the load would fail (exit 1, "no file named ..."): exit 2 with the flag's message shows the
    # refusal came from model_index.json and the configs, before any component was built.
    monkeypatch.chdir(tmp_path)
    image = tmp_path / "cond.png"
    __import__("PIL.Image").Image.new("RGB", (8, 8)).save(image)
    argv = [str(image) if a == "__IMAGE__" else a for a in argv]
    line = _one_line_error(["generate", "--model", str(configs_only), "--steps", "1", *argv], capsys)
    assert message in line and "no file named" not in line
    assert [p.name for p in tmp_path.iterdir()] == ["cond.png"]


def test_local_directory_without_weights_still_fails_to_load_when_the_arguments_are_fine(configs_only, capsys):
    # The preflight passes valid arguments on to the load, which reports the missing weights as before.
    assert main(["generate", "--model", str(configs_only), "--steps", "1", "--height", "32", "--width", "32",
                 "--output", str(configs_only / "out.png")]) == 1
    assert "no file named" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--frames", "5"], "--frames=5: OmniFluxPipeline takes no num_frames"),
        (["--height", "7"], "--height=7: OmniFluxPipeline needs a multiple of 4"),
        (["--model", "tiny-wan", "--frames", "4"], "--frames=4: OmniWanPipeline needs 1 + a multiple of 4 frames"),
        (["--model", "tiny-wan", "--output", "frames.png"], "this pipeline makes a video; use .mp4 or .gif"),
        (["--output", "image.gif"], "this pipeline makes an image"),
        (["--model", "tiny-wan", "--height", "1024"],
         "--height=1024: OmniWanPipeline's transformer places at most 32 patches along an axis (rope_max_seq_len"),
        (["--model", "tiny-wan", "--frames", "201"], "--frames=201: OmniWanPipeline's transformer places at most 32 "
                                                     "latent frames"),
    ],
)
def test_tiny_models_are_refused_before_they_are_built(argv, message, no_load, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert message in _one_line_error(["generate", "--steps", "1", *argv], capsys)
    assert not list(tmp_path.iterdir())


def test_mp4_without_an_encoder_is_refused_before_the_model_loads(no_load, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(sys.modules, "imageio_ffmpeg", None)  # as on a machine without the video extra
    line = _one_line_error(["generate", "--model", "tiny-wan", "--output", "x.mp4"], capsys)
    assert "--output='x.mp4': no mp4 encoder installed" in line


def test_wan_position_limit_is_the_transformers_own():
    # The refusal above is not a guess: past rope_max_seq_len patches along an axis, Wan's rotary embedding fails.
    pipe = testing.tiny_wan_pipeline()
    rope, limit = pipe.transformer.rope, pipe.transformer.config.rope_max_seq_len
    assert rope(torch.zeros(1, 16, 1, 2 * limit, 8)) is not None
    with pytest.raises(RuntimeError):
        rope(torch.zeros(1, 16, 1, 2 * (limit + 1), 8))


def test_sizes_that_cannot_be_allocated_are_refused(no_load, capsys):
    side = str(2**20)  # one frame through the decoder: ≥ 4 channels × 2^40 pixels × 4 bytes = 16 TiB
    line = _one_line_error(["generate", "--height", side, "--width", side], capsys)
    assert f"--height={side} --width={side}: decoding one frame needs at least" in line
    assert "the VAE decoder's last stage: 4 channels" in line and "GiB" in line


def test_huge_step_count_is_refused(no_load, capsys):
    with pytest.raises(SystemExit) as exit_info:  # by the parser now (tests/cli/test_bounds.py)
        main(["generate", "--steps", str(10**15)])
    assert exit_info.value.code == 2
    assert f"argument --steps: must be an integer from 1 to 1000, got '{10**15}'" in capsys.readouterr().err


@pytest.mark.parametrize("content", [b"root:x:0:0:root:/root:/bin/bash\n", b"\x89PNG\r\n\x1a\n truncated"])
def test_image_that_is_not_an_image_names_the_flag(content, no_load, capsys, tmp_path):
    path = tmp_path / "cond.png"
    path.write_bytes(content)
    line = _one_line_error(["generate", "--model", "tiny-wan-i2v", "--image", str(path)], capsys)
    assert f"--image={str(path)!r}: " in line and ("not an image" in line or "cannot be read" in line)


@pytest.mark.skipif(torch.xpu.is_available(), reason="needs a machine without XPU")
@pytest.mark.parametrize("device", ["xpu", "xpu:3"])
def test_device_without_that_accelerator_is_one_line(device, no_load, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--device", device])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert f"argument --device: {device!r}: XPU is not available here" in err


@pytest.mark.parametrize("argv", [["generate", "--steps", "abc"], ["generate", "--offload", "layerwse"],
                                  ["generate", "--no-such-flag"], ["explain", "--dtype", "int3"]])
def test_parse_errors_are_one_line_with_a_help_hint(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "usage:" not in err, err
    command = f"diffusers-omni {argv[0]}"
    assert err.startswith(f"{command}: error: ") and err.rstrip().endswith(f"(see {command} --help)")


def test_hub_id_is_checked_from_model_index_and_configs_only(configs_only, monkeypatch, capsys, tmp_path):
    # A hub snapshot in a local cache (offline) holding model_index.json and the VAE and transformer configs, no
    # weights: the refusal needs those three files only.
    import huggingface_hub.constants as constants

    revision = "0" * 40
    repo = tmp_path / "hub" / "models--someone--flux-configs"
    for name in ("model_index.json", "vae/config.json", "transformer/config.json"):
        target = repo / "snapshots" / revision / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text((configs_only / name).read_text())
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.chdir(tmp_path)
    line = _one_line_error(["generate", "--model", "someone/flux-configs", "--frames", "5"], capsys)
    assert "--frames=5: OmniFluxPipeline takes no num_frames" in line
    line = _one_line_error(["generate", "--model", "someone/flux-configs", "--width", "30"], capsys)
    assert "--width=30: OmniFluxPipeline needs a multiple of 4" in line
