"""Silence one known-harmless third-party message, only while our own imports trigger it.

Transformers 5 (``transformers.utils.import_utils``) logs "`CLIPImageProcessor` requires torchvision (not
installed); falling back to `CLIPImageProcessorPil`" once per class the first time anything reads
``transformers.CLIPImageProcessor``; Diffusers' pipeline modules import those names at module level (FLUX, Wan and
others: for IP-Adapter image encoders we never use), so every command printed three such lines. The fallback is
exactly what transformers would use, so nothing changes but the noise. Only that message is dropped, only on that
logger and only inside the ``with`` block: every other warning still shows.
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Iterator

_LOGGER = "transformers.utils.import_utils"
_FALLBACK = re.compile(r"^`\w+` requires torchvision \(not installed\); falling back to `\w+Pil`")


class _DropTorchvisionFallback(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not _FALLBACK.match(record.getMessage())


@contextlib.contextmanager
def quiet_torchvision_fallback() -> Iterator[None]:
    """Drop transformers' torchvision-fallback notice while Diffusers pipeline modules are imported.

    Example:
    ```py
    >>> with quiet_torchvision_fallback():
    ...     module = importlib.import_module("diffusers_omni.pipelines.flux")
    ```
    """
    logger = logging.getLogger(_LOGGER)
    drop = _DropTorchvisionFallback()
    logger.addFilter(drop)
    try:
        yield
    finally:
        logger.removeFilter(drop)
