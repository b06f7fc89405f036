"""Rank functions for tests/offload/test_distributed_systems.py (module level: ranks import them by name)."""

from __future__ import annotations

from typing import Any

import torch


def _parity(pipe, run, use_allgather: bool) -> dict[str, Any]:
    reference = run()
    backend = pipe.enable_distributed_layerwise_offload(use_allgather=use_allgather, device="cpu")
    streamed = backend.stats.streamed_blocks
    outputs = [run() for _ in range(2)]
    pipe.disable_omni_offload()
    return {"equal": all(torch.equal(o, reference) for o in outputs), "after": torch.equal(run(), reference),
            "streamed": streamed > 0}


def bagel_parity(rank: int, world: int, use_allgather: bool) -> dict[str, Any]:
    from diffusers_omni import omnify
    from diffusers_omni.testing.tiny_bagel import tiny_bagel_pipeline

    pipe = omnify(tiny_bagel_pipeline(), "TORCH_SDPA")
    pipe.set_progress_bar_config(disable=True)
    call = {"prompt": "a red cube", "height": 16, "width": 12, "num_inference_steps": 3, "output_type": "pt"}
    return _parity(pipe, lambda: pipe(**call, generator=torch.Generator().manual_seed(0)).images, use_allgather)


def soulx_singer_parity(rank: int, world: int, use_allgather: bool) -> dict[str, Any]:
    from diffusers_omni import omnify
    from diffusers_omni.testing.tiny_soulx_singer import tiny_soulx_singer_inputs, tiny_soulx_singer_pipeline

    pipe = omnify(tiny_soulx_singer_pipeline(), "TORCH_SDPA")
    pipe.set_progress_bar_config(disable=True)
    call = {**tiny_soulx_singer_inputs(), "num_inference_steps": 2, "output_type": "mel"}

    def run():
        output = pipe(**call, generator=torch.Generator().manual_seed(0))
        return output[0] if isinstance(output, tuple) else next(iter(output.values()))

    return _parity(pipe, run, use_allgather)


def lossless_parity(rank: int, world: int, use_allgather: bool, cache_dir: str | None = None) -> dict[str, Any]:
    """Distributed layerwise offload with compression="lossless" (each rank's full host copy coded) on tiny FLUX in
    bfloat16. With ``cache_dir`` (shared by the ranks: each writes the same files by an atomic rename) a second
    enable reads every block's code from it."""
    from offload_helpers import flux_pipe, generate

    pipe = flux_pipe()
    pipe.to(torch.bfloat16)
    reference = generate(pipe, steps=2)
    extra = {} if cache_dir is None else {"compression_cache_dir": cache_dir}
    backend = pipe.enable_distributed_layerwise_offload(use_allgather=False, device="cpu", compression="lossless",
                                                        **extra)
    coded = backend.stats.store_blocks.get("lossless", 0) > 0
    outputs = [generate(pipe, steps=2) for _ in range(2)]
    pipe.disable_omni_offload()
    result = {"equal": all(torch.equal(o, reference) for o in outputs),
              "after": torch.equal(generate(pipe, steps=2), reference), "streamed": coded}
    if cache_dir is not None:
        backend = pipe.enable_distributed_layerwise_offload(use_allgather=False, device="cpu", compression="lossless",
                                                            **extra)
        counters = backend.stats.cache_counters
        result["read_all"] = counters["cache blocks read"] == backend.stats.store_blocks["lossless"]
        result["equal_cached"] = torch.equal(generate(pipe, steps=2), reference)
        pipe.disable_omni_offload()
    return result
