"""The mixin that turns a Diffusers pipeline into an Omni pipeline."""

from __future__ import annotations

import logging
import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any, ClassVar, Protocol, runtime_checkable

import torch
import torch.nn as nn

from ..installer import apply_attention_all, attention_report, remove_attention_all
from ..utils.modules import get_submodule_path

logger = logging.getLogger("diffusers_omni")


@runtime_checkable
class SupportsComponentDiscovery(Protocol):
    """A pipeline that names its components for attention and offload strategies (dotted paths allowed)."""

    _dit_modules: ClassVar[tuple[str, ...]]
    _encoder_modules: ClassVar[tuple[str, ...]]
    _vae_modules: ClassVar[tuple[str, ...]]
    _resident_modules: ClassVar[tuple[str, ...]]


# Set by ``omnify`` while it builds the Omni pipeline: Diffusers' ``from_pipe`` ends with ``to(dtype=float32 or the
# requested dtype)``, which would cast the very components omnify promises to share unchanged.
_sharing_components: contextvars.ContextVar[bool] = contextvars.ContextVar("omni_sharing_components", default=False)


@contextlib.contextmanager
def sharing_components() -> Iterator[None]:
    token = _sharing_components.set(True)
    try:
        yield
    finally:
        _sharing_components.reset(token)


