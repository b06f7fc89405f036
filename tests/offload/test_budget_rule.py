"""The rule "a budget never makes a step slower than no budget", pinned where it is decided.

A step under layerwise offload is bounded by the larger of its compute and its copies; a budget can only change the
copies. So the rule holds when, for every budget: no block streams that would not stream without one (the streamed
bytes per step never grow), the in-flight window is never narrower (room for ``prefetch_depth + 1`` of the largest
block that still streams, the block-count limit lifted so smaller blocks fill it), and the budget itself is kept. The H200 measurement
of the same rule (torchao float8 and int8 FLUX.1-dev, ``quant-offload-budget-float8``) is in the offload guide.
"""

from __future__ import annotations

import random
import re

import pytest
import torch

from diffusers_omni import OffloadConfig, apply_offload
from diffusers_omni.offload.layerwise import plan_residency
from offload_helpers import bare_flux, flux_inputs

random.seed(0)
# Block sizes of real stacks, in units (FLUX's double-stream blocks ~2.4× its single-stream ones; Wan's equal;
# GGUF mixes a few percent apart; two DiT stacks one after the other; a forced-resident first block).
SHAPES = {
    "flux": ([24] * 19 + [10] * 38, [False] * 57, 5),
    "wan": ([30] * 40, [False] * 40, 3),
    "hunyuan-like": ([30] * 20 + [12] * 40, [False] * 60, 5),
    "gguf-mix": ([random.randint(95, 105) for _ in range(10)] + [random.randint(40, 44) for _ in range(30)],
                 [False] * 40, 3),
    "two-stacks": ([24] * 19 + [10] * 38 + [8] * 24, [False] * 81, 5),
    "forced-first": ([24] * 19 + [10] * 38, [i == 0 for i in range(57)], 5),
}


def _streamed(sizes: list[int], plan: list[bool]) -> int:
    return sum(size for size, resident in zip(sizes, plan) if not resident)


@pytest.mark.parametrize("name", sorted(SHAPES))
@pytest.mark.parametrize("slots", [2, 3])
def test_every_budget_streams_a_subset_of_no_budget_and_keeps_within_it(name, slots):
    sizes, forced, fixed = SHAPES[name]
    free = plan_residency(sizes, forced, fixed, None, slots)
    assert free == forced  # without a budget every block not forced resident streams
    window = slots * max(size for size, f in zip(sizes, forced) if not f)
    least = fixed + sum(size for size, f in zip(sizes, forced) if f) + window
    whole = fixed + sum(sizes)
    for step in range(201):
        budget = least + (whole - least) * step // 200
        plan = plan_residency(sizes, forced, fixed, budget, slots)
        assert all(plan[i] for i, f in enumerate(forced) if f)
        assert _streamed(sizes, plan) <= _streamed(sizes, free)
        streams = not all(plan)
        assert fixed + sum(s for s, r in zip(sizes, plan) if r) + (window if streams else 0) <= budget
    assert all(plan_residency(sizes, forced, fixed, whole, slots))
    with pytest.raises(ValueError, match="too small"):
        plan_residency(sizes, forced, fixed, least - 1, slots)


def test_a_real_offload_with_any_budget_copies_no_more_and_keeps_the_window():
    model = bare_flux(num_layers=2, num_single_layers=6)
    with torch.no_grad():
        reference = model(**flux_inputs())[0]

    blocks = [*model.transformer_blocks, *model.single_transformer_blocks]
    position = {id(block): i for i, block in enumerate(blocks)}

    def run(budget):
        """The offload's stats, and for each streamed block how many blocks before it its load was issued in the
        second call (the lead the copy has on the block's compute)."""
        running = [None]
        handles = [block.register_forward_pre_hook(lambda m, a, i=i: running.__setitem__(0, i))
                   for i, block in enumerate(blocks)]
        backend = apply_offload(model, OffloadConfig("layerwise", device="cpu", max_device_memory=budget))
        leads: dict[int, int] = {}
        streamer = backend._state.streamer
        original = streamer.load

        def watching(block, evict=True):
            loaded = original(block, evict)
            if loaded and recording[0]:
                target = position[id(_module_of(backend, block))]
                lead = (target - running[0]) % len(blocks) if running[0] is not None else len(blocks)
                leads[target] = max(leads.get(target, 0), lead)
            return loaded

        recording = [False]
        streamer.load = watching
        try:
            with torch.no_grad():
                for call in range(2):
                    recording[0] = call == 1
                    assert torch.equal(model(**flux_inputs())[0], reference)
            return backend.stats, leads
        finally:
            backend.disable()
            for handle in handles:
                handle.remove()

    free, free_leads = run(None)
    assert set(free_leads) == set(range(len(blocks)))
    assert free.in_flight_blocks == free.slot_count
    with pytest.raises(ValueError, match=r"allowed: at least (\d+)") as error:
        apply_offload(model, OffloadConfig("layerwise", device="cpu", max_device_memory=1))
    least = int(re.search(r"at least (\d+)", str(error.value)).group(1))
    whole = sum(p.numel() * p.element_size() for p in model.parameters())
    seen_resident = set()
    for step in range(9):
        stats, leads = run(least + (whole - least) * step // 8)
        # Every block that still streams starts its copy at least as many blocks ahead as without a budget.
        assert all(lead >= free_leads[i] for i, lead in leads.items()), (leads, free_leads)
        assert len(leads) == stats.streamed_blocks
        seen_resident.add(stats.resident_blocks)
        if stats.streamed_blocks:
            # As many of its streamed blocks in flight as without a budget (the reserve is sized by the largest
            # block that still streams), and smaller ones may fill the paid-for reserve beyond that count.
            assert stats.slot_count == free.slot_count
            assert stats.in_flight_capacity == stats.slot_count * stats.slot_bytes
            assert stats.in_flight_blocks is None
        assert stats.streamed_bytes_per_pass <= free.streamed_bytes_per_pass
        assert stats.copied_bytes <= free.copied_bytes
        assert stats.on_demand_loads == 0
    assert len(seen_resident) > 2  # the budgets above do keep different numbers of blocks resident


def _module_of(backend, block):
    """The block module a streamed block's weights belong to."""
    for stack, row in zip(backend._state.stacks, backend._state.streamed):
        for (_, module), streamed in zip(stack.blocks, row):
            if streamed is block:
                return module
    raise AssertionError("a load of a block no stack holds")
