"""What each rank runs in the distributed offload tests. Every function returns plain data the test asserts on;
references (no offload) are computed in the same process, so comparisons are bitwise."""

from __future__ import annotations

import os
import time
from typing import Any

import torch
import torch.nn as nn

from diffusers_omni import OffloadConfig, OffloadPlan, apply_offload
from diffusers_omni.offload.dataparallel import StepMismatchError
from diffusers_omni.offload.distributed import shard_numel
from diffusers_omni.offload.layerwise import stack_modules
from diffusers_omni.offload.loading import load_transformer_mmap

from dist_harness import note
from offload_helpers import (
    assert_same_snapshot,
    block_bytes,
    file_mappings,
    mapped_file,
    flux_pipe,
    generate,
    pipeline_modules,
    snapshot,
    wan22_pipe,
)


def deep_flux_pipe():
    """The tiny FLUX pipeline with a 3 + 4 block transformer (an odd ring of 7: slots are reused and the
    wrap-around shares the last block's slot)."""
    from diffusers import FluxTransformer2DModel

    pipe = flux_pipe()
    config = {**pipe.transformer.config, "num_layers": 3, "num_single_layers": 4}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        transformer = FluxTransformer2DModel.from_config(config).eval()
    pipe.register_modules(transformer=transformer)
    return pipe


def _expected_host_bytes(backend, world_size: int) -> dict[str, int]:
    total: dict[str, int] = {}
    state = backend._state
    for row in state.weights:
        for weights in row:
            for dtype, numel in weights.numel.items():
                size = shard_numel(numel, world_size) * torch.empty(0, dtype=dtype).element_size()
                total[str(dtype)] = total.get(str(dtype), 0) + size
    return total


def _parity(rank: int, world: int, make, use_allgather: bool, **options: Any) -> dict[str, Any]:
    pipe = make()
    reference = generate(pipe, steps=2)
    full_bytes = sum(block_bytes(m) for m in pipeline_modules(pipe))
    ids = [id(p) for m in pipeline_modules(pipe) for p in m.parameters()]
    backend = pipe.enable_distributed_layerwise_offload(use_allgather=use_allgather, device="cpu", **options)
    blocks = stack_modules(backend)
    outputs = [generate(pipe, steps=2) for _ in range(2)]
    stats = backend.stats
    largest = max(w.nbytes for row in backend._state.weights for w in row)
    result = {
        "equal": all(torch.equal(o, reference) for o in outputs),
        "ids_kept": ids == [id(p) for m in pipeline_modules(pipe) for p in m.parameters()],
        "materialised_between_calls": [block_bytes(b) for b in blocks],
        "slot_count": stats.slot_count,
        "slot_bytes": stats.slot_bytes,
        "largest_block": largest,
        "host_bytes": stats.host_bytes,
        "host_bytes_per_dtype": dict(stats.host_bytes_per_dtype),
        "on_demand_loads": stats.on_demand_loads,
        "loads": stats.loads,
        "full_bytes": full_bytes,
    }
    if use_allgather:
        result["expected_host_bytes"] = _expected_host_bytes(backend, world)
        result["streamed_total"] = sum(w.nbytes for row in backend._state.weights for w in row)
    pipe.disable_omni_offload()
    result["restored"] = all(block_bytes(b) > 0 for b in blocks)
    result["equal_after_disable"] = torch.equal(generate(pipe, steps=2), reference)
    return result


