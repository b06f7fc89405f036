"""Typed offload configuration: which strategy moves weights between host and device, and with what limits.

``OffloadConfig`` validates itself on construction; invalid input raises ``ValueError`` (``TypeError`` for a value
of the wrong type) naming the field, the value found and what is allowed.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from accelerate.utils import convert_file_size_to_int

from ._values import check_int_range, show


class OffloadStrategy(str, enum.Enum):
    """How weights move between host memory and the accelerator.

    ``MODEL_LEVEL`` keeps only the running DiT or encoder on the device; ``LAYERWISE`` streams the DiT's blocks one
    after another; ``DISTRIBUTED_LAYERWISE`` shares the host copy across the ranks of a process group.
    """

    NONE = "none"
    MODEL_LEVEL = "model_level"
    LAYERWISE = "layerwise"
    DISTRIBUTED_LAYERWISE = "distributed_layerwise"

    @classmethod
    def parse(cls, value: Any, field_name: str = "strategy") -> "OffloadStrategy":
        """Accept an ``OffloadStrategy`` or its name/value in any case (``"Layerwise"``, ``"model-level"``)."""
        if isinstance(value, cls):
            return value
        if not isinstance(value, str):
            raise TypeError(
                f"{field_name} must be an OffloadStrategy or str, got {type(value).__name__}: {show(value)}"
            )
        key = value.strip().lower().replace("-", "_")
        for member in cls:
            if key in (member.value, member.name.lower()):
                return member
        raise ValueError(
            f"{field_name}={show(value)} is not an offload strategy; allowed: {', '.join(_ALLOWED_NAMES)}"
        )


_ALLOWED_NAMES = tuple(member.value for member in OffloadStrategy)

# When several strategies are requested, the first one present wins.
STRATEGY_PRIORITY: tuple[OffloadStrategy, ...] = (
    OffloadStrategy.DISTRIBUTED_LAYERWISE,
    OffloadStrategy.LAYERWISE,
    OffloadStrategy.MODEL_LEVEL,
    OffloadStrategy.NONE,
)

def _accelerate_unit(unit: str) -> int:
    """Bytes in one ``unit`` as ``accelerate.utils.convert_file_size_to_int`` counts them (``"1GiB"`` → 2³⁰)."""
    return convert_file_size_to_int(f"1{unit}")


# Unit factors come from accelerate (the parser the Hugging Face stack uses for ``max_memory``); accelerate has no
# bare bytes, "B", "TB" or "TiB", which are derived from its factors. Keys are lower case: units are matched
# case-insensitively and always count bytes (accelerate reads a lower-case "b", as in "5Gb", as bits).
_BYTE_UNITS = {
    "": 1,
    "b": 1,
    "kb": _accelerate_unit("KB"),
    "mb": _accelerate_unit("MB"),
    "gb": _accelerate_unit("GB"),
    "tb": _accelerate_unit("GB") * 1000,
    "kib": _accelerate_unit("KiB"),
    "mib": _accelerate_unit("MiB"),
    "gib": _accelerate_unit("GiB"),
    "tib": _accelerate_unit("GiB") * 1024,
}
# The largest byte count a budget or size may take: 1 PiB (2**50 bytes). Far above any device or host memory one
# process can address today (an H200 has 141 GB; the largest single hosts a few tens of TiB), so every real budget
# fits, while a typo of a few extra digits (or 10**400) is refused where it is parsed instead of failing later
# (OverflowError converting to a C integer, repr() of a 5000-digit config). 2**50 also leaves room for sums of
# budgets and block sizes in int64 (torch and C APIs) without overflow.
MAX_BYTES = 2**50
_MAX_BYTES_TEXT = "= 1 PiB, above any device or host memory"
# The largest block/rank count a count field may take: far above any DiT's block count (at most 60 blocks in the
# supported families) or one job's ranks, small enough that every derived size stays exact and printable.
MAX_COUNT = 2**20
_MAX_COUNT_TEXT = "= 2**20, above any model's block count or job's rank count"

_BYTES_RE = re.compile(r"^\s*([0-9]*)(?:\.([0-9]+))?\s*([a-zA-Z]*)\s*$", re.ASCII)
_BYTES_ALLOWED = 'a non-negative int of bytes or a string such as "12GiB", "500MB", "1.5 GB"'


def parse_bytes(value: Any, field_name: str) -> int:
    """``12`` → 12, ``"12GiB"`` → 12·2³⁰, ``"500MB"`` → 5·10⁸ (decimal and binary units, case-insensitive).

    The unit factors are accelerate's (``accelerate.utils.convert_file_size_to_int``: ``GB`` = 10⁹, ``GiB`` = 2³⁰),
    extended by ``B``, ``TB``, ``TiB`` and bare byte counts. The number is scaled with exact integer arithmetic
    rather than through accelerate's float (which turns ``"4.1MB"`` into 4 099 999 and overflows for long digit
    strings), and every refusal names ``field_name``, the value and what is allowed.

    Args:
        value (`int | str`): a byte count, or digits with an optional fraction and unit (``"1.5 GiB"``).
        field_name (`str`): the config field, for error messages.

    Example:
    ```py
    >>> parse_bytes("1.5 GiB", "max_device_memory")
    1610612736
    ```
    """
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise TypeError(f"{field_name} must be {_BYTES_ALLOWED}, got {type(value).__name__}: {show(value)}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"{field_name}={show(value)} is negative; allowed: {_BYTES_ALLOWED}")
        return check_int_range(value, field_name, 0, MAX_BYTES, "bytes", _MAX_BYTES_TEXT)
    match = _BYTES_RE.match(value)
    whole, fraction, unit = match.groups() if match else ("", None, None)
    unit = unit.lower() if unit is not None else None
    if match is None or not (whole or fraction) or unit not in _BYTE_UNITS:
        raise ValueError(
            f"{field_name}={show(value)} is not a byte size; allowed: {_BYTES_ALLOWED} "
            f"(units, any case: {', '.join(u.upper().replace('I', 'i') for u in _BYTE_UNITS if u)})"
        )
    out_of_range = (f"{field_name}={show(value)} is out of range; allowed: 0 to {MAX_BYTES} bytes "
                    f"({_MAX_BYTES_TEXT})")
    if len(whole.lstrip("0")) > 30:  # beyond MAX_BYTES whatever the unit; int() also refuses > 4300 digits
        raise ValueError(out_of_range)
    # Exact integer arithmetic: a float would overflow to inf (OverflowError in int()) for long digit strings.
    fraction = (fraction or "")[:30]
    scaled = int(whole or "0") * 10 ** len(fraction) + int(fraction or "0")
    nbytes = scaled * _BYTE_UNITS[unit] // 10 ** len(fraction)
    if nbytes > MAX_BYTES:
        raise ValueError(f"{out_of_range}; got {nbytes} bytes")
    return nbytes


def format_bytes(nbytes: int | float) -> str:
    """``1.50 GiB``-style rendering for logs and reports."""
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{value:.2f} {unit}" if unit != "B" else f"{int(value)} B"
        value /= 1024
    return f"{value:.2f} GiB"


def _normalize_paths(owner: str, value: Any) -> tuple[str, ...]:
    if isinstance(value, (str, Mapping)) or not isinstance(value, Iterable):
        raise TypeError(
            f"{owner} must be a sequence of dotted paths (str), got {type(value).__name__}: {show(value)}"
        )
    paths = tuple(value)
    for path in paths:
        if not isinstance(path, str):
            raise TypeError(f"{owner} must hold dotted paths (str), got {type(path).__name__}: {show(path)}")
        if not path.strip():
            raise ValueError(f"{owner} must hold non-empty dotted paths, got {show(path)}")
    return paths


@dataclass(frozen=True)
class OffloadPlan:
    """Explicit offload topology, for pipelines and models whose structure the declarations do not describe.

    Args:
        blocks (`Mapping[str, Sequence[str]]`, defaults to `{}`): per DiT path (as discovered, e.g.
            ``"transformer"``; ``""`` for a bare model), the attributes holding its repeated blocks in execution
            order. Overrides the DiT's ``_layerwise_offload_blocks_attrs`` and this package's declaration.
        extra_streamed (`Sequence[str]`, defaults to `()`): further dotted paths (from the pipeline or bare model)
            to stream layerwise. A ``ModuleList``/``Sequential`` streams child by child as its own prefetch ring;
            any other module streams as one unit.
        resident (`Sequence[str]`, defaults to `()`): dotted paths that stay on the device under every strategy,
            e.g. one block of a stack (``"transformer.blocks.0"``) or a small extra module.
    """

    blocks: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    extra_streamed: tuple[str, ...] = ()
    resident: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.blocks, Mapping):
            raise TypeError(
                "OffloadPlan.blocks must be a mapping of DiT path to block attributes, got "
                f"{type(self.blocks).__name__}: {show(self.blocks)}"
            )
        blocks = {}
        for dit_path, attrs in self.blocks.items():
            if not isinstance(dit_path, str):
                raise TypeError(
                    f"OffloadPlan.blocks keys must be DiT paths (str), got {type(dit_path).__name__}: {show(dit_path)}"
                )
            blocks[dit_path] = _normalize_paths(f"OffloadPlan.blocks[{dit_path!r}]", attrs)
        object.__setattr__(self, "blocks", blocks)
        object.__setattr__(self, "extra_streamed", _normalize_paths("OffloadPlan.extra_streamed", self.extra_streamed))
        object.__setattr__(self, "resident", _normalize_paths("OffloadPlan.resident", self.resident))


def _normalize_strategies(value: Any) -> tuple[OffloadStrategy, ...]:
    if isinstance(value, (str, OffloadStrategy)):
        requested = {OffloadStrategy.parse(value)}
    elif isinstance(value, Iterable) and not isinstance(value, Mapping):
        requested = {OffloadStrategy.parse(item) for item in value}
        if not requested:
            raise ValueError(f"strategy={show(value)} is empty; allowed: one or more of {', '.join(_ALLOWED_NAMES)}")
    else:
        raise TypeError(
            "strategy must be an OffloadStrategy, a str or a collection of them, got "
            f"{type(value).__name__}: {show(value)}"
        )
    if len(requested) > 1:
        requested.discard(OffloadStrategy.NONE)
    return tuple(s for s in STRATEGY_PRIORITY if s in requested)


def _normalize_device(value: Any) -> torch.device:
    if isinstance(value, torch.device):
        device = value
    elif isinstance(value, str):
        try:
            device = torch.device(value)
        except (RuntimeError, ValueError) as error:
            raise ValueError(
                f"device={show(value)} is not a torch device; allowed: e.g. 'cuda', 'cuda:1', 'cpu'"
            ) from error
    else:
        raise TypeError(f"device must be a str or torch.device, got {type(value).__name__}: {show(value)}")
    if device.type == "meta":
        raise ValueError("device='meta' cannot run a model; allowed: an accelerator such as 'cuda', or 'cpu' for tests")
    return device


@dataclass(frozen=True)
class OffloadConfig:
    """What to offload and how.

    Args:
        strategy (`OffloadStrategy | str | Collection`): ``"none"``, ``"model_level"``, ``"layerwise"`` or
            ``"distributed_layerwise"`` (case-insensitive). Several may be given; the highest priority one is used
            (distributed layerwise > layerwise > model level) and ``requested`` keeps them all.
        device (`str | torch.device`, defaults to `"cuda"`): where the model computes. ``"cpu"`` runs the same code
            path with synchronous copies (for testing on machines without an accelerator).
        pin_memory (`bool`, defaults to `True`): keep host copies in page-locked memory, which asynchronous copies
            need. Has no effect with ``device="cpu"``.
        max_device_memory (`int | str`, *optional*): layerwise only. Bytes of DiT weights allowed on the device
            (non-block weights, resident blocks and streaming slots; encoders, VAE and activations are not
            counted). Blocks beyond the budget stream; ``None`` streams every block.
        prefetch_depth (`int`, defaults to `1`): layerwise only. Blocks copied ahead of the running one; each costs
            one device slot the size of the largest streamed block.
        plan (`OffloadPlan`, *optional*): explicit topology overriding declarations.
        show_progress (`bool`, *optional*): byte progress bars while building host copies (and while distributed
            ``disable()`` gathers them back); ``None`` shows them for 1 GiB or more. Never shown when the pipeline's
            ``set_progress_bar_config(disable=True)`` is set, nor on ranks other than 0.
        use_allgather (`bool`, defaults to `True`): distributed layerwise only. Each rank pins 1/N of every block
            and blocks are rebuilt per layer by all-gather; ``False`` streams a full host copy per rank.
        resident_layers (`int`, defaults to `0`): distributed layerwise only, with ``use_allgather=False``: the
            first N blocks of the main DiT stay on the device.
        tensor_parallel_size (`int`, defaults to `1`): the tensor-parallel degree the model was loaded with; must
            be 1 with ``use_allgather=True`` (the shards would be sharded twice).
        hsdp (`bool`, defaults to `False`): whether the weights are already sharded by HSDP/FSDP; not allowed with
            ``use_allgather=True`` (double sharding).
        process_group (`torch.distributed.ProcessGroup`, *optional*): distributed layerwise only: the ranks that
            share the host copy; ``None`` is the default (world) group.

    Example:
    ```py
    >>> OffloadConfig("layerwise", device="cuda", max_device_memory="12GiB")
    ```
    """

    strategy: Any
    device: Any = "cuda"
    pin_memory: bool = True
    max_device_memory: Any = None
    prefetch_depth: int = 1
    plan: OffloadPlan | None = None
    show_progress: bool | None = None
    use_allgather: bool = True
    resident_layers: int = 0
    tensor_parallel_size: int = 1
    hsdp: bool = False
    process_group: Any = field(default=None, compare=False)
    requested: tuple[OffloadStrategy, ...] = field(init=False)

    def __post_init__(self) -> None:
        requested = _normalize_strategies(self.strategy)
        object.__setattr__(self, "requested", requested)
        object.__setattr__(self, "strategy", requested[0])
        object.__setattr__(self, "device", _normalize_device(self.device))
        if not isinstance(self.pin_memory, bool):
            raise TypeError(f"pin_memory must be a bool, got {type(self.pin_memory).__name__}: {show(self.pin_memory)}")
        if self.max_device_memory is not None:
            object.__setattr__(self, "max_device_memory", parse_bytes(self.max_device_memory, "max_device_memory"))
            if self.strategy is not OffloadStrategy.LAYERWISE:
                raise ValueError(
                    f"max_device_memory={show(self.max_device_memory)} applies only to the layerwise strategy, got "
                    f"strategy={self.strategy.value!r}; allowed: None, or use strategy='layerwise'"
                )
        if isinstance(self.prefetch_depth, bool) or not isinstance(self.prefetch_depth, int):
            raise TypeError(
                f"prefetch_depth must be an int >= 1, got {type(self.prefetch_depth).__name__}: "
                f"{show(self.prefetch_depth)}"
            )
        if self.prefetch_depth < 1:
            raise ValueError(f"prefetch_depth={show(self.prefetch_depth)} is out of range; allowed: an int >= 1")
        check_int_range(self.prefetch_depth, "prefetch_depth", 1, MAX_COUNT, "blocks", _MAX_COUNT_TEXT)
        if self.plan is not None and not isinstance(self.plan, OffloadPlan):
            raise TypeError(f"plan must be an OffloadPlan or None, got {type(self.plan).__name__}: {show(self.plan)}")
        if self.show_progress is not None and not isinstance(self.show_progress, bool):
            raise TypeError(
                f"show_progress must be a bool or None, got {type(self.show_progress).__name__}: "
                f"{show(self.show_progress)}"
            )
        self._validate_distributed()

    def _validate_distributed(self) -> None:
        for name in ("use_allgather", "hsdp"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise TypeError(f"{name} must be a bool, got {type(value).__name__}: {show(value)}")
        for name, low in (("resident_layers", 0), ("tensor_parallel_size", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int >= {low}, got {type(value).__name__}: {show(value)}")
            if value < low:
                raise ValueError(f"{name}={show(value)} is out of range; allowed: an int >= {low}")
            check_int_range(value, name, low, MAX_COUNT, "", _MAX_COUNT_TEXT)
        if self.strategy is not OffloadStrategy.DISTRIBUTED_LAYERWISE:
            changed = [
                f"{n}={show(getattr(self, n))}"
                for n, default in (("use_allgather", True), ("resident_layers", 0), ("process_group", None))
                if getattr(self, n) != default
            ]
            if changed:
                raise ValueError(
                    f"{', '.join(changed)} apply only to strategy='distributed_layerwise', got "
                    f"strategy={self.strategy.value!r}"
                )
            return
        if self.use_allgather:
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
                    f"prefetch_depth={self.prefetch_depth} does not apply with use_allgather=True (two fixed "
                    "gathered slots); allowed: 1, or use_allgather=False"
                )

    @property
    def dropped(self) -> tuple[OffloadStrategy, ...]:
        """Requested strategies that lost to a higher-priority one."""
        return self.requested[1:]
