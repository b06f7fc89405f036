"""``max_device_memory="auto"``: the resident DiT blocks follow what each call shape needs, as measured
(``diffusers_omni/offload/headroom.py``).

The CPU has no allocator statistics, so a simulated card stands in for the device's memory (``Card``): what the
allocator holds reserved (``budget.read_reserved``, replaced) rises, when a DiT forward runs, to the offload's
resident bytes + its streaming window + the activations the test sets for the call's shape, and a forward that
would pass the card's size runs out of memory (``torch.OutOfMemoryError``) as a real one would. The reading auto
makes when enabling (``budget.read_machine``) is replaced by the same card. Blocks really move between the host
copies and the device buffers (the CPU is the device); every output is compared bitwise with the model's own.
"""

from __future__ import annotations

import logging
import re

import pytest
import torch

from diffusers_omni import OffloadConfig, apply_offload
from diffusers_omni.offload import budget
from diffusers_omni.offload.budget import MachineReading
from diffusers_omni.offload.headroom import Headroom, Need, Shape, call_shape
from diffusers_omni.offload.streamer import StreamedBlock
from diffusers_omni.testing.tiny import tiny_flux_inputs

from offload_helpers import (
    FLUX_CALL, assert_same_snapshot, bare_flux, block_bytes, flux_pipe, generate, snapshot, wan22_pipe,
)

GiB = 1 << 30
MiB = 1 << 20
MARGIN = 512 * MiB  # budget.peak_margin of the cards below (8 % of ~1 GiB is less than its floor)


class Card:
    """A simulated device (see the module's docstring): ``size`` bytes; ``activation`` what the next forwards need
    beside the weights and the window."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.activation = 0
        self.reserved = 0
        self.failures = 0
        self.fail_next = False  # the next forward needs more than the card has, whatever it holds
        self.backend = None

    def read_machine(self, device: torch.device) -> MachineReading:
        return MachineReading(str(device), mem_available=self.size)

    def read_reserved(self, device: torch.device, empty_cache: bool = False) -> int:
        if empty_cache:
            self.reserved = self.backend.stats.resident_device_bytes
        return self.reserved

    def forward(self, module, args) -> None:  # a forward pre-hook on the DiT's first block
        if self.backend._state is None:
            return  # disabled: the model's own forward
        stats = self.backend.stats
        needed = stats.resident_device_bytes + stats.in_flight_capacity + self.activation
        if needed > self.size or self.fail_next:
            self.fail_next = False
            self.failures += 1
            raise torch.OutOfMemoryError(f"CUDA out of memory: {needed} > {self.size} (simulated card)")
        self.reserved = max(self.reserved, needed)

    def install(self, monkeypatch) -> "Card":
        monkeypatch.setattr(budget, "read_machine", self.read_machine)
        monkeypatch.setattr(budget, "read_reserved", self.read_reserved)
        return self


def _blocks(model) -> list[torch.nn.Module]:
    return list(model.transformer_blocks) + list(model.single_transformer_blocks)


def _non_block(model) -> int:
    return sum(p.numel() * 4 for n, p in model.named_parameters() if "transformer_blocks" not in n)


def _run(model, seed: int = 0, tokens: int = 16) -> torch.Tensor:
    dtype = model.proj_out.bias.dtype if model.proj_out.bias.numel() else model.x_embedder.bias.dtype
    inputs = {k: v.to(dtype) if v.is_floating_point() and k not in ("img_ids", "txt_ids") else v
              for k, v in tiny_flux_inputs(seed, image_tokens=tokens).items()}
    with torch.no_grad():
        return model(**inputs, return_dict=False)[0]


def _offload(model, card: Card, monkeypatch, weights_budget: int):
    """Auto on ``card`` sized so that auto's budget (the card less its 1 GiB headroom floor) is
    ``weights_budget``."""
    card.size = GiB + weights_budget
    card.install(monkeypatch)
    backend = apply_offload(model, OffloadConfig("layerwise", device="cpu", max_device_memory="auto"))
    card.backend = backend
    _blocks(model)[0].register_forward_pre_hook(card.forward)
    return backend


def _peak(backend, card: Card) -> int:
    return backend.stats.resident_device_bytes + backend.stats.in_flight_capacity + card.activation


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and r.name == "diffusers_omni"]


def _give_back(backend, model, original, reference) -> None:
    """Disable: the model's tensors are the same objects, bitwise, no hook left, and it computes as before."""
    backend.disable()
    assert_same_snapshot(original, snapshot(model))
    assert torch.equal(_run(model), reference)


