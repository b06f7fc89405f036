"""Typed offload configuration: one frozen config per strategy, holding only the fields that strategy reads.

Each config validates itself on construction; invalid input raises ``ValueError`` (``TypeError`` for a value of the
wrong type) naming the field, the value found and what is allowed, and a field of another strategy is refused naming
the strategies that take it. ``OffloadConfig(strategy, **fields)`` builds the config of a strategy given by name.

A strategy is its config class here (or in its own module), its handler (an ``OffloadBackend`` in
``diffusers_omni/offload/``) and one ``register_offload_strategy`` call; the CLI's ``--offload`` choices and flags
come from the registered configs' fields.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ._values import show
from .offload_base import MAX_BYTES as MAX_BYTES
from .offload_base import MAX_COUNT as MAX_COUNT
from .offload_base import OffloadConfig as OffloadConfig
from .offload_base import OffloadPlan as OffloadPlan
from .offload_base import OffloadStrategy as OffloadStrategy
from .offload_base import OffloadStrategyEntry as OffloadStrategyEntry
from .offload_base import check_bool, check_count
from .offload_base import format_bytes as format_bytes
from .offload_base import offload_option as offload_option
from .offload_base import offload_strategies as offload_strategies
from .offload_base import offload_strategy_entry as offload_strategy_entry
from .offload_base import parse_bytes as parse_bytes
from .offload_base import register_offload_strategy as register_offload_strategy
from .offload_base import unregister_offload_strategy as unregister_offload_strategy

_PKG = "diffusers_omni.offload"


def _prefetch_depth() -> Any:
    return offload_option(1, minimum=1, help="blocks prefetched ahead of the running one")


@dataclass(frozen=True, kw_only=True)
class NoOffloadConfig(OffloadConfig):
    """Strategy ``"none"``: installs nothing; the pipeline's weights stay where they are. Takes the shared fields
    only (``device``, ``pin_memory``, ``plan``, ``show_progress``; see ``OffloadConfig``).

    Example:
    ```py
    >>> get_offload_backend(NoOffloadConfig()) is None
    True
    ```
    """

    strategy: ClassVar[str] = OffloadStrategy.NONE


@dataclass(frozen=True, kw_only=True)
class ModelLevelOffloadConfig(OffloadConfig):
    """Strategy ``"model_level"``: only the running DiT or encoder is on the device (plus the VAE and declared
    resident modules); components take turns. Takes the shared fields only (``device``, ``pin_memory``, ``plan``,
    ``show_progress``; see ``OffloadConfig``).

    Example:
    ```py
    >>> pipe.enable_omni_offload(ModelLevelOffloadConfig(device="cuda"))
    ```
    """

    strategy: ClassVar[str] = OffloadStrategy.MODEL_LEVEL


AUTO = "auto"
# max_device_memory="none": no budget on any device, every DiT block streams through the prefetch window
NO_BUDGET = "none"
LOSSLESS = "lossless"
COMPRESSIONS = (LOSSLESS,)


def _compression(value: Any) -> str | None:
    """``None`` / ``"none"`` (no compression) or ``"lossless"``, any case."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise TypeError(f"compression must be a str or None, got {type(value).__name__}: {show(value)}")
    name = value.strip().lower()
    if name == "none":
        return None
    if name not in COMPRESSIONS:
        raise ValueError(f"compression={show(value)} is not a known mode; allowed: {', '.join(map(repr, COMPRESSIONS))}"
                         " or None")
    return name


def device_budget_default(device: Any) -> str | None:
    """What ``max_device_memory`` comes to when not given: ``"auto"`` on an accelerator whose free memory PyTorch
    reads (``torch.<type>.mem_get_info``: CUDA, ROCm, XPU; the budget read from the card when enabling); ``None``
    (no budget: every block streams) on the CPU, where "device" memory is the host's own and streaming is the
    testing mode, and on a device PyTorch reads no free memory of (MPS)."""
    kind = getattr(device, "type", str(device))
    if kind in ("cpu", "meta"):
        return None
    return AUTO if callable(getattr(getattr(torch, kind, None), "mem_get_info", None)) else None


