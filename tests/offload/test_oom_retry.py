"""A denoising step that runs out of device memory beside resident DiT blocks streams them and runs again, exactly,
once (``diffusers_omni/offload/oom_retry.py``).

Running out of device memory is injected: a forward pre-hook on one module inside the DiT raises
``torch.OutOfMemoryError`` (once, or every time), as a real card would for a large resolution; the shrink, the
retry, the warning and the give-back on disable are the real ones. Every component is ``.eval()`` before outputs
are compared.
"""

from __future__ import annotations

import logging

import pytest
import torch

from diffusers_omni import OffloadConfig, apply_offload
from diffusers_omni.offload.report import offload_report

from offload_helpers import WAN_CALL, assert_same_snapshot, bare_flux, block_bytes, flux_inputs, snapshot, wan22_pipe

RETRY = "ran out of device memory in a denoising step"


def _blocks(model) -> list[torch.nn.Module]:
    return list(model.transformer_blocks) + list(model.single_transformer_blocks)


def _spread_budget(model) -> int:
    """A budget that keeps two of the bare FLUX's eight blocks resident (``transformer_blocks.1`` and
    ``single_transformer_blocks.3``), the others stream."""
    blocks = _blocks(model)
    single = block_bytes(blocks[-1])
    non_block = sum(p.numel() * 4 for n, p in model.named_parameters() if "transformer_blocks" not in n)
    return non_block + 2 * max(block_bytes(b) for b in blocks) + 3 * single + 64 * 1024


def _inject(module: torch.nn.Module, times: int | None = 1, error: BaseException | None = None) -> list[int]:
    """``module``'s next ``times`` calls (``None``: every call) raise an out-of-memory error; the failures so far."""
    failures: list[int] = []

    def fail(mod, args):
        if times is None or len(failures) < times:
            failures.append(1)
            raise error if error is not None else torch.OutOfMemoryError(
                "CUDA out of memory. Tried to allocate 2.00 GiB (injected)")

    module.register_forward_pre_hook(fail)
    return failures


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and r.name == "diffusers_omni"]


def _run(model, seed: int = 0) -> torch.Tensor:
    with torch.no_grad():
        return model(**flux_inputs(seed))[0]


def test_a_step_out_of_memory_beside_resident_blocks_streams_them_and_runs_again_bitwise(caplog):
    """The failure comes mid-step, inside a streamed block that is running (after a resident block ran): the
    failed run's running block and prefetched blocks are settled, the residents stream, the step runs again."""
    model = bare_flux(num_layers=2, num_single_layers=6).eval()
    reference = [_run(model, seed) for seed in range(2)]
    original = snapshot(model)
    backend = apply_offload(model, OffloadConfig("layerwise", device="cpu", max_device_memory=_spread_budget(model)))
    stats, state = backend.stats, backend._state
    assert (stats.resident_blocks, stats.streamed_blocks) == (2, 6)
    resident = [block for block, kept in zip(_blocks(model), state.resident[0]) if kept]
    resident_bytes = sum(block_bytes(block) for block in resident)
    # single_transformer_blocks.4 streams, and runs after both resident blocks did.
    assert not state.resident[0][6]
    failures = _inject(model.single_transformer_blocks[4].proj_out)
    with caplog.at_level(logging.WARNING, logger="diffusers_omni"):
        assert torch.equal(_run(model), reference[0])
    assert len(failures) == 1
    warnings = _warnings(caplog)
    assert len(warnings) == 1 and warnings[0].startswith(f"{state.stacks[0].name} {RETRY}")
    assert "2 resident blocks stream from now on" in warnings[0] and "Tried to allocate 2.00 GiB" in warnings[0]
    assert "Later steps run with the smaller resident set" in warnings[0]
    assert stats.residents_shrunk == 2
    assert (stats.resident_blocks, stats.streamed_blocks) == (0, 8)
    assert all(block_bytes(block) == 0 for block in resident)  # placeholders between uses, like every streamed one
    assert stats.residents_shrunk_bytes >= resident_bytes
    assert state.phases.residents is None and not any(r for row in state.resident for r in row)
    assert stats.max_in_flight_bytes <= stats.in_flight_capacity
    # Later steps keep the smaller resident set: no failure, no warning, the same outputs.
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="diffusers_omni"):
        for seed in range(2):
            assert torch.equal(_run(model, seed), reference[seed])
    assert not _warnings(caplog) and stats.residents_shrunk == 2 and len(failures) == 1
    # state_dict() of a block that streams now shows its host copy.
    assert all(torch.equal(value, original[f"0.{name}"][-1]) for name, value in model.state_dict().items())
    backend.disable()
    assert_same_snapshot(original, snapshot(model))  # the same tensors, bitwise, no hook of the offload left
    assert torch.equal(_run(model), reference[0])



