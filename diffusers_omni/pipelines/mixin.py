"""The mixin that turns a Diffusers pipeline into an Omni pipeline."""

from __future__ import annotations

import contextlib
import contextvars
import functools
import json
import logging
import sys
from collections.abc import Iterator
from typing import Any, ClassVar, Protocol, runtime_checkable

import torch
import torch.nn as nn

from ..installer import (
    TuneResult,
    apply_attention_all,
    attention_report,
    is_attention_applied,
    remove_attention_all,
    tune_attention,
)
from ..models.base import check_layer_counts
from ..offload.discovery import OffloadConflictError
from ..offload.guards import FOREIGN_OFFLOADERS, SUSPENDING_METHODS, call_refused, call_suspended, offload_backends
from ..offload.report import OffloadReport, call_peak_end, call_peak_start, offload_report
from ..utils.modules import get_submodule_path

logger = logging.getLogger("diffusers_omni")


@runtime_checkable
class SupportsComponentDiscovery(Protocol):
    """A pipeline that names its components for attention and offload strategies (dotted paths allowed).
    Optional: ``_alternating_dits``, DiTs among ``_dit_modules`` of which one runs per denoising step (Wan 2.2's
    experts); under ``max_host_memory`` their blocks may share host buffers."""

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


# True inside a pipeline call whose device peak is being recorded (a call nested in it records nothing of its own).
_in_tracked_call: contextvars.ContextVar[bool] = contextvars.ContextVar("omni_in_tracked_call", default=False)


# Where the pipeline classes an Omni class may extend live: Diffusers, and this package's own ``architectures`` (for
# systems Diffusers has no class for).
_PIPELINE_MODULES = ("diffusers.", "diffusers_omni.architectures.")


def diffusers_pipeline_class(cls: type) -> type | None:
    """The Diffusers pipeline class an Omni pipeline class extends (the first class from ``diffusers``, or from
    this package's ``architectures`` for systems Diffusers lacks, in its MRO), or ``None`` for the mixins
    themselves."""
    for base in cls.__mro__:
        if base.__module__.startswith(_PIPELINE_MODULES) and base.__name__.endswith("Pipeline"):
            return base
    return None


def _follow_offload(cls: type) -> None:
    """Make ``cls``'s methods that change weights (``load_lora_weights``, ``fuse_lora``, ...) suspend, and its other
    offloaders (``enable_model_cpu_offload``, ...) refuse, whenever an offload places its components, whichever
    pipeline object enabled it: Diffusers' loops reach into the components directly (``unfuse_lora`` unmerges every
    LoRA layer itself), which no guard on a component can see."""
    for name in (*SUSPENDING_METHODS, *FOREIGN_OFFLOADERS):
        original = getattr(cls, name, None)
        if not callable(original) or getattr(original, "_omni_follows_offload", False):
            continue
        handler = call_refused if name in FOREIGN_OFFLOADERS else call_suspended
        setattr(cls, name, _following(name, original, handler))


def _following(name: str, original: Any, handler: Any) -> Any:
    @functools.wraps(original)
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        return handler(self, name, original, args, kwargs)

    method._omni_follows_offload = True  # type: ignore[attr-defined]
    return method


def _track_call_peak(cls: type) -> None:
    """Make ``cls``'s ``__call__`` record the device's peak memory over each call (``omni_offload_report``). The
    wrapper keeps the original's signature and docstring (``functools.wraps``)."""
    original = next((klass.__dict__["__call__"] for klass in cls.__mro__
                     if klass is not OmniPipelineMixin and "__call__" in klass.__dict__), None)
    if original is None or getattr(original, "_omni_tracks_peak", False):
        return

    @functools.wraps(original)
    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
        return _tracked_call(self, functools.partial(original, self), args, kwargs)

    __call__._omni_tracks_peak = True  # type: ignore[attr-defined]
    cls.__call__ = __call__


