"""The shard store (AllGather's 1/N of each block) behind the all-gather transport: each rank holds exactly its
shard of every block's bytes, the ranks' shards together are the block, and the tensors come back bitwise (with
their identities) on disable and after a failure injected on one rank while enabling."""

from __future__ import annotations

import pytest
import torch

from diffusers_omni.offload.memory import HostMemory, PackedWeights, Transfers
from diffusers_omni.offload.stores import (
    PinnedStore, ShardGroup, ShardStore, StoreContext, registered_stores, store_for,
)
from diffusers_omni.offload.stores.shard import shard_numel

import dist_harness
import dist_shards
from dist_harness import launch

dist_harness.start_server()


def test_shard_store_is_chosen_only_when_the_context_carries_a_shard_group():
    block = torch.nn.Linear(3, 5)
    weights = PackedWeights("block", block)
    context = StoreContext(torch.device("cpu"), HostMemory(torch.device("cpu"), False))
    assert registered_stores()[0] is ShardStore  # asked first: no other store may hold a block whole under it
    assert isinstance(store_for(weights, context), PinnedStore)
    context.shards = ShardGroup(group=None, rank=1, world_size=4)
    store = store_for(weights, context)
    assert isinstance(store, ShardStore)
    assert store.device_numel == {d: shard_numel(n, 4) * 4 for d, n in weights.numel.items()}
    assert store.host_nbytes == sum(shard_numel(n, 4) * d.itemsize for d, n in weights.numel.items())
    with pytest.raises(TypeError, match="all-gather transport"):  # the copy transport cannot rebuild a shard
        store.fill({}, Transfers(torch.device("cpu")), None, None)
    with pytest.raises(RuntimeError, match="1/N shard"):
        store.host_views()


@pytest.mark.parametrize("world", [2, 3])
def test_each_rank_holds_exactly_its_shard_and_gets_tensors_back_bitwise(world):
    results = launch(dist_shards.shards_held, world, deadline=120)
    assert all(r["ok"] for r in results), "\n".join(dist_harness.describe(k, r) for k, r in enumerate(results))
    ranks = [r["value"] for r in results]
    for rank, r in enumerate(ranks):
        assert r["runs_equal"] and not any(r["between"]), (rank, r)
        assert r["ids_kept"] and r["given_back"] and r["ordinary"], (rank, r)
        assert r["store_blocks"] == {"shard": 3}
        assert r["host_bytes"] == r["store_host_bytes"]["shard"] == sum(b["host_nbytes"] for b in r["blocks"])
        for block in r["blocks"]:
            assert block["store"] == "ShardStore"
            for dtype, d in block["per_dtype"].items():
                assert d["equal_slice"], (rank, dtype)  # this rank's slice of the block's layout, zero padded
                assert d["shard_numel"] == -(-d["numel"] // world)  # exactly 1/N (ceil)
                # Padding: fewer than N elements in all.
                assert 0 <= d["shard_bytes"] * world - d["block_bytes"] < world * d["itemsize"]
            assert block["host_nbytes"] == sum(d["shard_bytes"] for d in block["per_dtype"].values())
    # The ranks' shards are each block's bytes exactly once: the report's leaf bytes add up to the block's.
    for index in range(3):
        assert sum(r["blocks"][index]["held_leaf_bytes"] for r in ranks) == ranks[0]["blocks"][index]["leaf_bytes"]
        for dtype, d in ranks[0]["blocks"][index]["per_dtype"].items():
            assert sum(r["blocks"][index]["per_dtype"][dtype]["shard_bytes"] for r in ranks) >= d["block_bytes"]
    if world == 2:  # an even layout splits in exact halves
        for r in ranks:
            for block in r["blocks"]:
                assert all(d["shard_bytes"] * 2 == d["block_bytes"] for d in block["per_dtype"].values())


@pytest.mark.parametrize("where", ["take", "guards"])
def test_a_failure_while_enabling_gives_every_tensor_back_bitwise(where):
    results = launch(dist_shards.failure_while_enabling, 2, where, deadline=120)
    assert all(r["ok"] for r in results), "\n".join(dist_harness.describe(k, r) for k, r in enumerate(results))
    ranks = [r["value"] for r in results]
    assert ranks[1]["error"].startswith("InjectedFailure"), ranks[1]
    assert "rank 1 could not enable" in ranks[0]["error"], ranks[0]
    for rank, r in enumerate(ranks):
        assert r["unchanged"] is True, (rank, r["unchanged"])
        assert r["given_back"] and r["given_back_again"], (rank, r)
