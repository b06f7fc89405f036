"""A VAE phase that does not fit the device untiled runs in tiles (``diffusers_omni/offload/vae_tiling.py``).

Running out of device memory is injected: the tiny VAE's decoder raises ``torch.OutOfMemoryError`` for any input
larger than one tile, as a real card would for a large resolution; the tiling, the retry, the warning and the
restore are the real ones.
"""

from __future__ import annotations

import logging

import pytest
import torch

from offload_helpers import WAN_CALL, flux_pipe, wan22_pipe


def generate(pipe) -> torch.Tensor:
    """A 64×64 image (latents larger than one of the tiny VAE's tiles), decoded."""
    return pipe(prompt="a red fox in the snow", num_inference_steps=2, generator=torch.Generator().manual_seed(0),
                height=64, width=64, output_type="pt", max_sequence_length=32).images


def generate_video(pipe, steps: int) -> torch.Tensor:
    """The tiny Wan 2.2's video, decoded by its VAE."""
    return pipe(prompt="a red fox in the snow", num_inference_steps=steps, generator=torch.Generator().manual_seed(0),
                output_type="pt", max_sequence_length=32, **WAN_CALL).frames


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


def test_a_decode_out_of_memory_beside_resident_blocks_makes_room_and_keeps_the_image(caplog):
    """A budget keeps a DiT block resident; the VAE does not fit beside it (injected: its decoder fails while the
    block is on the device). The resident blocks leave for it, the decode runs again untiled, the video is the
    resident one; later calls bring them back for the DiT and make the room before the decode, without failing."""
    pipe = wan22_pipe()
    reference = generate_video(pipe, steps=2)
    forward, failures, held = pipe.vae.decoder.forward, [], {}

    def decoder(*args, **kwargs):
        if not held["residents"].away:
            failures.append(1)
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 3.00 GiB (injected)")
        return forward(*args, **kwargs)

    pipe.vae.decoder.forward = decoder
    # The tiny Wan 2.2's smallest budget (301 KiB) plus room for one of its blocks.
    backend = pipe.enable_layerwise_offload(device="cpu", max_device_memory=308160 + 50000)
    stats = backend.stats
    assert (stats.resident_blocks, stats.streamed_blocks) == (1, 3)
    held["residents"] = residents = backend._state.phases.residents
    assert residents is not None and len(residents.weights) == 1
    with caplog.at_level(logging.WARNING, logger="diffusers_omni"):
        video = generate_video(pipe, steps=2)
    assert torch.equal(video, reference) and not pipe.vae.use_tiling
    assert len(failures) == 1 and stats.residents_left == 1 and stats.residents_left_bytes == residents.nbytes
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "vae.decode ran out of device memory beside the DiT blocks" in warnings[0]
    assert "The output is unchanged" in warnings[0]
    assert any("left the device 1 times" in note for note in pipe.omni_offload_report().notes)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="diffusers_omni"):
        assert torch.equal(generate_video(pipe, steps=2), reference)  # back for the DiT, away before the decode
    assert len(failures) == 1 and stats.residents_left == 2 and not caplog.records
    pipe.disable_omni_offload()
    assert torch.equal(generate_video(pipe, steps=2), reference)


def test_a_decode_beside_no_resident_block_tiles_as_before():
    pipe = flux_pipe()
    _fail_untiled(pipe.vae)
    backend = pipe.enable_layerwise_offload(device="cpu")
    assert backend._state.phases.residents is None  # nothing to free: the tiling retry as before
    generate(pipe)
    assert pipe.vae.use_tiling and backend.stats.residents_left == 0