def _device_budget(value: Any, device: Any) -> int | str | None:
    """``max_device_memory``: ``None`` (not given: ``device_budget_default``), ``"none"`` (no budget, any device),
    ``"auto"`` or a byte size."""
    if value is None:
        return device_budget_default(device)
    if isinstance(value, str) and value.strip().lower() == NO_BUDGET:
        return NO_BUDGET
    try:
        return _bytes_or_auto(value, "max_device_memory")
    except (TypeError, ValueError) as error:
        raise type(error)(f'{error}; or "none" (no budget: every block streams)') from None


def _bytes_or_auto(value: Any, field_name: str) -> int | str:
    """A byte size (``parse_bytes``) or ``"auto"`` (any case, surrounding spaces ignored)."""
    if isinstance(value, str) and value.strip().lower() == AUTO:
        return AUTO
    try:
        return parse_bytes(value, field_name)
    except (TypeError, ValueError) as error:
        raise type(error)(f'{error}; or "auto" (read from the machine when enabling)') from None


def _cache_dir(value: Any, compression: str | None) -> str | None:
    """``compression_cache_dir``: a folder (``str`` or path-like; created when enabling) for ``compression="lossless"``
    only."""
    if value is None:
        return None
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"compression_cache_dir must be a folder (str or os.PathLike) or None, got "
                        f"{type(value).__name__}: {show(value)}")
    folder = os.fspath(value)
    if not folder.strip():
        raise ValueError("compression_cache_dir='' is empty; allowed: a folder, or None (no cache)")
    if compression != LOSSLESS:
        raise ValueError(f"compression_cache_dir={show(folder)} keeps the code of compression=\"lossless\", but "
                         f"compression={show(compression)}; allowed: compression=\"lossless\", or "
                         "compression_cache_dir=None")
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise ValueError(f"compression_cache_dir={show(folder)} is a file, not a folder; allowed: a folder (it is "
                         "created when enabling if missing)")
    return folder


def _cache_dir_option() -> Any:
    return offload_option(
        None, kind="path", help="with --compression lossless: a folder where the coded blocks are written once and "
        "read back by later enables (checked against the weights), and from which blocks over --max-host-memory "
        "are read coded")


def _compression_option() -> Any:
    return offload_option(
        None, kind="choice", choices=(LOSSLESS,), help="keep streamed bfloat16 blocks losslessly coded in host "
        "memory (about 0.75 of their bytes), move them coded and decode them on the device")


