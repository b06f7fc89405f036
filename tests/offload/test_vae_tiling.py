"""A VAE phase that does not fit the device untiled runs in tiles (``diffusers_omni/offload/vae_tiling.py``).

Running out of device memory is injected: the tiny VAE's decoder raises ``torch.OutOfMemoryError`` for any input
larger than one tile, as a real card would for a large resolution; the tiling, the retry, the warning and the
restore are the real ones.
"""

from __future__ import annotations

import logging

import pytest
import torch

from offload_helpers import flux_pipe


def generate(pipe) -> torch.Tensor:
    """A 64×64 image (latents larger than one of the tiny VAE's tiles), decoded."""
    return pipe(prompt="a red fox in the snow", num_inference_steps=2, generator=torch.Generator().manual_seed(0),
                height=64, width=64, output_type="pt", max_sequence_length=32).images


def _fail_untiled(vae) -> list[tuple[int, ...]]:
    """Make ``vae``'s decoder raise an out-of-memory error for inputs larger than one tile; the shapes it saw."""
    seen = []
    forward = vae.decoder.forward

    def decoder(z, *args, **kwargs):
        seen.append(tuple(z.shape))
        if max(z.shape[-2:]) > vae.tile_latent_min_size:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.00 GiB (injected)")
        return forward(z, *args, **kwargs)

    vae.decoder.forward = decoder  # before enabling: the offload's hooks wrap it like any forward
    return seen


def _reference(tiled: bool) -> torch.Tensor:
    pipe = flux_pipe()
    if tiled:
        pipe.vae.enable_tiling()
    with torch.no_grad():
        return generate(pipe)


def test_an_untiled_decode_that_runs_out_of_memory_runs_again_in_tiles(caplog):
    pipe = flux_pipe()
    seen = _fail_untiled(pipe.vae)
    pipe.enable_layerwise_offload(device="cpu")
    with caplog.at_level(logging.WARNING, logger="diffusers_omni"):
        image = generate(pipe)
    assert torch.equal(image, _reference(tiled=True))
    assert max(max(shape[-2:]) for shape in seen) > pipe.vae.tile_latent_min_size  # it did fail untiled first
    warnings = [r.getMessage() for r in caplog.records if "runs in tiles" in r.getMessage()]
    assert len(warnings) == 1 and "vae.decode ran out of device memory untiled" in warnings[0]
    assert pipe.vae.use_tiling
    assert any(note.startswith("vae: ran out of device memory untiled") for note in pipe.omni_offload_report().notes)
    # Later calls tile from the start: no second failure, no second warning.
    seen.clear()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="diffusers_omni"):
        assert torch.equal(generate(pipe), image)
    assert max(max(shape[-2:]) for shape in seen) <= pipe.vae.tile_latent_min_size
    assert not [r for r in caplog.records if "runs in tiles" in r.getMessage()]
    pipe.disable_omni_offload()
    assert not pipe.vae.use_tiling and "decode" not in pipe.vae.__dict__ and "encode" not in pipe.vae.__dict__


def test_a_decode_that_fits_is_untouched_bitwise():
    pipe = flux_pipe()
    pipe.enable_layerwise_offload(device="cpu")
    assert torch.equal(generate(pipe), _reference(tiled=False))
    assert not pipe.vae.use_tiling
    assert not [note for note in pipe.omni_offload_report().notes if "untiled" in note]
    pipe.disable_omni_offload()
    assert "decode" not in pipe.vae.__dict__


def test_a_tiled_retry_that_fails_too_raises_and_leaves_tiling_off():
    pipe = flux_pipe()
    forward = pipe.vae.decoder.forward

    def always(z, *args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory (injected, every size)")

    pipe.vae.decoder.forward = always
    pipe.enable_layerwise_offload(device="cpu")
    with pytest.raises(torch.OutOfMemoryError, match="every size"):
        generate(pipe)
    assert not pipe.vae.use_tiling
    pipe.disable_omni_offload()
    pipe.vae.decoder.forward = forward


def test_a_vae_tiling_already_gets_the_error_as_it_came():
    pipe = flux_pipe()
    pipe.vae.enable_tiling()
    calls = []

    def always(z, *args, **kwargs):
        calls.append(tuple(z.shape))
        raise torch.OutOfMemoryError("CUDA out of memory (injected, in a tile)")

    pipe.vae.decoder.forward = always
    pipe.enable_layerwise_offload(device="cpu")
    with pytest.raises(torch.OutOfMemoryError, match="in a tile"):
        generate(pipe)
    assert len(calls) == 1  # no retry
    pipe.disable_omni_offload()
    assert pipe.vae.use_tiling  # the user's own setting
