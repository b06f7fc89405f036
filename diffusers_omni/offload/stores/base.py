"""Block stores: where a streamed block's bytes live between its uses.

A store holds one block's bytes from enable to disable and answers four things: it takes the bytes from the
block's tensors (``take``, journaled so a failed enable gives them back), puts them into the block's device buffers
when the block loads (``fill``, queued on the transfer's copy stream), shows them as host tensors for
``state_dict()`` (``host_views``), and gives the model its tensors back on disable (``give_back``). The streamer,
the hooks and the planner never ask how: a new way of holding bytes (compressed, in another process, …) is one
file with a ``BlockStore`` subclass and its ``register_store``.

The planner chooses a store per streamed block: the registered stores are asked in priority order (highest
first) whether they ``claims`` the block; the pinned host copy (lowest priority) claims every block.

Example:
```py
>>> @register_store
... class MyStore(BlockStore):
...     name = "mine"
...     priority = 10
...     @classmethod
...     def claims(cls, weights, context): return weights.path.startswith("transformer.")
...     ...
```
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from ...utils.journal import Journal
from ..memory import HostMemory, PackedWeights, Transfers


@dataclass
class StoreContext:
    """What stores share within one enable: the device, the offload's host memory (pinned pages are released with
    it), the release of checkpoint pages once copied, and, under a host budget, the disk-backed blocks' sources,
    their reader and the staging ring (set once the ring starts), and the coded stores' device buffers."""

    device: torch.device
    host_memory: HostMemory
    release: Callable[[list[torch.Tensor]], Any] | None = None
    sources: dict[int, Any] = field(default_factory=dict)  # id(PackedWeights) → disk.BlockSource
    reader: Any = None  # disk.DiskReader
    ring: Any = None  # disk.StagingRing
    compression: str | None = None  # the offload's ``compression`` ("lossless" lets the lossless store claim blocks)
    shards: Any = None  # shard.ShardGroup under AllGather: the shard store claims every streamed block
    cache: Any = None  # coded_cache.CodedCache of ``compression_cache_dir`` (None: no cache)
    window_blocks: int = 2  # streamed blocks on the device at once, at most (prefetch depth + 1)
    code_ring: Any = None  # lossless.CodeRing: the code's device buffers, shared by the coded stores

    @property
    def clone_on_release(self) -> bool:
        """Whether host copies must be cloned when given back (their pages are released with the host memory)."""
        return self.host_memory.needs_clone_on_release


