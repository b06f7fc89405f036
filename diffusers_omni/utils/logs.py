"""Our loggers follow Diffusers' verbosity: ``diffusers.utils.logging.set_verbosity_info()`` shows our INFO logs too.

Every logger of the package is ``diffusers_omni`` or below it (``diffusers_omni.attention``, ...). Its parent is
made a small bridge logger instead of the root logger:

- level: the bridge's level is the level of Diffusers' library logger (``"diffusers"``, set by
  ``diffusers.utils.logging.set_verbosity_*`` and ``DIFFUSERS_VERBOSITY``), so while no logger of ours has a level of
  its own, ours log at Diffusers' verbosity; before Diffusers configures its logger the root logger decides, as
  before.
- output: records still propagate to the root logger, so ``logging.basicConfig`` and pytest's ``caplog`` see them.
  Only when nothing would receive a record (no handler on the root logger nor on any logger of ours) does the bridge
  hand it to Diffusers' own handler (stderr), where Diffusers' messages appear.

A user who configures our logger explicitly wins: ``logging.getLogger("diffusers_omni").setLevel(...)`` is found
before the bridge in the walk up the hierarchy, and a handler of our own stops the bridge from lending Diffusers'.
"""

from __future__ import annotations

import logging

PACKAGE_LOGGER = "diffusers_omni"
DIFFUSERS_LOGGER = "diffusers"


def _diffusers_logger() -> logging.Logger | None:
    """Diffusers' library logger if it exists yet (never created here: creating it is Diffusers' business)."""
    found = logging.Logger.manager.loggerDict.get(DIFFUSERS_LOGGER)
    return found if isinstance(found, logging.Logger) else None


def _ours_have_handlers() -> bool:
    loggers = logging.Logger.manager.loggerDict
    return any(
        isinstance(logger, logging.Logger) and logger.handlers
        for name, logger in list(loggers.items())
        if name == PACKAGE_LOGGER or name.startswith(PACKAGE_LOGGER + ".")
    )


class _DiffusersBridge(logging.Logger):
    """The parent of ``diffusers_omni``: Diffusers' level, and Diffusers' handlers where none would handle a record.

    Not registered with the logging manager (``logging.getLogger`` never returns it); its parent is the root logger.
    """

    def __init__(self) -> None:
        super().__init__(f"{PACKAGE_LOGGER}<-{DIFFUSERS_LOGGER}")
        self.parent = logging.root

    @property  # type: ignore[override]
    def level(self) -> int:
        diffusers = _diffusers_logger()
        return diffusers.level if diffusers is not None else logging.NOTSET

    @level.setter
    def level(self, value: int) -> None:
        if value != logging.NOTSET:  # Logger.__init__ sets NOTSET; nothing else may set a level here
            raise AttributeError(f"the level of {self.name!r} is Diffusers' verbosity; set the level of "
                                 f"logging.getLogger({PACKAGE_LOGGER!r}) or call diffusers.utils.logging.set_verbosity")

    @property  # type: ignore[override]
    def handlers(self) -> list[logging.Handler]:
        diffusers = _diffusers_logger()
        if diffusers is None or logging.root.handlers or _ours_have_handlers():
            return []
        return list(diffusers.handlers)

    @handlers.setter
    def handlers(self, value: list[logging.Handler]) -> None:
        if value:  # Logger.__init__ sets []; the bridge owns no handler
            raise AttributeError(f"{self.name!r} lends Diffusers' handlers and takes none; add handlers to "
                                 f"logging.getLogger({PACKAGE_LOGGER!r})")


def follow_diffusers_logging() -> None:
    """Make the package logger follow Diffusers' verbosity (idempotent; the package root calls it on import)."""
    logger = logging.getLogger(PACKAGE_LOGGER)
    if not isinstance(logger.parent, _DiffusersBridge):
        logger.parent = _DiffusersBridge()