def test_a_dit_whose_every_block_is_resident_streams_them_all_under_inference_mode(caplog):
    """A budget that fits everything keeps every block resident (no block hooks, no window): the retry installs
    the streamed path for all of them, the last block's output layers included."""
    model = bare_flux().eval()
    with torch.inference_mode():
        reference = model(**flux_inputs())[0]
    original = snapshot(model)
    backend = apply_offload(model, OffloadConfig("layerwise", device="cpu", max_device_memory="1GiB"))
    stats = backend.stats
    assert (stats.resident_blocks, stats.streamed_blocks, stats.slot_count) == (7, 0, 0)
    failures = _inject(model.single_transformer_blocks[2].proj_out)
    with caplog.at_level(logging.WARNING, logger="diffusers_omni"), torch.inference_mode():
        for _ in range(2):
            assert torch.equal(model(**flux_inputs())[0], reference)
    assert len(failures) == 1 and len(_warnings(caplog)) == 1 and "7 resident blocks stream" in _warnings(caplog)[0]
    assert (stats.resident_blocks, stats.streamed_blocks, stats.slot_count) == (0, 7, 2)
    assert stats.on_demand_loads == 0  # the window is primed and prefetches as for any streamed DiT
    assert all(block_bytes(block) == 0 for block in _blocks(model))
    assert block_bytes(model.proj_out) == 0  # the output layers stream with the last block
    assert not any(torch.is_inference(p) for p in model.parameters())
    backend.disable()
    assert_same_snapshot(original, snapshot(model))


def test_a_retry_that_runs_out_of_memory_too_raises_it_and_nothing_is_retried_again(caplog):
    model = bare_flux(num_layers=2, num_single_layers=6).eval()
    reference = _run(model)
    original = snapshot(model)
    backend = apply_offload(model, OffloadConfig("layerwise", device="cpu", max_device_memory=_spread_budget(model)))
    failures = _inject(model.single_transformer_blocks[4].proj_out, times=2)
    with caplog.at_level(logging.WARNING, logger="diffusers_omni"):
        with pytest.raises(torch.OutOfMemoryError, match="injected"):
            _run(model)
    assert len(failures) == 2  # the step and its one retry: no loop
    assert len(_warnings(caplog)) == 1 and backend.stats.residents_shrunk == 2
    # The resident set stays shrunk; the next call fits (the injection is spent) and is exact.
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="diffusers_omni"):
        assert torch.equal(_run(model), reference)
    assert not _warnings(caplog)
    # Nothing is resident any more: a later failure shrinks the window instead (one warning), exact.
    again = _inject(model.transformer_blocks[0].ff, times=1)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="diffusers_omni"):
        assert torch.equal(_run(model), reference)
    assert len(again) == 1 and len(_warnings(caplog)) == 1 and backend.stats.window_shrunk == 1
    # Nothing left to shrink (the window holds one block): a failure is raised as it came, the very error.
    error = torch.OutOfMemoryError("CUDA out of memory (injected, nothing left to shrink)")
    last = _inject(model.transformer_blocks[1].ff, times=1, error=error)
    with pytest.raises(torch.OutOfMemoryError) as raised:
        _run(model)
    assert raised.value is error and len(last) == 1
    assert torch.equal(_run(model), reference)  # the failed call left a clean window behind it
    backend.disable()
    assert_same_snapshot(original, snapshot(model))


