"""What every offload strategy's config shares: the base class, byte and device parsing, the explicit topology
(``OffloadPlan``) and the registry of strategies (name → config type → handler).

A strategy is one frozen dataclass subclassing ``OffloadConfig`` (its own fields only, validated on construction)
and one ``register_offload_strategy`` call naming its handler, the ``OffloadBackend`` that applies it. The built-in
strategies are in ``config/offload.py``; the CLI derives ``--offload`` and each strategy's flags from this registry.
"""

from __future__ import annotations

import dataclasses
import enum
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from accelerate.utils import convert_file_size_to_int

from ._values import check_int_range, show
from .names import did_you_mean


class OffloadStrategy(str, enum.Enum):
    """The names of the built-in offload strategies (each is the ``strategy`` of one config class).

    ``NONE`` installs nothing; ``MODEL_LEVEL`` keeps only the running DiT or encoder on the device; ``LAYERWISE``
    streams the DiT's blocks one after another; ``DISTRIBUTED_LAYERWISE`` shares the host copy across the ranks of a
    process group. Strategies registered later (``register_offload_strategy``) are named by a plain ``str``.
    """

    NONE = "none"
    MODEL_LEVEL = "model_level"
    LAYERWISE = "layerwise"
    DISTRIBUTED_LAYERWISE = "distributed_layerwise"

    def __str__(self) -> str:
        return self.value

    @classmethod
    def parse(cls, value: Any, field_name: str = "strategy") -> "OffloadStrategy":
        """Accept an ``OffloadStrategy`` or its name/value in any case (``"Layerwise"``, ``"model-level"``)."""
        if isinstance(value, cls):
            return value
        if not isinstance(value, str):
            raise TypeError(
                f"{field_name} must be an OffloadStrategy or str, got {type(value).__name__}: {show(value)}"
            )
        key = canonical_strategy_name(value)
        for member in cls:
            if key in (member.value, member.name.lower()):
                return member
        allowed = ", ".join(member.value for member in cls)
        raise ValueError(f"{field_name}={show(value)} is not an offload strategy; allowed: {allowed}")


def canonical_strategy_name(value: str) -> str:
    """``" Model-Level"`` → ``"model_level"``: how strategy names are compared (any case, ``-`` or ``_``)."""
    return value.strip().lower().replace("-", "_")


# -- bytes, counts, devices ----------------------------------------------------------------------------------------

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
MAX_BYTES_TEXT = "= 1 PiB, above any device or host memory"
# The largest block/rank count a count field may take: far above any DiT's block count (at most 60 blocks in the
# supported families) or one job's ranks, small enough that every derived size stays exact and printable.
MAX_COUNT = 2**20
MAX_COUNT_TEXT = "= 2**20, above any model's block count or job's rank count"

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
        return check_int_range(value, field_name, 0, MAX_BYTES, "bytes", MAX_BYTES_TEXT)
    match = _BYTES_RE.match(value)
    whole, fraction, unit = match.groups() if match else ("", None, None)
    unit = unit.lower() if unit is not None else None
    if match is None or not (whole or fraction) or unit not in _BYTE_UNITS:
        raise ValueError(
            f"{field_name}={show(value)} is not a byte size; allowed: {_BYTES_ALLOWED} "
            f"(units, any case: {', '.join(u.upper().replace('I', 'i') for u in _BYTE_UNITS if u)})"
        )
    out_of_range = (f"{field_name}={show(value)} is out of range; allowed: 0 to {MAX_BYTES} bytes "
                    f"({MAX_BYTES_TEXT})")
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


def check_bool(value: Any, field_name: str, allow_none: bool = False) -> None:
    """``TypeError`` naming the field, the type and the value unless ``value`` is a bool (or ``None``)."""
    if isinstance(value, bool) or (allow_none and value is None):
        return
    allowed = "a bool or None" if allow_none else "a bool"
    raise TypeError(f"{field_name} must be {allowed}, got {type(value).__name__}: {show(value)}")


