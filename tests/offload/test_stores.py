"""A new block store is one class plus its registration.

``DictStore`` below keeps each streamed block's bytes in a Python dict of ``bytes`` objects (nothing in the offload
knows it). Registered, the planner hands it every streamed block it claims; the tiny FLUX and Wan 2.2 pipelines run
end to end on it, bitwise equal to the resident pipeline, ``state_dict()`` reads its blocks, disable gives every
tensor back, and a failure injected into it while enabling (or while loading a block) leaves the pipeline exactly as
it was.
"""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch

from diffusers_omni.offload.memory import PackedWeights, Transfers
from diffusers_omni.offload.stores import (
    BlockStore, PinnedStore, StoreContext, register_store, registered_stores, unregister_store,
)
from diffusers_omni.utils.journal import Journal
from offload_helpers import assert_same_snapshot, flux_pipe, generate, pipeline_snapshot, wan22_pipe


class InjectedFailure(Exception):
    pass


class DictStore(BlockStore):
    """Each block's bytes as one ``bytes`` object per dtype, in a dict."""

    name = "test-dict"
    priority = 10
    fail_take_at: ClassVar[int | None] = None  # the n-th take (0-based) raises
    fail_fill_at: ClassVar[int | None] = None  # the n-th fill raises
    takes: ClassVar[int] = 0
    fills: ClassVar[int] = 0

    @classmethod
    def claims(cls, weights: PackedWeights, context: StoreContext) -> bool:
        return True

    def take(self, journal: Journal) -> None:
        weights = self.weights
        originals = weights.tensors.current()
        journal.record(f"restore {weights.path}", lambda: weights.park(originals))
        flat = weights.current_flat()
        type(self).takes += 1
        if type(self).takes - 1 == self.fail_take_at:
            raise InjectedFailure(f"take {weights.path}")
        self.bytes = {dtype: tensor.view(torch.uint8).numpy().tobytes() for dtype, tensor in flat.items()}

    def _tensors(self) -> dict[torch.dtype, torch.Tensor]:
        return {dtype: torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype)
                for dtype, data in self.bytes.items()}

    def fill(self, buffers: dict[torch.dtype, torch.Tensor], transfers: Transfers, wait_for, done) -> None:
        type(self).fills += 1
        if type(self).fills - 1 == self.fail_fill_at:
            raise InjectedFailure(f"fill {self.weights.path}")
        transfers.copy([(tensor, buffers[dtype]) for dtype, tensor in self._tensors().items()],
                       wait_for=wait_for, done=done)

    def host_views(self) -> list[torch.Tensor]:
        return self.weights.views_into(self._tensors())

    def give_back(self) -> None:
        self.weights.park(self.host_views(), final=True)


@pytest.fixture
def dict_store():
    DictStore.takes = DictStore.fills = 0
    DictStore.fail_take_at = DictStore.fail_fill_at = None
    register_store(DictStore)
    yield DictStore
    unregister_store(DictStore)


def _state_dicts(pipe, names) -> dict[str, dict[str, torch.Tensor]]:
    return {name: {k: v.clone() for k, v in getattr(pipe, name).state_dict().items()} for name in names}


@pytest.mark.parametrize("make, dits", [(flux_pipe, ("transformer",)), (wan22_pipe, ("transformer", "transformer_2"))],
                         ids=["flux", "wan2.2"])
def test_a_registered_store_runs_the_pipeline_bitwise_and_gives_every_tensor_back(make, dits, dict_store):
    pipe = make()
    reference = generate(pipe, steps=2)
    expected = _state_dicts(pipe, dits)
    backend = pipe.enable_layerwise_offload(device="cpu")
    stats = backend.stats
    assert stats.store_blocks == {"test-dict": stats.streamed_blocks} and stats.streamed_blocks > 0
    assert stats.store_bytes["test-dict"] == stats.streamed_bytes_per_pass
    for row in backend._state.streamed:
        for block in row:
            assert block is None or type(block.store) is DictStore
    # Encoders stream too: every block of every stack went through the store, once.
    assert DictStore.takes == stats.streamed_blocks
    for _ in range(2):
        assert torch.equal(generate(pipe, steps=2), reference)
    assert DictStore.fills >= 2 * stats.streamed_blocks
    actual = _state_dicts(pipe, dits)  # read through the store's host views
    for name in dits:
        assert actual[name].keys() == expected[name].keys()
        for key, tensor in expected[name].items():
            assert torch.equal(actual[name][key], tensor), (name, key)
    pipe.disable_omni_offload()
    assert _state_dicts(pipe, dits).keys() == expected.keys()
    for name in dits:
        for key, tensor in getattr(pipe, name).state_dict().items():
            assert torch.equal(tensor, expected[name][key]), (name, key)
    assert torch.equal(generate(pipe, steps=2), reference)


def test_a_store_failing_while_enabling_rolls_back_exactly(dict_store):
    pipe = wan22_pipe()
    reference = generate(pipe, steps=2)
    count = pipe.enable_layerwise_offload(device="cpu").stats.streamed_blocks
    pipe.disable_omni_offload()
    assert count >= 3
    before = pipeline_snapshot(pipe)
    DictStore.takes = 0
    DictStore.fail_take_at = count // 2  # some blocks already hold their bytes in the store
    with pytest.raises(InjectedFailure):
        pipe.enable_layerwise_offload(device="cpu")
    assert pipe.omni_offload_backend is None
    assert_same_snapshot(before, pipeline_snapshot(pipe))
    DictStore.fail_take_at = None
    pipe.enable_layerwise_offload(device="cpu")
    assert torch.equal(generate(pipe, steps=2), reference)
    pipe.disable_omni_offload()
    assert torch.equal(generate(pipe, steps=2), reference)


def test_a_store_failing_to_fill_a_block_fails_that_call_only(dict_store):
    pipe = flux_pipe()
    reference = generate(pipe, steps=2)
    pipe.enable_layerwise_offload(device="cpu")
    DictStore.fail_fill_at = DictStore.fills + 3
    with pytest.raises(InjectedFailure):
        generate(pipe, steps=2)
    assert torch.equal(generate(pipe, steps=2), reference)
    pipe.disable_omni_offload()
    assert torch.equal(generate(pipe, steps=2), reference)


def test_registry_orders_by_priority_and_refuses_a_taken_name(dict_store):
    stores = registered_stores()
    assert stores.index(DictStore) < stores.index(PinnedStore)  # asked before the fallback
    assert stores[-1] is PinnedStore

    class Clash(DictStore):
        name = "test-dict"

    with pytest.raises(ValueError, match="'test-dict' is registered already"):
        register_store(Clash)
    with pytest.raises(TypeError, match="BlockStore subclass"):
        register_store(object)
