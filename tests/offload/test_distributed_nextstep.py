"""Distributed layerwise offload of NextStep-1.1's backbone on 2 gloo ranks (CPU): the same bits as resident."""

from __future__ import annotations

import pytest

import dist_harness
import dist_nextstep
from dist_harness import launch

dist_harness.start_server()


@pytest.mark.parametrize("use_allgather", [True, False], ids=["allgather", "full-copy"])
def test_nextstep_distributed_layerwise_is_bitwise_equal(use_allgather):
    results = launch(dist_nextstep.nextstep_parity, 2, use_allgather, deadline=240.0)
    for rank, result in enumerate(results):
        assert result.get("ok"), f"rank {rank}: {result}"
        assert result["value"] == {"equal": True, "after": True}, f"rank {rank}: {result['value']}"
