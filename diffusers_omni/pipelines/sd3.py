"""Omni Stable Diffusion 3 / 3.5 pipelines, including Perturbed-Attention Guidance (PAG).

ControlNet pipelines (``StableDiffusion3ControlNetPipeline``, ``StableDiffusion3ControlNetInpaintingPipeline``)
add a ``SD3ControlNetModel`` and are not covered; modular pipelines neither.
"""

from __future__ import annotations

import functools
from typing import Any

from diffusers import (
    StableDiffusion3Img2ImgPipeline,
    StableDiffusion3InpaintPipeline,
    StableDiffusion3PAGImg2ImgPipeline,
    StableDiffusion3PAGPipeline,
    StableDiffusion3Pipeline,
)

from ..attention.plan import AttentionPlan
from ..installer import applied_attention_config, plan_attention, reapply_attention
from .mixin import OmniPipelineMixin, diffusers_pipeline_class


class SD3Components:
    _omni_family = "sd3"
    _dit_modules = ("transformer",)
    _encoder_modules = ("text_encoder", "text_encoder_2", "text_encoder_3", "image_encoder")
    _vae_modules = ("vae",)
    _resident_modules = ()


class OmniPAGMixin:
    """Keeps omni attention applied through Diffusers' PAG processor swaps.

    A PAG pipeline call saves the DiT's processors, installs PAG processors on ``pag_applied_layers``, runs the
    denoising loop and puts the saved processors back. Omni attention follows along: the DiT's forward pre-hook
    replaces the PAG processors with omni PAG processors (the family declaration knows them), and after the call
    omni attention is re-applied so that its bookkeeping again refers to the processors Diffusers restored. The
    roles PAG will use are resolved when omni attention is enabled, so a backend that cannot run them fails then.

    ``from_pipe`` carries ``pag_applied_layers`` over (Diffusers would reset it to the pipeline's default).

    Each subclass's ``__call__`` wraps its Diffusers pipeline's ``__call__`` with ``functools.wraps``: the signature
    (``inspect.signature``), docstring and name are the Diffusers ones.
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        base = diffusers_pipeline_class(cls)
        if base is None:
            return

        @functools.wraps(base.__call__)
        def __call__(self, *args: Any, **kwargs: Any):
            return OmniPAGMixin._call_keeping_processors(self, *args, **kwargs)

        __call__.__qualname__ = f"{cls.__qualname__}.__call__"
        cls.__call__ = __call__

    @classmethod
    def from_pipe(cls, pipeline, **kwargs):
        layers = getattr(pipeline, "pag_applied_layers", None)
        if layers is not None and "pag_applied_layers" not in kwargs:
            kwargs["pag_applied_layers"] = list(layers)
        return super().from_pipe(pipeline, **kwargs)

    def enable_omni_attention(self, config: Any = None) -> list[dict]:
        plan = AttentionPlan.build(config)  # parsed once: the PAG planning and the install share the plan
        return self._enable_omni_attention(plan, seen_roles=self._plan_pag_attention(plan))

    def _plan_pag_attention(self, plan: AttentionPlan) -> set[tuple[str, str]]:
        """Resolve the roles PAG processors will use; returns them as ``(role, category)`` pairs."""
        seen: set[tuple[str, str]] = set()
        if not getattr(self, "pag_applied_layers", None) or getattr(self, "_pag_attn_processors", None) is None:
            return seen
        model = self.unet if hasattr(self, "unet") else self.transformer
        saved = model.attn_processors
        try:
            for do_classifier_free_guidance in (True, False):
                self._set_pag_attn_processor(self.pag_applied_layers, do_classifier_free_guidance)
                _, sites = plan_attention(model, plan, check_roles=False)
                seen.update((r.role, r.category) for _site, resolutions in sites for r in resolutions.values())
        finally:
            model.set_attn_processor(saved)
        return seen

    def _call_keeping_processors(self, *args: Any, **kwargs: Any):
        # Diffusers restores the saved processors only when the call succeeds; restore them on failure too.
        saved = {path: model.attn_processors for path, model in self.omni_dits().items()}
        try:
            return super(OmniPAGMixin, self).__call__(*args, **kwargs)
        finally:
            for path, model in self.omni_dits().items():
                model.set_attn_processor(saved[path])
                if applied_attention_config(model) is not None:
                    reapply_attention(model)


class OmniStableDiffusion3Pipeline(SD3Components, OmniPipelineMixin, StableDiffusion3Pipeline):
    """``StableDiffusion3Pipeline`` with omni attention and offload."""


class OmniStableDiffusion3Img2ImgPipeline(SD3Components, OmniPipelineMixin, StableDiffusion3Img2ImgPipeline):
    """``StableDiffusion3Img2ImgPipeline`` with omni attention and offload."""


class OmniStableDiffusion3InpaintPipeline(SD3Components, OmniPipelineMixin, StableDiffusion3InpaintPipeline):
    """``StableDiffusion3InpaintPipeline`` with omni attention and offload."""


class OmniStableDiffusion3PAGPipeline(SD3Components, OmniPAGMixin, OmniPipelineMixin, StableDiffusion3PAGPipeline):
    """``StableDiffusion3PAGPipeline`` with omni attention (PAG layers included) and offload."""


class OmniStableDiffusion3PAGImg2ImgPipeline(
    SD3Components, OmniPAGMixin, OmniPipelineMixin, StableDiffusion3PAGImg2ImgPipeline
):
    """``StableDiffusion3PAGImg2ImgPipeline`` with omni attention (PAG layers included) and offload."""
