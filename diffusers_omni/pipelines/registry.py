"""Which Omni pipeline class serves which Diffusers pipeline class, and ``omnify``.

``PIPELINE_FAMILIES`` is the registration: the family module of this package and the Diffusers pipelines it
covers. The Omni class of Diffusers' ``XPipeline`` is ``OmniXPipeline`` in that module; only the module of the
family in use is imported (a test checks the table against the classes the modules define).
"""

from __future__ import annotations

import functools
import importlib
import logging
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .mixin import OmniPipelineMixin

logger = logging.getLogger(__name__)

PIPELINE_FAMILIES: dict[str, tuple[str, ...]] = {
    "bagel": ("BagelPipeline",),
    "chroma": ("ChromaPipeline", "ChromaImg2ImgPipeline", "ChromaInpaintPipeline"),
    "cosmos3": ("Cosmos3OmniPipeline",),
    "flux": ("FluxPipeline", "FluxImg2ImgPipeline", "FluxInpaintPipeline", "FluxFillPipeline", "FluxKontextPipeline",
             "FluxKontextInpaintPipeline", "FluxControlPipeline", "FluxControlImg2ImgPipeline",
             "FluxControlInpaintPipeline"),
    "flux2": ("Flux2Pipeline", "Flux2KleinPipeline", "Flux2KleinKVPipeline", "Flux2KleinInpaintPipeline"),
    "hunyuanvideo15": ("HunyuanVideo15Pipeline", "HunyuanVideo15ImageToVideoPipeline"),
    "longcat": ("LongCatImagePipeline", "LongCatImageEditPipeline"),
    "nextstep": ("NextStep11Pipeline",),
    "ltx2": ("LTX2Pipeline", "LTX2ImageToVideoPipeline", "LTX2ConditionPipeline", "LTX2InContextPipeline",
             "LTX2HDRPipeline", "LTX2DFRPipeline", "LTX2DFRTemporalRefinePipeline"),
    "ovis": ("OvisImagePipeline",),
    "qwenimage": ("QwenImagePipeline", "QwenImageImg2ImgPipeline", "QwenImageInpaintPipeline", "QwenImageEditPipeline",
                  "QwenImageEditInpaintPipeline", "QwenImageEditPlusPipeline", "QwenImageLayeredPipeline"),
    "sd3": ("StableDiffusion3Pipeline", "StableDiffusion3Img2ImgPipeline", "StableDiffusion3InpaintPipeline",
            "StableDiffusion3PAGPipeline", "StableDiffusion3PAGImg2ImgPipeline"),
    "sdxl": ("StableDiffusionXLPipeline", "StableDiffusionXLImg2ImgPipeline", "StableDiffusionXLInpaintPipeline",
             "StableDiffusionXLInstructPix2PixPipeline", "StableDiffusionXLPAGPipeline",
             "StableDiffusionXLPAGImg2ImgPipeline", "StableDiffusionXLPAGInpaintPipeline"),
    "soulx_singer": ("SoulXSingerPipeline", "SoulXSingerSVCPipeline"),
    "wan": ("WanPipeline", "WanImageToVideoPipeline", "WanVideoToVideoPipeline"),
    "zimage": ("ZImagePipeline", "ZImageImg2ImgPipeline", "ZImageInpaintPipeline", "ZImageOmniPipeline"),
}

# Diffusers pipeline class name -> family module; Omni class name -> module path (the package root's lazy names).
FAMILY_OF: dict[str, str] = {name: family for family, names in PIPELINE_FAMILIES.items() for name in names}
OMNI_CLASS_MODULES: dict[str, str] = {f"Omni{name}": f"{__package__}.{family}" for name, family in FAMILY_OF.items()}


TESTED_DIFFUSERS = (0, 42)