def test_a_measured_shape_keeps_streamed_blocks_on_the_device_up_to_the_card_and_a_larger_one_streams_first(
        monkeypatch, caplog):
    model = bare_flux(num_layers=2, num_single_layers=6).eval()
    references = {tokens: _run(model, tokens=tokens) for tokens in (16, 64)}
    original = snapshot(model)
    blocks = _blocks(model)
    single, double = block_bytes(blocks[-2]), block_bytes(blocks[0])
    card = Card(0)
    # Auto keeps two blocks resident (the budget of the other tests of a spread plan): non-block weights + the
    # window (two double blocks) + one double and one single block + slack.
    backend = _offload(model, card, monkeypatch, _non_block(model) + 2 * double + double + single + 16 * 1024)
    stats, state = backend.stats, backend._state
    assert isinstance(backend._state.streamer, object) and stats.resident_blocks == 2
    assert state.device_limit == card.size and stats.headroom_ceiling == card.size - MARGIN
    resident0, window0 = stats.resident_device_bytes, stats.in_flight_capacity
    # The small shape needs all but room for two and a half single blocks below the ceiling.
    room = 2 * single + single // 2
    card.activation = card.size - MARGIN - resident0 - window0 - room
    with caplog.at_level(logging.WARNING, logger="diffusers_omni"):
        assert torch.equal(_run(model), references[16])  # measured, nothing moves yet
        assert stats.resident_blocks == 2 and stats.headroom == {"FluxTransformer2DModel 1×16×16": window0 +
                                                                 card.activation}
        assert torch.equal(_run(model), references[16])  # two single blocks stay on the device from now on
    assert (stats.resident_blocks, stats.headroom_kept) == (4, 2) and 2 * single <= stats.headroom_kept_bytes <= room
    assert stats.resident_device_bytes == resident0 + stats.headroom_kept_bytes
    assert _peak(backend, card) <= card.size - MARGIN < _peak(backend, card) + single  # no third one fits
    kept = [b for b, r in zip(blocks, state.resident[0]) if r]
    assert all(block_bytes(b) > 0 for b in kept) and len(kept) == 4
    # The same shape again: nothing moves, nothing is measured again.
    assert torch.equal(_run(model), references[16]) and stats.headroom_kept == 2

    # A shape four times larger: predicted at four times what the small one needed, more than the card has beside
    # any resident block: every block the budget or the measurement chose streams *before* the forward runs.
    card.activation += double  # what it really needs: a little more than the small shape
    with caplog.at_level(logging.WARNING, logger="diffusers_omni"):
        assert torch.equal(_run(model, tokens=64), references[64])
    assert card.failures == 0 and not _warnings(caplog)  # no out-of-memory retry was needed
    assert stats.headroom_streamed == 4 and stats.resident_blocks == 0
    assert "FluxTransformer2DModel 1×64×16" in stats.headroom  # measured as it ran
    # Measured, it leaves room for some blocks again at the next call of that shape.
    assert torch.equal(_run(model, tokens=64), references[64])
    assert stats.resident_blocks > 0 and _peak(backend, card) <= card.size - MARGIN
    # Back to the small shape: its measurement applies, blocks come back up to the ceiling, exact.
    card.activation -= double
    assert torch.equal(_run(model), references[16]) and card.failures == 0
    assert _peak(backend, card) <= card.size - MARGIN < _peak(backend, card) + single
    # state_dict() shows every block's values, resident or streamed; disable gives back the model bitwise.
    assert all(torch.equal(value, original[f"0.{name}"][-1]) for name, value in model.state_dict().items())
    _give_back(backend, model, original, references[16])