def _tracked_call(pipe: Any, call: Any, args: tuple, kwargs: dict) -> Any:
    """Run ``call``; the outermost pipeline call in this thread resets the execution device's peak counter first
    and records the peak after (also when the call raises). Under an offload, a component compiled with
    ``fullgraph=True`` is refused first (``check_no_fullgraph_compile``)."""
    if _in_tracked_call.get():
        return call(*args, **kwargs)
    if offload_backends(pipe):
        check_no_fullgraph_compile(pipe)
    device = torch.device(pipe._execution_device)
    token = _in_tracked_call.set(True)
    tracked = call_peak_start(device)
    completed = False
    try:
        result = call(*args, **kwargs)
        completed = True
        return result
    finally:
        _in_tracked_call.reset(token)
        pipe.__dict__["_omni_last_call_peak"] = call_peak_end(device, tracked, completed)
        for backend in offload_backends(pipe):  # the last phase's weights (the VAE) leave the device
            backend.end_of_call()


def _compiled_with_fullgraph(module: nn.Module) -> bool:
    """Whether ``module`` itself was compiled with ``fullgraph=True``: ``torch.compile(module, ...)`` (an
    ``OptimizedModule``) or ``module.compile(...)`` / regional compile (``_compiled_call_impl``)."""
    context = getattr(module, "dynamo_ctx", None) if "_orig_mod" in module.__dict__.get("_modules", {}) else None
    if context is not None:
        return bool(getattr(context, "fullgraph", False))
    compiled = module.__dict__.get("_compiled_call_impl")
    if compiled is None:
        return False
    # torch.compile(fn) returns a wrapper closing over its OptimizeContext, which records fullgraph.
    for cell in getattr(compiled, "__closure__", None) or ():
        try:
            context = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if isinstance(getattr(context, "fullgraph", None), bool):
            return context.fullgraph
    return False


def check_no_fullgraph_compile(pipe: Any) -> None:
    """Refuse components (or their submodules) compiled with ``torch.compile(fullgraph=True)`` while an offload
    places this pipeline's components: Dynamo cannot trace the offload hooks, and would fail inside the first
    forward ("Skip inlining `torch.compiler.disable()`d function") after the encoders ran."""
    from ..offload.hooks import EAGER_ONLY

    for name, component in getattr(pipe, "components", {}).items():
        if not isinstance(component, nn.Module):
            continue
        found = next((sub for sub, module in component.named_modules() if _compiled_with_fullgraph(module)), None)
        if found is None:
            continue
        where = f"{name!r}" + (f" (its submodule {found!r})" if found else "")
        raise OffloadConflictError(
            f"{where} is compiled with torch.compile(fullgraph=True) while diffusers-omni offload places this "
            f"pipeline's components; {EAGER_ONLY}; or disable_omni_offload() first to run it fullgraph with every "
            "weight resident. Nothing was run"
        )


def _expose_in_diffusers(cls: type) -> None:
    """Make ``cls`` resolvable by name where Diffusers looks pipeline classes up (``getattr(diffusers, name)`` in
    ``DiffusionPipeline.from_pretrained`` for a ``model_index.json`` naming it, ``diffusers.pipelines`` in
    Diffusers' own test helpers). Names start with ``Omni`` and never shadow a Diffusers name."""
    for module_name in ("diffusers", "diffusers.pipelines"):
        module = sys.modules.get(module_name)
        if module is not None and module.__dict__.get(cls.__name__, cls) is cls:
            setattr(module, cls.__name__, cls)


class AttentionReport(list):
    """The attention report: a list of dicts (``module``, ``role``, ``category``, ``backend``, ``source``, …) that
    prints as one line per role with its backend, source and module count."""

    def __repr__(self) -> str:
        if not self:
            return "AttentionReport(omni attention is off)"
        grouped: dict[tuple, int] = {}
        for entry in self:
            key = (entry.get("role"), entry.get("category"), entry.get("backend"), entry.get("source"),
                   bool(entry.get("lossy")))
            grouped[key] = grouped.get(key, 0) + 1
        lines = [f"  {role} ({category}): {backend}{' [LOSSY]' if lossy else ''} — {source} "
                 f"[{count} module{'s' * (count != 1)}]"
                 for (role, category, backend, source, lossy), count in grouped.items()]
        return "AttentionReport(\n" + "\n".join(lines) + "\n)"


