"""Layerwise offload manages every component (#29 item 1): text/image encoders stream their blocks with their other
weights on the device only while they run, VAEs come in for their phase, and the device budget counts them all."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from diffusers_omni.models.encoders import ENCODER_BLOCKS, encoder_blocks_attrs
from diffusers_omni.offload.discovery import ENCODER, Component, encoder_stack, scan_block_lists
from diffusers_omni.offload.memory import PackedWeights

from offload_helpers import assert_same_snapshot, block_bytes, flux_pipe, generate, pipeline_snapshot, wan22_pipe

pytestmark = pytest.mark.integration


def _image(pipe, steps: int = 2) -> torch.Tensor:
    """The final decoded image (the VAE runs), not latents."""
    return pipe(prompt="a red fox in the snow", num_inference_steps=steps, height=32, width=32,
                generator=torch.Generator().manual_seed(0), output_type="pt", max_sequence_length=32).images


def _units(backend) -> dict[str, object]:
    return {unit.label: unit for unit in backend._state.units}


def _clip_layers(pipe) -> nn.ModuleList:
    encoder = pipe.text_encoder
    return encoder.text_model.encoder.layers if hasattr(encoder, "text_model") else encoder.encoder.layers


def test_flux_final_image_bitwise_with_every_component_managed_and_nothing_left_between_calls():
    pipe = flux_pipe()
    reference = _image(pipe)
    backend = pipe.enable_layerwise_offload(device="cpu")
    assert set(backend._state.managed) == {"text_encoder", "text_encoder_2", "vae"}
    assert torch.equal(_image(pipe), reference)
    with torch.inference_mode():
        assert torch.equal(_image(pipe), reference)
    # Between calls: every encoder block is an empty placeholder, every phase's weights are back on the host.
    for block in list(pipe.text_encoder_2.encoder.block) + list(_clip_layers(pipe)):
        assert block_bytes(block) == 0
    assert not any(unit.onloaded for unit in backend._state.units)
    stats = backend.stats
    assert stats.phase_units == 3 and stats.phase_onloads == 2 * 3  # CLIP's and T5's other weights, the VAE; per call
    assert stats.on_demand_loads == 0  # each encoder's first blocks load as it is entered
    pipe.disable_omni_offload()
    assert torch.equal(_image(pipe), reference)


def test_wan22_final_video_bitwise_with_umt5_streamed_and_the_vae_for_its_phase():
    pipe = wan22_pipe()
    call = {"prompt": "a red fox", "num_inference_steps": 4, "height": 32, "width": 32, "num_frames": 5,
            "output_type": "pt", "max_sequence_length": 32}
    reference = pipe(**call, generator=torch.Generator().manual_seed(0)).frames
    backend = pipe.enable_layerwise_offload(device="cpu")
    assert backend._state.managed["text_encoder"].startswith(f"{len(pipe.text_encoder.encoder.block)} blocks")
    for _ in range(2):
        assert torch.equal(pipe(**call, generator=torch.Generator().manual_seed(0)).frames, reference)
    assert not any(unit.onloaded for unit in backend._state.units)
    pipe.disable_omni_offload()


def test_vae_and_encoder_called_directly_come_in_and_the_next_phase_sends_them_back():
    pipe = flux_pipe()
    image = torch.rand(1, 3, 32, 32, generator=torch.Generator().manual_seed(1)) * 2 - 1
    ids = pipe.tokenizer_2(["a red fox"], return_tensors="pt").input_ids
    with torch.no_grad():
        latents = pipe.vae.encode(image).latent_dist.mean
        decoded = pipe.vae.decode(latents).sample
        encoded = pipe.text_encoder_2(ids)[0]
    backend = pipe.enable_layerwise_offload(device="cpu")
    vae = _units(backend)["vae"]
    with torch.no_grad():
        assert torch.equal(pipe.vae.encode(image).latent_dist.mean, latents)  # through apply_forward_hook
        assert vae.onloaded  # stays for its phase
        assert torch.equal(pipe.vae.decode(latents).sample, decoded)
        assert torch.equal(pipe.text_encoder_2(ids)[0], encoded)  # another phase: the VAE went back
    assert not vae.onloaded and not _units(backend)["text_encoder_2"].onloaded
    assert all(block_bytes(block) == 0 for block in pipe.text_encoder_2.encoder.block)
    pipe.disable_omni_offload()


def test_dits_only_keeps_encoders_and_vae_on_the_device():
    pipe = flux_pipe()
    reference = generate(pipe)
    backend = pipe.enable_layerwise_offload(device="cpu", dits_only=True)
    assert backend._state.units == [] and backend._state.managed == {}
    assert backend.stats.streamed_blocks == len(pipe.transformer.transformer_blocks) + len(
        pipe.transformer.single_transformer_blocks)
    assert block_bytes(pipe.text_encoder_2.encoder.block[0]) > 0
    assert pipe.omni_offload_report()["vae"].placement == "resident"
    assert torch.equal(generate(pipe), reference)
    pipe.disable_omni_offload()


def test_a_budget_that_holds_everything_keeps_every_component_resident():
    pipe = flux_pipe()
    reference = _image(pipe)
    backend = pipe.enable_layerwise_offload(device="cpu", max_device_memory="1GiB")
    assert backend.stats.streamed_blocks == 0 and backend.stats.phase_units == 0
    assert all(unit.resident and unit.onloaded for unit in backend._state.units)
    assert torch.equal(_image(pipe), reference)
    assert all(unit.onloaded for unit in backend._state.units)  # the call's end leaves resident units alone
    assert pipe.omni_offload_report()["vae"].placement == "resident"
    pipe.disable_omni_offload()


def test_a_budget_holding_every_block_but_not_every_phase_keeps_blocks_and_swaps_the_phases():
    pipe = flux_pipe()
    reference = _image(pipe)
    backend = pipe.enable_layerwise_offload(device="cpu")
    state = backend._state
    everything = (backend.stats.resident_device_bytes + sum(w.nbytes for row in state.weights for w in row)
                  + sum(u.weights.nbytes for u in state.units))
    pipe.disable_omni_offload()
    backend = pipe.enable_layerwise_offload(device="cpu", max_device_memory=everything - 1)
    assert backend.stats.streamed_blocks == 0 and backend.stats.phase_units == 3
    assert not any(unit.resident for unit in backend._state.units)
    for _ in range(2):
        assert torch.equal(_image(pipe), reference)
        assert not any(unit.onloaded for unit in backend._state.units)  # every block resident, the rest per phase
    assert pipe.omni_offload_report()["text_encoder_2"].placement == "swapped"
    pipe.disable_omni_offload()


def test_a_budget_keeps_dit_blocks_before_encoder_blocks():
    import dist_scenarios

    pipe = dist_scenarios.deep_flux_pipe()  # 3 + 4 DiT blocks
    reference = _image(pipe)
    backend = pipe.enable_layerwise_offload(device="cpu")
    dit_bytes, largest_block = backend.stats.resident_device_bytes, backend.stats.slot_bytes
    largest_phase = max(u.weights.nbytes for u in backend._state.units)
    pipe.disable_omni_offload()
    # The DiT's non-block weights, the largest phase, the window and room for two of the largest blocks.
    budget = dit_bytes + largest_phase + 2 * largest_block + 2 * largest_block
    backend = pipe.enable_layerwise_offload(device="cpu", max_device_memory=budget)
    report = pipe.omni_offload_report()
    # The encoders' blocks run once per call, the DiT's every step: the budget goes to the DiT's.
    assert report["transformer"].resident_blocks == 2
    assert report["text_encoder_2"].streamed_blocks == len(pipe.text_encoder_2.encoder.block)
    assert report["text_encoder"].streamed_blocks == len(_clip_layers(pipe))
    assert torch.equal(_image(pipe), reference)
    pipe.disable_omni_offload()


def test_plan_gives_the_budget_to_dit_blocks_and_encoder_blocks_only_when_everything_fits():
    from diffusers_omni.offload.layerwise import plan_residency

    sizes = [10] * 8  # four DiT blocks, then four encoder blocks
    never = [False] * 4 + [True] * 4
    forced = [False] * 8
    # Non-block weights 5 and a window of two blocks (20), then room for two blocks, four, or everything.
    assert plan_residency(sizes, forced, 5, 5 + 20 + 20, 2, never=never) == [False, True, False, True] + [False] * 4
    assert plan_residency(sizes, forced, 5, 5 + 20 + 40, 2, never=never) == [True] * 4 + [False] * 4
    assert plan_residency(sizes, forced, 5, 5 + 80, 2, never=never) == [True] * 8


def test_a_budget_too_small_names_the_largest_phase_and_the_largest_block():
    pipe = flux_pipe()
    before = pipeline_snapshot(pipe)
    with pytest.raises(ValueError) as error:
        pipe.enable_layerwise_offload(device="cpu", max_device_memory=1)
    message = str(error.value)
    assert "max_device_memory=1 (1 B) is too small" in message
    sizes = {label: unit.weights.nbytes for label, unit in _planned_units(pipe).items()}
    largest = max(sizes, key=sizes.get)
    assert f"the largest phase, {largest!r}" in message and "the largest streamed block, 'transformer." in message
    assert_same_snapshot(before, pipeline_snapshot(pipe))


def _planned_units(pipe) -> dict[str, PackedWeights]:
    backend = pipe.enable_layerwise_offload(device="cpu")
    try:
        return {unit.label: unit for unit in backend._state.units}
    finally:
        pipe.disable_omni_offload()


def test_a_failure_packing_the_vae_leaves_every_component_exactly_as_before(monkeypatch):
    pipe = flux_pipe()
    reference = _image(pipe)
    before = pipeline_snapshot(pipe)
    original = PackedWeights.pack

    def pack(self, host_memory, release=None):
        if self.path == "vae":
            raise MemoryError("no host memory for the VAE (injected)")
        return original(self, host_memory, release)

    monkeypatch.setattr(PackedWeights, "pack", pack)
    with pytest.raises(MemoryError, match="injected"):
        pipe.enable_layerwise_offload(device="cpu")
    monkeypatch.setattr(PackedWeights, "pack", original)
    assert_same_snapshot(before, pipeline_snapshot(pipe))
    assert torch.equal(_image(pipe), reference)


# -- which blocks an encoder streams ---------------------------------------------------------------------------


class _Layer(nn.Module):
    def __init__(self, width: int, shared: nn.Linear | None = None) -> None:
        super().__init__()
        self.proj = shared if shared is not None else nn.Linear(width, width)
        self.inner = nn.ModuleList([nn.Linear(width, width), nn.Linear(width, width)])  # nested: never a stack


class _Unknown(nn.Module):
    """An encoder nobody declared: its layers, a tiny same-class list, an embedding."""

    def __init__(self, shared: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 32)
        common = nn.Linear(32, 32) if shared else None
        self.stack = nn.Sequential()
        self.stack.layers = nn.ModuleList([_Layer(32, common) for _ in range(3)])
        self.heads = nn.ModuleList([nn.Linear(32, 1), nn.Linear(32, 1)])  # < 5% of the weights


def test_scan_finds_the_outermost_same_class_lists_worth_streaming():
    assert scan_block_lists(_Unknown()) == ("stack.layers",)


def test_an_unknown_encoder_is_scanned():
    stack, source = encoder_stack(Component("text_encoder", _Unknown(), ENCODER))
    assert source == "scanned" and [path for path, _ in stack.blocks] == [
        f"text_encoder.stack.layers.{i}" for i in range(3)]


@pytest.mark.parametrize("shared", [False, True], ids=["own-weights", "shared-weights"])
def test_a_scanned_encoder_streams_unless_its_blocks_share_weights_then_it_swaps_whole(shared):
    pipe = flux_pipe()
    pipe.text_encoder = _Unknown(shared=shared).eval()  # stands in for CLIP; enabling never calls it
    backend = pipe.enable_layerwise_offload(device="cpu")
    try:
        how = backend._state.managed["text_encoder"]
        assert how == ("on the device for its phase" if shared else "3 blocks streamed (scanned)")
    finally:
        pipe.disable_omni_offload()


def test_every_declared_row_resolves_on_the_tiny_encoders():
    from diffusers_omni.testing.tiny import tiny_flux_components, tiny_wan_components
    from diffusers_omni.testing.tiny_qwenimage import tiny_qwen2_5_vl_text_encoder, tiny_qwen2_tokenizer

    flux = tiny_flux_components()
    encoders = {"CLIP": flux["text_encoder"], "T5": flux["text_encoder_2"],
                "UMT5": tiny_wan_components()["text_encoder"],
                "Qwen2.5-VL": tiny_qwen2_5_vl_text_encoder(tiny_qwen2_tokenizer())}
    for name, encoder in encoders.items():
        attrs, source = encoder_blocks_attrs(encoder)
        assert source == "declared" and attrs, name
        assert type(encoder).__name__ in ENCODER_BLOCKS
    vl = encoder_blocks_attrs(encoders["Qwen2.5-VL"])[0]
    assert vl.index("model.visual.blocks") < vl.index("model.language_model.layers")  # the order its forward runs


def test_a_model_class_can_declare_its_own_encoder_blocks():
    class Declared(_Unknown):
        _layerwise_offload_blocks_attrs = ("stack.layers",)

    assert encoder_blocks_attrs(Declared()) == (("stack.layers",), "model")
    assert encoder_blocks_attrs(_Unknown()) == ((), "")