def test_nothing_resident_shrinks_the_window_to_the_running_block_then_raises_as_it_came(caplog):
    """No budget: nothing resident to stream. The one retry drops the window's prefetched blocks (the least device
    memory a streamed step takes), exact, one warning; later calls load each block when it runs; a failure with the
    window at one block is raised as it came."""
    model = bare_flux().eval()
    reference = _run(model)
    original = snapshot(model)
    backend = apply_offload(model, OffloadConfig("layerwise", device="cpu"))
    stats = backend.stats
    assert stats.resident_blocks == 0 and stats.in_flight_blocks == 2
    failures = _inject(model.single_transformer_blocks[1].proj_out, times=1)
    with caplog.at_level(logging.WARNING, logger="diffusers_omni"):
        assert torch.equal(_run(model), reference)
    warnings = _warnings(caplog)
    assert len(failures) == 1 and len(warnings) == 1 and backend.stats.residents_shrunk == 0
    assert "with nothing resident to stream" in warnings[0] and "keeps only the running block" in warnings[0]
    assert (stats.window_shrunk, stats.in_flight_blocks, stats.slot_count) == (1, 1, 1)
    assert stats.in_flight_capacity == stats.slot_bytes
    assert any("holds only the running block" in note for note in offload_report(model, backend, None).notes)
    caplog.clear()
    stats.max_in_flight_bytes = 0
    with caplog.at_level(logging.WARNING, logger="diffusers_omni"):
        for _ in range(2):
            assert torch.equal(_run(model), reference)
    assert not _warnings(caplog) and 0 < stats.max_in_flight_bytes <= stats.slot_bytes  # one block at a time
    error = torch.OutOfMemoryError("CUDA out of memory (injected, streaming only)")
    again = _inject(model.single_transformer_blocks[2].proj_out, times=1, error=error)
    with pytest.raises(torch.OutOfMemoryError) as raised:
        _run(model)
    assert raised.value is error and str(raised.value) == "CUDA out of memory (injected, streaming only)"
    assert len(again) == 1 and stats.window_shrunk == 1
    assert torch.equal(_run(model), reference)
    backend.disable()
    assert_same_snapshot(original, snapshot(model))


def test_another_error_is_not_retried():
    model = bare_flux(num_layers=2, num_single_layers=6).eval()
    backend = apply_offload(model, OffloadConfig("layerwise", device="cpu", max_device_memory=_spread_budget(model)))
    error = RuntimeError("not a memory error")
    failures = _inject(model.single_transformer_blocks[4].proj_out, times=1, error=error)
    with pytest.raises(RuntimeError) as raised:
        _run(model)
    assert raised.value is error and len(failures) == 1 and backend.stats.residents_shrunk == 0
    assert backend.stats.resident_blocks == 2
    backend.disable()


def _video(pipe) -> torch.Tensor:
    return pipe(prompt="a red fox in the snow", num_inference_steps=4, generator=torch.Generator().manual_seed(0),
                output_type="pt", max_sequence_length=32, **WAN_CALL).frames


def test_a_wan22_step_out_of_memory_keeps_the_stock_video(caplog):
    """The tiny Wan 2.2, a budget that keeps the low-noise expert's block resident; its first step runs out of
    memory. The video is stock Diffusers' (no offload), bitwise; the report says what happened."""
    pipe = wan22_pipe()
    pipe.register_to_config(boundary_ratio=0.8)  # of 4 steps (999, 900, 750, 500): two per expert
    for component in (pipe.transformer, pipe.transformer_2, pipe.text_encoder, pipe.vae):
        component.eval()
    reference = _video(pipe)
    before = snapshot(pipe.transformer, pipe.transformer_2)
    # The tiny Wan 2.2's smallest budget (301 KiB) plus room for one of its blocks.
    backend = pipe.enable_layerwise_offload(device="cpu", max_device_memory=308160 + 50000)
    stats = backend.stats
    assert (stats.resident_blocks, stats.streamed_blocks) == (1, 3)
    assert backend._state.resident[1] == [True]  # transformer_2.blocks.0
    failures = _inject(pipe.transformer_2.blocks[0].ffn)
    with caplog.at_level(logging.WARNING, logger="diffusers_omni"):
        assert torch.equal(_video(pipe), reference)
    warnings = _warnings(caplog)
    assert len(failures) == 1 and len(warnings) == 1 and warnings[0].startswith(f"transformer_2 {RETRY}")
    assert (stats.resident_blocks, stats.streamed_blocks, stats.residents_shrunk) == (0, 4, 1)
    assert any("1 resident DiT blocks" in note and "ran out of device memory beside them" in note
               for note in pipe.omni_offload_report().notes)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="diffusers_omni"):
        assert torch.equal(_video(pipe), reference)
    assert not _warnings(caplog) and len(failures) == 1
    pipe.disable_omni_offload()
    assert_same_snapshot(before, snapshot(pipe.transformer, pipe.transformer_2))
    assert torch.equal(_video(pipe), reference)


