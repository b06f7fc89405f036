"""Rank function for tests/offload/test_distributed_nextstep.py (module level: ranks import it by name)."""

from __future__ import annotations

from typing import Any

import torch

CALL = dict(prompt="a red cat", negative_prompt="blurry", height=16, width=16, num_inference_steps=2,
            guidance_scale=3.0, output_type="latent")


def nextstep_parity(rank: int, world: int, use_allgather: bool) -> dict[str, Any]:
    from diffusers_omni import omnify
    from diffusers_omni.testing.tiny_nextstep import tiny_nextstep_pipeline

    pipe = omnify(tiny_nextstep_pipeline(0), "TORCH_SDPA")
    pipe.set_progress_bar_config(disable=True)

    def run():
        return pipe(**CALL, generator=torch.Generator().manual_seed(0)).images

    reference = run()
    pipe.enable_distributed_layerwise_offload(use_allgather=use_allgather, device="cpu")
    outputs = [run() for _ in range(2)]
    pipe.disable_omni_offload()
    return {"equal": all(torch.equal(o, reference) for o in outputs), "after": torch.equal(run(), reference)}