@dataclass(frozen=True, kw_only=True)
class LayerwiseOffloadConfig(OffloadConfig):
    """Strategy ``"layerwise"``: the DiTs' blocks stream from host memory, the next ones copied while the current
    one runs. Takes the shared fields (see ``OffloadConfig``) and:

    Args:
        max_device_memory (`int | str`, *optional*): bytes of weights allowed on the device at once, every
            component counted: the DiTs' non-block weights and resident blocks, the streaming slots, and the largest
            weights one phase brings in (an encoder's non-block weights, or the VAE); activations are not counted.
            E.g. ``"12GiB"``. DiT blocks that fit stay resident. ``"auto"``: what this process may use on the
            device when enabling (free memory, the per-process memory fraction) less a headroom for activations
            (``offload.budget``), then fitted to what each call shape measures (``offload.headroom``; on
            ``device="cpu"``, host memory). ``"none"``: no budget, every block streams through the prefetch window.
            Not given (``None``): ``"auto"`` on an accelerator, no budget on the CPU.
        prefetch_depth (`int`, defaults to `1`): blocks copied ahead of the running one; each costs one device slot
            the size of the largest streamed block.
        dits_only (`bool`, defaults to `False`): stream the DiTs' blocks only and keep the text/image encoders and
            VAEs on the device, as before every component was managed. By default encoders stream block by block
            too and the VAE is on the device only for its phase.
        max_host_memory (`int | str`, *optional*): bytes of host copies allowed (pinned memory), e.g. ``"32GiB"``.
            Streamed blocks that do not fit (encoder blocks first, then DiT blocks spread through each stack) keep
            no host copy: each load reads them from the safetensors files their component was loaded from, through
            a small pinned staging ring (counted in the budget). ``None`` keeps a host copy of every block.
            ``"auto"``: the RAM available when enabling (``MemAvailable``, the cgroup limit), plus what the model's
            weights already take, less a margin.
        compression (`str`, *optional*): ``"lossless"`` keeps streamed bfloat16 blocks coded in host memory (about
            0.70 of their bytes on random weights: their exponents take 1 to 4 bits, ``offload.codec``), moves them
            coded and decodes them on the device before they run, bit for bit; float16, float32 and quantized tensors pass through as they are.
            ``None`` (default) keeps plain host copies.
        compression_cache_dir (`str | os.PathLike`, *optional*): with ``compression="lossless"``, a folder where
            each streamed block's code is written once (``offload.coded_cache``): later enables read it instead
            of coding again, after checking it against the model's weights (a digest of every byte), and under
            ``max_host_memory`` the blocks that keep no host copy are read from it, coded, instead of from the
            checkpoint. A block whose weights changed is coded again and its file replaced (one file per block).

    Example:
    ```py
    >>> LayerwiseOffloadConfig(device="cuda", max_device_memory="12GiB")
    ```
    """

    strategy: ClassVar[str] = OffloadStrategy.LAYERWISE

    max_device_memory: int | str | None = offload_option(
        None, kind="bytes", help="weight bytes allowed on the device, every component counted, e.g. 12GiB (DiT "
        "blocks that fit stay); auto (what this process may use, less a headroom: the default on an accelerator) or "
        "none (every block streams: the default on the CPU)")
    prefetch_depth: int = _prefetch_depth()
    dits_only: bool = offload_option(
        False, help="stream the DiTs only; text/image encoders and VAEs stay on the device")
    max_host_memory: int | str | None = offload_option(
        None, kind="bytes", help="bytes of pinned host copies allowed, e.g. 32GiB (streamed blocks that do not fit are "
        "read from the checkpoint's safetensors files at each load), or auto (the RAM available)")
    compression: str | None = _compression_option()
    compression_cache_dir: str | None = _cache_dir_option()

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "max_device_memory", _device_budget(self.max_device_memory, self.device))
        check_count(self.prefetch_depth, "prefetch_depth", 1)
        check_bool(self.dits_only, "dits_only")
        if self.max_host_memory is not None:
            object.__setattr__(self, "max_host_memory", _bytes_or_auto(self.max_host_memory, "max_host_memory"))
        object.__setattr__(self, "compression", _compression(self.compression))
        object.__setattr__(self, "compression_cache_dir", _cache_dir(self.compression_cache_dir, self.compression))