class OmniPipelineMixin:
    """Adds omni attention (and later offload) to a Diffusers pipeline class.

    Subclasses declare their components; the DiTs listed in ``_dit_modules`` get omni attention.

    Interop with Diffusers:

    - ``save_pretrained`` writes the Diffusers class name (``"FluxPipeline"``, not ``"OmniFluxPipeline"``) to
      ``model_index.json``: the directory loads with plain Diffusers (``DiffusionPipeline.from_pretrained``, no
      diffusers-omni needed) and with the Omni class (``OmniFluxPipeline.from_pretrained``), like any checkpoint of
      the Diffusers pipeline.
    - Each Omni class is also reachable by name from the ``diffusers`` and ``diffusers.pipelines`` namespaces once
      defined, so Diffusers code that resolves a pipeline class by its name (older ``model_index.json`` files naming
      an Omni class, Diffusers' test helpers) finds it.
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.__name__.startswith("Omni") and diffusers_pipeline_class(cls) is not None:
            _expose_in_diffusers(cls)
        if diffusers_pipeline_class(cls) is not None:
            _follow_offload(cls)
            _track_call_peak(cls)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # Reached only through ``super().__call__`` from a class that replaced the tracked ``__call__`` after
        # ``__init_subclass__`` (the PAG pipelines' wrapper): the call is tracked here instead.
        return _tracked_call(self, super().__call__, args, kwargs)

    def to_json_string(self) -> str:
        # ``save_pretrained`` → ``save_config`` → here: Diffusers writes ``type(self).__name__`` as ``_class_name``;
        # write the Diffusers pipeline this class extends so that plain Diffusers can load the directory.
        config = json.loads(super().to_json_string())
        base = diffusers_pipeline_class(type(self))
        if base is not None:
            config["_class_name"] = base.__name__
        return json.dumps(config, indent=2, sort_keys=True) + "\n"

    _omni_family: ClassVar[str] = ""
    _dit_modules: ClassVar[tuple[str, ...]] = ()
    _encoder_modules: ClassVar[tuple[str, ...]] = ()
    _vae_modules: ClassVar[tuple[str, ...]] = ()
    _resident_modules: ClassVar[tuple[str, ...]] = ()
    _alternating_dits: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def from_pretrained(cls, *args: Any, omni_attention: Any = None, **kwargs: Any):
        """Diffusers' ``from_pretrained``, then omni attention on every declared DiT.

        Args:
            omni_attention: the attention config (anything ``AttentionConfig.parse`` accepts); ``None`` uses
                ``DIFFUSION_ATTENTION_BACKEND`` or the platform default; ``False`` keeps Diffusers' processors.

        Other arguments are those of ``DiffusionPipeline.from_pretrained``.

        Every way to get an Omni pipeline — ``from_pretrained``, ``from_pipe`` and ``omnify`` — turns omni attention
        on unless told not to (constructing the class from components directly does not).

        Example:
        ```py
        >>> pipe = OmniFluxPipeline.from_pretrained("black-forest-labs/FLUX.1-dev", torch_dtype=torch.bfloat16)
        ```
        """
        pipe = super().from_pretrained(*args, **kwargs)
        pipe._enable_omni_attention_on_creation(omni_attention)
        return pipe

    @classmethod
    def from_pipe(cls, pipeline: Any, omni_attention: Any = None, **kwargs: Any):
        """Diffusers' ``from_pipe`` (components shared, cast to ``torch_dtype``, float32 by default), then omni
        attention as for ``from_pretrained``. A DiT that already runs omni attention keeps its configuration unless
        ``omni_attention`` names one.

        Example:
        ```py
        >>> omni = OmniFluxPipeline.from_pipe(pipe, omni_attention="TORCH_SDPA")
        ```
        """
        pipe = super().from_pipe(pipeline, **kwargs)
        pipe._enable_omni_attention_on_creation(omni_attention)
        return pipe

    def _enable_omni_attention_on_creation(self, config: Any) -> None:
        dits = self.omni_dits()
        if config is False or not dits:
            return
        if config is None and all(is_attention_applied(module) for module in dits.values()):
            return
        self.enable_omni_attention(config)

    def to(self, *args: Any, **kwargs: Any):
        """Diffusers' ``to``. With offload on any of the components (enabled on this pipeline or on another one
        sharing them), every component is checked first: a cast works (each offload re-packs its host copies in the
        new dtype, once for the whole call); a move away from the offload device is refused with nothing changed."""
        from ..offload.guards import offloaded_pipeline_to

        if _sharing_components.get() and not args and set(kwargs) <= {"dtype", "torch_dtype"}:
            return self
        return offloaded_pipeline_to(self, super().to, args, kwargs)

    def __setattr__(self, name: str, value: Any) -> None:
        old = self.__dict__.get(name)
        super().__setattr__(name, value)
        backend = self.__dict__.get("_omni_offload_backend")
        if (backend is None or old is value or not isinstance(old, nn.Module) or not backend.is_enabled()
                or not any(module is old for _, module, _ in backend.members())):
            return
        if isinstance(value, nn.Module) and any(module is old for module in value.modules()):
            return  # a wrapper around the same component (torch.compile's OptimizedModule): the offload is in place
        # A component the offload places was swapped (``pipe.vae = other``): bring the new one under the offload.
        logger.info("%s.%s was replaced while %s offload places it; re-planning the offload", type(self).__name__,
                    name, backend.strategy)
        self._replan_omni_offload(backend, undo=lambda: super(OmniPipelineMixin, self).__setattr__(name, old))

    def omni_dits(self) -> dict[str, nn.Module]:
        """The declared DiTs present in this pipeline, by path."""
        found = {}
        for path in self._dit_modules:
            module = get_submodule_path(self, path)
            if module is not None:
                found[path] = module
        return found

    def enable_omni_attention(self, config: Any = None) -> AttentionReport:
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

    def tune_omni_attention(self, *, allow_lossy: bool = False, warmup: int = 3, repeats: int = 7,
                            **call_kwargs: Any) -> TuneResult:
        """Measure every attention backend at the calls this pipeline really makes, on this GPU, and cache the
        routing table ``auto`` then follows (in this process and later ones, until a driver, CUDA, torch or kernel
        package version changes; ``diffusers-omni tune`` does the same from the command line).

        Args:
            allow_lossy (`bool`, defaults to `False`): also time lossy kernels (SageAttention INT8) and let ``auto``
                route to them where they are faster.
            warmup: calls per backend before timing.
            repeats: timed rounds (interleaved across backends).
            call_kwargs: the pipeline call whose attention shapes are measured (e.g. ``prompt``, ``height``,
                ``width``, ``num_frames``); ``num_inference_steps`` defaults to 1 (the shapes do not depend on it).

        Returns:
            A ``TuneResult``: the table's cache path, the table, the recorded call shapes and the seconds taken.

        Example:
        ```py
        >>> result = pipe.tune_omni_attention(prompt="a cat", height=1024, width=1024)
        >>> pipe.enable_omni_attention()  # auto now routes per the table measured here
        ```
        """
        dits = self.omni_dits()
        if not dits:
            raise ValueError(
                f"{type(self).__name__} has none of its declared DiTs {list(self._dit_modules)}; nothing to tune"
            )
        call_kwargs.setdefault("num_inference_steps", 1)
        return tune_attention(list(dits.values()), lambda: self(**call_kwargs), allow_lossy=allow_lossy,
                              warmup=warmup, repeats=repeats)

    def disable_omni_attention(self) -> None:
        """Restore the exact Diffusers processors that omni attention replaced (on every DiT, or on none if it
        fails)."""
        remove_attention_all(list(self.omni_dits().values()))

    def omni_attention_report(self) -> AttentionReport:
        """One dict per attention call site: ``module`` (dotted, from the pipeline), ``role``, ``category``,
        ``backend`` and ``source``."""
        report = AttentionReport()
        for path, module in self.omni_dits().items():
            for entry in attention_report(module):
                report.append({**entry, "module": f"{path}.{entry['module']}"})
        return report

    # Offload --------------------------------------------------------------------------------------------------

    def enable_omni_offload(self, config: Any) -> Any:
        """Enable the offload strategy ``config`` asks for (a strategy's config: ``LayerwiseOffloadConfig``,
        ``ModelLevelOffloadConfig``, ``DistributedLayerwiseOffloadConfig``, ..., or ``OffloadConfig("<strategy>",
        ...)``, which builds one); returns the enabled backend, or ``None`` for ``NoOffloadConfig`` (strategy
        ``"none"``). The backend is the handler registered for the config's type.

        Enabling is all or nothing: if any stage fails, no hook stays installed and every weight is back where it
        was. Only one offload strategy may be active; call ``disable_omni_offload()`` before switching.

        The offload belongs to the components, so another pipeline object sharing them (``from_pipe``, a pipeline
        built from ``pipe.components``, the Diffusers pipeline given to ``omnify``) already runs with it. Enabling
        the same config there adopts it (returns the same backend; where this pipeline's components differ, e.g. a
        swapped VAE, the offload is re-planned for this pipeline's set); a different config is refused, naming the
        pipeline that enabled it.

        Example:
        ```py
        >>> pipe.enable_omni_offload(LayerwiseOffloadConfig(device="cuda", max_device_memory="12GiB"))
        ```
        """
        from ..offload.discovery import OffloadConflictError
        from ..offload.factory import get_offload_backend

        backend = get_offload_backend(config)
        for module in self.omni_dits().values():
            check_layer_counts(module, type(module).__name__)
        if backend is not None:
            check_no_fullgraph_compile(self)
        active = self.omni_offload_backend
        if active is None:
            return self._enable_new_omni_offload(backend)
        if backend is None or backend.config != active.config:
            labels = ", ".join(label for label, _, _ in active.members())
            requested = "strategy 'none'" if backend is None else repr(backend.config)
            raise OffloadConflictError(
                f"{active.strategy} offload is already enabled on this pipeline's components ({labels}), "
                f"enabled on {active.owner()} with {active.config!r}; {requested} is a different config, so nothing "
                "was changed. Allowed: the same config (this pipeline adopts that offload), or disable it first: "
                "disable_omni_offload() on any Omni pipeline sharing these components, or "
                "diffusers_omni.disable_offload(pipe) on any pipeline or component"
            )
        return self._adopt_omni_offload(active)

    def _enable_new_omni_offload(self, backend: Any) -> Any:
        from ..config.offload import ModelLevelOffloadConfig

        delegate = getattr(self, "enable_omni_model_cpu_offload", None)
        if backend is not None and isinstance(backend.config, ModelLevelOffloadConfig) and delegate is not None:
            # Split models (one module serving as DiT and encoder, e.g. Cosmos3) know their own swap points.
            logger.info("%s handles model-level offload itself (enable_omni_model_cpu_offload)", type(self).__name__)
            backend = delegate(backend.config)
        elif backend is not None:
            backend.enable(self)
        self.__dict__["_omni_offload_backend"] = backend
        return backend

    def _adopt_omni_offload(self, active: Any) -> Any:
        """``active`` (enabled with the requested config) already places this pipeline's components: use it as it
        is when it places exactly this pipeline's set, else re-plan it for this pipeline."""
        from ..offload.discovery import discover_components

        wanted = {id(c.module) for c in discover_components(self, active.config.plan).components}
        placed = {id(module) for _, module, _ in active.members()}
        if wanted == placed:
            logger.info("%s adopts the %s offload enabled on %s (same components, same config)", type(self).__name__,
                        active.strategy, active.owner())
            self.__dict__["_omni_offload_backend"] = active
            return active
        return self._replan_omni_offload(active)

    def _replan_omni_offload(self, active: Any, undo: Any = None) -> Any:
        """Disable ``active`` and enable its config on this pipeline's components (a swapped or added component
        comes under the offload). If that fails, ``undo()`` runs and ``active`` is enabled again where it was."""
        from ..offload.discovery import OffloadConflictError
        from ..offload.factory import get_offload_backend

        if active.config.collective:
            if undo is not None:
                undo()
            raise OffloadConflictError(
                f"{active.strategy} offload (enabled on {active.owner()}) places other components than "
                f"{type(self).__name__}'s; re-planning it is collective, so nothing was changed. Allowed: "
                "disable_omni_offload() on every rank, then enable it on this pipeline on every rank"
            )
        previous = active.target
        logger.info("%s re-plans the %s offload enabled on %s for its own components", type(self).__name__,
                    active.strategy, active.owner())
        active.disable()
        try:
            return self._enable_new_omni_offload(get_offload_backend(active.config))
        except BaseException:
            if undo is not None:
                undo()
            try:
                active.enable(previous)
            except Exception:  # noqa: BLE001 - the original error is the one to raise
                logger.exception("offload: enabling the previous %s offload again on %s failed",
                                 active.strategy, type(previous).__name__)
            raise

    def enable_model_level_offload(self, device: str | torch.device = "cuda", **options: Any) -> Any:
        """Keep only the running DiT or encoder on ``device``; VAEs stay there. ``options`` are further
        ``ModelLevelOffloadConfig`` fields (``pin_memory``, ``plan``, ``show_progress``)."""
        from ..config.offload import ModelLevelOffloadConfig

        return self.enable_omni_offload(ModelLevelOffloadConfig(device=device, **options))

    def enable_layerwise_offload(
        self, device: str | torch.device = "cuda", max_device_memory: int | str | None = None, **options: Any
    ) -> Any:
        """Stream DiT blocks from host memory, prefetching the next block while the current one runs.

        Args:
            device: where the pipeline computes.
            max_device_memory: bytes (or ``"12GiB"``) of weights allowed on the device; DiT blocks that fit stay
                resident, spread through the stack. ``"auto"`` reads what this process may use on the device and
                follows what each call shape measures; ``"none"`` streams every block. Not given: ``"auto"`` on an
                accelerator, no budget on the CPU.
            options: further ``LayerwiseOffloadConfig`` fields (``prefetch_depth``, ``pin_memory``, ``plan``,
                ``show_progress``).
        """
        from ..config.offload import LayerwiseOffloadConfig

        return self.enable_omni_offload(
            LayerwiseOffloadConfig(device=device, max_device_memory=max_device_memory, **options)
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
            options: further ``DistributedLayerwiseOffloadConfig`` fields (``prefetch_depth``, ``pin_memory``,
                ``plan``, ``tensor_parallel_size``, ``hsdp``, ``show_progress``).

        Example:
        ```py
        >>> torch.distributed.init_process_group("nccl")
        >>> torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        >>> pipe.enable_distributed_layerwise_offload()
        ```
        """
        from ..config.offload import DistributedLayerwiseOffloadConfig
        from ..offload.distributed import require_process_group

        require_process_group(group)
        if device is None:
            device = f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"
        return self.enable_omni_offload(
            DistributedLayerwiseOffloadConfig(
                device=device,
                use_allgather=use_allgather,
                resident_layers=resident_layers,
                process_group=group,
                **options,
            )
        )

    def disable_omni_offload(self) -> None:
        """Remove omni offload hooks; offloaded weights become ordinary host tensors (move the pipeline with
        ``.to()`` afterwards). Also disables an offload enabled on another pipeline object sharing these components
        (the offload belongs to them). Does nothing when no offload is active."""
        from ..offload.guards import offload_backends

        backend = self.__dict__.pop("_omni_offload_backend", None)
        if backend is not None:
            backend.disable()
        for other in offload_backends(self):  # enabled on another pipeline object sharing the components
            other.disable()

    def omni_offload_report(self) -> OffloadReport:
        """Where every component's weights live now, and the peak device memory of the last pipeline call.

        Per component (transformers, text and image encoders, VAEs, other modules): its bytes on the device, in
        pinned host memory, in pageable host memory and on disk; whether the offload streams it block by block,
        swaps it in whole while it runs (model-level) or leaves it resident; where it computes. Works with no
        offload and with every strategy; it reads the offload's records and changes nothing. The peak is
        ``torch.cuda.max_memory_allocated`` over the last call on a CUDA device, ``None`` elsewhere (CPU) or before
        the first call; ``peak_note`` says which. ``str(report)`` is a table.

        Example:
        ```py
        >>> pipe.enable_layerwise_offload(device="cuda")
        >>> image = pipe("a cat").images[0]
        >>> print(pipe.omni_offload_report())
        ```
        """
        return offload_report(self, self.omni_offload_backend, self.__dict__.get("_omni_last_call_peak"))

    @property
    def omni_offload_backend(self) -> Any:
        """The enabled offload backend placing this pipeline's components (enabled here or on another pipeline
        object sharing them), or ``None``."""
        from ..offload.guards import offload_backends

        backend = self.__dict__.get("_omni_offload_backend")
        if backend is not None and backend.is_enabled():
            return backend
        found = offload_backends(self)
        return found[0] if found else None

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
