"""One journal for every reversible change the package makes: attention installs, offload enables, guards.

A :class:`Journal` records how to undo each change as it is made; :meth:`Journal.rollback` undoes them newest first
and keeps undoing when one undo fails (each failure is logged). Three kinds of record cover what the package changes:

- ``record(what, undo)``: any change, with the callable that reverts it;
- ``snapshot(module)``: an object's ``__dict__`` as it was before its first change (attributes, ``_modules``, hook
  dicts), restored exactly: containers keep their identity, which hook handles rely on;
- ``set(obj, name, value)``: one instance attribute, put back (or removed) on rollback.

Example:
```py
>>> journal = Journal()
>>> journal.set(module, "processor", new_processor)
>>> journal.rollback()  # module.processor is what it was (or absent again)
```
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable
from typing import Any

logger = logging.getLogger("diffusers_omni")

_MISSING = object()
# Exact types only: subclasses such as Diffusers' FrozenDict (a model's config) refuse clear()/update() and are
# replaced, never mutated, by anything the package does.
_CONTAINERS = (dict, collections.OrderedDict, set, list)


class Journal:
    """Undo records, run newest first by :meth:`rollback`.

    Args:
        label (`str`, defaults to ``"journal"``): names the journal in the log when an undo fails.
    """

    def __init__(self, label: str = "journal") -> None:
        self.label = label
        self._undo: list[tuple[str, Callable[[], None]]] = []
        self._snapshots: set[int] = set()

    def record(self, what: str, undo: Callable[[], None]) -> None:
        """Remember ``undo``, which reverts the change described by ``what``."""
        self._undo.append((what, undo))

    def set(self, obj: Any, name: str, value: Any) -> None:
        """Set instance attribute ``name`` of ``obj`` to ``value`` (in its ``__dict__``); rollback restores it."""
        before = obj.__dict__.get(name, _MISSING)
        obj.__dict__[name] = value

        def undo() -> None:
            if before is _MISSING:
                obj.__dict__.pop(name, None)
            else:
                obj.__dict__[name] = before

        self.record(f"set {type(obj).__name__}.{name}", undo)

    def snapshot(self, obj: Any) -> None:
        """Record ``obj.__dict__`` as it is now, once per object: rollback restores the dict, and one level of the
        containers in it (dicts, sets, lists), in place."""
        if id(obj) in self._snapshots:
            return
        self._snapshots.add(id(obj))
        attrs = dict(obj.__dict__)
        contents = {key: _copy(value) for key, value in attrs.items() if type(value) in _CONTAINERS}

        def undo() -> None:
            for key, saved in contents.items():
                container = attrs[key]
                container.clear()
                if isinstance(container, list):
                    container.extend(saved)
                else:
                    container.update(saved)
            obj.__dict__.clear()
            obj.__dict__.update(attrs)
            self._snapshots.discard(id(obj))

        self.record(f"restore {type(obj).__name__}", undo)

    def move_tensor(self, tensor: Any, device: Any) -> None:
        """Rebind ``tensor`` to a copy on ``device``; rollback rebinds the original data."""
        if tensor.device == device:
            return
        original = tensor.data
        tensor.data = original.to(device)

        def undo() -> None:
            tensor.data = original

        self.record("move tensor", undo)

    def rollback(self) -> None:
        """Undo every record, newest first; a failing undo is logged and the rest still run."""
        while self._undo:
            what, undo = self._undo.pop()
            try:
                undo()
            except Exception:  # noqa: BLE001 - keep undoing the rest, report each failure
                logger.exception("%s: rollback step %r failed", self.label, what)
        self._snapshots.clear()

    def commit(self) -> None:
        """Forget every record: the changes stay."""
        self._undo.clear()
        self._snapshots.clear()

    def __len__(self) -> int:
        return len(self._undo)


def _copy(container):
    return list(container) if isinstance(container, list) else type(container).copy(container)
