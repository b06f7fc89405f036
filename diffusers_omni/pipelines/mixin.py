"""The mixin that turns a Diffusers pipeline into an Omni pipeline."""

from __future__ import annotations

import logging
from typing import Any, ClassVar, Protocol, runtime_checkable

import torch.nn as nn

from ..attention.install import apply_attention, attention_report, remove_attention

logger = logging.getLogger("diffusers_omni")


@runtime_checkable
class SupportsComponentDiscovery(Protocol):
    """A pipeline that names its components for attention and offload strategies (dotted paths allowed)."""

    _dit_modules: ClassVar[tuple[str, ...]]
    _encoder_modules: ClassVar[tuple[str, ...]]
    _vae_modules: ClassVar[tuple[str, ...]]
    _resident_modules: ClassVar[tuple[str, ...]]


def get_submodule_path(root: Any, path: str) -> Any:
    """Follow a dotted attribute path (``"transformer"``, ``"text_encoder.encoder"``); ``None`` if absent."""
    obj = root
    for part in path.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


class OmniPipelineMixin:
    """Adds omni attention (and later offload) to a Diffusers pipeline class.

    Subclasses declare their components; the DiTs listed in ``_dit_modules`` get omni attention.
    """

    _dit_modules: ClassVar[tuple[str, ...]] = ()
    _encoder_modules: ClassVar[tuple[str, ...]] = ()
    _vae_modules: ClassVar[tuple[str, ...]] = ()
    _resident_modules: ClassVar[tuple[str, ...]] = ()

    def omni_dits(self) -> dict[str, nn.Module]:
        """The declared DiTs present in this pipeline, by path."""
        found = {}
        for path in self._dit_modules:
            module = get_submodule_path(self, path)
            if module is not None:
                found[path] = module
        return found

    def enable_omni_attention(self, config: Any = None) -> list[dict]:
        """Route every DiT attention call through the backend resolved for its role.

        Args:
            config: anything ``AttentionConfig.parse`` accepts (an ``AttentionConfig``, a backend name, a dict
                or a JSON string); ``None`` uses ``DIFFUSION_ATTENTION_BACKEND`` or the platform default.

        Returns:
            The attention report (see ``omni_attention_report``).

        All DiTs are resolved before any is changed: if one role cannot run, nothing is installed.

        Example:
        ```py
        >>> pipe.enable_omni_attention({"default": {"backend": "TORCH_SDPA"}, "per_role": {"cross": "auto"}})
        ```
        """
        from ..attention.install import plan_attention

        dits = self.omni_dits()
        if not dits:
            raise ValueError(
                f"{type(self).__name__} has none of its declared DiTs {list(self._dit_modules)}; nothing to enable"
            )
        for module in dits.values():
            plan_attention(module, config)
        for module in dits.values():
            apply_attention(module, config)
        return self.omni_attention_report()

    def disable_omni_attention(self) -> None:
        """Restore the exact Diffusers processors that omni attention replaced."""
        for module in self.omni_dits().values():
            remove_attention(module)

    def omni_attention_report(self) -> list[dict]:
        """One dict per attention call site: ``module`` (dotted, from the pipeline), ``role``, ``category``,
        ``backend`` and ``source``."""
        report = []
        for path, module in self.omni_dits().items():
            for entry in attention_report(module):
                report.append({**entry, "module": f"{path}.{entry['module']}"})
        return report
