"""Invalid command-line input: one clean line on stderr naming the flag and the value, exit status 2; Ctrl-C 130."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from diffusers_omni.cli.main import main


@pytest.mark.parametrize(
    "argv, message",
    [
        (["generate", "--steps", "0"], "argument --steps: must be an integer from 1 to 1000, got '0'"),
        (["generate", "--width", "-64"], "argument --width: must be a positive integer, got '-64'"),
        (["generate", "--height", "0"], "argument --height: must be a positive integer, got '0'"),
        (["generate", "--frames", "-3"], "argument --frames: must be a positive integer, got '-3'"),
        (["generate", "--device", "bogus"], "argument --device: 'bogus' is not a torch device"),
        (["generate", "--guidance-scale", "nan"], "argument --guidance-scale: must be a finite number"),
        (["generate", "--offload", "layerwse"], "invalid choice: 'layerwse' (did you mean 'layerwise'?)"),
        (["genrate"], "invalid choice: 'genrate' (did you mean 'generate'?)"),
        (["align", "--steps", "0"], "argument --steps: must be an integer from 1 to 1000, got '0'"),
    ],
)
def test_argument_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_device_without_cuda(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--device", "cuda"])
    assert exit_info.value.code == 2
    assert "argument --device: 'cuda': CUDA is not available here" in capsys.readouterr().err


def _error(argv, capsys) -> str:
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    return captured.err


def test_missing_image(tmp_path, capsys):
    missing = tmp_path / "missing.png"
    err = _error(["generate", "--model", "tiny-wan-i2v", "--image", str(missing)], capsys)
    assert f"--image={str(missing)!r}: no such file" in err


def test_unwritable_output(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    err = _error(["generate", "--output", str(blocker / "out.png")], capsys)
    assert f"--output={str(blocker / 'out.png')!r}: cannot write there ({blocker} is a file, not a directory)" in err
    err = _error(["generate", "--output", str(tmp_path)], capsys)
    assert f"--output={str(tmp_path)!r} is a directory" in err


def test_directory_without_model_index(tmp_path, capsys):
    err = _error(["generate", "--model", str(tmp_path)], capsys)
    assert f"--model={str(tmp_path)!r} is a directory without model_index.json" in err


def test_explain_nonexistent_model(capsys):
    err = _error(["explain", "--model", "/nonexistent"], capsys)
    assert "--model='/nonexistent' is not a model directory" in err


def test_tiny_model_typo_gets_a_suggestion(capsys):
    assert "(did you mean 'tiny-flux'?)" in _error(["explain", "--model", "tiny-flx"], capsys)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--height", "7"], "--height=7: OmniFluxPipeline needs a multiple of 4 (VAE scale 2 × patch 2)"),
        (["--width", "30"], "--width=30: OmniFluxPipeline needs a multiple of 4"),
        (["--model", "tiny-wan", "--frames", "4"], "--frames=4: OmniWanPipeline needs 1 + a multiple of 4 frames"),
        (["--frames", "5"], "--frames=5: OmniFluxPipeline takes no num_frames"),
        (["--max-device-memory", "12GiB"], "--max-device-memory=12GiB needs --offload layerwise (got --offload none)"),
        (["--offload", "layerwise", "--max-device-memory", "lots"], "--max-device-memory"),
        (["--prefetch-depth", "2"], "--prefetch-depth=2 needs --offload layerwise"),
        (["--no-allgather"], "--no-allgather=True needs --offload distributed-layerwise"),
        (["--output", "x.txt"], "--output='x.txt': unknown file type '.txt'"),
        (["--model", "tiny-wan", "--output", "frames.png"], "this pipeline makes a video; use .mp4 or .gif"),
        (["--output", "image.gif"], "this pipeline makes an image"),
        (["--offload", "distributed-layerwise"], "--offload distributed-layerwise needs a distributed launch"),
    ],
)
def test_generate_refuses_values_the_model_cannot_use(argv, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("RANK", raising=False)
    err = _error(["generate", "--steps", "1", *argv], capsys)
    assert message in err
    assert not list(tmp_path.iterdir())


def test_align_compare_missing_file_is_invalid_input(tmp_path, capsys):
    err = _error(["align", "--compare", str(tmp_path / "missing.json"), str(tmp_path / "other.json")], capsys)
    assert "--compare" in err and "missing.json" in err and "no such file" in err


def test_ctrl_c_exits_130_without_a_traceback(tmp_path):
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "diffusers_omni.cli.main", "generate", "--steps", "1000", "--height", "32",
               "--width", "32", "--output", str(tmp_path / "x.png")]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    # Wait until the denoising loop runs (the role table is printed just before it).
    deadline = time.monotonic() + 240
    line = ""
    while "flux.single" not in line and time.monotonic() < deadline and proc.poll() is None:
        line = proc.stdout.readline()
    time.sleep(1.0)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err[-2000:]
    assert "interrupted" in err and "Traceback" not in err
    assert not (tmp_path / "x.png").exists()


def test_version(capsys):
    from importlib.metadata import version

    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"diffusers-omni {version('diffusers-omni')}"


def test_help_shows_defaults(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "denoising steps (default: the pipeline's" in out and "(default: tiny-flux)" in out and "(default: auto)" in out


def test_generate_json_summary(tmp_path, capsys):
    output = tmp_path / "out.png"
    argv = ["generate", "--steps", "2", "--height", "32", "--width", "32", "--guidance-scale", "2.5", "--json",
            "--output", str(output), "--attention", "native"]
    assert main(argv) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["output"] == str(output) and output.exists()
    assert summary["pipeline"] == "OmniFluxPipeline" and summary["dtype"] == "float32"
    assert {row["role"]: row["backend"] for row in summary["backends"]} == {"flux.joint": "TORCH_SDPA", "flux.single": "TORCH_SDPA"}
    assert set(summary["timings_s"]) == {"load", "enable", "generate"} and summary["timings_s"]["generate"] > 0
    assert summary["peak_host_rss_bytes"] > 0


def test_generate_layerwise_with_budget_and_prefetch(tmp_path, capsys):
    output = tmp_path / "out.png"
    argv = ["generate", "--steps", "1", "--height", "32", "--width", "32", "--offload", "layerwise",
            "--max-device-memory", "1MiB", "--prefetch-depth", "2", "--device", "cpu", "--output", str(output)]
    assert main(argv) == 0
    assert output.exists()


def test_generate_negative_prompt_reaches_the_pipeline(tmp_path, capsys):
    base = ["generate", "--model", "tiny-wan", "--steps", "1", "--height", "32", "--width", "32", "--json"]
    outputs = []
    for extra in ([], ["--negative-prompt", "blurry, low quality"]):
        output = tmp_path / f"v{len(outputs)}.gif"
        assert main([*base, *extra, "--output", str(output)]) == 0
        capsys.readouterr()
        outputs.append(output.read_bytes())
    assert outputs[0] != outputs[1]
