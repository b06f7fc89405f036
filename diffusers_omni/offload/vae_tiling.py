"""A VAE whose phase does not fit the device: make room, exactly, then decode (or encode) in tiles instead of failing.

Under layerwise offload the streamed DiT blocks and the encoders have left the device when the VAE's phase starts;
what stays is the VAE's weights and activations and the DiT blocks a ``max_device_memory`` budget keeps resident.
When the VAE runs out of device memory beside resident blocks, they leave the device first (``make_room``: their
host copy stays, they come back when the DiT runs again) and the same call runs again untiled: the output is the
one it would have been, and later calls make that room before the VAE runs, without failing first. Only when that
is not enough (or there is nothing to free) does the VAE tile: at a large resolution or many frames the
activations alone can exceed a small card. Diffusers' VAEs can work in tiles (``vae.enable_tiling()``); which size needs it depends on the
card, the resolution and the frame count, which the offload cannot know before the call. So the managed VAE's
``decode`` and ``encode`` are wrapped while the offload is enabled: when one runs out of device memory untiled, the
VAE switches to tiling, says so once (the output of a tiled decode can differ slightly from an untiled one), and the
same call runs again. Tiling stays on for later calls; ``disable_omni_offload()`` puts the VAE's own setting back.
A VAE already tiling, or one without ``enable_tiling``, raises the error as it came, and so does a tiled retry that
fails too (tiling is switched off again first).
"""

from __future__ import annotations

import functools
import gc
import logging
from typing import Any, Callable

import torch

from ..config.offload import format_bytes as _format_bytes

logger = logging.getLogger("diffusers_omni")

METHODS = ("decode", "encode")


def can_tile(vae: Any) -> bool:
    """Whether ``vae`` has Diffusers' tiling switch (``enable_tiling`` / ``disable_tiling`` and ``use_tiling``)."""
    return all(callable(getattr(vae, name, None)) for name in ("enable_tiling", "disable_tiling")) and isinstance(
        getattr(vae, "use_tiling", None), bool)


def install(vae: Any, label: str, set_attribute: Callable[[Any, str, Any], None],
            on_remove: Callable[[Callable[[], None]], None],
            switched: Callable[[str], None] = lambda label: None,
            make_room: Callable[[], int] = lambda: 0) -> list[str]:
    """Wrap ``vae``'s ``decode`` and ``encode`` (instance attributes through ``set_attribute``, undone by the
    caller) and register, through ``on_remove``, putting its tiling setting back; ``switched(label)`` is told when a
    retry turns tiling on; ``make_room()`` frees device memory other weights hold (the bytes freed). The methods
    wrapped."""
    if not can_tile(vae):
        return []
    tiled_before = vae.use_tiling

    def restore() -> None:
        if vae.use_tiling != tiled_before:
            (vae.enable_tiling if tiled_before else vae.disable_tiling)()

    on_remove(restore)
    wrapped = []
    room = _Room(make_room)
    for name in METHODS:
        method = getattr(vae, name, None)
        if callable(method):
            set_attribute(vae, name, _retry_tiled(vae, label, name, method, switched, room))
            wrapped.append(name)
    return wrapped


class _Room:
    """``make_room`` for one VAE, and whether its phase needed it (then later calls make room before running)."""

    def __init__(self, make_room: Callable[[], int]) -> None:
        self.make_room = make_room
        self.needed = False


def _first_line(error: BaseException) -> str:
    return str(error).splitlines()[0] if str(error) else type(error).__name__


def _free_cached() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _retry_tiled(vae: Any, label: str, name: str, method: Callable[..., Any],
                 switched: Callable[[str], None], room: _Room) -> Callable[..., Any]:
    @functools.wraps(method)
    def call(*args: Any, **kwargs: Any) -> Any:
        if room.needed:
            room.make_room()
        if vae.use_tiling:
            return method(*args, **kwargs)
        try:
            return method(*args, **kwargs)
        except torch.OutOfMemoryError as error:
            # Leave the except block before retrying, so the failed call's frames (and the activations they hold)
            # are gone from the traceback first.
            message = _first_line(error)
        _free_cached()
        freed = room.make_room()
        if freed:
            logger.warning(
                "%s.%s ran out of device memory beside the DiT blocks a max_device_memory budget keeps resident (%s); "
                "they leave the device for it (%s) and come back when the DiT runs again, from now on before every "
                "%s. The output is unchanged", label, name, message, _format_bytes(freed), name)
            room.needed = True
            try:
                return method(*args, **kwargs)
            except torch.OutOfMemoryError as error:
                message = _first_line(error)
            _free_cached()
        logger.warning(
            "%s.%s ran out of device memory untiled (%s); it runs in tiles from now on (vae.enable_tiling(): the "
            "output can differ slightly from an untiled one). disable_omni_offload() puts the VAE's setting back",
            label, name, message)
        vae.enable_tiling()
        try:
            output = method(*args, **kwargs)
        except BaseException:
            vae.disable_tiling()  # tiling did not save it: the VAE is left as it was
            raise
        switched(label)
        return output

    return call
