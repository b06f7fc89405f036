"""Backend registry: the kernel families, and every name, alias, option rule and route they declare.

This is the one list of families (``BUILTIN_FAMILIES``): a new backend is its package under ``backends/`` (whose
``__init__.py`` declares ``FAMILY``) plus one line here. Everything else asks this module: the plan checks backend
names, aliases and options against it (``check_config``), routing joins the families' routes, the CLI lists the
backends. Nothing is pushed into another module when this one is imported, and importing it loads no backend and
not even torch (the descriptors are plain data; backend classes load on first use).
"""

from __future__ import annotations

import importlib
import logging
import threading
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from ..config._values import show
from ..config.attention import AUTO, OPTION_FIELDS, AttentionConfig, AttentionSpec
from ..config.names import DIFFUSERS_NAMES, NO_EQUIVALENT, DiffusersBackendName, check_diffusers_env_value, did_you_mean
from .backends import flash, flashinfer, hub, rainfusion, sage, sdpa, trtllm
from .backends.family import Alias, BackendFamily, OptionNotAccepted

if TYPE_CHECKING:
    from .backends.base import AttentionBackend

logger = logging.getLogger("diffusers_omni.attention.registry")

# One line per kernel family; their order is the order names are listed in (messages, ``info``, the docs tables):
# the reference first, then the platform defaults in Blackwell's preference order, then explicit-only families.
BUILTIN_FAMILIES: tuple[BackendFamily, ...] = (
    sdpa.FAMILY,
    trtllm.FAMILY,
    flashinfer.FAMILY,
    flash.FAMILY,
    sage.FAMILY,
    hub.FAMILY,
    rainfusion.FAMILY,
)

_lock = threading.RLock()
_families: dict[str, BackendFamily] = {}
_owner: dict[str, str] = {}  # backend name -> family name
_classes: dict[str, "type[AttentionBackend]"] = {}  # loaded (or replaced) classes
_aliases: dict[str, Alias] = {}  # folded alias -> alias
# Bumped by every change; cached resolutions of an older generation are stale (selector.resolve).
_generation = 0


def _add(family: BackendFamily) -> None:
    clash = [name for name in family.backends if name in _owner and _owner[name] != family.name]
    if clash:
        raise ValueError(f"register_family: {family.name!r} declares {clash}, already registered by family "
                         f"{_owner[clash[0]]!r}")
    for alias in family.aliases:
        folded = alias.name.strip().lower()
        taken = _aliases.get(folded)
        if taken is not None and _owner.get(taken.backend) != family.name:
            raise ValueError(f"register_family: alias {alias.name!r} of {family.name!r} is already an alias of "
                             f"{taken.backend}")
        if folded.upper() in _owner:
            raise ValueError(f"register_family: alias {alias.name!r} of {family.name!r} is a backend name")
    _families[family.name] = family
    for name in family.backends:
        _owner[name] = family.name
        _classes.pop(name, None)
    for alias in family.aliases:
        _aliases[alias.name.strip().lower()] = alias


def _drop(name: str) -> None:
    family = _families.pop(name)
    for backend in family.backends:
        _owner.pop(backend, None)
        _classes.pop(backend, None)
    for alias in family.aliases:
        _aliases.pop(alias.name.strip().lower(), None)


def _bump() -> None:
    global _generation
    _generation += 1


for _family in BUILTIN_FAMILIES:
    _add(_family)
_BUILTIN = {family.name: family for family in BUILTIN_FAMILIES}


def register_family(family: BackendFamily) -> None:
    """Register a kernel family (or replace the one of the same name): its backends become valid names, its aliases
    select them, its option checks run when a plan is built and its routes join the platform defaults.

    Example:
    ```py
    >>> from diffusers_omni.attention.backends.family import BackendFamily
    >>> register_family(BackendFamily("mine", backends={"MY_ATTN": "my_package.attention:MyBackend"}))
    ```
    """
    if not isinstance(family, BackendFamily):
        raise TypeError(f"register_family: expected a BackendFamily, got {type(family).__name__}: {family!r}")
    with _lock:
        previous = _families.get(family.name)
        if previous is not None:
            _drop(family.name)
        try:
            _add(family)
        except Exception:
            if previous is not None:
                _add(previous)
            raise
        _bump()


