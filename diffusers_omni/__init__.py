"""diffusers-omni: per-role attention backends and CPU offloading for Hugging Face Diffusers pipelines.

Importing this package is cheap: it imports no kernel package and no Diffusers pipeline; the names below load
their modules on first use (``diffusers_omni.OmniFluxPipeline`` imports the FLUX family alone).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from .pipelines.registry import OMNI_CLASS_MODULES
from .config.attention import AttentionConfig, AttentionSpec, AttnQuantSpec, BlockSparseSpec, SkipSoftmaxSpec
from .utils.logs import follow_diffusers_logging
from .utils.versions import omni_version

__version__ = omni_version()
follow_diffusers_logging()  # our loggers log at Diffusers' verbosity unless configured themselves

_LAZY = {
    "register_backend": "diffusers_omni.attention.registry",
    "get_backend_class": "diffusers_omni.attention.registry",
    "AttentionBackend": "diffusers_omni.attention.backends.base",
    "AttentionCall": "diffusers_omni.attention.backends.base",
    "BackendNotSupportedError": "diffusers_omni.attention.selector",
    "resolve": "diffusers_omni.attention.selector",
    "Platform": "diffusers_omni.attention.platform",
    "current_platform": "diffusers_omni.attention.platform",
    "use_platform": "diffusers_omni.attention.platform",
    "apply_attention": "diffusers_omni.installer",
    "remove_attention": "diffusers_omni.installer",
    "attention_report": "diffusers_omni.installer",
    "omnify": "diffusers_omni.pipelines.registry",
    "check_alignment": "diffusers_omni.alignment",
    "kernel_fingerprint": "diffusers_omni.alignment",
    "compare_fingerprints": "diffusers_omni.alignment",
    "record_transformer_inputs": "diffusers_omni.alignment",
    "compare_pipelines": "diffusers_omni.alignment",
    "OmniPipelineMixin": "diffusers_omni.pipelines.mixin",
    "SupportsComponentDiscovery": "diffusers_omni.pipelines.mixin",
    "OffloadConfig": "diffusers_omni.config.offload",
    "OffloadStrategy": "diffusers_omni.config.offload",
    "OffloadPlan": "diffusers_omni.config.offload",
    "NoOffloadConfig": "diffusers_omni.config.offload",
    "ModelLevelOffloadConfig": "diffusers_omni.config.offload",
    "LayerwiseOffloadConfig": "diffusers_omni.config.offload",
    "DistributedLayerwiseOffloadConfig": "diffusers_omni.config.offload",
    "register_offload_strategy": "diffusers_omni.config.offload",
    "get_offload_backend": "diffusers_omni.offload.factory",
    "apply_offload": "diffusers_omni.offload.api",
    "disable_offload": "diffusers_omni.offload.api",
    "load_transformer_mmap": "diffusers_omni.offload.loading",
    "load_gguf_mmap": "diffusers_omni.offload.loading",
    "load_dfloat11": "diffusers_omni.offload.dfloat11",
    "check_same_steps": "diffusers_omni.offload.dataparallel",
    "NextStep11Pipeline": "diffusers_omni.architectures.nextstep",
    "NextStepModel": "diffusers_omni.architectures.nextstep",
    "SoulXSingerPipeline": "diffusers_omni.architectures.soulx_singer",
    "SoulXSingerSVCPipeline": "diffusers_omni.architectures.soulx_singer",
    # Every Omni<Name>Pipeline class; importing one imports only its family's module.
    "BagelPipeline": "diffusers_omni.architectures.bagel",
    "BagelModel": "diffusers_omni.architectures.bagel",
    "Qwen2MoTModel": "diffusers_omni.architectures.bagel",
    **OMNI_CLASS_MODULES,
}

__all__ = [
    "AttentionConfig",
    "AttentionSpec",
    "AttnQuantSpec",
    "BlockSparseSpec",
    "SkipSoftmaxSpec",
    *_LAZY,
]


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'diffusers_omni' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:
    from .attention.backends.base import AttentionBackend, AttentionCall
    from .installer import apply_attention, attention_report, remove_attention
    from .attention.platform import Platform, current_platform, use_platform
    from .attention.registry import get_backend_class, register_backend
    from .attention.selector import BackendNotSupportedError, resolve
    from .config.offload import OffloadConfig, OffloadPlan, OffloadStrategy, register_offload_strategy
    from .config.offload import (DistributedLayerwiseOffloadConfig, LayerwiseOffloadConfig, ModelLevelOffloadConfig,
                                 NoOffloadConfig)
    from .offload.api import apply_offload, disable_offload
    from .offload.factory import get_offload_backend
    from .offload.dfloat11 import load_dfloat11
    from .offload.loading import load_gguf_mmap, load_transformer_mmap
    from .pipelines.flux import OmniFluxPipeline
    from .pipelines.mixin import OmniPipelineMixin, SupportsComponentDiscovery
    from .alignment import check_alignment, compare_fingerprints, kernel_fingerprint, record_transformer_inputs
    from .alignment import compare_pipelines
    from .pipelines.registry import omnify
    from .pipelines.wan import OmniWanImageToVideoPipeline, OmniWanPipeline, OmniWanVideoToVideoPipeline
