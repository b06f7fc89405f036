"""What each rank runs in test_distributed_failures: one rank fails while enabling distributed offload, after the
ranks agreed on the model; every rank must raise, naming the failing rank, and leave its pipeline as before."""

from __future__ import annotations

import time
from typing import Any, Callable

import torch

from diffusers_omni.offload import memory
from diffusers_omni.offload.distributed import AllGatherLayerwiseOffloadBackend, DistributedLayerwiseOffloadBackend

from dist_harness import note
from offload_helpers import assert_same_snapshot, flux_pipe, generate, pipeline_snapshot


def _fail(where: str, use_allgather: bool) -> Callable[[], None]:
    """Make this rank fail at ``where``: ``"packing"`` (a host allocation, as host OOM does) or
    ``"install_guards"`` (a later local stage); returns the undo."""
    if where == "packing":
        original = memory.HostMemory.allocate
        calls = {"n": 0}

        def allocate(self, numel, dtype):
            calls["n"] += 1
            if calls["n"] == 2:  # the second block: the first is packed, so rollback has work to do
                raise MemoryError(f"cannot allocate {numel} elements of host memory (injected)")
            return original(self, numel, dtype)

        memory.HostMemory.allocate = allocate
        return lambda: setattr(memory.HostMemory, "allocate", original)
    backend = AllGatherLayerwiseOffloadBackend if use_allgather else DistributedLayerwiseOffloadBackend
    name = "_install_guards"  # the guard step (both modes run the layerwise backend's steps)
    original_stage = getattr(backend, name)  # the class's own, or the one it inherits
    own = name in backend.__dict__

    def stage(self, state, journal):
        original_stage(self, state, journal)
        raise RuntimeError("install_guards failed (injected)")

    setattr(backend, name, stage)
    return (lambda: setattr(backend, name, original_stage)) if own else (lambda: delattr(backend, name))


def one_rank_fails(rank: int, world: int, use_allgather: bool, where: str, failing: int) -> dict[str, Any]:
    pipe = flux_pipe()
    reference = generate(pipe, steps=1)
    before = pipeline_snapshot(pipe)
    undo = _fail(where, use_allgather) if rank == failing else (lambda: None)
    note(f"enabling (use_allgather={use_allgather}, rank {failing} fails at {where})")
    started = time.monotonic()
    try:
        pipe.enable_distributed_layerwise_offload(device="cpu", use_allgather=use_allgather)
        error = None
    except Exception as exc:  # noqa: BLE001 - reported to the test
        error = {"type": type(exc).__name__, "message": str(exc), "notes": list(getattr(exc, "__notes__", []))}
    finally:
        undo()
    seconds = time.monotonic() - started
    note("enable returned")
    try:
        assert_same_snapshot(before, pipeline_snapshot(pipe))
        unchanged = True
    except AssertionError as mismatch:
        unchanged = str(mismatch)
    result = {"error": error, "seconds": seconds, "unchanged": unchanged,
              "no_backend": pipe.omni_offload_backend is None,
              "equal_after": torch.equal(generate(pipe, steps=1), reference)}
    # No rank is left behind in a collective: enabling again on every rank works and is bitwise equal.
    note("enabling again")
    pipe.enable_distributed_layerwise_offload(device="cpu", use_allgather=use_allgather)
    result["equal_enabled_again"] = torch.equal(generate(pipe, steps=1), reference)
    pipe.disable_omni_offload()
    return result