def test_a_card_with_room_for_everything_keeps_every_block_and_the_hooks_of_streaming_go(monkeypatch):
    model = bare_flux(num_layers=2, num_single_layers=4).eval()
    reference = _run(model)
    original = snapshot(model)
    blocks = _blocks(model)
    card = Card(0)
    backend = _offload(model, card, monkeypatch, _non_block(model) + 3 * block_bytes(blocks[0]) + 16 * 1024)
    stats, state = backend.stats, backend._state
    assert 0 < stats.resident_blocks < len(blocks)
    card.activation = 1024  # next to nothing: everything fits below the ceiling
    for _ in range(3):
        assert torch.equal(_run(model), reference)
    assert stats.streamed_blocks == 0 and stats.resident_blocks == len(blocks) and stats.in_flight_capacity == 0
    # No block (nor the output layers) keeps a streamed block's hook: nothing loads, nothing is bound again.
    loads = stats.loads
    assert torch.equal(_run(model), reference) and stats.loads == loads
    assert all(not state.hooks.installed(b, "layerwise_block") for b in blocks + [model.proj_out, model.norm_out])
    assert all(block_bytes(b) > 0 for b in blocks)
    assert all(torch.equal(value, original[f"0.{name}"][-1]) for name, value in model.state_dict().items())
    backend.disable()
    assert_same_snapshot(original, snapshot(model))


def test_a_step_that_runs_out_of_memory_after_all_freezes_its_shape(monkeypatch, caplog):
    """The measurement said there was room, the next step needed more (a shape whose activations vary): the
    retry streams the resident blocks, and no block is kept on the device for that shape again."""
    model = bare_flux(num_layers=2, num_single_layers=6).eval()
    reference = _run(model)
    blocks = _blocks(model)
    single = block_bytes(blocks[-2])
    card = Card(0)
    backend = _offload(model, card, monkeypatch, _non_block(model) + 3 * block_bytes(blocks[0]) + single + 16384)
    stats = backend.stats
    card.activation = card.size - MARGIN - stats.resident_device_bytes - stats.in_flight_capacity - 3 * single
    assert torch.equal(_run(model), reference) and torch.equal(_run(model), reference)
    assert stats.headroom_kept > 0
    card.fail_next = True  # more than measured, once
    with caplog.at_level(logging.WARNING, logger="diffusers_omni"):
        assert torch.equal(_run(model), reference)
    assert card.failures == 1 and len(_warnings(caplog)) == 1 and stats.residents_shrunk > 0
    kept = stats.headroom_kept
    for _ in range(2):
        assert torch.equal(_run(model), reference)
    assert stats.headroom_kept == kept and stats.resident_blocks == 0 and card.failures == 1
    backend.disable()


def test_a_block_whose_device_memory_is_refused_stays_streamed_and_the_call_runs(monkeypatch):
    """The measurement left room, but the device refuses the second block's memory when it is kept (another process
    took some): the first stays kept, the others stream as before, the shape keeps no more, the output is exact."""
    model = bare_flux(num_layers=2, num_single_layers=6).eval()
    reference = _run(model)
    original = snapshot(model)
    blocks = _blocks(model)
    card = Card(0)
    backend = _offload(model, card, monkeypatch, _non_block(model) + 3 * block_bytes(blocks[0]) + 16384)
    stats = backend.stats
    total = stats.resident_blocks + stats.streamed_blocks
    card.activation = 1024  # room for everything
    assert torch.equal(_run(model), reference)  # measured
    calls = []
    stay = StreamedBlock.stay

    def refuse_the_second(self, transfers):
        calls.append(self.weights.path)
        if len(calls) == 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 MiB (injected)")
        return stay(self, transfers)

    monkeypatch.setattr(StreamedBlock, "stay", refuse_the_second)
    assert torch.equal(_run(model), reference)
    monkeypatch.setattr(StreamedBlock, "stay", stay)
    assert stats.headroom_kept == 1 and stats.resident_blocks + stats.streamed_blocks == total
    assert stats.streamed_blocks > 0 and backend._state.streamer.capacity == stats.in_flight_capacity
    for _ in range(2):  # frozen: nothing more is kept, every call exact
        assert torch.equal(_run(model), reference)
    assert stats.headroom_kept == 1
    assert all(torch.equal(value, original[f"0.{name}"][-1]) for name, value in model.state_dict().items())
    backend.disable()
    assert_same_snapshot(original, snapshot(model))


