"""What a kernel family declares, in one value: ``BackendFamily``.

Each family lives in its own package, ``attention/backends/<family>/``. Its ``__init__.py`` holds the descriptor
(``FAMILY``), which names everything the rest of the package needs to know about it:

- ``backends``: its backend names and their classes, as lazy ``"package.module:ClassName"`` paths (or classes);
- ``aliases``: other names that select one of them (Diffusers' names, such as ``"_flash_3"``), each with a note;
- ``options``: the spec options it reads (``quant``, ``skip_softmax``, ``block_sparse``) and the check of their
  values; an option a family does not list is refused with its backends;
- ``routes``: where one of its backends is a platform default, in which place, and under which conditions;
- ``conditions``: the route conditions only this family knows how to test (named, so routes read like the docs).

``attention.registry`` lists the built-in families once and answers every question from them; nothing is pushed
into another module when a package is imported. The descriptor imports neither torch nor a kernel package, so the
registry can read names, aliases and option rules without loading any backend.
"""

from __future__ import annotations

import importlib
import re
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Callable, Mapping

from ...config._values import show
from ...config.attention import OPTION_FIELDS

if TYPE_CHECKING:
    from ..platform import Platform
    from .base import AttentionBackend, AttentionCall

# ``(backend name, option value) -> None``; raises ``ValueError`` naming the field, the value and what is allowed.
OptionCheck = Callable[[str, Any], None]
Condition = Callable[["Platform", "AttentionCall"], bool]

_NAME = re.compile(r"^[A-Z][A-Z0-9_]*$")


@dataclass(frozen=True)
class Route:
    """One candidate in a platform's default list, taken only when every named condition holds.

    Args:
        backend (`str`): the backend this route selects.
        when (`tuple[str, ...]`): names of conditions (``routing.ROUTE_CONDITIONS``) that must all hold.
        why (`str`): one line for ``explain`` and the docs.
        platforms (`tuple[str, ...]`): the platform families (``Platform.family``) whose list holds this route.
        priority (`int`, defaults to 50): its place in those lists, lowest first (``TORCH_SDPA``, the last resort
            everywhere, has 100).
    """

    backend: str
    when: tuple[str, ...] = ()
    why: str = ""
    platforms: tuple[str, ...] = ()
    priority: int = 50


@dataclass(frozen=True)
class Alias:
    """Another name for one of a family's backends (one of Diffusers' names, for instance), and how they differ."""

    name: str
    backend: str
    note: str


@dataclass(frozen=True)
class BackendFamily:
    """One kernel family: its backends, aliases, option checks and routes (see the module docstring).

    Example:
    ```py
    >>> FAMILY = BackendFamily(
    ...     "my_kernels",
    ...     backends={"MY_ATTN": "my_package.attention:MyBackend"},
    ...     aliases=(Alias("mine", "MY_ATTN", "the same kernel"),),
    ...     options={"quant": check_my_quant},
    ... )
    >>> register_family(FAMILY)  # diffusers_omni.attention.registry
    ```
    """

    name: str
    backends: Mapping[str, "str | type[AttentionBackend]"]
    aliases: tuple[Alias, ...] = ()
    options: Mapping[str, OptionCheck | None] = field(default_factory=dict)
    routes: tuple[Route, ...] = ()
    conditions: Mapping[str, Condition] = field(default_factory=dict)

    def __post_init__(self) -> None:
        where = f"BackendFamily({self.name!r})"
        if not isinstance(self.name, str) or not self.name.strip():
            raise ValueError(f"BackendFamily.name={self.name!r} must be a non-empty str")
        if not isinstance(self.backends, Mapping) or not self.backends:
            raise ValueError(f"{where}.backends must name at least one backend, got {self.backends!r}")
        for name, entry in self.backends.items():
            if not isinstance(name, str) or not _NAME.match(name):
                raise ValueError(f"{where}.backends: name {name!r} must be upper case (letters, digits, '_'), "
                                 "e.g. 'MY_ATTN'")
            if name == "AUTO":
                raise ValueError(f"{where}.backends: 'AUTO' is reserved for the platform default")
            if isinstance(entry, str) and ":" not in entry:
                raise ValueError(f"{where}.backends[{name!r}]={entry!r} must look like 'package.module:ClassName'")
            if not isinstance(entry, (str, type)):
                raise TypeError(f"{where}.backends[{name!r}] must be an AttentionBackend subclass or a "
                                f"'module:Class' path, got {entry!r}")
        object.__setattr__(self, "backends", MappingProxyType(dict(self.backends)))
        aliases = tuple(self.aliases)
        for alias in aliases:
            if not isinstance(alias, Alias):
                raise TypeError(f"{where}.aliases must hold Alias values, got {alias!r}")
            if alias.backend not in self.backends:
                raise ValueError(f"{where}: alias {alias.name!r} names {alias.backend!r}, which is not one of its "
                                 f"backends {list(self.backends)}")
            if alias.name.strip().upper() in self.backends or alias.name.strip().lower() == "auto":
                raise ValueError(f"{where}: alias {alias.name!r} would shadow a backend name")
        object.__setattr__(self, "aliases", aliases)
        unknown = [key for key in self.options if key not in OPTION_FIELDS]
        if unknown:
            raise ValueError(f"{where}.options has unknown option(s) {unknown}; allowed: {list(OPTION_FIELDS)}")
        object.__setattr__(self, "options", MappingProxyType(dict(self.options)))
        routes = tuple(self.routes)
        for route in routes:
            if route.backend not in self.backends:
                raise ValueError(f"{where}: a route names {route.backend!r}, which is not one of its backends "
                                 f"{list(self.backends)}")
            if not route.platforms:
                raise ValueError(f"{where}: the route to {route.backend} names no platform family")
        object.__setattr__(self, "routes", routes)
        object.__setattr__(self, "conditions", MappingProxyType(dict(self.conditions)))

    def accepts(self, option: str) -> bool:
        """Whether this family's backends read ``option`` (``quant``, ``skip_softmax``, ``block_sparse``)."""
        return option in self.options

    def check_options(self, backend: str, spec: Any) -> None:
        """Refuse the options of ``spec`` that ``backend`` does not read, and check the values of those it does."""
        for option in OPTION_FIELDS:
            value = getattr(spec, option, None)
            if value is None:
                continue
            if option not in self.options:
                raise OptionNotAccepted(option, backend)
            check = self.options[option]
            if check is not None:
                check(backend, value)


class OptionNotAccepted(ValueError):
    """An option given with a backend that does not read it (the registry completes the message)."""

    def __init__(self, option: str, backend: str) -> None:
        super().__init__(option, backend)
        self.option = option
        self.backend = backend


def choice(owner: str, name: str, value: Any, allowed: tuple, context: str = "") -> None:
    """``ValueError`` naming ``owner.name``, the value and the allowed values, unless ``value`` is one of them."""
    if value not in allowed:
        suffix = f" {context}" if context else ""
        raise ValueError(
            f"{owner}.{name}={show(value)} is not allowed{suffix}; allowed: {', '.join(map(repr, allowed))}"
        )


def backend_module_getattr(package: str, module: str = "backend"):
    """A module ``__getattr__`` for a family package: public names of its backend module load it on first use, so
    ``from diffusers_omni.attention.backends.flash import FlashAttentionBackend`` works while importing the package
    itself (the descriptor) loads neither torch nor a kernel."""

    def __getattr__(name: str):
        if name.startswith("_"):
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(f"{package}.{module}"), name)

    return __getattr__