def check_count(value: Any, field_name: str, low: int) -> int:
    """``value`` if it is an int from ``low`` to ``MAX_COUNT``; else ``TypeError``/``ValueError`` naming the field,
    the value and the range."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{field_name} must be an int >= {low}, got {type(value).__name__}: {show(value)}")
    if value < low:
        raise ValueError(f"{field_name}={show(value)} is out of range; allowed: an int >= {low}")
    return check_int_range(value, field_name, low, MAX_COUNT, "", MAX_COUNT_TEXT)


def normalize_device(value: Any) -> torch.device:
    """A ``torch.device`` from a device or its name; ``meta`` (which cannot run a model) is refused."""
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


# -- explicit topology ---------------------------------------------------------------------------------------------

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


# -- fields and their command-line flags ---------------------------------------------------------------------------

# What a field's value is, for the CLI: a flag (``bool``), a whole number (``int``, bounded below by ``minimum``) or
# a byte size (``bytes``: ``"12GiB"``, checked by ``parse_bytes``) or one of some names (``choice``, given as
# ``choices``; the config checks the value) or a file-system path (``path``).
OPTION_KINDS = ("bool", "int", "bytes", "choice", "path")


def offload_option(default: Any, *, help: str, kind: str | None = None, minimum: int | None = None,
                   flag: str | None = None, cli: bool = True, compare: bool = True,
                   choices: tuple[str, ...] = ()) -> Any:
    """A config field with what the CLI needs to offer it as a flag (``dataclasses.field`` metadata).

    Args:
        default: the field's default.
        help (`str`): one line for ``--help``; the CLI prefixes the strategies that read the flag.
        kind (`str`, *optional*): ``"bool"``, ``"int"``, ``"bytes"``, ``"choice"`` or ``"path"``; by default from
            ``default``'s type.
        minimum (`int`, *optional*): the smallest value of an ``int`` field (``1`` → the CLI takes positive ints).
        flag (`str`, *optional*): the flag's name; by default ``--<field-name>`` (a bool field defaulting to
            ``True`` gets ``--no-<field-name>``).
        cli (`bool`, defaults to `True`): ``False`` keeps the field out of the CLI.
        compare (`bool`, defaults to `True`): as ``dataclasses.field``.
        choices (`tuple[str, ...]`): the names a ``"choice"`` field takes (the CLI offers them).
    """
    if kind is None:
        kind = "bool" if isinstance(default, bool) else "int" if isinstance(default, int) else None
    if cli and kind not in OPTION_KINDS:
        raise ValueError(f"offload_option: kind={kind!r} must be one of {', '.join(OPTION_KINDS)} for a CLI field "
                         "(or pass cli=False)")
    metadata = {"help": help, "kind": kind, "minimum": minimum, "flag": flag, "cli": cli, "choices": choices}
    return field(default=default, compare=compare, metadata=metadata)


# -- the base of every strategy's config ---------------------------------------------------------------------------

class _ConfigType(type):
    """Checks keyword names before a config's ``__init__`` runs (a field of another strategy is refused naming
    the strategies that take it) and lets ``OffloadConfig(strategy, **fields)`` build the strategy's config."""

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        if cls is OffloadConfig:
            return build_offload_config(*args, **kwargs)
        if args:
            raise TypeError(f"{cls.__name__} takes keyword arguments only (e.g. {cls.__name__}(device='cuda')), got "
                            f"{len(args)} positional: {show(args)}")
        for name, value in kwargs.items():
            if name not in init_fields(cls):
                raise foreign_field_error(cls, name, value)
        return super().__call__(**kwargs)