def test_lossless_blocks_stay_on_the_device_decoded_and_disable_gives_every_bit_back(monkeypatch, caplog):
    """compression="lossless": the streamed blocks are coded in host memory; the ones a measured shape leaves room
    for are decoded once into device buffers and stay (their store keeps the code for disable), then stream again,
    coded, when a larger shape needs their room."""
    model = bare_flux(num_layers=2, num_single_layers=6).to(torch.bfloat16).eval()
    references = {tokens: _run(model, tokens=tokens) for tokens in (16, 64)}
    original = snapshot(model)
    blocks = _blocks(model)
    double = block_bytes(blocks[0])
    with pytest.raises(ValueError, match="is too small") as error:
        apply_offload(model, OffloadConfig("layerwise", device="cpu", max_device_memory=1, compression="lossless"))
    least = int(re.search(r"allowed: at least (\d+)", str(error.value)).group(1))
    card = Card(GiB + least + 4096).install(monkeypatch)
    backend = apply_offload(model, OffloadConfig("layerwise", device="cpu", max_device_memory="auto",
                                                 compression="lossless"))
    card.backend = backend
    blocks[0].register_forward_pre_hook(card.forward)
    stats, state = backend.stats, backend._state
    assert stats.resident_blocks == 0 and stats.store_blocks == {"lossless": 8}
    card.activation = card.size - MARGIN - stats.resident_device_bytes - stats.in_flight_capacity - 3 * double
    with caplog.at_level(logging.WARNING, logger="diffusers_omni"):
        for _ in range(2):
            assert torch.equal(_run(model), references[16])
    assert stats.headroom_kept >= 2 and set(state.kept) and stats.store_blocks["lossless"] == 8 - len(state.kept)
    assert all(type(b.store).__name__ == "LosslessStore" for b in state.kept.values())
    assert torch.equal(_run(model), references[16]) and not _warnings(caplog)
    assert all(torch.equal(value, original[f"0.{name}"][-1]) for name, value in model.state_dict().items())
    # A larger shape streams them again, coded, before it runs; back at the small shape they stay again.
    card.activation += double
    assert torch.equal(_run(model, tokens=64), references[64]) and stats.headroom_streamed >= 2
    assert not state.kept and stats.store_blocks["lossless"] == 8
    card.activation -= double
    assert torch.equal(_run(model), references[16]) and state.kept and card.failures == 0
    _give_back(backend, model, original, references[16])


def test_an_explicit_budget_is_the_users_number_and_nothing_is_measured(monkeypatch):
    model = bare_flux(num_layers=2, num_single_layers=6).eval()
    reference = _run(model)
    card = Card(GiB).install(monkeypatch)
    blocks = _blocks(model)
    backend = apply_offload(model, OffloadConfig("layerwise", device="cpu", max_device_memory=_non_block(model) + 3 *
                                                 block_bytes(blocks[0]) + 16384))
    card.backend = backend
    resident = backend.stats.resident_blocks
    assert backend._state.device_limit is None and backend.stats.headroom_ceiling is None
    for _ in range(2):
        assert torch.equal(_run(model), reference)
    assert backend.stats.resident_blocks == resident and backend.stats.headroom == {}
    backend.disable()


def _least_budget(pipe) -> int:
    with pytest.raises(ValueError, match="is too small") as error:
        pipe.enable_layerwise_offload(device="cpu", max_device_memory=1)
    return int(re.search(r"allowed: at least (\d+)", str(error.value)).group(1))


def test_the_whole_tiny_flux_pipeline_under_auto_on_a_small_card_is_bitwise_the_pipeline(monkeypatch, caplog):
    """Encoders stream through the same window, the VAE comes in for its phase: the transformer's streamed blocks
    stay on the device once measured (its stack then has no streamed block left), bitwise the pipeline."""
    pipe = flux_pipe()
    reference = generate(pipe, steps=3)
    transformer = pipe.transformer
    double = block_bytes(_blocks(transformer)[0])
    card = Card(GiB + _least_budget(pipe) + 1024).install(monkeypatch)
    backend = pipe.enable_layerwise_offload(device="cpu", max_device_memory="auto")
    card.backend = backend
    stats, state = backend.stats, backend._state
    assert state.resident[0] == [False, False]  # the transformer's two blocks stream
    _blocks(transformer)[0].register_forward_pre_hook(card.forward)
    card.activation = card.size - MARGIN - stats.resident_device_bytes - stats.in_flight_capacity - 2 * double
    with caplog.at_level(logging.WARNING, logger="diffusers_omni"):
        for _ in range(2):
            assert torch.equal(generate(pipe, steps=3), reference)
    assert not _warnings(caplog) and card.failures == 0
    assert state.resident[0] == [True, True] and stats.headroom_kept == 2
    assert stats.headroom_kept_bytes == sum(w.nbytes for w in state.weights[0])  # the output layers with the last
    assert list(stats.headroom) == ["transformer 1×16×16"] or len(stats.headroom) == 1
    report = str(pipe.omni_offload_report())
    assert "auto headroom, measured per call shape" in report
    assert "2 streamed DiT blocks" in report and "kept on the device where a shape left room" in report
    pipe.disable_omni_offload()
    assert torch.equal(generate(pipe, steps=3), reference)


