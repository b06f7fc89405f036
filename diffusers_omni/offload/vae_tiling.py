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

Running out of memory is not the only way a full device changes a VAE's output. cuDNN's convolutions try their
plans in order and take the next one when a plan's workspace cannot be allocated: beside resident blocks under a
memory cap, the same decode takes another algorithm, other bits and more time, and raises nothing (measured on an
H200: FLUX.1-dev on a 12 GiB card with 10 and 11 GiB budgets and auto, images that differ from the resident one
with no error and a slower decode). So where the allocator keeps statistics (CUDA), the first call of a VAE method at
each input shape makes room before it runs (the resident blocks leave; they come back when the DiT runs again) and
is measured: what the allocator reserved over the call, with its unused cache handed back first
(``budget.read_reserved``). A later call at that shape runs beside the resident blocks only where the device still
has that much room for this process and a share more (``budget.device_room``, ``budget.vae_room_margin``: cuDNN's
first choice wants more than what the call reserved), and makes room otherwise;
the VAE then always finds the room its first choice of plan had, and decodes the bits it decodes alone.
"""

from __future__ import annotations

import functools
import gc
import logging
from typing import Any, Callable

import torch

from ..config.offload import format_bytes as _format_bytes
from . import budget as machine
from .headroom import call_shape

logger = logging.getLogger("diffusers_omni")

METHODS = ("decode", "encode")


def can_tile(vae: Any) -> bool:
    """Whether ``vae`` has Diffusers' tiling switch (``enable_tiling`` / ``disable_tiling`` and ``use_tiling``)."""
    return all(callable(getattr(vae, name, None)) for name in ("enable_tiling", "disable_tiling")) and isinstance(
        getattr(vae, "use_tiling", None), bool)


def install(vae: Any, label: str, set_attribute: Callable[[Any, str, Any], None],
            on_remove: Callable[[Callable[[], None]], None],
            switched: Callable[[str], None] = lambda label: None,
            make_room: Callable[[], int] = lambda: 0, device: torch.device | None = None) -> list[str]:
    """Wrap ``vae``'s ``decode`` and ``encode`` (instance attributes through ``set_attribute``, undone by the
    caller) and register, through ``on_remove``, putting its tiling setting back; ``switched(label)`` is told when a
    retry turns tiling on; ``make_room()`` frees device memory other weights hold (the bytes freed); ``device``: where
    the VAE runs (its calls' room is measured there, see the module's docstring). The methods wrapped."""
    if not can_tile(vae):
        return []
    tiled_before = vae.use_tiling

    def restore() -> None:
        if vae.use_tiling != tiled_before:
            (vae.enable_tiling if tiled_before else vae.disable_tiling)()

    on_remove(restore)
    wrapped = []
    room = _Room(make_room, device, label)
    for name in METHODS:
        method = getattr(vae, name, None)
        if callable(method):
            set_attribute(vae, name, _retry_tiled(vae, label, name, method, switched, room))
            wrapped.append(name)
    return wrapped


class _Room:
    """``make_room`` for one VAE; whether its phase ran out of memory beside the resident blocks (then every later
    call makes room first); and what each of its calls' shapes reserved, measured with the room made."""

    def __init__(self, make_room: Callable[[], int], device: torch.device | None, label: str) -> None:
        self.make_room = make_room
        self.device = device
        self.label = label
        self.needed = False
        self.needs: dict[tuple[Any, ...], int] = {}  # (method, tiling, input shape) → bytes reserved over its call

    def before(self, key: tuple[Any, ...]) -> int | None:
        """Make room where this call may need it (see the module's docstring); the bytes reserved at its start
        where it is to be measured, else ``None``."""
        if self.needed:
            self.make_room()
            return None
        # No allocator statistics (the CPU): nothing chooses its algorithm by free memory.
        if self.device is None or machine.read_reserved(self.device) is None:
            return None
        need = self.needs.get(key)
        if need is None:
            self.make_room()
            return machine.read_reserved(self.device, empty_cache=True)
        room = machine.device_room(machine.read_machine(self.device))
        if room is None or room < need + machine.vae_room_margin(need):
            if self.make_room():
                logger.info("%s needs %s of device memory (measured); %s is left beside the resident DiT blocks, "
                            "so they leave for it", key[2].describe() if key[2] else f"{self.label}.{key[0]}",
                            _format_bytes(need), "an unknown amount" if room is None else _format_bytes(room))
        return None

    def after(self, key: tuple[Any, ...], start: int | None) -> None:
        """The call returned: keep what it reserved, if it was measured."""
        if start is None:
            return
        end = machine.read_reserved(self.device)
        if end is not None:
            self.needs[key] = max(self.needs.get(key, 0), end - start)


def _first_line(error: BaseException) -> str:
    return str(error).splitlines()[0] if str(error) else type(error).__name__


def _free_cached() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _measured(room: _Room, key: tuple[Any, ...], start: int | None, output: Any) -> Any:
    room.after(key, start)
    return output


def _retry_tiled(vae: Any, label: str, name: str, method: Callable[..., Any],
                 switched: Callable[[str], None], room: _Room) -> Callable[..., Any]:
    @functools.wraps(method)
    def call(*args: Any, **kwargs: Any) -> Any:
        key = (name, bool(vae.use_tiling), call_shape(label, args, kwargs))
        start = room.before(key)
        if vae.use_tiling:
            return _measured(room, key, start, method(*args, **kwargs))
        try:
            return _measured(room, key, start, method(*args, **kwargs))
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