@dataclass(frozen=True, kw_only=True)
class OffloadConfig(metaclass=_ConfigType):
    """The base of every offload strategy's config, holding the fields they share; calling it with a strategy name
    builds that strategy's config.

    Each strategy has its own frozen config class (``ModelLevelOffloadConfig``, ``LayerwiseOffloadConfig``,
    ``DistributedLayerwiseOffloadConfig``, ``NoOffloadConfig``) holding only the fields it reads, validated on
    construction: invalid input raises ``ValueError`` (``TypeError`` for a value of the wrong type) naming the field,
    the value found and what is allowed. A field of another strategy is refused naming the strategies that take it.

    ``OffloadConfig(strategy, **fields)`` returns the config of ``strategy`` (a name in any case, ``-`` or ``_``):
    ``OffloadConfig("layerwise", device="cuda")`` is ``LayerwiseOffloadConfig(device="cuda")``. Several strategies may
    be given; the highest-priority one is built (distributed layerwise > layerwise > model level > none) and
    ``requested`` keeps them all. A field of another strategy given with that field's default value is left out
    (it asks for nothing); with any other value it is refused.

    Args:
        device (`str | torch.device`, defaults to `"cuda"`): where the model computes. ``"cpu"`` runs the same code
            path with synchronous copies (for testing on machines without an accelerator).
        pin_memory (`bool`, defaults to `True`): keep host copies in page-locked memory, which asynchronous copies
            need. Has no effect with ``device="cpu"``.
        plan (`OffloadPlan`, *optional*): explicit topology overriding declarations.
        show_progress (`bool`, *optional*): byte progress bars while building host copies (and while distributed
            ``disable()`` gathers them back); ``None`` shows them for 1 GiB or more. Never shown when the pipeline's
            ``set_progress_bar_config(disable=True)`` is set, nor on ranks other than 0.

    Example:
    ```py
    >>> OffloadConfig("layerwise", device="cuda", max_device_memory="12GiB")
    LayerwiseOffloadConfig(device=device(type='cuda'), ..., max_device_memory=12884901888, prefetch_depth=1)
    ```
    """

    # The registered name of the strategy (an ``OffloadStrategy`` for the built-in ones).
    strategy: ClassVar[str]
    # Whether the strategy is collective: enabled and disabled together on every rank of a process group (the CLI
    # runs it under ``torchrun``; a pipeline cannot re-plan it alone).
    collective: ClassVar[bool] = False

    device: Any = offload_option("cuda", help="where the model computes", cli=False)
    pin_memory: bool = offload_option(True, help="keep host copies in page-locked memory", cli=False)
    plan: OffloadPlan | None = offload_option(None, help="explicit topology", cli=False)
    show_progress: bool | None = offload_option(None, help="byte progress bars while building host copies",
                                                cli=False)
    # The strategies asked for, highest priority first (``OffloadConfig([...])``); ``(strategy,)`` otherwise.
    requested: tuple[str, ...] = field(default=(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not getattr(type(self), "strategy", None):
            raise TypeError(f"{type(self).__name__} declares no strategy; a strategy's config sets the class "
                            "attribute strategy (its registered name)")
        object.__setattr__(self, "requested", (self.strategy,))
        object.__setattr__(self, "device", normalize_device(self.device))
        check_bool(self.pin_memory, "pin_memory")
        if self.plan is not None and not isinstance(self.plan, OffloadPlan):
            raise TypeError(f"plan must be an OffloadPlan or None, got {type(self.plan).__name__}: {show(self.plan)}")
        check_bool(self.show_progress, "show_progress", allow_none=True)

    @property
    def dropped(self) -> tuple[str, ...]:
        """Requested strategies that lost to a higher-priority one."""
        return self.requested[1:]


def init_fields(config_type: type) -> dict[str, dataclasses.Field]:
    """The fields a config class takes as keyword arguments, by name, in declaration order."""
    return {f.name: f for f in dataclasses.fields(config_type) if f.init}


# -- the registry --------------------------------------------------------------------------------------------------

@dataclass
class OffloadStrategyEntry:
    """One registered strategy: its name, its config class, the handler that applies it (an ``OffloadBackend``
    subclass, or its lazy ``"module:Class"`` path; ``None`` for a strategy that installs nothing) and its priority
    when several strategies are requested at once (the highest wins)."""

    name: str
    config: type
    handler: Any
    priority: int


_STRATEGIES: dict[str, OffloadStrategyEntry] = {}
_NAME_RE = re.compile(r"^[a-z][a-z0-9_]*$")


def register_offload_strategy(config: type, handler: Any, *, priority: int) -> type:
    """Register ``config`` (an ``OffloadConfig`` dataclass with a ``strategy`` name) and the handler applying it.

    Everything else follows from this: ``OffloadConfig("<name>", ...)``, ``get_offload_backend``/``apply_offload``/
    ``pipe.enable_omni_offload`` with the config, and the CLI's ``--offload <name>`` choice with one flag per field.

    Args:
        config (`type`): a frozen dataclass subclassing ``OffloadConfig`` whose class attribute ``strategy`` is its
            name (lower case, digits and ``_``).
        handler (`type | str | None`): the ``OffloadBackend`` subclass that applies it, or its lazy
            ``"package.module:ClassName"`` path (imported on first use); ``None`` installs nothing.
        priority (`int`): rank among strategies requested together (higher wins): none 0, model level 10,
            layerwise 20, distributed layerwise 30.

    Returns:
        ``config``, so that the call can follow the class definition.

    Example:
    ```py
    >>> @dataclass(frozen=True, kw_only=True)
    ... class DiskOffloadConfig(OffloadConfig):
    ...     strategy: ClassVar[str] = "disk"
    ...     path: str = offload_option("/tmp", help="where the weights go", cli=False)
    >>> register_offload_strategy(DiskOffloadConfig, "my_package.disk:DiskOffloadBackend", priority=15)
    ```
    """
    if not (isinstance(config, type) and issubclass(config, OffloadConfig) and dataclasses.is_dataclass(config)
            and config is not OffloadConfig):
        raise TypeError(f"register_offload_strategy: config must be a dataclass subclassing OffloadConfig, got "
                        f"{show(config)}")
    name = getattr(config, "strategy", None)
    if not isinstance(name, str) or not _NAME_RE.match(str(name)):
        raise ValueError(f"register_offload_strategy: {config.__name__}.strategy={show(name)} must be a lower-case "
                         "name of letters, digits and '_' (e.g. 'layerwise')")
    if handler is not None and not isinstance(handler, (str, type)):
        raise TypeError(f"register_offload_strategy: handler must be an OffloadBackend subclass, a "
                        f"'module:Class' path or None, got {show(handler)}")
    if isinstance(handler, str) and ":" not in handler:
        raise ValueError(f"register_offload_strategy: handler={handler!r} must look like 'package.module:ClassName'")
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise TypeError(f"register_offload_strategy: priority must be an int, got {show(priority)}")
    key = str(name)
    existing = _STRATEGIES.get(key)
    if existing is not None and existing.config is not config:
        raise ValueError(f"register_offload_strategy: strategy {key!r} is already registered by "
                         f"{existing.config.__name__}; unregister_offload_strategy({key!r}) first")
    for field_name, f in init_fields(config).items():
        _check_same_option(config, field_name, f)
    _STRATEGIES[key] = OffloadStrategyEntry(key, config, handler, priority)
    return config


def unregister_offload_strategy(strategy: Any) -> OffloadStrategyEntry:
    """Remove a registered strategy and return its entry (to register it again later)."""
    entry = offload_strategy_entry(strategy)
    del _STRATEGIES[entry.name]
    return entry


def offload_strategies() -> list[OffloadStrategyEntry]:
    """Every registered strategy, lowest priority first (``none`` first)."""
    return sorted(_STRATEGIES.values(), key=lambda entry: entry.priority)


def offload_strategy_entry(strategy: Any, field_name: str = "strategy") -> OffloadStrategyEntry:
    """The entry of ``strategy`` (a registered name in any case, ``-`` or ``_``, an ``OffloadStrategy``, or a
    registered config class)."""
    if isinstance(strategy, type) and issubclass(strategy, OffloadConfig):
        for entry in _STRATEGIES.values():
            if entry.config is strategy:
                return entry
        raise ValueError(f"{strategy.__name__} is not a registered offload config; registered: "
                         f"{', '.join(e.config.__name__ for e in offload_strategies())} (register_offload_strategy)")
    if not isinstance(strategy, str):
        raise TypeError(f"{field_name} must be an OffloadStrategy or str, got {type(strategy).__name__}: "
                        f"{show(strategy)}")
    key = canonical_strategy_name(strategy)
    entry = _STRATEGIES.get(key)
    if entry is None:
        names = [e.name for e in offload_strategies()]
        raise ValueError(f"{field_name}={show(strategy)} is not an offload strategy; allowed: {', '.join(names)}"
                         f"{did_you_mean(key, names)}")
    return entry


def takers(field_name: str) -> list[OffloadStrategyEntry]:
    """The registered strategies whose config has a field ``field_name``, lowest priority first."""
    return [entry for entry in offload_strategies() if field_name in init_fields(entry.config)]


def _check_same_option(config: type, field_name: str, f: dataclasses.Field) -> None:
    """A field name two strategies share is one CLI flag: it must have the same kind, flag and default."""
    for entry in takers(field_name):
        other = init_fields(entry.config)[field_name]
        if entry.config is config or other is f:
            continue
        mine = (f.metadata.get("kind"), f.metadata.get("flag"), f.metadata.get("cli"), f.default)
        theirs = (other.metadata.get("kind"), other.metadata.get("flag"), other.metadata.get("cli"), other.default)
        if mine != theirs:
            raise ValueError(f"register_offload_strategy: {config.__name__}.{field_name} differs from "
                             f"{entry.config.__name__}.{field_name} (kind, flag, cli, default: {mine} vs {theirs}); "
                             "a field name shared by strategies must mean the same")


def _strategy_list(entries: list[OffloadStrategyEntry]) -> str:
    names = [entry.name for entry in entries]
    joined = names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"
    return f"the {joined} strateg{'y' if len(names) == 1 else 'ies'}"


def foreign_field_error(config: type, field_name: str, value: Any) -> Exception:
    """The error for ``field_name=value`` given to ``config``, which has no such field: a ``ValueError`` naming the
    strategies whose configs take it, or a ``TypeError`` with the allowed fields when none does."""
    own = ", ".join(init_fields(config))
    strategy = getattr(config, "strategy", None)
    owner = f"{config.__name__} (strategy={str(strategy)!r})" if strategy else config.__name__
    entries = takers(field_name)
    if entries:
        classes = [entry.config.__name__ for entry in entries]
        return ValueError(
            f"{field_name}={show(value)} applies only to {_strategy_list(entries)} ({', '.join(classes)}), got "
            f"strategy={str(strategy)!r}; allowed: leave {field_name} out, or use {' or '.join(classes)}. "
            f"{owner} takes: {own}"
        )
    known = {name for entry in offload_strategies() for name in init_fields(entry.config)} | set(init_fields(config))
    return TypeError(f"{owner} has no field {field_name!r}{did_you_mean(field_name, sorted(known))}; "
                     f"allowed: {own}")


def _strategies_of(value: Any) -> list[OffloadStrategyEntry]:
    if isinstance(value, str):
        return [offload_strategy_entry(value)]
    if isinstance(value, Iterable) and not isinstance(value, Mapping):
        items = list(value)
        if not items:
            names = ", ".join(e.name for e in offload_strategies())
            raise ValueError(f"strategy={show(value)} is empty; allowed: one or more of {names}")
        entries = {entry.name: entry for entry in (offload_strategy_entry(item) for item in items)}
        if len(entries) > 1:  # another strategy wins over "none"
            entries = {name: e for name, e in entries.items() if e.handler is not None} or entries
        return sorted(entries.values(), key=lambda entry: -entry.priority)
    raise TypeError(
        "strategy must be an OffloadStrategy, a str or a collection of them, got "
        f"{type(value).__name__}: {show(value)}"
    )


def build_offload_config(strategy: Any = None, /, **fields: Any) -> OffloadConfig:
    """``OffloadConfig(strategy, **fields)``: the config of ``strategy`` (or of the highest-priority one of a
    collection) built from ``fields``. A field only other strategies take is left out when it has their default
    (it asks for nothing) and refused otherwise."""
    if strategy is None:
        strategy = fields.pop("strategy", None)
    elif "strategy" in fields:
        raise TypeError("OffloadConfig got strategy twice (positionally and as a keyword)")
    if strategy is None:
        names = ", ".join(e.name for e in offload_strategies())
        raise TypeError(f"OffloadConfig needs a strategy, got None; allowed: {names} (or build a strategy's config "
                        "class directly, e.g. LayerwiseOffloadConfig(device='cuda'))")
    entries = _strategies_of(strategy)
    config = entries[0].config
    own = init_fields(config)
    kept = {}
    for name, value in fields.items():
        if name not in own:
            others = [init_fields(entry.config)[name] for entry in takers(name)]
            if others and all(_is_default(value, f.default) for f in others):
                continue
            raise foreign_field_error(config, name, value)
        kept[name] = value
    built = config(**kept)
    object.__setattr__(built, "requested", tuple(entry.config.strategy for entry in entries))
    return built


def _is_default(value: Any, default: Any) -> bool:
    return value is default or (type(value) is type(default) and value == default)