def _image(pipe) -> torch.Tensor:
    """A decoded image (``generate`` stops at the latents)."""
    return pipe(prompt="a red fox in the snow", num_inference_steps=2, generator=torch.Generator().manual_seed(0),
                output_type="pt", max_sequence_length=32, **FLUX_CALL).images


def test_kept_blocks_make_room_for_a_vae_and_come_back(monkeypatch):
    """The transformer's blocks stay on the device once measured; the VAE's first decode is measured with the room
    made (were they there, its decoder would fail: injected): they leave for the decode through their store,
    exactly, and come back for the next call's DiT; the next decode, with no room left beside them, makes it again."""
    pipe = flux_pipe()
    reference = _image(pipe)
    forward, failures, held = pipe.vae.decoder.forward, [], {}

    def decoder(*args, **kwargs):
        state = held["backend"]._state
        if state is not None and state.kept and not state.phases.residents.away:
            failures.append(1)
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 3.00 GiB (injected)")
        return forward(*args, **kwargs)

    pipe.vae.decoder.forward = decoder  # before enabling: the offload's hooks wrap it like any forward
    transformer = pipe.transformer
    double = block_bytes(_blocks(transformer)[0])  # measured before enabling: streamed, it holds a placeholder
    card = Card(GiB + _least_budget(pipe) + 1024).install(monkeypatch)
    held["backend"] = backend = card.backend = pipe.enable_layerwise_offload(device="cpu", max_device_memory="auto")
    stats, state = backend.stats, backend._state
    _blocks(transformer)[0].register_forward_pre_hook(card.forward)
    card.activation = card.size - MARGIN - stats.resident_device_bytes - stats.in_flight_capacity - 2 * double
    assert torch.equal(_image(pipe), reference)  # measured at the first step, kept at the second, away for the decode
    assert len(state.kept) == 2 and not failures and stats.residents_left == 1
    assert all(block_bytes(block) == 0 for block in _blocks(transformer)) and state.phases.residents.away
    assert torch.equal(_image(pipe), reference)  # back for the DiT, away again (the card reads no device room)
    assert not failures and stats.residents_left == 2 and not pipe.vae.use_tiling
    pipe.disable_omni_offload()
    assert torch.equal(_image(pipe), reference)


def test_wan22s_two_experts_share_the_card_and_the_second_starts_from_the_firsts_measurement(monkeypatch):
    """Two DiTs alternate (Wan 2.2's high- and low-noise experts): the second's first step is fitted from the
    first's measurement, each then measured; the video is stock Diffusers', bitwise, through two calls."""
    pipe = wan22_pipe()
    pipe.register_to_config(boundary_ratio=0.8)  # of 4 steps: two per expert
    for component in (pipe.transformer, pipe.transformer_2, pipe.text_encoder, pipe.vae):
        component.eval()
    reference = generate(pipe, steps=4)
    card = Card(GiB + _least_budget(pipe) + 1024).install(monkeypatch)
    backend = card.backend = pipe.enable_layerwise_offload(device="cpu", max_device_memory="auto")
    stats, state = backend.stats, backend._state
    assert stats.resident_blocks == 0
    for expert in (pipe.transformer, pipe.transformer_2):
        expert.blocks[0].register_forward_pre_hook(card.forward)
    block = state.weights[0][0].nbytes  # an expert's one block, packed with its output layers
    card.activation = card.size - MARGIN - stats.resident_device_bytes - stats.in_flight_capacity - 3 * block
    for _ in range(2):
        assert torch.equal(generate(pipe, steps=4), reference)
    assert card.failures == 0 and len(stats.headroom) == 2  # each expert measured at its own first step
    assert {shape.split()[0] for shape in stats.headroom} == {"transformer", "transformer_2"}
    assert stats.headroom_kept == 2 and state.resident[0] == [True] and state.resident[1] == [True]
    pipe.disable_omni_offload()
    assert torch.equal(generate(pipe, steps=4), reference)


