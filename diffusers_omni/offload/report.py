"""Where a pipeline's weights are: per component, bytes on the device, in pinned or pageable host memory, on disk.

``offload_report(pipe, backend, peak)`` reads the enabled backend's own records (its packed host copies, which blocks
are resident, which are in flight, which component is onloaded) and the components' tensors; it changes nothing.
Every weight (parameter or buffer, a quantized one counted by the bytes it stores) is counted once in
``weight_bytes``. ``device`` is the memory of the device the offload computes on (with ``device="cpu"``, the
testing mode, that is host memory too; without offload, any accelerator). A weight with two copies (a resident block keeps its host copy; a streamed block in flight has a
device copy beside its host one) counts in both places, so ``device + pinned + pageable + disk`` is at least
``weight_bytes`` and equal to it when every weight has exactly one copy. Under distributed layerwise offload with
AllGather, host bytes are this rank's shards (the other ranks hold the rest). Under layerwise offload with
``max_host_memory``, blocks with no host copy count under ``disk`` (their checkpoint files), and the staging ring
they are read through is a note (it holds no weight of its own).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn as nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from ..config.offload import format_bytes
from ..utils.text import table
from .codec import kernel_name as codec_kernel_name
from .dfloat11 import kernel_name as dfloat11_kernel_name
from .discovery import DIT, ENCODER, RESIDENT, VAE, discover_components

# Locations a weight's bytes can be in (``disk``: no host copy, read from the checkpoint files at each use).
LOCATIONS = ("device", "pinned", "pageable", "disk")

# How a component's weights reach the device under the offload.
RESIDENT_PLACEMENT = "resident"  # where they are, not moved per call
STREAMED = "streamed"  # block by block (layerwise), some blocks may stay resident under a budget
SWAPPED = "swapped"  # the whole component onloaded while it runs (model-level)


@dataclass
class ComponentPlacement:
    """One component: ``bytes`` per location (``LOCATIONS``), ``placement`` (``resident``, ``streamed`` or
    ``swapped``), blocks streamed / resident for a streamed one, and where it computes."""

    component: str
    kind: str  # transformer, text encoder, image encoder, VAE, resident, other
    module_class: str
    weight_bytes: int
    bytes: dict[str, int]
    placement: str
    device: str
    streamed_blocks: int = 0
    resident_blocks: int = 0

    @property
    def device_bytes(self) -> int:
        return self.bytes["device"]

    @property
    def pinned_bytes(self) -> int:
        return self.bytes["pinned"]

    @property
    def pageable_bytes(self) -> int:
        return self.bytes["pageable"]

    @property
    def disk_bytes(self) -> int:
        return self.bytes["disk"]

    @property
    def host_bytes(self) -> int:
        return self.bytes["pinned"] + self.bytes["pageable"]


@dataclass
class OffloadReport:
    """Per component, where its weights live; and the peak device memory of the last pipeline call.

    ``peak_device_bytes`` is ``torch.cuda.max_memory_allocated`` over the last call (the call resets the counter
    when it starts), ``None`` when the pipeline computes elsewhere (CPU: PyTorch records no peak there) or has not
    been called; ``peak_note`` says which. ``str(report)`` is a table.
    """

    pipeline: str
    strategy: str  # "none", "layerwise", "model_level", "distributed_layerwise"
    device: str
    host_memory_mode: str | None  # "registered", "pinned", "pageable"; None without offload
    components: list[ComponentPlacement] = field(default_factory=list)
    peak_device_bytes: int | None = None
    peak_note: str = ""
    notes: list[str] = field(default_factory=list)

    def __getitem__(self, component: str) -> ComponentPlacement:
        for entry in self.components:
            if entry.component == component:
                return entry
        raise KeyError(f"{component!r} is not a component of this report; allowed: "
                       f"{[entry.component for entry in self.components]}")

    def totals(self) -> dict[str, int]:
        """Bytes per location over every component, and ``weight_bytes``."""
        total = {location: sum(c.bytes[location] for c in self.components) for location in LOCATIONS}
        total["weight_bytes"] = sum(c.weight_bytes for c in self.components)
        return total

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "totals": self.totals()}

    def __str__(self) -> str:
        rows = []
        for c in self.components:
            placement = c.placement
            if c.placement == STREAMED:
                placement = f"streamed ({c.streamed_blocks} blocks" + (
                    f", {c.resident_blocks} resident)" if c.resident_blocks else ")")
            rows.append({"component": c.component, "kind": c.kind, "placement": placement, "computes on": c.device,
                         "weights": format_bytes(c.weight_bytes),
                         **{location: _cell(c.bytes[location]) for location in LOCATIONS}})
        totals = self.totals()
        rows.append({"component": "total", "weights": format_bytes(totals["weight_bytes"]),
                     **{location: _cell(totals[location]) for location in LOCATIONS}})
        columns = ["component", "kind", "placement", "computes on", "weights", *LOCATIONS]
        mode = f", host copies {self.host_memory_mode}" if self.host_memory_mode else ""
        lines = [f"{self.pipeline}: offload {self.strategy} on {self.device}{mode}",
                 table(rows, columns, width=None).rstrip("\n")]
        if self.peak_device_bytes is not None:
            lines.append(f"peak device memory of the last call: {format_bytes(self.peak_device_bytes)} "
                         f"({self.peak_note})")
        else:
            lines.append(f"peak device memory of the last call: unknown ({self.peak_note})")
        lines.extend(self.notes)
        return "\n".join(lines)

    __repr__ = __str__



_CODED_STORES = (
    ("lossless", "held coded in host memory",
     "bfloat16 exponents as 1- to 4-bit codes with escapes (offload.codec)", codec_kernel_name),
    ("disk (lossless)", "read coded from compression_cache_dir at each load",
     "bfloat16 exponents as 1- to 4-bit codes with escapes (offload.codec)", codec_kernel_name),
    ("disk (DFloat11)", "read coded from the DFloat11 checkpoint they were loaded from at each load",
     "DFloat11's Huffman code of the bfloat16 exponents, per unit (its checkpoint's own)", dfloat11_kernel_name),
)


def _lossless_notes(stats: Any, backend: Any) -> list[str]:
    """What streams coded (compression="lossless", or a DFloat11 checkpoint's blocks read from it): bytes in host
    memory or read from disk against their bf16 size, per component, the code widths, what passed through, the
    decoder that runs on the execution device, and what the cache folder served."""
    device = getattr(backend, "execution_device", None) or torch.device("cpu")
    notes = []
    for store, where, codec, kernel_name in _CODED_STORES:
        if store not in stats.store_bytes:
            continue
        counts = stats.store_counters.get(store, {})
        coded = sum(c.get("coded bytes", 0) + c.get("passed bytes", 0) for c in counts.values())
        logical = stats.store_bytes[store]
        notes.append(f"{store}: {stats.store_blocks[store]} streamed blocks {where}, {format_bytes(coded)} for "
                     f"{format_bytes(logical)} ({coded / max(logical, 1):.3f}); codec: {codec}, decoded on {device} "
                     f"by {kernel_name(device)}")
        for component, counts in counts.items():
            widths = "".join(f"; {counts[key]} {key}" for key in sorted(counts)
                             if key.endswith("-bit buffers") or key == "DFloat11 units")
            escapes = f"; {counts['escapes']:,} escapes" if "escapes" in counts else ""
            ratio = counts.get("coded bytes", 0) / max(counts.get("logical bytes", 0), 1)
            notes.append(f"{store} {component}: bfloat16 {format_bytes(counts.get('logical bytes', 0))} → "
                         f"{format_bytes(counts.get('coded bytes', 0))} ({ratio:.3f}{widths}{escapes}); other "
                         f"tensors passed through as they are: {format_bytes(counts.get('passed bytes', 0))}")
    if getattr(stats, "code_buffers", 0):
        notes.append(f"lossless: the code moves to {device} through {stats.code_buffers} buffers of "
                     f"{format_bytes(stats.code_buffer_bytes // stats.code_buffers)} (the largest code), "
                     f"{format_bytes(stats.code_buffer_bytes)} made on the first load and reused in turn (not in the "
                     "columns above)")
    cache = getattr(stats, "cache_counters", None)
    if cache:
        notes.append(f"compression_cache_dir {stats.cache_dir}: this enable read {cache['cache blocks read']} blocks' "
                     f"code ({format_bytes(cache['cache bytes read'])}) and wrote {cache['cache blocks written']} "
                     f"({format_bytes(cache['cache bytes written'])}; {cache['cache files replaced']} files "
                     "replaced: weights changed or files damaged)")
        seconds = getattr(stats, "cache_seconds", None) or {}
        if any(seconds.values()):
            notes.append("compression_cache_dir: the enable's time on it: " + ", ".join(
                f"{what} {value:.1f} s" for what, value in seconds.items() if value) +
                " (hashing and writing run beside the coding)")
    return notes


def _cell(nbytes: int) -> str:
    return format_bytes(nbytes) if nbytes else "-"


@dataclass
class _Unit:
    """Weights an offload packed as one unit (a block, a DiT's last block with its output layers, a component):
    the tensor objects it covers, each leaf's bytes, its host copy's bytes per leaf and their kind, whether a device
    copy exists now, and whether it streams."""

    ids: set[int]
    leaf_bytes: int
    host_bytes: int
    host_kind: str | None  # "pinned", "pageable", "disk" (read from its checkpoint at each use) or None (no copy)
    on_device: bool
    mode: str  # STREAMED, SWAPPED or RESIDENT_PLACEMENT
    block: bool  # a block of a streamed stack (counted in streamed/resident blocks)
    kept_bytes: int = 0  # a disk-backed block's tensors that are in no file as the model holds them: pageable


def _host_kind(mode: str | None) -> str:
    return "pinned" if mode in ("registered", "pinned") else "pageable"


def _leaf_bytes(weights: Any) -> int:
    return sum(slot.numel * slot.dtype.itemsize for slot in weights.slots)


def _layerwise_units(state: Any) -> list[_Unit]:
    mode = state.host_memory.mode if state.host_memory is not None else None
    units = []
    for weights_row, resident_row, streamed_row in zip(state.weights, state.resident, state.streamed):
        for weights, resident, entry in zip(weights_row, resident_row, streamed_row):
            if weights.empty:
                continue
            nbytes = _leaf_bytes(weights)
            if entry is not None:  # streamed: what its store holds (a host copy, its checkpoint, this rank's
                store = entry.store  # shard under AllGather), and a device copy while in flight
                source = getattr(store, "source", None)  # a file-backed store's checkpoint pieces
                if not store.in_host_memory:
                    kind = "disk"
                else:  # the pinned and shard stores' memory is the offload's; another store's is ordinary host memory
                    kind = _host_kind(mode) if store.uses_offload_host_memory else "pageable"
                kept = source.kept_bytes if source is not None else 0
                units.append(_Unit(weights.tensors.ids, nbytes, store.held_leaf_bytes() - kept, kind,
                                   entry.slot is not None, STREAMED, True, kept))
            else:  # resident: on the device, with its host copy when it was packed (AllGather moves residents)
                packed = bool(weights.host)
                units.append(_Unit(weights.tensors.ids, nbytes, nbytes if packed else 0,
                                   _host_kind(mode) if packed else None, True, RESIDENT_PLACEMENT, resident))
    for unit in getattr(state, "units", ()):  # encoders' non-block weights and VAEs: on the device for their phase
        weights = unit.weights
        nbytes = _leaf_bytes(weights)
        units.append(_Unit(weights.tensors.ids, nbytes, nbytes, _host_kind(mode), unit.onloaded,
                           RESIDENT_PLACEMENT if unit.resident else SWAPPED, False))
    return units


def _model_level_units(state: Any) -> list[_Unit]:
    mode = state.host_memory.mode if state.host_memory is not None else None
    units = []
    for exclusive in state.exclusives:
        weights = exclusive.weights
        nbytes = _leaf_bytes(weights)
        units.append(_Unit(weights.tensors.ids, nbytes, nbytes, _host_kind(mode), exclusive.onloaded, SWAPPED,
                           False))
    return units


def _units(backend: Any) -> list[_Unit]:
    state = getattr(backend, "_state", None) if backend is not None else None
    if state is None:
        return []
    if hasattr(state, "exclusives"):
        return _model_level_units(state)
    if hasattr(state, "streamed"):
        return _layerwise_units(state)
    raise TypeError(f"offload report: {type(backend).__name__} keeps its weights in a way this report does not read; "
                    "allowed: the layerwise, model-level and distributed layerwise backends")


def _own_tensors(module: nn.Module) -> dict[int, torch.Tensor]:
    found: dict[int, torch.Tensor] = {}
    for _, tensor in list(module.named_parameters()) + list(module.named_buffers()):
        if tensor is not None:
            found.setdefault(id(tensor), tensor)
    return found


def _inner(tensor: torch.Tensor) -> list[torch.Tensor]:
    if is_traceable_wrapper_subclass(tensor):
        names, _ = tensor.__tensor_flatten__()
        return [leaf for name in names for leaf in _inner(getattr(tensor, name))]
    return [tensor]


def _where(tensor: torch.Tensor, device: torch.device | None) -> str:
    """The location of a weight that holds its own bytes; ``device``: where the offload computes, if any."""
    if tensor.device.type == "meta":
        return "meta"
    if tensor.device.type != "cpu" or tensor.device == device:
        return "device"
    try:
        pinned = tensor.is_pinned()
    except (RuntimeError, TypeError):  # a build or subclass that cannot tell
        pinned = False
    return "pinned" if pinned else "pageable"


def _kind(role: str, path: str, module: nn.Module) -> str:
    if role == DIT:
        return "transformer"
    if role == ENCODER:
        image = "image" in path or "Vision" in type(module).__name__ or "Image" in type(module).__name__
        return "image encoder" if image else "text encoder"
    if role == VAE:
        return "VAE"
    if role == RESIDENT:
        return "resident"
    return "other"


def offload_report(pipe: Any, backend: Any, peak: dict[str, Any] | None) -> OffloadReport:
    """The report for ``pipe`` (a pipeline) under ``backend`` (enabled, or ``None``); ``peak`` is what the last call
    recorded: ``{"device": str, "bytes": int | None, "note": str}`` (``None``: no call yet)."""
    plan = backend.config.plan if backend is not None else None
    topology = discover_components(pipe, plan)
    components = [(c.path, c.role, c.module) for c in topology.components]
    known = {id(module) for _, _, module in components}
    for name, module in sorted(getattr(pipe, "components", {}).items()):
        if isinstance(module, nn.Module) and id(module) not in known:
            components.append((name, "other", module))
            known.add(id(module))
    units = _units(backend)
    unit_of = {tensor_id: unit for unit in units for tensor_id in unit.ids}
    # Each weight belongs to its most specific component (a declared resident inside a DiT is its own row).
    seen: set[int] = set()
    tensors_of: dict[str, dict[int, torch.Tensor]] = {}
    for path, _, module in sorted(components, key=lambda c: -c[0].count(".") - (c[0] != "")):
        tensors_of[path] = {i: t for i, t in _own_tensors(module).items() if i not in seen}
        seen |= set(tensors_of[path])
    strategy = str(backend.strategy) if backend is not None else "none"
    entries = []
    for path, role, module in components:
        counts = dict.fromkeys(LOCATIONS, 0)
        weight_bytes = 0
        modes: set[str] = set()
        streamed_blocks = resident_blocks = 0
        done_units: set[int] = set()
        devices: set[str] = set()
        for tensor_id, tensor in tensors_of[path].items():
            unit = unit_of.get(tensor_id)
            if unit is None:
                nbytes = sum(t.numel() * t.element_size() for t in _inner(tensor))
                where = _where(tensor, backend.device if backend is not None else None)
                counts[where] = counts.get(where, 0) + nbytes
                weight_bytes += nbytes
                modes.add(RESIDENT_PLACEMENT)
                devices.add(str(tensor.device))
                continue
            if id(unit) in done_units:
                continue
            done_units.add(id(unit))
            weight_bytes += unit.leaf_bytes
            modes.add(unit.mode)
            if unit.host_kind is not None:
                counts[unit.host_kind] += unit.host_bytes
            counts["pageable"] += unit.kept_bytes
            if unit.on_device:
                counts["device"] += unit.leaf_bytes
            if unit.block:
                if unit.mode == STREAMED:
                    streamed_blocks += 1
                else:
                    resident_blocks += 1
        if STREAMED in modes:
            placement = STREAMED
        elif SWAPPED in modes:
            placement = SWAPPED
        else:
            placement = RESIDENT_PLACEMENT
        if backend is not None and (placement != RESIDENT_PLACEMENT or role != "other"):
            computes_on = str(backend.execution_device)
        else:
            computes_on = ", ".join(sorted(devices)) or "-"
        entries.append(ComponentPlacement(path, _kind(role, path, module), type(module).__name__, weight_bytes,
                                          counts, placement, computes_on, streamed_blocks, resident_blocks))
    notes = []
    if any(entry.bytes.get("meta") for entry in entries):
        notes.append("meta: weights that hold no data (never materialised)")
    if backend is not None and getattr(backend, "use_allgather", False):  # AllGather keeps 1/N per rank
        rank, world = getattr(backend, "rank", 0), getattr(backend, "world_size", 1)
        notes.append(f"host bytes of streamed blocks are this rank's 1/{world} shards (rank {rank}); the other ranks "
                     "hold the rest")
    stats = getattr(getattr(backend, "_state", None), "stats", None)
    if getattr(stats, "staging_bytes", 0):
        mode = getattr(getattr(backend._state, "host_memory", None), "mode", None)
        blocks = getattr(stats, "store_blocks", {})
        coded, dfloat11 = blocks.get("disk (lossless)", 0), blocks.get("disk (DFloat11)", 0)
        sources = [(coded, "compression_cache_dir, coded"), (dfloat11, "the DFloat11 checkpoint, coded"),
                   (stats.disk_blocks - coded - dfloat11, "their checkpoint files")]
        present = [(count, label) for count, label in sources if count]
        where = present[0][1] if len(present) == 1 else "; ".join(f"{count} from {label}" for count, label in present)
        notes.append(f"disk: {stats.disk_blocks} streamed blocks have no host copy and are read from {where} at each "
                     f"load ({format_bytes(stats.disk_bytes_per_pass)} per pass), through a staging ring of "
                     f"{format_bytes(stats.staging_bytes)} of {_host_kind(mode)} host memory (not in the columns "
                     "above: it holds no weight of its own)")
    if getattr(stats, "shared_buffers", 0):
        mode = getattr(getattr(backend._state, "host_memory", None), "mode", None)
        notes.append(f"shared: {stats.shared_blocks} blocks of the alternating DiTs share {stats.shared_buffers} "
                     f"buffers ({format_bytes(stats.shared_bytes)} of {_host_kind(mode)} host memory, not in the "
                     "columns above); a block is read from its checkpoint when its DiT runs after the other")
    for chosen in getattr(stats, "auto", ()):
        notes.append(f"auto: {chosen}")
    if getattr(stats, "auto_readings", None):
        notes.append("auto read: " + ", ".join(f"{k} {v}" for k, v in stats.auto_readings.items()))
    measured = getattr(stats, "headroom", None)
    if measured:
        notes.append("auto headroom, measured per call shape (beside the resident weights, planned within "
                     f"{format_bytes(stats.headroom_ceiling)}): "
                     + ", ".join(f"{shape} {format_bytes(nbytes)}" for shape, nbytes in measured.items()))
    if getattr(stats, "headroom_kept", 0) or getattr(stats, "headroom_streamed", 0):
        notes.append(f"auto headroom: {stats.headroom_kept} streamed DiT blocks "
                     f"({format_bytes(stats.headroom_kept_bytes)}) kept on the device where a shape left room, "
                     f"{stats.headroom_streamed} resident ones "
                     f"({format_bytes(stats.headroom_streamed_bytes)}) streamed before a shape that needed theirs "
                     "(exact: the output is unchanged)")
    store_bytes = getattr(stats, "store_bytes", None)
    if store_bytes and set(store_bytes) != {"pinned"}:
        held = getattr(stats, "store_host_bytes", {})
        notes.append("streamed blocks by store: " + ", ".join(
            f"{name} {stats.store_blocks[name]} blocks ({format_bytes(nbytes)}, {format_bytes(held.get(name, 0))} "
            f"in host memory)" for name, nbytes in store_bytes.items()))
    if {store for store, *_ in _CODED_STORES} & set(store_bytes or {}):
        notes.extend(_lossless_notes(stats, backend))
    if getattr(stats, "residents_left", 0):
        notes.append(f"resident DiT blocks left the device {stats.residents_left} times "
                     f"({format_bytes(stats.residents_left_bytes)}) to make room for a VAE that ran out of memory "
                     "beside them; they come back when the DiT runs (exact: the output is unchanged)")
    if getattr(stats, "residents_shrunk", 0):
        notes.append(f"{stats.residents_shrunk} resident DiT blocks ({format_bytes(stats.residents_shrunk_bytes)}) "
                     "stream since a denoising step ran out of device memory beside them; the step ran again with "
                     "the smaller resident set (exact: the output is unchanged)")
    if getattr(stats, "window_shrunk", 0):
        notes.append("the streaming window holds only the running block since a denoising step ran out of device "
                     "memory with nothing resident to stream; the step ran again (exact: the output is unchanged), "
                     "steps are slower since (no prefetch)")
    for label in dict.fromkeys(getattr(stats, "tiled_vaes", ())):
        notes.append(f"{label}: ran out of device memory untiled; it decodes and encodes in tiles now "
                     "(vae.enable_tiling(); disable_omni_offload() puts its own setting back)")
    if peak is None:
        peak_bytes, peak_note = None, "the pipeline has not been called"
    else:
        peak_bytes, peak_note = peak.get("bytes"), peak.get("note", "")
    device = str(backend.execution_device) if backend is not None else (peak or {}).get("device") or \
        ", ".join(sorted({e.device for e in entries if e.device != "-"})) or "-"
    return OffloadReport(
        pipeline=type(pipe).__name__,
        strategy=strategy,
        device=device,
        host_memory_mode=getattr(getattr(getattr(backend, "_state", None), "host_memory", None), "mode", None),
        components=entries,
        peak_device_bytes=peak_bytes,
        peak_note=peak_note,
        notes=notes,
    )


def call_peak_start(device: torch.device) -> bool:
    """Reset the peak counter of ``device`` before a pipeline call; whether a peak will be recorded."""
    if device.type != "cuda":
        return False
    torch.cuda.reset_peak_memory_stats(device)
    return True


def call_peak_end(device: torch.device, tracked: bool, completed: bool) -> dict[str, Any]:
    """What a pipeline call that ran on ``device`` records (see ``offload_report``'s ``peak``)."""
    ending = "" if completed else "; the call raised"
    if not tracked:
        return {"device": str(device), "bytes": None,
                "note": f"the pipeline computes on {device}: PyTorch records a peak only for CUDA memory{ending}"}
    return {"device": str(device), "bytes": torch.cuda.max_memory_allocated(device),
            "note": f"torch.cuda.max_memory_allocated on {device} over the call{ending}"}