@functools.lru_cache(maxsize=1)
def check_diffusers_version() -> str | None:
    """Warn once when the installed Diffusers is not the release series diffusers-omni is tested against.

    Returns the warning (``None`` when the version is the tested one). Newer releases usually work; the declarations
    (attention call sites, block lists) are checked against the models when omni attention is enabled, so a changed
    model fails there with the module it could not match.
    """
    import diffusers
    from packaging.version import Version

    found = Version(diffusers.__version__)
    if found.release[:2] == TESTED_DIFFUSERS:
        return None
    tested = ".".join(map(str, TESTED_DIFFUSERS))
    message = (f"diffusers {diffusers.__version__} is installed; diffusers-omni {'is tested against' if found.release[:2] > TESTED_DIFFUSERS else 'needs'} "
               f"{tested}.x. Report problems with `diffusers-omni info` output.")
    logger.warning(message)
    return message


def omni_class_for(pipeline_name: str) -> type | None:
    """The Omni class serving the Diffusers pipeline named ``pipeline_name`` (imports only its family module)."""
    family = FAMILY_OF.get(pipeline_name)
    if family is None:
        return None
    from ..utils.quiet import quiet_torchvision_fallback

    check_diffusers_version()
    try:
        with quiet_torchvision_fallback():
            module = importlib.import_module(f"{__package__}.{family}")
    except ImportError as exc:
        import diffusers

        raise ImportError(
            f"diffusers-omni's {family} pipelines cannot be built on diffusers {diffusers.__version__} ({exc}); "
            f"tested against {'.'.join(map(str, TESTED_DIFFUSERS))}.x"
        ) from exc
    return getattr(module, f"Omni{pipeline_name}")


@functools.lru_cache(maxsize=1)
def omni_pipelines() -> dict[str, type]:
    """Diffusers pipeline class name → Omni class, for every registered family (imports all of them)."""
    return {name: omni_class_for(name) for name in FAMILY_OF}


def supported_pipelines() -> list[str]:
    return sorted(omni_pipelines())


def omni_pipeline_class(pipeline_cls: type) -> type:
    """The Omni class for a Diffusers pipeline class (its own class if it already is one)."""
    from .mixin import OmniPipelineMixin

    if issubclass(pipeline_cls, OmniPipelineMixin):
        return pipeline_cls
    for cls in pipeline_cls.__mro__:
        if cls.__name__ in FAMILY_OF:
            return omni_class_for(cls.__name__)
    from ..config.names import did_you_mean
    from ..models.base import declarations

    families = sorted({d.display_name or d.name for d in declarations()})
    raise TypeError(
        f"{pipeline_cls.__name__} is not supported by diffusers-omni{did_you_mean(pipeline_cls.__name__, FAMILY_OF)}; "
        f"supported families: {', '.join(families)} ({len(FAMILY_OF)} pipelines; `diffusers-omni models` lists them)"
    )


def omnify(pipe: Any, attention: Any = None, *, enable_attention: bool = True) -> OmniPipelineMixin:
    """Return the Omni version of a Diffusers pipeline, sharing its components.

    Args:
        pipe: a supported Diffusers pipeline (e.g. ``FluxPipeline``).
        attention: anything ``AttentionConfig.parse`` accepts; ``None`` uses the environment variable or the
            platform default.
        enable_attention (`bool`, defaults to `True`): install omni attention right away (as
            ``Omni<Name>Pipeline.from_pretrained`` and ``from_pipe`` do).

    The components are shared, not copied or cast (unlike ``from_pipe``, which casts every component to one
    dtype): the original pipeline object sees the omni processors too.

    Example:
    ```py
    >>> pipe = omnify(FluxPipeline.from_pretrained("black-forest-labs/FLUX.1-dev"), "TORCH_SDPA")
    ```
    """
    from .mixin import sharing_components

    omni_cls = omni_pipeline_class(type(pipe))
    if isinstance(pipe, omni_cls):
        omni = pipe
    else:
        with sharing_components():
            omni = omni_cls.from_pipe(pipe, omni_attention=False)
        # The components (and their placement) are shared, so Diffusers' own guards that read the pipeline's
        # device map (refusing ``.to()``, ``reset_device_map``) must see it on the new object too.
        device_map = getattr(pipe, "hf_device_map", None)
        if device_map is not None:
            omni.hf_device_map = device_map
    if enable_attention:
        omni.enable_omni_attention(attention)
    return omni
