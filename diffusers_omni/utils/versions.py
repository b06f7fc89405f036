"""Installed versions of optional packages, read from their distribution metadata and compared as PEP 440."""

from __future__ import annotations

from importlib import metadata

from packaging.version import InvalidVersion, Version


def installed_version(*distributions: str) -> str | None:
    """The version of the first of ``distributions`` that is installed (``None`` when none is).

    Example:
    ```py
    >>> installed_version("flashinfer-python", "flashinfer")  # the wheel's name changed over releases
    ```
    """
    for name in distributions:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def omni_version() -> str:
    """diffusers-omni's own version, read from its installed metadata (``pyproject.toml`` is the one source)."""
    return installed_version("diffusers-omni") or "0+unknown"


def parse_version(text: str | None) -> Version | None:
    """``text`` as a ``packaging`` version, or ``None`` when it is missing or not a PEP 440 version."""
    if text is None:
        return None
    try:
        return Version(text)
    except InvalidVersion:
        return None


def version_at_least(found: str | None, required: str) -> bool:
    """Whether ``found`` is ``required`` or newer; a missing or unparsable ``found`` is not."""
    parsed = parse_version(found)
    return parsed is not None and parsed >= Version(required)