class OmniPipelineMixin:
    """Adds omni attention (and later offload) to a Diffusers pipeline class.

    Subclasses declare their components; the DiTs listed in ``_dit_modules`` get omni attention.
    """

    _omni_family: ClassVar[str] = ""
    _dit_modules: ClassVar[tuple[str, ...]] = ()
    _encoder_modules: ClassVar[tuple[str, ...]] = ()
    _vae_modules: ClassVar[tuple[str, ...]] = ()
    _resident_modules: ClassVar[tuple[str, ...]] = ()

    def to(self, *args: Any, **kwargs: Any):
        if _sharing_components.get() and not args and set(kwargs) <= {"dtype", "torch_dtype"}:
            return self
        return super().to(*args, **kwargs)

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

        All or nothing across the DiTs: every role of every DiT is resolved and every processor built before any
        is installed; if anything fails, every DiT is left exactly as it was. A ``per_role`` key that names no role
        or category of the DiTs is refused (it would be ignored), with "did you mean" for near misses.

        Example:
        ```py
        >>> pipe.enable_omni_attention({"default": {"backend": "TORCH_SDPA"}, "per_role": {"cross": "auto"}})
        ```
        """
        return self._enable_omni_attention(config)

    def _enable_omni_attention(self, config: Any, seen_roles=()) -> list[dict]:
        dits = self.omni_dits()
        if not dits:
            raise ValueError(
                f"{type(self).__name__} has none of its declared DiTs {list(self._dit_modules)}; nothing to enable"
            )
        apply_attention_all(list(dits.values()), config, seen_roles=seen_roles)
        return self.omni_attention_report()

    def disable_omni_attention(self) -> None:
        """Restore the exact Diffusers processors that omni attention replaced (on every DiT, or on none if it
        fails)."""
        remove_attention_all(list(self.omni_dits().values()))

    def omni_attention_report(self) -> list[dict]:
        """One dict per attention call site: ``module`` (dotted, from the pipeline), ``role``, ``category``,
        ``backend`` and ``source``."""
        report = []
        for path, module in self.omni_dits().items():
            for entry in attention_report(module):
                report.append({**entry, "module": f"{path}.{entry['module']}"})
        return report

    # Offload --------------------------------------------------------------------------------------------------

    def enable_omni_offload(self, config: Any) -> Any:
        """Enable the offload strategy ``config`` asks for (an ``OffloadConfig``); returns the enabled backend, or
        ``None`` for strategy ``"none"``.

        Enabling is all or nothing: if any stage fails, no hook stays installed and every weight is back where it
        was. Only one offload strategy may be active; call ``disable_omni_offload()`` before switching.

        Example:
        ```py
        >>> pipe.enable_omni_offload(OffloadConfig("layerwise", device="cuda", max_device_memory="12GiB"))
        ```
        """
        from ..offload.factory import get_offload_backend

        active = self.__dict__.get("_omni_offload_backend")
        if active is not None and active.is_enabled():
            raise RuntimeError(
                f"{active.strategy.value} offload is already enabled on this pipeline; call disable_omni_offload() "
                "first"
            )
        backend = get_offload_backend(config)
        delegate = getattr(self, "enable_omni_model_cpu_offload", None)
        if backend is not None and backend.strategy.value == "model_level" and delegate is not None:
            # Split models (one module serving as DiT and encoder, e.g. Cosmos3) know their own swap points.
            logger.info("%s handles model-level offload itself (enable_omni_model_cpu_offload)", type(self).__name__)
            backend = delegate(backend.config)
        elif backend is not None:
            backend.enable(self)
        self.__dict__["_omni_offload_backend"] = backend
        return backend

    def enable_model_level_offload(self, device: str | torch.device = "cuda", **options: Any) -> Any:
        """Keep only the running DiT or encoder on ``device``; VAEs stay there. ``options`` go to
        ``OffloadConfig`` (e.g. ``pin_memory``)."""
        from ..config.offload import OffloadConfig

        return self.enable_omni_offload(OffloadConfig("model_level", device=device, **options))

    def enable_layerwise_offload(
        self, device: str | torch.device = "cuda", max_device_memory: int | str | None = None, **options: Any
    ) -> Any:
        """Stream DiT blocks from host memory, prefetching the next block while the current one runs.

        Args:
            device: where the pipeline computes.
            max_device_memory: bytes (or ``"12GiB"``) of DiT weights allowed on the device; blocks that fit stay
                resident, spread through the stack. ``None`` streams every block.
            options: further ``OffloadConfig`` fields (``prefetch_depth``, ``pin_memory``, ``plan``, ...).
        """
        from ..config.offload import OffloadConfig

        return self.enable_omni_offload(
            OffloadConfig("layerwise", device=device, max_device_memory=max_device_memory, **options)
        )

    def enable_distributed_layerwise_offload(
        self,
        use_allgather: bool = True,
        resident_layers: int = 0,
        group: Any = None,
        device: str | torch.device | None = None,
        **options: Any,
    ) -> Any:
        """Layerwise offload on every rank of an initialised ``torch.distributed`` group (call it on every rank).

        Args:
            use_allgather: each rank pins 1/N of every block and blocks are rebuilt per layer by all-gather
                (device weights bounded by two blocks); ``False`` streams a full host copy on every rank.
            resident_layers: with ``use_allgather=False``, the first N blocks of the main DiT stay on the device.
            group: the process group sharing the host copy (default: the world group).
            device: where this rank computes; ``None`` → the current CUDA device, or ``"cpu"`` without CUDA.
            options: further ``OffloadConfig`` fields (``pin_memory``, ``plan``, ``tensor_parallel_size``, ...).

        Example:
        ```py
        >>> torch.distributed.init_process_group("nccl")
        >>> torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        >>> pipe.enable_distributed_layerwise_offload()
        ```
        """
        from ..config.offload import OffloadConfig
        from ..offload.distributed import require_process_group

        require_process_group(group)
        if device is None:
            device = f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"
        return self.enable_omni_offload(
            OffloadConfig(
                "distributed_layerwise",
                device=device,
                use_allgather=use_allgather,
                resident_layers=resident_layers,
                process_group=group,
                **options,
            )
        )

    def disable_omni_offload(self) -> None:
        """Remove omni offload hooks; offloaded weights become ordinary host tensors (move the pipeline with
        ``.to()`` afterwards). Does nothing when no offload is active."""
        backend = self.__dict__.pop("_omni_offload_backend", None)
        if backend is not None:
            backend.disable()

    @property
    def omni_offload_backend(self) -> Any:
        """The enabled offload backend, or ``None``."""
        backend = self.__dict__.get("_omni_offload_backend")
        return backend if backend is not None and backend.is_enabled() else None

    @property
    def _execution_device(self) -> torch.device:
        # Diffusers only recognises its own offload hooks here; with ours active, the accelerator is where
        # latents and embeddings must go even though some weights sit on the host.
        backend = self.omni_offload_backend
        if backend is not None:
            return backend.execution_device
        return super()._execution_device

    @contextlib.contextmanager
    def omni_onload(self, name: str) -> Iterator[nn.Module]:
        """Make component ``name`` usable outside its ``forward`` (e.g. ``pipe.vae.decode`` or a method reading an
        encoder's weights) under model-level offload; other strategies keep it usable already.

        Example:
        ```py
        >>> with pipe.omni_onload("text_encoder") as encoder:
        ...     embeddings = encoder.get_input_embeddings()(ids)
        ```
        """
        backend = self.omni_offload_backend
        use = getattr(backend, "use", None)
        if use is None:
            module = get_submodule_path(self, name)
            if module is None:
                raise ValueError(f"{type(self).__name__} has no component {name!r}")
            yield module
            return
        with use(name) as module:
            yield module
