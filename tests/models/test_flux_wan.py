from PIL import Image

from diffusers_omni import OmniFluxPipeline, OmniWanImageToVideoPipeline, OmniWanPipeline
from diffusers_omni.testing import tiny_flux_pipeline, tiny_wan_i2v_pipeline, tiny_wan_pipeline

from .harness import ModelCase, standard_tests

SMALL = {"prompt": "a red fox", "height": 32, "width": 32, "num_inference_steps": 2, "output_type": "latent"}

CASES = [
    ModelCase("flux", tiny_flux_pipeline, OmniFluxPipeline, SMALL, {"flux.joint": "self", "flux.single": "self"}),
    ModelCase("wan", tiny_wan_pipeline, OmniWanPipeline, {**SMALL, "num_frames": 5}, {"wan.self": "self", "wan.cross": "cross"}),
    ModelCase(
        "wan_i2v",
        tiny_wan_i2v_pipeline,
        OmniWanImageToVideoPipeline,
        {**SMALL, "num_frames": 5, "image": Image.new("RGB", (32, 32), (120, 60, 30))},
        {"wan.self": "self", "wan.cross": "cross", "wan.image_cross": "cross"},
    ),
]

globals().update(standard_tests(CASES))


def test_wan_video_to_video_shares_the_declaration():
    import numpy as np
    import torch
    from diffusers import WanVideoToVideoPipeline

    from diffusers_omni import OmniWanVideoToVideoPipeline, omnify
    from diffusers_omni.testing.tiny import tiny_wan_components

    video = [Image.fromarray(np.full((32, 32, 3), 60 * i, dtype=np.uint8)) for i in range(5)]
    call = {"video": video, "prompt": "a red fox", "height": 32, "width": 32, "num_inference_steps": 2, "output_type": "latent"}
    def components():
        parts = tiny_wan_components()
        return {k: v for k, v in parts.items() if k not in ("transformer_2", "boundary_ratio", "expand_timesteps")}

    stock = WanVideoToVideoPipeline(**components())
    expected = stock(**call, generator=torch.Generator().manual_seed(0)).frames
    pipe = omnify(WanVideoToVideoPipeline(**components()), "TORCH_SDPA")
    assert type(pipe) is OmniWanVideoToVideoPipeline
    assert {e["role"] for e in pipe.omni_attention_report()} == {"wan.self", "wan.cross"}
    assert torch.equal(pipe(**call, generator=torch.Generator().manual_seed(0)).frames, expected)