def reset_family(name: str) -> None:
    """Restore the built-in family ``name``, or drop a family that was only registered at run time."""
    with _lock:
        if name in _families:
            _drop(name)
        if name in _BUILTIN:
            _add(_BUILTIN[name])
        _bump()


def families() -> tuple[BackendFamily, ...]:
    """The registered families, in registration order (built-in ones first)."""
    return tuple(_families.values())


def family_of(name: str) -> BackendFamily:
    """The family that declares backend ``name`` (canonical name)."""
    try:
        return _families[_owner[name]]
    except KeyError:
        raise ValueError(f"backend={name!r} is not registered; registered: {', '.join(registered_backend_names())}"
                         ) from None


def registered_backend_names() -> tuple[str, ...]:
    return tuple(name for family in _families.values() for name in family.backends)


def is_registered(name: str) -> bool:
    return name in _owner


def registry_generation() -> int:
    """A number that changes whenever a backend or family is registered or reset (for caches of resolutions)."""
    return _generation


def get_backend_class(name: str) -> "type[AttentionBackend]":
    """The backend class registered under ``name`` (imported on first use)."""
    cls = _classes.get(name)
    if cls is not None:
        return cls
    entry = family_of(name).backends[name]
    if isinstance(entry, str):
        module_name, _, attr = entry.partition(":")
        entry = getattr(importlib.import_module(module_name), attr)
    with _lock:
        return _classes.setdefault(name, entry)


def register_backend(name: str, backend: "type[AttentionBackend] | str") -> None:
    """Add or replace the backend behind ``name``.

    A name a family declares keeps that family's aliases, option checks and routes, and runs ``backend`` instead of
    its class until ``reset_backend``. A new name becomes a family of its own that reads no options; declare a
    ``BackendFamily`` and ``register_family`` it for aliases, options or routes.

    Args:
        name (`str`): the configuration name, e.g. ``"MY_ATTN"`` (upper case by convention).
        backend (`type[AttentionBackend]` or `str`): a subclass of ``AttentionBackend`` or a lazy
            ``"package.module:ClassName"`` path.
    """
    if not isinstance(name, str) or not name.strip() or name.strip().lower() == AUTO:
        raise ValueError(f"register_backend: name={name!r} must be a non-empty backend name other than 'auto'")
    from .backends.base import AttentionBackend

    if isinstance(backend, str):
        if ":" not in backend:
            raise ValueError(f"register_backend: backend={backend!r} must look like 'package.module:ClassName'")
        module_name, _, attr = backend.partition(":")
    elif not (isinstance(backend, type) and issubclass(backend, AttentionBackend)):
        raise TypeError(
            f"register_backend: backend must be an AttentionBackend subclass or a 'module:Class' path, got {backend!r}"
        )
    canonical = name.strip().upper()
    with _lock:
        if canonical in _owner:
            if isinstance(backend, str):
                backend = getattr(importlib.import_module(module_name), attr)
            _classes[canonical] = backend
        else:
            _add(BackendFamily(f"runtime:{canonical}", backends={canonical: backend}))
        _bump()


def reset_backend(name: str) -> None:
    """Restore the built-in entry for ``name`` (or drop a name that was only registered at run time)."""
    canonical = name.strip().upper()
    with _lock:
        owner = _owner.get(canonical)
        if owner is not None and owner.startswith("runtime:"):
            _drop(owner)
        else:
            _classes.pop(canonical, None)
        _bump()


# Names a user types -------------------------------------------------------------------------------------------


def diffusers_backend_names() -> tuple[DiffusersBackendName, ...]:
    """Every one of Diffusers' backend names, in ``config.names.DIFFUSERS_NAMES`` order, with the backend here that
    runs the same kernel family (a family's alias) or, when none does, the reason (``config.names.NO_EQUIVALENT``)."""
    out = []
    for name in DIFFUSERS_NAMES:
        alias = _aliases.get(name)
        if alias is not None:
            out.append(DiffusersBackendName(name, alias.backend, alias.note))
        else:
            out.append(DiffusersBackendName(name, None, NO_EQUIVALENT.get(name, "no backend here runs this kernel")))
    return tuple(out)


def diffusers_backend_name(name: str) -> DiffusersBackendName | None:
    """The table entry for one of Diffusers' backend names (case-insensitive), or ``None``."""
    folded = name.strip().lower()
    return next((entry for entry in diffusers_backend_names() if entry.diffusers == folded), None)