class _Block(nn.Module):
    def __init__(self, sizes: dict[torch.dtype, int], seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        for i, (dtype, n) in enumerate(sizes.items()):
            data = torch.randn(n, generator=g).to(dtype)
            self.register_parameter(f"p{i}", nn.Parameter(data, requires_grad=False))

    def forward(self, seen: list) -> list:
        seen.append([p.detach().clone() for p in self.parameters()])
        return seen


class _Stack(nn.Module):
    def __init__(self, sizes: list[dict[torch.dtype, int]]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Block(s, i) for i, s in enumerate(sizes))

    def forward(self) -> list:
        seen: list = []
        for block in self.blocks:
            block(seen)
        return seen


def dtypes_round_trip(rank: int, world: int) -> dict[str, Any]:
    """Weights rebuilt by all-gather are byte-identical (bf16, fp32, float8), odd sizes (remainder padding), an
    odd ring (the wrap-around shares the last block's slot)."""
    dtypes = [torch.bfloat16, torch.float32] + ([torch.float8_e4m3fn] if hasattr(torch, "float8_e4m3fn") else [])
    sizes = [{d: 37 + 11 * i + j for j, d in enumerate(dtypes)} for i in range(3)]
    model = _Stack(sizes)
    originals = [[p.detach().clone() for p in b.parameters()] for b in model.blocks]
    config = OffloadConfig("distributed_layerwise", device="cpu", plan=OffloadPlan(blocks={"": ("blocks",)}))
    backend = apply_offload(model, config)
    runs = [model() for _ in range(3)]
    same = all(
        torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        for seen in runs
        for got, want in zip(seen, originals)
        for a, b in zip(got, want)
    )
    stats = backend.stats
    result = {
        "byte_identical": same,
        "dtypes": [str(d) for d in dtypes],
        "host_bytes_per_dtype": dict(stats.host_bytes_per_dtype),
        "expected": _expected_host_bytes(backend, world),
        "on_demand_loads": stats.on_demand_loads,
        "empty_between": [block_bytes(b) for b in model.blocks],
    }
    backend.disable()
    result["restored_equal"] = all(
        torch.equal(p.view(torch.uint8), o.view(torch.uint8))
        for b, orig in zip(model.blocks, originals)
        for p, o in zip(b.parameters(), orig)
    )
    return result


def data_parallel(rank: int, world: int) -> dict[str, Any]:
    pipe = flux_pipe()
    seed = 100 + rank
    prompt = ["a red fox in the snow", "a lighthouse at dawn", "a bowl of ramen", "a city at night"][rank % 4]

    def run(steps: int = 2) -> torch.Tensor:
        return pipe(prompt=prompt, num_inference_steps=steps, generator=torch.Generator().manual_seed(seed),
                    output_type="latent", max_sequence_length=32, height=32, width=32)[0]

    reference = run()
    pipe.enable_distributed_layerwise_offload(device="cpu")
    out = run()
    started = time.monotonic()
    try:
        run(steps=2 + rank)
        mismatch = "no error"
    except StepMismatchError as error:
        mismatch = str(error)
    elapsed = time.monotonic() - started
    after = run()  # the group is still in step after the refused call
    return {"equal": torch.equal(out, reference), "mismatch": mismatch, "mismatch_s": elapsed,
            "equal_after": torch.equal(after, reference), "digest": float(out.double().sum())}


def rejections(rank: int, world: int) -> dict[str, Any]:
    """Each refused combination raises before anything is mutated."""
    pipe = flux_pipe()
    before = snapshot(*pipeline_modules(pipe))
    errors = {}
    attempts = {
        "resident+allgather": dict(use_allgather=True, resident_layers=1),
        "tp+allgather": dict(tensor_parallel_size=2),
        "hsdp+allgather": dict(hsdp=True),
        "too many resident": dict(use_allgather=False, resident_layers=99),
    }
    for name, options in attempts.items():
        try:
            pipe.enable_distributed_layerwise_offload(device="cpu", **options)
            errors[name] = None
            pipe.disable_omni_offload()
        except (ValueError, RuntimeError) as error:
            errors[name] = f"{type(error).__name__}: {error}"
    # A quantized (tensor subclass) weight that cannot stream, on rank 1 only: rank 0 must learn of it and refuse.
    from quant_helpers import OpaqueTensor

    module = pipe.transformer.single_transformer_blocks[0].proj_out
    plain = module.weight
    if rank == 1:
        module._parameters["weight"] = OpaqueTensor(plain.detach().clone())
    try:
        pipe.enable_distributed_layerwise_offload(device="cpu")
        errors["unstreamable on rank 1"] = None
        pipe.disable_omni_offload()
    except (ValueError, RuntimeError) as error:
        errors["unstreamable on rank 1"] = f"{type(error).__name__}: {error}"
    module._parameters["weight"] = plain
    try:
        assert_same_snapshot(before, snapshot(*pipeline_modules(pipe)))
        unchanged = True
    except AssertionError:
        unchanged = False
    return {"errors": errors, "unchanged": unchanged, "backend": pipe.omni_offload_backend is None}


def mmap_loading(rank: int, world: int, single: str, sharded: str) -> dict[str, Any]:
    from diffusers import WanTransformer3DModel

    pipe = wan22_pipe()
    reference = generate(pipe, steps=2)
    original_buffers = {n: b.clone() for n, b in pipe.transformer.named_buffers()}
    results = {}
    for name, folder in (("single", single), ("sharded", sharded)):
        first = load_transformer_mmap(WanTransformer3DModel, folder)
        mappings = file_mappings()
        mapped = sum(1 for p in first.parameters() if (mapped_file(p, mappings) or "").endswith(".safetensors"))
        buffers_equal = all(torch.equal(b, original_buffers[n]) for n, b in first.named_buffers())
        pipe.transformer = first
        pipe.register_modules(transformer=first)
        backend = pipe.enable_distributed_layerwise_offload(device="cpu")
        out = generate(pipe, steps=2)
        results[name] = {
            "equal": torch.equal(out, reference),
            "max_diff": float((out - reference).abs().max()),
            "buffers_equal": buffers_equal,
            "nonpersistent": sorted(n for n, _ in first.named_buffers()),
            "mapped_params": mapped,
            "host_bytes": backend.stats.host_bytes,
            "streamed_total": sum(w.nbytes for row in backend._state.weights for w in row),
        }
        pipe.disable_omni_offload()
    return results


def progress_bars(rank: int, world: int) -> dict[str, str]:
    """stderr of AllGather enable and disable with ``show_progress=True``, then with the pipeline's bars disabled."""
    import contextlib
    import io

    out = {}
    for name in ("shown", "pipeline_disabled"):
        pipe = flux_pipe()
        if name == "pipeline_disabled":
            pipe.set_progress_bar_config(disable=True)
        enable, disable = io.StringIO(), io.StringIO()
        with contextlib.redirect_stderr(enable):
            pipe.enable_distributed_layerwise_offload(device="cpu", show_progress=True)
        with contextlib.redirect_stderr(disable):
            pipe.disable_omni_offload()
        out[name] = {"enable": enable.getvalue(), "disable": disable.getvalue()}
    return out


def main_suite(rank: int, world: int, single: str, sharded: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, call in (
        ("flux_allgather", lambda: _parity(rank, world, deep_flux_pipe, True)),
        ("flux_no_allgather", lambda: _parity(rank, world, deep_flux_pipe, False, resident_layers=2)),
        ("wan22_allgather", lambda: _parity(rank, world, wan22_pipe, True)),
        ("dtypes", lambda: dtypes_round_trip(rank, world)),
        ("data_parallel", lambda: data_parallel(rank, world)),
        ("rejections", lambda: rejections(rank, world)),
        ("mmap", lambda: mmap_loading(rank, world, single, sharded)),
        ("progress", lambda: progress_bars(rank, world)),
    ):
        note(f"scenario {name}")
        try:
            out[name] = {"ok": True, "value": call()}
        except Exception as error:  # noqa: BLE001 - reported per scenario
            import traceback

            out[name] = {"ok": False, "error": f"{type(error).__name__}: {error}", "tb": traceback.format_exc()}
    return out


def collect_garbage(rank: int, world: int) -> dict[str, Any]:
    """A full garbage collection, then a collective (see test_ranks_do_not_inherit_the_test_process_garbage)."""
    import gc

    import torch.distributed as dist

    gc.collect()
    dist.barrier()
    return {"barrier": True}


def rank_dies(rank: int, world: int) -> dict[str, Any]:
    """Rank 1 exits after enabling; the others must fail in their next collective, not hang."""
    pipe = flux_pipe()
    pipe.enable_distributed_layerwise_offload(device="cpu")
    if rank == 1:
        os._exit(3)
    started = time.monotonic()
    try:
        generate(pipe, steps=2)
        return {"error": None, "seconds": time.monotonic() - started}
    except Exception as error:  # noqa: BLE001
        return {"error": f"{type(error).__name__}: {error}", "seconds": time.monotonic() - started}
