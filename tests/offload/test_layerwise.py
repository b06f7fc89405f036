"""Layerwise offload on CPU: the same buffers, views, placeholders and ring as on an accelerator."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from diffusers_omni import OffloadConfig, apply_offload
from diffusers_omni.offload.host_plan import spread_positions
from diffusers_omni.offload.residency import size_classes, plan_residency

from offload_helpers import bare_flux, bare_wan, block_bytes, flux_inputs, flux_pipe, generate, wan22_pipe

CPU = OffloadConfig("layerwise", device="cpu")


def _flux_blocks(model):
    return list(model.transformer_blocks) + list(model.single_transformer_blocks)


def test_bare_flux_bitwise_equal_and_empty_between_calls():
    model = bare_flux()
    with torch.no_grad():
        reference = [model(**flux_inputs(seed))[0] for seed in range(3)]
    ids = [id(p) for p in model.parameters()]
    backend = apply_offload(model, CPU)
    assert backend.stats.streamed_blocks == 7
    assert backend.stats.loads == 1  # block 0 is primed before the first forward
    with torch.no_grad():
        for seed in range(3):
            assert torch.equal(model(**flux_inputs(seed))[0], reference[seed])
            assert all(block_bytes(block) == 0 for block in _flux_blocks(model))
    assert [id(p) for p in model.parameters()] == ids
    stats = backend.stats
    # Every load was a prefetch (the last block prefetches block 0 for the next pass); a pass copies each block once.
    assert stats.on_demand_loads == 0
    assert stats.loads == 1 + 3 * 7
    first_block_bytes = stats.copied_bytes - 3 * stats.streamed_bytes_per_pass
    assert 0 < first_block_bytes < stats.streamed_bytes_per_pass
    backend.disable()
    backend.disable()  # idempotent
    assert all(block_bytes(block) > 0 for block in _flux_blocks(model))
    model.to(torch.float64).to(torch.float32)  # ordinary tensors: .to() works
    with torch.no_grad():
        assert torch.equal(model(**flux_inputs(0))[0], reference[0])


def test_under_inference_mode_and_deeper_prefetch():
    model = bare_flux()
    with torch.inference_mode():
        reference = model(**flux_inputs())[0]
    backend = apply_offload(model, OffloadConfig("layerwise", device="cpu", prefetch_depth=3))
    assert backend.stats.slot_count == 4
    with torch.inference_mode():
        for _ in range(2):
            assert torch.equal(model(**flux_inputs())[0], reference)
    assert not any(torch.is_inference(p) for p in model.parameters())
    assert backend.stats.on_demand_loads == 0
    backend.disable()
    assert not any(torch.is_inference(p) for p in model.parameters())


def test_budget_keeps_spread_blocks_resident():
    model = bare_flux(num_layers=2, num_single_layers=6)
    blocks = _flux_blocks(model)
    single = sum(p.numel() * 4 for p in blocks[-1].parameters())
    non_block = sum(p.numel() * 4 for n, p in model.named_parameters() if "transformer_blocks" not in n)
    budget = non_block + 2 * max(block_bytes(b) for b in blocks) + 3 * single + 64 * 1024
    with torch.no_grad():
        reference = model(**flux_inputs())[0]
    backend = apply_offload(model, OffloadConfig("layerwise", device="cpu", max_device_memory=budget))
    stats = backend.stats
    assert 0 < stats.resident_blocks < len(blocks)
    assert stats.resident_blocks + stats.streamed_blocks == len(blocks)
    resident = [block_bytes(b) > 0 for b in blocks]
    assert sum(resident) == stats.resident_blocks
    with torch.no_grad():
        assert torch.equal(model(**flux_inputs())[0], reference)
        assert torch.equal(model(**flux_inputs())[0], reference)
    assert stats.on_demand_loads == 0
    backend.disable()


def test_budget_prefetch_fills_slots_freed_during_resident_blocks():
    # Streamed S1, resident R..., streamed S2, ..., S3: S3 must be copied while the resident blocks after S1 run,
    # not only once S2 starts, or the copy engine idles for the whole resident stretch.
    model = bare_flux(num_layers=2, num_single_layers=6)
    blocks = _flux_blocks(model)
    single = sum(p.numel() * 4 for p in blocks[-1].parameters())
    non_block = sum(p.numel() * 4 for n, p in model.named_parameters() if "transformer_blocks" not in n)
    budget = non_block + 2 * max(block_bytes(b) for b in blocks) + 3 * single + 64 * 1024
    with torch.no_grad():
        reference = model(**flux_inputs())[0]
    backend = apply_offload(model, OffloadConfig("layerwise", device="cpu", max_device_memory=budget))
    streamer = backend._state.streamer
    index = {id(b): i for i, b in enumerate(blocks)}
    events: list[tuple[str, int]] = []
    original_load = streamer.load

    def recording_load(block, evict=True):
        loaded = original_load(block, evict)
        if loaded:
            events.append(("load", block_positions[id(block)]))
        return loaded

    state = backend._state
    block_positions = {
        id(sb): index[id(module)]
        for stack, row in zip(state.stacks, state.streamed)
        for (_, module), sb in zip(stack.blocks, row)
        if sb is not None
    }
    streamer.load = recording_load
    handles = [b.register_forward_pre_hook(lambda m, a: events.append(("start", index[id(m)]))) for b in blocks]
    resident = [block_bytes(b) > 0 for b in blocks]
    with torch.no_grad():
        assert torch.equal(model(**flux_inputs())[0], reference)
    for h in handles:
        h.remove()
    streamed = [i for i, r in enumerate(resident) if not r]
    checked = 0
    for previous, current, following in zip(streamed, streamed[1:], streamed[2:]):
        if any(resident[previous + 1 : current]):
            assert events.index(("load", following)) < events.index(("start", current)), events
            checked += 1
    assert checked > 0, resident
    assert backend.stats.on_demand_loads == 0
    assert backend.stats.slot_count == 2
    backend.disable()


def _watch_window(backend):
    streamer = backend._state.streamer
    seen = []
    original_load = streamer.load

    def watching_load(block, evict=True):
        loaded = original_load(block, evict)
        seen.append((len(streamer.in_flight), streamer.in_flight_bytes))
        return loaded

    streamer.load = watching_load
    return seen


def test_without_budget_at_most_prefetch_depth_plus_one_blocks_in_flight():
    # As Diffusers' group offload (running group + the next one): FLUX's small single blocks do not fill the room
    # of two double blocks, which would raise peak device memory where activations are largest.
    model = bare_flux(num_layers=1, num_single_layers=6)
    with torch.no_grad():
        reference = model(**flux_inputs())[0]
    backend = apply_offload(model, CPU)
    stats = backend.stats
    assert stats.in_flight_capacity == 2 * stats.slot_bytes and stats.in_flight_blocks == 2
    seen = _watch_window(backend)
    with torch.no_grad():
        for _ in range(2):
            assert torch.equal(model(**flux_inputs())[0], reference)
    assert max(count for count, _ in seen) == 2
    assert max(nbytes for _, nbytes in seen) <= stats.in_flight_capacity
    assert stats.max_in_flight_bytes == max(nbytes for _, nbytes in seen)
    assert stats.on_demand_loads == 0
    backend.disable()


def _streaming_budget(model) -> OffloadConfig:
    """A budget that streams every block: the non-block weights plus two largest blocks (the reserve), nothing more."""
    probe = apply_offload(model, CPU)
    fixed, largest = probe.stats.resident_device_bytes, probe.stats.slot_bytes
    probe.disable()
    return OffloadConfig("layerwise", device="cpu", max_device_memory=fixed + 2 * largest + 1024)


def test_without_budget_next_pass_loads_after_the_last_block_ends():
    # The wrap-around load (the next step's first block) waits for the last block to finish, so it never sits on the
    # device next to the last block's activations (FLUX: the single blocks', the largest); with a budget or a deeper
    # window (memory the user chose to spend) it may.
    model = bare_flux(num_layers=2, num_single_layers=3)
    with torch.no_grad():
        reference = model(**flux_inputs())[0]
    budget = _streaming_budget(model)
    deeper = OffloadConfig("layerwise", device="cpu", prefetch_depth=2)
    for config, loaded_while_last_runs in ((CPU, [False, False]), (budget, [True, True]), (deeper, [True, True])):
        backend = apply_offload(model, config)
        first = next(b for b in backend._state.streamed[0] if b is not None)
        during_last, after_last = [], []
        # Hooks on modules inside the last block run while it computes; norm_out runs right after it (the output
        # layers stream with the last block, which stays bound until the forward returns; the next pass's first
        # block loads when the last block's own forward ends, so its copy overlaps them).
        hooks = [model.single_transformer_blocks[-1].proj_out.register_forward_hook(
                     lambda *_: during_last.append(first.slot is not None)),
                 model.norm_out.register_forward_pre_hook(lambda *_: after_last.append(first.slot is not None))]
        with torch.no_grad():
            for _ in range(2):
                assert torch.equal(model(**flux_inputs())[0], reference)
        for hook in hooks:
            hook.remove()
        assert during_last == loaded_while_last_runs, config
        assert after_last == [True, True], config
        assert backend.stats.on_demand_loads == 0
        assert backend.stats.max_in_flight_bytes <= backend.stats.in_flight_capacity
        backend.disable()
        with torch.no_grad():
            assert torch.equal(model(**flux_inputs())[0], reference)


def test_budget_reserve_holds_more_small_blocks_but_never_more_bytes():
    # With a budget the reserve of two largest blocks is paid for: FLUX's smaller single blocks fill it.
    model = bare_flux(num_layers=1, num_single_layers=6)
    with torch.no_grad():
        reference = model(**flux_inputs())[0]
    backend = apply_offload(model, _streaming_budget(model))
    stats = backend.stats
    assert stats.resident_blocks == 0 and stats.in_flight_blocks is None
    assert stats.in_flight_capacity == 2 * stats.slot_bytes
    seen = _watch_window(backend)
    with torch.no_grad():
        for _ in range(2):
            assert torch.equal(model(**flux_inputs())[0], reference)
    assert max(count for count, _ in seen) > 2
    assert max(nbytes for _, nbytes in seen) <= stats.in_flight_capacity
    assert stats.on_demand_loads == 0
    backend.disable()


def test_budget_too_small_names_minimum():
    with pytest.raises(ValueError, match=r"max_device_memory=1000 .* too small; allowed: at least"):
        apply_offload(bare_flux(), OffloadConfig("layerwise", device="cpu", max_device_memory=1000))


def test_whole_model_fits_budget():
    model = bare_flux()
    backend = apply_offload(model, OffloadConfig("layerwise", device="cpu", max_device_memory="1GiB"))
    assert backend.stats.streamed_blocks == 0 and backend.stats.slot_count == 0
    backend.disable()


def test_spread_and_plan():
    assert spread_positions(2, 8) == [2, 6]
    assert spread_positions(0, 5) == []
    resident = plan_residency([10] * 8, [False] * 8, fixed_bytes=5, budget=5 + 2 * 10 + 30, slot_count=2)
    assert sum(resident) == 3 and resident[0] is False and resident[-1] is False


def test_the_plan_reserves_what_streaming_needs_beside_the_window():
    """``stream_extra`` (the lossless code's device buffers) comes out of the budget only when something streams,
    and a budget too small for it says so."""
    kept = plan_residency([10] * 8, [False] * 8, fixed_bytes=5, budget=5 + 2 * 10 + 30, slot_count=2)
    fewer = plan_residency([10] * 8, [False] * 8, fixed_bytes=5, budget=5 + 2 * 10 + 30, slot_count=2,
                           stream_extra=20)
    assert sum(kept) == 3 and sum(fewer) == 1
    assert all(plan_residency([10] * 8, [False] * 8, fixed_bytes=5, budget=85, slot_count=2, stream_extra=50))
    with pytest.raises(ValueError, match=r"at least 45 .* \+ 2 streaming slots of 10 B \+ 20 B for the code"):
        plan_residency([10] * 8, [False] * 8, fixed_bytes=5, budget=44, slot_count=2, stream_extra=20,
                       stream_extra_detail="for the code")


def test_plan_keeps_the_larger_blocks_first():
    # FLUX-like: 4 double-stream blocks of 20 bytes, then 8 single-stream ones of 8. Two 20-byte slots plus 45 bytes
    # keep two doubles (evenly spread among the doubles), not a mix spread over the whole stack.
    sizes = [20] * 4 + [8] * 8
    resident = plan_residency(sizes, [False] * 12, fixed_bytes=0, budget=2 * 20 + 45, slot_count=2)
    assert resident == [False, True, False, True] + [False] * 8
    # Blocks within 10% of each other are one class (GGUF mixes): spread, not the few larger ones bunched.
    resident = plan_residency([100, 95, 100, 95, 100, 95], [False] * 6, fixed_bytes=0, budget=200 + 200,
                              slot_count=2)
    assert sum(resident) == 2 and resident != [True, False, True, False, False, False]
    # A last block that carries the output layers (FLUX: ~14% larger) stays in its peers' class.
    assert size_classes([20, 20, 8, 8, 9], [0, 1, 2, 3, 4]) == [[0, 1], [2, 3, 4]]


def _longest_run(sizes: list[int], resident: list[bool]) -> int:
    doubled = list(zip(sizes, resident)) * 2  # cyclic: the last blocks run right before the next step's first
    longest = run = 0
    for size, kept in doubled:
        run = run + size if kept else 0
        longest = max(longest, run)
    return longest


def test_plan_never_keeps_a_run_larger_than_the_window():
    # Five of six doubles fit the budget, but evenly spread they would run three in a row (60 bytes) while the window
    # (two 20-byte slots) holds 40: the copy engine would idle through that run. Four doubles, then singles.
    sizes = [20] * 6 + [8] * 4
    resident = plan_residency(sizes, [False] * 10, fixed_bytes=0, budget=2 * 20 + 100, slot_count=2)
    assert sum(resident[:6]) == 4 and sum(resident[6:]) == 2
    assert _longest_run(sizes, resident) <= 40
    # Equal blocks, a budget that an evenly spread set fills with runs of the window's size: the same set.
    resident = plan_residency([10] * 9, [False] * 9, fixed_bytes=0, budget=20 + 65, slot_count=2)
    assert _longest_run([10] * 9, resident) <= 20 and sum(resident) == 6
    # A budget near the model's size: an evenly spread set would run three in a row (30 > the 20-byte window), and
    # so may this plan; capping at the window would keep one block fewer and stream more than spreading did.
    resident = plan_residency([10] * 12, [False] * 12, fixed_bytes=0, budget=20 + 95, slot_count=2)
    assert sum(resident) == 9 and _longest_run([10] * 12, resident) == 30


class _MixedBlock(nn.Module):
    def __init__(self, width: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.proj = nn.Linear(width, width).to(dtype)
        self.register_buffer("scale", torch.full((width,), 0.5, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x.to(self.proj.weight.dtype)).float() * self.scale.float()


class _MixedModel(nn.Module):
    _layerwise_offload_blocks_attrs = ("blocks",)

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(
            [_MixedBlock(8, torch.float32), _MixedBlock(8, torch.bfloat16), _MixedBlock(8, torch.float64)]
        )
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def test_blocks_of_different_dtypes():
    model = _MixedModel()
    x = torch.randn(2, 8)
    with torch.no_grad():
        reference = model(x)
    backend = apply_offload(model, CPU)
    assert backend.stats.streamed_blocks == 3
    with torch.no_grad():
        for _ in range(2):
            assert torch.equal(model(x), reference)
    assert all(b.scale.numel() == 0 for b in model.blocks)
    backend.disable()
    assert all(b.scale.dtype == torch.float64 and b.scale.numel() == 8 for b in model.blocks)


def test_forward_that_raised_does_not_wedge_the_ring():
    model = _MixedModel()
    x = torch.randn(2, 8)
    with torch.no_grad():
        reference = model(x)
    backend = apply_offload(model, CPU)
    with torch.no_grad(), pytest.raises(RuntimeError):
        model(torch.randn(2, 5))
    with torch.no_grad():
        assert torch.equal(model(x), reference)
    backend.disable()


def test_flux_pipeline_bitwise_with_omni_attention():
    pipe = flux_pipe()
    reference = generate(pipe)
    pipe.enable_omni_attention("TORCH_SDPA")
    backend = pipe.enable_layerwise_offload(device="cpu")
    assert pipe._execution_device == torch.device("cpu")
    assert torch.equal(generate(pipe), reference)
    with torch.inference_mode():
        assert torch.equal(generate(pipe), reference)
    blocks = _flux_blocks(pipe.transformer)
    assert all(block_bytes(b) == 0 for b in blocks)
    assert backend.stats.on_demand_loads == 0
    pipe.disable_omni_offload()
    pipe.disable_omni_attention()
    pipe.to("cpu")
    assert torch.equal(generate(pipe), reference)


def test_wan22_two_experts_share_the_slots():
    pipe = wan22_pipe()
    reference = generate(pipe, steps=4)
    backend = pipe.enable_layerwise_offload(device="cpu", dits_only=True)  # the DiTs' blocks only
    assert backend.stats.streamed_blocks == 2 and backend.stats.slot_count == 2
    assert torch.equal(generate(pipe, steps=4), reference)
    assert torch.equal(generate(pipe, steps=4), reference)
    assert block_bytes(pipe.transformer.blocks[0]) == 0 and block_bytes(pipe.transformer_2.blocks[0]) == 0
    pipe.disable_omni_offload()
    assert torch.equal(generate(pipe, steps=4), reference)


def test_bare_wan_transformer():
    model = bare_wan()
    g = torch.Generator().manual_seed(0)
    inputs = {
        "hidden_states": torch.randn(1, 16, 2, 4, 4, generator=g),
        "timestep": torch.tensor([500]),
        "encoder_hidden_states": torch.randn(1, 8, 32, generator=g),
        "return_dict": False,
    }
    with torch.no_grad():
        reference = model(**inputs)[0]
    backend = apply_offload(model, CPU)
    with torch.no_grad():
        assert torch.equal(model(**inputs)[0], reference)
        assert torch.equal(model(**inputs)[0], reference)
    backend.disable()


def test_enable_returns_the_freed_device_memory(monkeypatch):
    # Packing frees the device weights; left in PyTorch's cache they made the offloaded steps from device weights
    # host-bound on the H200 (torchao float8 FLUX: three times the step). Enabling hands them back to the driver.
    import diffusers_omni.offload.layerwise as layerwise

    calls = []
    monkeypatch.setattr(layerwise, "release_freed_device_memory", lambda device: calls.append(device))
    model = bare_flux(num_layers=1, num_single_layers=1)
    backend = apply_offload(model, CPU)
    assert calls == [torch.device("cpu")]
    backend.disable()


def test_release_freed_device_memory_empties_the_accelerator_cache(monkeypatch):
    from diffusers_omni.offload import memory

    done = []

    class FakeCuda:
        @staticmethod
        def synchronize(device):
            done.append(("synchronize", device))

        @staticmethod
        def empty_cache():
            done.append(("empty_cache",))

    monkeypatch.setattr(memory.torch, "get_device_module", lambda device: FakeCuda)
    memory.release_freed_device_memory(torch.device("cpu"))
    assert done == []  # nothing to return on the host
    memory.release_freed_device_memory(torch.device("cuda", 0))
    assert done == [("synchronize", torch.device("cuda", 0)), ("empty_cache",)]


class _RecordingTransfers:
    """``Transfers`` on the host that logs the stream-ordering calls (events are plain objects)."""

    def __init__(self) -> None:
        self.log: list[tuple[str, object]] = []

    def new_event(self):
        return object()

    def record_on_compute(self, event) -> None:
        self.log.append(("record", event))

    def copy(self, pairs, wait_for=None, done=None) -> None:
        for src, dst in pairs:
            dst.copy_(src)
        self.log.append(("copy", done))

    def compute_waits_for(self, event) -> None:
        self.log.append(("wait", event))


def _streamed_block(seed: int):
    from diffusers_omni.offload.memory import HostMemory, PackedWeights
    from diffusers_omni.offload.stores import PinnedStore, StoreContext
    from diffusers_omni.offload.streamer import StreamedBlock

    torch.manual_seed(seed)
    weights = PackedWeights(f"block{seed}", nn.Linear(8, 8))
    host_memory = HostMemory(torch.device("cpu"), pin_memory=False)
    weights.pack(host_memory)
    store = PinnedStore(weights, StoreContext(torch.device("cpu"), host_memory))
    block = StreamedBlock(weights, torch.device("cpu"), store)
    weights.park(block.placeholders)
    return block


def test_device_buffers_are_made_once_and_freed_between_loads_and_an_evicted_unrun_block_is_awaited():
    """Each load allocates the block's own buffers again (same objects and views, memory freed when it ends);
    the compute stream waits for a copy once before the block runs, and before freeing a prefetched block that
    never ran (nothing else orders the compute stream's next use of that memory after the copy)."""
    from diffusers_omni.offload.stats import LayerwiseStats
    from diffusers_omni.offload.streamer import Streamer

    a, b = _streamed_block(0), _streamed_block(1)
    transfers = _RecordingTransfers()
    streamer = Streamer(a.weights.nbytes, transfers, LayerwiseStats(), max_blocks=1)
    assert streamer.load(a)
    views = a.views
    ready = a.slot.ready
    streamer.begin(a, ())
    streamer.begin(a, ())  # called again while loaded: no second wait
    assert [entry for entry in transfers.log if entry[0] == "wait"] == [("wait", ready)]
    streamer.end(a)
    assert all(buffer.untyped_storage().nbytes() == 0 for buffer in a.buffers.values())
    transfers.log.clear()
    assert streamer.load(a) and a.views is views  # the same views over memory allocated again
    ready = a.slot.ready
    assert streamer.load(b, evict=True)  # evicts a, which never ran since this load
    # a's load; then, for b's, the wait for a's copy before its memory is freed and b's copy into it.
    assert [kind for kind, _ in transfers.log] == ["record", "copy", "wait", "record", "copy"]
    assert transfers.log[2] == ("wait", ready)
    assert all(buffer.untyped_storage().nbytes() == 0 for buffer in a.buffers.values())
    streamer.begin(b, ())
    assert torch.equal(b.weights.tensors.current()[0], b.weights.host_views[0])


def test_output_layers_stream_with_the_last_block():
    # FLUX's norm_out and proj_out run once, after the last block: they are on the device from the last block's start
    # to the end of the forward, empty placeholders while the other blocks run (where the peak is).
    model = bare_flux()
    originals = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(2, model.config.num_attention_heads * model.config.attention_head_dim)
    with torch.no_grad():
        reference = model(**flux_inputs())[0]
        proj_reference = model.proj_out(x)
    tail = [model.norm_out.linear.weight, model.proj_out.weight, model.proj_out.bias]
    backend = apply_offload(model, CPU)
    last = model.single_transformer_blocks[-1]
    seen = {"first block": [], "last block": [], "norm_out": []}
    hooks = [model.transformer_blocks[0].register_forward_pre_hook(
                 lambda *_: seen["first block"].append([t.numel() for t in tail])),
             last.proj_out.register_forward_hook(lambda *_: seen["last block"].append([t.numel() for t in tail])),
             model.norm_out.register_forward_pre_hook(lambda *_: seen["norm_out"].append([t.numel() for t in tail]))]
    with torch.no_grad():
        for _ in range(2):
            assert torch.equal(model(**flux_inputs())[0], reference)
    for hook in hooks:
        hook.remove()
    assert seen["first block"] == [[0, 0, 0]] * 2  # placeholders (zero elements) while the blocks run
    assert all(n > 0 for row in seen["norm_out"] for n in row) and len(seen["norm_out"]) == 2
    assert all(n > 0 for row in seen["last block"] for n in row) and len(seen["last block"]) == 2
    assert all(t.numel() == 0 for t in tail)  # and again after the forward
    stats = backend.stats
    assert stats.on_demand_loads == 0
    # Counted with the last block (streamed), not with the weights that stay on the device.
    tail_bytes = sum(originals[k].numel() * originals[k].element_size() for k in originals
                     if k.startswith(("norm_out.", "proj_out.")))
    non_block = sum(v.numel() * v.element_size() for k, v in originals.items()
                    if not k.startswith(("transformer_blocks.", "single_transformer_blocks.")))
    assert stats.resident_device_bytes == non_block - tail_bytes
    # Called on their own (no forward around them), they load with the last block's unit.
    with torch.no_grad():
        assert torch.equal(model.proj_out(x), proj_reference)
        assert torch.equal(model(**flux_inputs())[0], reference)
    # state_dict reads them from their host copies.
    state = model.state_dict()
    assert all(torch.equal(state[k], v) for k, v in originals.items())
    backend.disable()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in originals.items())
    with torch.no_grad():
        assert torch.equal(model(**flux_inputs())[0], reference)


def test_output_layers_stay_when_the_last_block_is_resident():
    model = bare_flux(num_layers=1, num_single_layers=3)
    with torch.no_grad():
        reference = model(**flux_inputs())[0]
    backend = apply_offload(model, OffloadConfig("layerwise", device="cpu", max_device_memory="1GiB"))
    assert backend.stats.streamed_blocks == 0
    assert model.proj_out.weight.numel() > 0
    with torch.no_grad():
        assert torch.equal(model(**flux_inputs())[0], reference)
    backend.disable()


def test_output_layers_can_be_kept_resident():
    # A model's own _layerwise_offload_tail_attrs wins over the declaration; an empty tuple keeps them on the device.
    model = bare_flux()
    model._layerwise_offload_tail_attrs = ()
    with torch.no_grad():
        reference = model(**flux_inputs())[0]
    backend = apply_offload(model, CPU)
    seen = []
    hook = model.transformer_blocks[0].register_forward_pre_hook(lambda *_: seen.append(model.proj_out.weight.numel()))
    with torch.no_grad():
        assert torch.equal(model(**flux_inputs())[0], reference)
    hook.remove()
    assert seen == [model.proj_out.weight.numel()] and seen[0] > 0
    backend.disable()


@pytest.mark.parametrize("attrs, what", [(("norm_outt",), "not a module of it"),
                                         (("single_transformer_blocks",), r"\(or holds\) a block")])
def test_misspelled_output_layer_is_refused_before_anything_changes(attrs, what):
    model = bare_flux()
    model._layerwise_offload_tail_attrs = attrs
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=rf"names '{attrs[0]}', which is {what}; allowed: .*norm_out"):
        apply_offload(model, CPU)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in state.items())
    assert not any(getattr(m, "_diffusers_hook", None) for m in model.modules())
