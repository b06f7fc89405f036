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
