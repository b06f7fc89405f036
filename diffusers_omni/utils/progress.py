"""Progress bars (tqdm) for long host-memory work."""

from __future__ import annotations

from tqdm.auto import tqdm

PROGRESS_MIN_BYTES = 2**30


def byte_progress(total: int, desc: str, show: bool | None = None) -> tqdm:
    """A progress bar counting ``total`` bytes; ``show=None`` shows it for ``PROGRESS_MIN_BYTES`` (1 GiB) or more.

    Example:
    ```py
    >>> with byte_progress(total, "layerwise offload: packing blocks", config.show_progress) as bar:
    ...     bar.update(block_bytes)
    ```
    """
    visible = show if show is not None else total >= PROGRESS_MIN_BYTES
    return tqdm(total=total, unit="B", unit_scale=True, desc=desc, disable=not visible)
