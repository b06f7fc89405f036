"""Progress bars of long offload work: shown on request or by size, silenced by the pipeline's own bar config."""

from __future__ import annotations

import contextlib
import io

import pytest
import torch
from tqdm import tqdm

from diffusers_omni import OffloadConfig, apply_offload
from diffusers_omni.utils.progress import PROGRESS_MIN_BYTES, byte_progress

from offload_helpers import bare_flux, flux_pipe, generate

DESCS = {
    "model_level": "model-level offload: packing components",
    "layerwise": "layerwise offload: packing blocks",
}


def _enable(pipe, strategy: str, **options):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        backend = pipe.enable_omni_offload(OffloadConfig(strategy, device="cpu", **options))
    return backend, err.getvalue()


def test_model_level_packing_shows_a_byte_bar_when_asked():
    pipe = flux_pipe()
    reference = generate(pipe, steps=2)
    backend, err = _enable(pipe, "model_level", show_progress=True)
    assert DESCS["model_level"] in err
    last = err.rstrip().split("\r")[-1]
    size = tqdm.format_sizeof(sum(e.weights.nbytes for e in backend._state.exclusives))  # packed, aligned bytes
    assert "100%" in last and f"| {size}/{size} [" in last, last
    assert torch.equal(generate(pipe, steps=2), reference)
    pipe.disable_omni_offload()


@pytest.mark.parametrize("strategy", ["model_level", "layerwise"])
def test_small_models_and_show_progress_false_show_no_bar(strategy):
    for options in ({}, {"show_progress": False}):  # tiny models are far below the 1 GiB threshold
        pipe = flux_pipe()
        _, err = _enable(pipe, strategy, **options)
        assert DESCS[strategy] not in err and "%|" not in err
        pipe.disable_omni_offload()


@pytest.mark.parametrize("strategy", ["model_level", "layerwise"])
def test_pipeline_progress_bar_config_disable_silences_offload_bars(strategy):
    pipe = flux_pipe()
    pipe.set_progress_bar_config(disable=True)
    _, err = _enable(pipe, strategy, show_progress=True)
    assert err == ""
    pipe.disable_omni_offload()
    pipe.set_progress_bar_config(disable=False)  # not an opinion: show_progress decides again
    _, err = _enable(pipe, strategy, show_progress=True)
    assert DESCS[strategy] in err
    pipe.disable_omni_offload()


def test_pipeline_progress_bar_settings_pass_through_but_desc_stays_ours():
    pipe = flux_pipe()
    out = io.StringIO()
    pipe.set_progress_bar_config(file=out, desc="Denoising", leave=False)
    _, err = _enable(pipe, "model_level", show_progress=True)
    assert err == ""  # the pipeline's file= is used
    text = out.getvalue()
    assert DESCS["model_level"] in text and "Denoising" not in text
    assert not text.endswith("\n")  # leave=False clears the bar instead of ending its line
    pipe.disable_omni_offload()


def test_bare_model_has_no_pipeline_config_and_follows_show_progress():
    model = bare_flux()
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        backend = apply_offload(model, OffloadConfig("model_level", device="cpu", show_progress=True))
    backend.disable()
    assert DESCS["model_level"] in err.getvalue() and "100%" in err.getvalue()


def test_byte_progress_rules():
    pipe = flux_pipe()
    with contextlib.redirect_stderr(io.StringIO()):
        assert not byte_progress(PROGRESS_MIN_BYTES, "x", None, pipe).disable  # size threshold
        assert byte_progress(PROGRESS_MIN_BYTES - 1, "x", None, pipe).disable
        assert byte_progress(PROGRESS_MIN_BYTES, "x", False, pipe).disable
        assert not byte_progress(1, "x", True, pipe).disable
        pipe.set_progress_bar_config(disable=True)
        assert byte_progress(PROGRESS_MIN_BYTES, "x", None, pipe).disable
        assert byte_progress(1, "x", True, pipe).disable
        assert not byte_progress(1, "x", True, pipe.transformer).disable  # a bare model has no bar config
