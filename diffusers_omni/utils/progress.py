"""Progress bars (tqdm) for long host-memory work."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from tqdm.auto import tqdm

PROGRESS_MIN_BYTES = 2**30

# tqdm arguments a bar of ours sets itself; the rest of a pipeline's ``set_progress_bar_config`` (``leave``,
# ``file``, ``position``, ``ncols``, ``mininterval``, ...) is passed through. Its ``desc`` names the denoising loop,
# so ours keeps its own.
_OWN_KWARGS = frozenset({"total", "desc", "disable", "unit", "unit_scale", "unit_divisor", "initial", "iterable"})


def pipeline_progress_config(target: Any) -> dict[str, Any]:
    """The kwargs a Diffusers pipeline passes to its own bars (``pipe.set_progress_bar_config(...)``, kept in
    ``pipe._progress_bar_config``); ``{}`` for a bare model or a pipeline that never set them."""
    config = getattr(target, "_progress_bar_config", None)
    return dict(config) if isinstance(config, dict) else {}


def byte_progress(total: int, desc: str, show: bool | None = None, target: Any = None) -> tqdm:
    """A progress bar counting ``total`` bytes.

    The bar shows when all of these hold:

    - ``show`` is ``True``, or ``show`` is ``None`` and ``total`` is at least ``PROGRESS_MIN_BYTES`` (1 GiB);
    - ``target``'s progress-bar config (a Diffusers pipeline's ``set_progress_bar_config``) does not say
      ``disable=True``: a pipeline silenced that way stays silent, whatever ``show`` says;
    - this process is rank 0 of ``torch.distributed`` (or no process group is initialised).

    The pipeline's other tqdm settings (``leave``, ``file``, ``position``, ...) apply to the bar too; ``desc`` and
    the counting arguments stay ours.

    Args:
        total (`int`): bytes the operation will process.
        desc (`str`): what the bar measures, e.g. ``"layerwise offload: packing blocks"``.
        show (`bool`, *optional*): the offload config's ``show_progress``; ``None`` decides by size.
        target (`Any`, *optional*): the pipeline (or bare model) being worked on.

    Example:
    ```py
    >>> with byte_progress(total, "layerwise offload: packing blocks", config.show_progress, pipe) as bar:
    ...     bar.update(block_bytes)
    ```
    """
    kwargs = pipeline_progress_config(target)
    visible = show if show is not None else total >= PROGRESS_MIN_BYTES
    if kwargs.get("disable") is True:
        visible = False
    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        visible = False
    extra = {k: v for k, v in kwargs.items() if k not in _OWN_KWARGS}
    return tqdm(total=total, unit="B", unit_scale=True, desc=desc, disable=not visible, **extra)