def check_diffusers_env_name(value: str, variable: str) -> DiffusersBackendName:
    """The table entry for the value of an environment variable Diffusers reads as a backend name
    (``DIFFUSERS_ATTN_BACKEND``), or ``ValueError`` in one line naming the variable, the value and the allowed names.

    Matched exactly, as Diffusers matches it (``config.names.check_diffusers_env_value``)."""
    check_diffusers_env_value(value, variable)
    return diffusers_backend_name(value)


def canonical_backend_name(value: Any, field_name: str = "backend") -> str:
    """The registered backend name ``value`` selects (ours in any case, or an alias such as one of Diffusers' names),
    or ``"auto"``; ``ValueError`` naming the field, the value and the valid names otherwise."""
    if not isinstance(value, str):
        raise TypeError(f"{field_name} must be a backend name (str), got {type(value).__name__}: {show(value)}")
    name = value.strip()
    if name.lower() == AUTO:
        return AUTO
    valid = registered_backend_names()
    if name.upper() in valid:
        return name.upper()
    alias = _aliases.get(name.lower())
    if alias is not None and alias.backend in valid:
        if alias.name in DIFFUSERS_NAMES:
            logger.info("%s=%r is Diffusers' name for %s (%s)", field_name, value, alias.backend, alias.note)
        else:
            logger.info("%s=%r is an alias of %s (%s)", field_name, value, alias.backend, alias.note)
        return alias.backend
    entry = diffusers_backend_name(name)
    if entry is not None:
        raise ValueError(
            f"{field_name}={value!r} is a Diffusers attention backend with no equivalent here: {entry.note}; "
            f"valid values: {', '.join(valid)}, or {AUTO!r} for the platform default"
        )
    aliases = [a.name for a in _aliases.values() if a.backend in valid]
    hint = did_you_mean(name, [*valid, AUTO, *aliases], prefix=" (did you mean ", suffix="?)")
    raise ValueError(
        f"{field_name}={value!r} is not a known attention backend{hint}; "
        f"valid values: {', '.join(valid)}, or {AUTO!r} for the platform default (Diffusers' names such as "
        "'native', '_native_cudnn', 'flash', '_flash_3', 'sage' are accepted too)"
    )


def check_spec(spec: AttentionSpec) -> AttentionSpec:
    """``spec`` with its backend name made canonical (aliases resolved), after its family checked the options it was
    given (refused when its backends do not read them, values checked when they do)."""
    name = canonical_backend_name(spec.spelling if spec.spelling is not None else spec.backend)
    if name == AUTO:
        return spec if spec.backend == AUTO else replace(spec, backend=AUTO)
    try:
        family_of(name).check_options(name, spec)
    except OptionNotAccepted as exc:
        readers = [backend for family in _families.values() if family.accepts(exc.option)
                   for backend in family.backends]
        allowed = (", ".join(readers[:-1]) + " or " + readers[-1]) if len(readers) > 1 else "".join(readers) or "none"
        raise ValueError(f"{exc.option} is not allowed with backend={name!r}; allowed only with {allowed}") from None
    return spec if spec.backend == name else replace(spec, backend=name)


def check_config(config: AttentionConfig) -> AttentionConfig:
    """``config`` with every spec checked by ``check_spec`` (the same object when nothing changes)."""
    default = check_spec(config.default) if config.default is not None else None
    per_role = {role: check_spec(spec) for role, spec in config.per_role.items()}
    if default is config.default and all(per_role[role] is config.per_role[role] for role in per_role):
        return config
    return AttentionConfig(default=default, per_role=per_role, deterministic=config.deterministic)


def __getattr__(name: str):
    # The joined table, computed when read so that families registered at run time count.
    if name == "DIFFUSERS_BACKEND_NAMES":
        return diffusers_backend_names()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "BUILTIN_FAMILIES", "DIFFUSERS_BACKEND_NAMES", "OPTION_FIELDS", "canonical_backend_name", "check_config", "check_diffusers_env_name",
    "check_spec", "diffusers_backend_name", "diffusers_backend_names", "families", "family_of", "get_backend_class",
    "is_registered", "register_backend", "register_family", "registered_backend_names", "registry_generation",
    "reset_backend", "reset_family",
]