def test_an_encoder_that_runs_out_beside_kept_blocks_lowers_the_ceiling_and_finds_room_at_its_next_call(
        monkeypatch, caplog):
    """The transformer's blocks stay on the device once measured; the T5 encoder then does not fit beside them at
    the next call (injected: it fails while more than the enable's resident bytes are there). It makes room and
    runs again (one warning), the ceiling comes down by a margin, the next denoising step streams the kept blocks
    first, and the call after finds the room: no second failure, every image bitwise."""
    pipe = flux_pipe()
    reference = generate(pipe, steps=2)
    double = block_bytes(_blocks(pipe.transformer)[0])
    card = Card(GiB + _least_budget(pipe) + 1024).install(monkeypatch)
    backend = card.backend = pipe.enable_layerwise_offload(device="cpu", max_device_memory="auto")
    stats, state = backend.stats, backend._state
    enabled = stats.resident_device_bytes
    _blocks(pipe.transformer)[0].register_forward_pre_hook(card.forward)
    card.activation = card.size - MARGIN - stats.resident_device_bytes - stats.in_flight_capacity - 2 * double
    failures: list[int] = []

    def t5_beside_kept_blocks(module, args):
        residents = state.phases.residents if backend._state is not None else None
        if residents is not None and not residents.away and stats.resident_device_bytes > enabled:
            failures.append(1)
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 400.00 MiB (injected)")

    pipe.text_encoder_2.encoder.block[0].register_forward_pre_hook(t5_beside_kept_blocks)
    ceiling = stats.headroom_ceiling
    with caplog.at_level(logging.WARNING, logger="diffusers_omni"):
        assert torch.equal(generate(pipe, steps=2), reference)  # measured, then the blocks stay
        assert len(state.kept) == 2 and not failures
        assert torch.equal(generate(pipe, steps=2), reference)  # T5 fails beside them, makes room; they stream
        assert len(failures) == 1 and stats.headroom_lowered == 1 and stats.headroom_ceiling == ceiling - MARGIN
        assert not state.kept and stats.headroom_streamed == 2
        assert torch.equal(generate(pipe, steps=2), reference)  # the room is there: no failure
    warnings = _warnings(caplog)
    assert len(failures) == 1 and len(warnings) == 1 and warnings[0].startswith("text_encoder_2 ran out of device")
    assert "planned under a lower ceiling from the next denoising step on" in warnings[0]
    assert card.failures == 0 and stats.residents_shrunk == 0
    pipe.disable_omni_offload()
    assert torch.equal(generate(pipe, steps=2), reference)


def test_call_shape_and_the_prediction_of_a_shape_not_measured():
    hidden = torch.zeros(2, 64, 16)
    assert call_shape("dit", (), {"hidden_states": hidden, "x": torch.zeros(1)}) == Shape("dit", (2, 64, 16), 2048)
    assert call_shape("dit", (hidden,), {}).dims == (2, 64, 16)
    assert call_shape("dit", (), {"timestep": 3}) is None

    class State:
        class stats:
            headroom_ceiling = None

    headroom = Headroom(State(), torch.device("cpu"), depth=1, limit=8 * GiB)
    assert headroom.ceiling == 8 * GiB - budget.peak_margin(8 * GiB)
    small, large = Shape("dit", (1, 16, 4), 64), Shape("dit", (1, 64, 4), 256)
    assert headroom.need(small) is None  # nothing measured: the plan stays
    headroom.needs[small] = Need(100, 10)
    assert headroom.need(large) == Need(400, 10, measured=False)  # scaled by the sizes' ratio
    headroom.needs[large] = Need(300, 10)
    middle = Shape("dit", (1, 32, 4), 128)
    assert headroom.need(middle) == Need(300, 10, measured=False)  # the nearest larger shape's
    assert headroom.need(small) == Need(100, 10)
    other = Shape("expert_2", (1, 16, 4), 64)  # another DiT not measured yet: the others' shapes
    assert headroom.need(other) == Need(100, 10, measured=False)


@pytest.mark.parametrize("device", ["cpu"])
def test_read_reserved_on_the_cpu_reads_nothing(device):
    assert budget.read_reserved(torch.device(device), empty_cache=True) is None
