"""A VAE phase that does not fit the device untiled runs in tiles (``diffusers_omni/offload/vae_tiling.py``).

Running out of device memory is injected: the tiny VAE's decoder raises ``torch.OutOfMemoryError`` for any input
larger than one tile, as a real card would for a large resolution; the tiling, the retry, the warning and the
restore are the real ones.
"""

from __future__ import annotations

import logging

import pytest
import torch

from diffusers_omni.offload.budget import MachineReading
from offload_helpers import WAN_CALL, flux_pipe, wan22_pipe

GiB = 1 << 30


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


class Allocator:
    """A simulated CUDA allocator for the VAE's room (``budget.read_reserved`` and ``budget.read_machine``): what is
    reserved is the resident blocks' bytes while they are on the device plus what the VAE's decoder takes (``need``,
    kept cached after the call as a real allocator keeps its segments); ``free`` is what the card has left."""

    def __init__(self, residents, need: int, free: int) -> None:
        self.residents, self.need, self.free = residents, need, free
        self.reserved = 0
        self.beside = []  # per decode: whether the resident blocks were on the device

    def on_device(self) -> int:
        return 0 if self.residents.away else self.residents.nbytes

    def read_reserved(self, device, empty_cache: bool = False) -> int:
        if empty_cache:
            self.reserved = self.on_device()
        return self.reserved

    def read_machine(self, device) -> MachineReading:
        return MachineReading("cuda:0", device_free=self.free, device_total=self.free + self.reserved,
                              device_allocated=self.on_device(), device_cached=0)

    def decoder(self, forward):
        def decode(*args, **kwargs):
            self.beside.append(not self.residents.away)
            self.reserved = self.on_device() + self.need
            return forward(*args, **kwargs)
        return decode


def test_a_decode_is_measured_with_the_room_made_then_runs_beside_resident_blocks_only_where_it_fits(monkeypatch):
    """Where the allocator keeps statistics, a VAE's first decode at a shape makes room first and is measured (a
    decode beside resident blocks may silently take another cuDNN algorithm, other bits); a later decode at that
    shape stays beside them when the device has its measured need plus the margin left, and makes room otherwise.
    The video is the resident one throughout, and after disable."""
    from diffusers_omni.offload import budget

    pipe = wan22_pipe()
    reference = generate_video(pipe, steps=2)
    backend = pipe.enable_layerwise_offload(device="cpu", max_device_memory=308160 + 50000)
    stats, residents = backend.stats, backend._state.phases.residents
    assert len(residents.weights) == 1
    need = 4 * GiB  # where a quarter of it is more than the least margin
    card = Allocator(residents, need, free=need + budget.vae_room_margin(need))
    pipe.vae.decoder.forward = card.decoder(pipe.vae.decoder.forward)
    monkeypatch.setattr(budget, "read_reserved", card.read_reserved)
    monkeypatch.setattr(budget, "read_machine", card.read_machine)

    def call() -> set[bool]:  # whether the resident blocks were beside the decoder (called per latent frame)
        card.beside.clear()
        assert torch.equal(generate_video(pipe, steps=2), reference)
        return set(card.beside)

    assert call() == {False} and stats.residents_left == 1  # measured with the room made
    assert call() == {True} and stats.residents_left == 1  # its need fits beside them: they stay
    assert budget.vae_room_margin(need) == need // 4 > budget.peak_margin(need)
    card.free = need + budget.vae_room_margin(need) - 1
    assert call() == {False} and stats.residents_left == 2  # no longer: they leave first
    assert not pipe.vae.use_tiling
    pipe.disable_omni_offload()
    assert torch.equal(generate_video(pipe, steps=2), reference)


def test_without_allocator_statistics_a_decode_runs_beside_resident_blocks():
    """On the CPU (no allocator statistics: nothing chooses an algorithm by free memory) a decode that fits runs
    beside the resident blocks: nothing leaves."""
    pipe = wan22_pipe()
    reference = generate_video(pipe, steps=2)
    backend = pipe.enable_layerwise_offload(device="cpu", max_device_memory=308160 + 50000)
    assert torch.equal(generate_video(pipe, steps=2), reference)
    assert backend.stats.residents_left == 0 and len(backend._state.phases.residents.weights) == 1
