"""Distributed layerwise offload of BAGEL's and SoulX-Singer's backbones on 2 gloo ranks (CPU): the same bits as
resident, as the supported-models table says (NextStep-1.1's is tests/offload/test_distributed_nextstep.py)."""

from __future__ import annotations

import pytest

import dist_harness
import dist_systems
from dist_harness import launch

dist_harness.start_server()


@pytest.mark.parametrize("system", ["bagel", "soulx_singer"])
@pytest.mark.parametrize("use_allgather", [True, False], ids=["allgather", "full-copy"])
def test_distributed_layerwise_is_bitwise_equal(system, use_allgather):
    results = launch(getattr(dist_systems, f"{system}_parity"), 2, use_allgather, deadline=240.0)
    for rank, result in enumerate(results):
        assert result.get("ok"), f"rank {rank}: {result}"
        assert result["value"] == {"equal": True, "after": True, "streamed": True}, f"rank {rank}: {result['value']}"


def test_distributed_lossless_ranks_share_one_compression_cache_dir(tmp_path):
    results = launch(dist_systems.lossless_parity, 2, False, str(tmp_path), deadline=240.0)
    for rank, result in enumerate(results):
        assert result.get("ok"), f"rank {rank}: {result}"
        assert result["value"] == {"equal": True, "after": True, "streamed": True, "read_all": True,
                                   "equal_cached": True}, f"rank {rank}: {result['value']}"
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_distributed_full_copy_with_lossless_compression_is_bitwise_equal():
    results = launch(dist_systems.lossless_parity, 2, False, deadline=240.0)
    for rank, result in enumerate(results):
        assert result.get("ok"), f"rank {rank}: {result}"
        assert result["value"] == {"equal": True, "after": True, "streamed": True}, f"rank {rank}: {result['value']}"
