"""What each rank runs in test_distributed_shard_store: the shard store's bytes per rank, and its tensors given back
bitwise on disable and after a failure while enabling (injected on one rank)."""

from __future__ import annotations

from typing import Any

import torch

from diffusers_omni import OffloadConfig, OffloadPlan, apply_offload
from diffusers_omni.offload.stores import ShardStore
from diffusers_omni.offload.stores.shard import shard_range

from dist_scenarios import _Stack
from offload_helpers import assert_same_snapshot, snapshot


class InjectedFailure(Exception):
    pass


def _model() -> _Stack:
    """Three blocks of bf16, fp32 and (where torch has it) float8 tensors of odd sizes: the padding of the last
    shard is exercised for any N."""
    dtypes = [torch.bfloat16, torch.float32] + ([torch.float8_e4m3fn] if hasattr(torch, "float8_e4m3fn") else [])
    return _Stack([{d: 37 + 11 * i + j for j, d in enumerate(dtypes)} for i in range(3)])


def _config() -> OffloadConfig:
    return OffloadConfig("distributed_layerwise", device="cpu", plan=OffloadPlan(blocks={"": ("blocks",)}))


def _bytes(tensors) -> list[bytes]:
    return [t.detach().contiguous().view(torch.uint8).numpy().tobytes() for t in tensors]


def _layout_bytes(weights, originals: list[torch.Tensor]) -> dict[torch.dtype, torch.Tensor]:
    """The block's flat per-dtype layout (zero padding between tensors) holding ``originals``."""
    flat = {dtype: torch.zeros(numel, dtype=dtype) for dtype, numel in weights.numel.items()}
    for view, original in zip(weights.views_into(flat), originals):
        view.copy_(original)
    return flat


def shards_held(rank: int, world: int) -> dict[str, Any]:
    model = _model()
    originals = [[p.detach().clone() for p in block.parameters()] for block in model.blocks]
    ids = [id(p) for p in model.parameters()]
    backend = apply_offload(model, _config())
    state = backend._state
    blocks = []
    for weights, block, block_originals in zip(state.weights[0], state.streamed[0], originals):
        store = block.store
        layout = _layout_bytes(weights, block_originals)
        per_dtype = {}
        for dtype, numel in weights.numel.items():
            start, end = shard_range(numel, world, rank)
            expected = torch.zeros(end - start, dtype=dtype)
            real = layout[dtype][start:min(end, numel)]
            expected[: real.numel()] = real
            shard = store.host[dtype]
            per_dtype[str(dtype)] = {
                "numel": numel,
                "shard_numel": shard.numel(),
                "shard_bytes": shard.numel() * shard.element_size(),
                "block_bytes": numel * dtype.itemsize,
                "itemsize": dtype.itemsize,
                "equal_slice": torch.equal(shard.view(torch.uint8), expected.view(torch.uint8)),
            }
        blocks.append({"store": type(store).__name__, "host_nbytes": store.host_nbytes,
                       "held_leaf_bytes": store.held_leaf_bytes(), "per_dtype": per_dtype,
                       "leaf_bytes": sum(o.numel() * o.element_size() for o in block_originals)})
    between = [sum(p.numel() for p in block.parameters()) for block in model.blocks]
    runs_equal = all(
        _bytes(got) == _bytes(want) for _ in range(2) for got, want in zip(model(), originals)
    )
    stats = backend.stats
    result = {"blocks": blocks, "between": between, "runs_equal": runs_equal,
              "store_blocks": dict(stats.store_blocks), "store_host_bytes": dict(stats.store_host_bytes),
              "host_bytes": stats.host_bytes}
    backend.disable()
    result["ids_kept"] = ids == [id(p) for p in model.parameters()]
    result["given_back"] = all(
        _bytes(block.parameters()) == _bytes(block_originals) for block, block_originals in zip(model.blocks, originals)
    )
    result["ordinary"] = all(type(p.data) is torch.Tensor and p.device.type == "cpu" for p in model.parameters())
    return result


def failure_while_enabling(rank: int, world: int, where: str) -> dict[str, Any]:
    """Rank 1 fails at ``where`` (``"take"``: the second block's shard store, once it holds its shard; ``"guards"``:
    after every block was taken and parked); every rank must give every tensor back, bitwise, identities kept."""
    model = _model()
    before = snapshot(model)
    originals = [p.detach().clone() for p in model.parameters()]
    undo = (lambda: None)
    if rank == 1:
        if where == "take":
            original = ShardStore.take
            calls = {"n": 0}

            def take(self, journal):
                original(self, journal)
                calls["n"] += 1
                if calls["n"] == 2:
                    raise InjectedFailure("shard store take failed (injected)")

            ShardStore.take = take
            undo = lambda: setattr(ShardStore, "take", original)  # noqa: E731
        else:
            from diffusers_omni.offload.layerwise import LayerwiseOffloadBackend

            original_step = LayerwiseOffloadBackend._install_guards

            def install_guards(self, state, journal):
                original_step(self, state, journal)
                raise InjectedFailure("install_guards failed (injected)")

            LayerwiseOffloadBackend._install_guards = install_guards
            undo = lambda: setattr(LayerwiseOffloadBackend, "_install_guards", original_step)  # noqa: E731
    try:
        apply_offload(model, _config())
        error = None
    except Exception as exc:  # noqa: BLE001 - reported to the test
        error = f"{type(exc).__name__}: {exc}"
    finally:
        undo()
    try:
        assert_same_snapshot(before, snapshot(model))
        unchanged = True
    except AssertionError as mismatch:
        unchanged = str(mismatch)
    result = {"error": error, "unchanged": unchanged,
              "given_back": _bytes(model.parameters()) == _bytes(originals)}
    backend = apply_offload(model, _config())  # every rank can enable again
    backend.disable()
    result["given_back_again"] = _bytes(model.parameters()) == _bytes(originals)
    return result