@dataclass(frozen=True, kw_only=True)
class DistributedLayerwiseOffloadConfig(OffloadConfig):
    """Strategy ``"distributed_layerwise"``: layerwise offload on every rank of a ``torch.distributed`` process
    group, the ranks sharing the host copy. Enabled and disabled collectively (on every rank). Takes the shared
    fields (see ``OffloadConfig``) and:

    Args:
        use_allgather (`bool`, defaults to `True`): each rank pins 1/N of every block and blocks are rebuilt per
            layer by all-gather; ``False`` streams a full host copy per rank.
        resident_layers (`int`, defaults to `0`): with ``use_allgather=False``, the first N blocks of the main DiT
            stay on the device.
        prefetch_depth (`int`, defaults to `1`): with ``use_allgather=False``, blocks copied ahead of the running
            one (all-gather keeps the running block and the next one only).
        tensor_parallel_size (`int`, defaults to `1`): the tensor-parallel degree the model was loaded with; must
            be 1 with ``use_allgather=True`` (the shards would be sharded twice).
        hsdp (`bool`, defaults to `False`): whether the weights are already sharded by HSDP/FSDP; not allowed with
            ``use_allgather=True`` (double sharding).
        process_group (`torch.distributed.ProcessGroup`, *optional*): the ranks that share the host copy; ``None``
            is the default (world) group. Not compared between configs.
        compression (`str`, *optional*): with ``use_allgather=False``, ``"lossless"`` keeps each rank's streamed
            bfloat16 blocks coded in host memory, as ``LayerwiseOffloadConfig.compression`` does.
        compression_cache_dir (`str | os.PathLike`, *optional*): as ``LayerwiseOffloadConfig.compression_cache_dir``
            (ranks sharing a folder write the same files, each by an atomic rename).

    Example:
    ```py
    >>> DistributedLayerwiseOffloadConfig(device=f"cuda:{local_rank}", use_allgather=False, resident_layers=4)
    ```
    """

    strategy: ClassVar[str] = OffloadStrategy.DISTRIBUTED_LAYERWISE
    collective: ClassVar[bool] = True

    use_allgather: bool = offload_option(
        True, flag="--no-allgather", help="a full host copy per rank instead of 1/N shards + all-gather")
    resident_layers: int = offload_option(
        0, minimum=0, help="leading blocks of the main DiT kept on the device (with --no-allgather)")
    prefetch_depth: int = _prefetch_depth()
    tensor_parallel_size: int = offload_option(
        1, minimum=1, cli=False, help="the tensor-parallel degree the model was loaded with")
    hsdp: bool = offload_option(False, cli=False, help="the weights are already sharded by HSDP/FSDP")
    process_group: Any = offload_option(None, cli=False, compare=False, help="the ranks sharing the host copy")
    compression: str | None = _compression_option()
    compression_cache_dir: str | None = _cache_dir_option()

    def __post_init__(self) -> None:
        super().__post_init__()
        check_count(self.prefetch_depth, "prefetch_depth", 1)
        check_bool(self.use_allgather, "use_allgather")
        object.__setattr__(self, "compression", _compression(self.compression))
        object.__setattr__(self, "compression_cache_dir", _cache_dir(self.compression_cache_dir, self.compression))
        check_bool(self.hsdp, "hsdp")
        check_count(self.resident_layers, "resident_layers", 0)
        check_count(self.tensor_parallel_size, "tensor_parallel_size", 1)
        if not self.use_allgather:
            return
        if self.resident_layers:
            raise ValueError(
                f"resident_layers={self.resident_layers} needs full weights on each rank, but use_allgather=True "
                "keeps only 1/N of them; allowed: resident_layers=0, or use_allgather=False"
            )
        if self.tensor_parallel_size > 1:
            raise ValueError(
                f"tensor_parallel_size={self.tensor_parallel_size} with use_allgather=True would shard weights "
                "twice (tensor-parallel slices, then 1/N host shards); allowed: tensor_parallel_size=1, or "
                "use_allgather=False"
            )
        if self.hsdp:
            raise ValueError(
                "hsdp=True with use_allgather=True would shard weights twice (HSDP, then 1/N host shards); "
                "allowed: hsdp=False, or use_allgather=False"
            )
        if self.prefetch_depth != 1:
            raise ValueError(
                f"prefetch_depth={show(self.prefetch_depth)} does not apply with use_allgather=True (its window "
                "holds the running block and the next one); allowed: 1, or use_allgather=False"
            )
        if self.compression is not None:
            raise ValueError(
                f"compression={self.compression!r} with use_allgather=True is not built yet (the 1/N shards are "
                "gathered as raw bytes); allowed: compression=None, or use_allgather=False (each rank's full host "
                "copy is coded)"
            )


# The built-in strategies: config → handler (lazy "module:Class", imported on first use), and the priority among
# strategies requested together (the highest wins).
register_offload_strategy(NoOffloadConfig, None, priority=0)
register_offload_strategy(ModelLevelOffloadConfig, f"{_PKG}.model_level:ModelLevelOffloadBackend", priority=10)
register_offload_strategy(LayerwiseOffloadConfig, f"{_PKG}.layerwise:LayerwiseOffloadBackend", priority=20)
register_offload_strategy(DistributedLayerwiseOffloadConfig,
                          f"{_PKG}.distributed:DistributedLayerwiseOffloadBackend", priority=30)
