"""#28 item 4: a rank failing while enabling distributed offload, after the ranks agreed on the model (host OOM
while packing, a later local stage), makes every rank roll back and raise an error naming it, within seconds. Before,
the other rank waited for the process group's whole timeout and failed with an unrelated gloo timeout (AllGather),
or stayed enabled while the failing rank was not (no AllGather)."""

from __future__ import annotations

import pytest

import dist_failures
import dist_harness
from dist_harness import launch

WORLD = 2
PG_TIMEOUT = 60  # the hang this replaces lasted this long; the agreement answers in well under it

dist_harness.start_server()


@pytest.mark.parametrize("where", ["packing", "install_guards"])
@pytest.mark.parametrize("use_allgather", [True, False], ids=["allgather", "no-allgather"])
def test_a_rank_failing_after_agreement_rolls_back_every_rank(use_allgather, where):
    results = launch(dist_failures.one_rank_fails, WORLD, use_allgather, where, 1, deadline=150,
                     pg_timeout=PG_TIMEOUT)
    assert all(r["ok"] for r in results), "\n".join(dist_harness.describe(k, r) for k, r in enumerate(results))
    ranks = [r["value"] for r in results]
    injected = "MemoryError: cannot allocate" if where == "packing" else "RuntimeError: install_guards failed"
    failing, other = ranks[1]["error"], ranks[0]["error"]
    assert failing is not None and other is not None, ranks
    # The failing rank raises its own error, noting that it is rank 1 and that every rank rolled back.
    assert f"{failing['type']}: {failing['message']}".startswith(injected), failing
    assert any("rank 1 of 2 (this rank) failed" in n and "every rank rolled back" in n for n in failing["notes"])
    # The other rank raises at once, naming rank 1 and its error.
    assert other["type"] == "RuntimeError", other
    assert other["message"].startswith("distributed layerwise offload: rank 1 could not enable"), other
    assert injected in other["message"] and "every rank rolled back" in other["message"]
    for rank, r in enumerate(ranks):
        assert r["seconds"] < 20, (rank, r["seconds"])
        assert r["unchanged"] is True, (rank, r["unchanged"])
        assert r["no_backend"] and r["equal_after"] and r["equal_enabled_again"], (rank, r)