class BlockStore(ABC):
    """Where one streamed block's bytes live between its uses. Subclasses set ``name`` (the report counts bytes
    under it) and ``priority`` and implement the five methods below."""

    name: ClassVar[str]
    priority: ClassVar[int] = 0
    # Whether the bytes stay in this process's memory (the report's host bytes; a file-backed store's do not).
    in_host_memory: ClassVar[bool] = True
    # Whether they are in the offload's own host memory (the report counts them as pinned when that memory is).
    uses_offload_host_memory: ClassVar[bool] = False
    # Why ``host_views`` cannot show the whole block in this process (``None``: it can). A store that sets it makes
    # the offload refuse ``state_dict()`` of its blocks and ``save_pretrained`` before anything is written.
    host_views_refusal: ClassVar[str | None] = None
    # The progress bar's label when ``give_back`` moves bytes worth showing (``None``: no bar on disable).
    give_back_progress: ClassVar[str | None] = None
    # Whether a streamed block of this store may stay on the device for good (``headroom``): ``fill`` needs nothing but
    # this process (no other rank, no reader thread) and the bytes stay held here for ``give_back``.
    can_stay: ClassVar[bool] = False

    def __init__(self, weights: PackedWeights, context: StoreContext) -> None:
        self.weights = weights
        self.context = context

    @classmethod
    @abstractmethod
    def claims(cls, weights: PackedWeights, context: StoreContext) -> bool:
        """Whether this store holds ``weights`` (asked in priority order; the first store that claims it does)."""

    @abstractmethod
    def take(self, journal: Journal) -> None:
        """Hold the block's bytes, read from its tensors as they are now. Record on ``journal`` how to give the
        tensors their own data back (a failed enable rolls back). The caller then parks the tensors on
        placeholders."""

    @abstractmethod
    def fill(self, buffers: dict[torch.dtype, torch.Tensor], transfers: Transfers, wait_for: Any,
             done: Any) -> None:
        """Queue the block's bytes into ``buffers`` (one flat device tensor per dtype, allocated on the compute
        stream): the copy waits for ``wait_for`` and records ``done`` once the bytes are there (events are ``None``
        on the CPU, where copies are synchronous). Raising leaves nothing queued that writes ``buffers`` later."""

    @abstractmethod
    def host_views(self) -> list[torch.Tensor]:
        """The block's tensors as host tensors, in ``weights.slots`` order (``state_dict()`` reads them)."""

    @abstractmethod
    def give_back(self) -> None:
        """Disable: the block's tensors become ordinary host tensors holding their values (final). Must not fail
        once ``prepare_give_back`` succeeded."""

    def prepare_give_back(self) -> None:
        """Before disable changes anything: get what ``give_back`` needs that may fail (a file-backed block reads
        itself back). Raising refuses the disable. Nothing by default."""

    def cancel_give_back(self) -> None:
        """The disable was refused: drop what ``prepare_give_back`` got."""

    def counters(self) -> dict[str, int]:
        """Numbers the report sums per component for this store (a coded store's coded and logical bytes, say).
        None by default."""
        return {}

    @property
    def host_nbytes(self) -> int:
        """Bytes this store holds in host memory for the block."""
        return self.weights.nbytes if self.in_host_memory else 0

    @property
    def host_bytes_per_dtype(self) -> dict[torch.dtype, int]:
        """``host_nbytes`` per dtype of the block's layout, as the distributed stats count them (by default the
        whole packed block's, when the bytes are in host memory)."""
        if not self.in_host_memory:
            return {}
        return {dtype: numel * dtype.itemsize for dtype, numel in self.weights.numel.items()}

    def held_leaf_bytes(self) -> int:
        """Bytes of the block's own tensors (alignment padding excluded) this store holds for this process, for the
        report: the whole block by default."""
        return sum(slot.numel * slot.dtype.itemsize for slot in self.weights.slots)

    @property
    def device_numel(self) -> dict[torch.dtype, int]:
        """Elements per dtype of the block's device buffers that ``fill`` writes (at least the layout's)."""
        return self.weights.numel

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.weights.path!r})"


_STORES: list[type[BlockStore]] = []


def register_store(cls: type[BlockStore]) -> type[BlockStore]:
    """Make ``cls`` one of the stores the planner may choose (usable as a class decorator). Raises for a name
    that is registered already."""
    if not (isinstance(cls, type) and issubclass(cls, BlockStore)):
        raise TypeError(f"register_store takes a BlockStore subclass, got {cls!r}")
    taken = [other for other in _STORES if other.name == cls.name and other is not cls]
    if taken:
        raise ValueError(f"a block store named {cls.name!r} is registered already ({taken[0].__qualname__}); "
                         "allowed: a name no other store has")
    if cls not in _STORES:
        _STORES.append(cls)
        _STORES.sort(key=lambda store: -store.priority)
    return cls


def unregister_store(cls: type[BlockStore]) -> None:
    """Stop offering ``cls`` to the planner (enabled offloads keep the stores they hold)."""
    if cls in _STORES:
        _STORES.remove(cls)


def registered_stores() -> tuple[type[BlockStore], ...]:
    """The stores the planner asks, in the order it asks them."""
    return tuple(_STORES)


def store_for(weights: PackedWeights, context: StoreContext) -> BlockStore:
    """The store of the highest priority that claims ``weights``."""
    for cls in _STORES:
        if cls.claims(weights, context):
            return cls(weights, context)
    raise RuntimeError(f"no registered block store claims {weights.path!r} (registered: "
                       f"{[cls.name for cls in _STORES]})")