def test_a_pipeline_whose_window_shrank_keeps_its_image_encoders_included(caplog):
    """The whole tiny FLUX pipeline without a budget: the text encoders stream through the same window, which keeps
    one block after the retry; every later call gives the same image."""
    from offload_helpers import flux_pipe, generate

    pipe = flux_pipe()
    reference = generate(pipe, steps=2)
    backend = pipe.enable_layerwise_offload(device="cpu")
    failures = _inject(pipe.transformer.single_transformer_blocks[0].proj_out)
    with caplog.at_level(logging.WARNING, logger="diffusers_omni"):
        assert torch.equal(generate(pipe, steps=2), reference)
    assert len(failures) == 1 and len(_warnings(caplog)) == 1 and backend.stats.window_shrunk == 1
    for _ in range(2):
        assert torch.equal(generate(pipe, steps=2), reference)
    assert any("holds only the running block" in note for note in pipe.omni_offload_report().notes)
    pipe.disable_omni_offload()
    assert torch.equal(generate(pipe, steps=2), reference)


def test_an_encoder_out_of_memory_beside_resident_blocks_makes_room_and_runs_again(caplog):
    """The text encoder runs before the DiTs, beside the block the budget keeps resident; it runs out of memory
    there (injected, while the block is on the device): the block leaves for it, exactly, the encoder runs again, one
    warning; later calls make that room before the encoder runs; the video is stock Diffusers'."""
    pipe = wan22_pipe()
    pipe.register_to_config(boundary_ratio=0.8)
    for component in (pipe.transformer, pipe.transformer_2, pipe.text_encoder, pipe.vae):
        component.eval()
    reference = _video(pipe)
    backend = pipe.enable_layerwise_offload(device="cpu", max_device_memory=308160 + 50000)
    stats, phases = backend.stats, backend._state.phases
    assert stats.resident_blocks == 1
    failures: list[int] = []

    def fail_beside_residents(module, args):
        if backend._state is not None and phases.residents is not None and not phases.residents.away:
            failures.append(1)
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB (injected)")

    pipe.text_encoder.encoder.block[0].register_forward_pre_hook(fail_beside_residents)
    with caplog.at_level(logging.WARNING, logger="diffusers_omni"):
        assert torch.equal(_video(pipe), reference)
    warnings = _warnings(caplog)
    assert len(failures) == 1 and len(warnings) == 1 and stats.residents_left == 1
    assert warnings[0].startswith("text_encoder ran out of device memory beside the DiT blocks kept on the device")
    assert "Its later calls make this room before they run" in warnings[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="diffusers_omni"):
        assert torch.equal(_video(pipe), reference)
    assert not _warnings(caplog) and len(failures) == 1 and stats.residents_left == 2
    assert stats.resident_blocks == 1 and stats.residents_shrunk == 0  # the budget's plan is unchanged
    pipe.disable_omni_offload()
    assert torch.equal(_video(pipe), reference)


def test_an_encoder_out_of_memory_with_nothing_resident_is_raised_as_it_came():
    pipe = wan22_pipe()
    backend = pipe.enable_layerwise_offload(device="cpu")
    assert backend.stats.resident_blocks == 0
    failures = _inject(pipe.text_encoder.encoder.block[0])
    with pytest.raises(torch.OutOfMemoryError, match="injected"):
        _video(pipe)
    assert len(failures) == 1 and backend.stats.residents_left == 0
    pipe.disable_omni_offload()
