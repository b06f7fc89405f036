"""``"auto"`` budgets: what this process may use on the device and in RAM, read from the machine.

Everything the machine tells is read by one function, ``read_machine`` (tests replace it: a 12 GiB card, 32 GiB of
RAM, a cgroup cap). ``device_budget`` and ``host_budget`` turn a reading into a byte budget and say how, so the
report and ``explain`` can show what auto read and what it chose.

Device (``max_device_memory="auto"``): the memory this process may still take on the device — the card's free
memory plus what PyTorch's allocator holds cached but unused, capped by the per-process memory fraction less what
it has allocated — minus the headroom the call needs for activations: ``HEADROOM_SHARE`` of it, at least
``HEADROOM_MIN``. On the CPU (the testing mode) the "device" is host memory, read as for the host budget.

Host (``max_host_memory="auto"``): RAM the kernel says is available (``MemAvailable``), capped by the room the
process's memory cgroups leave (its own and each ancestor's limit less its usage without reclaimable page cache),
plus the bytes of the model's weights that are already in this process's RAM as ordinary (not file-mapped) tensors
— packing moves them into the host copies rather than adding to them — minus ``HOST_MARGIN_SHARE`` of that, at
least ``HOST_MARGIN_MIN``; on the CPU device, less what the device side takes in RAM.

The device headroom is a prediction; ``headroom`` corrects it per call shape from what the allocator reserved over
a forward, read by ``read_reserved`` (the other function tests replace), against the ceiling auto read
(``AutoBudget.limit``) less ``PEAK_MARGIN_SHARE`` of it, at least ``PEAK_MARGIN_MIN``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..config.offload import format_bytes

AUTO = "auto"
HEADROOM_SHARE = 0.2
HEADROOM_MIN = 1 << 30
HOST_MARGIN_SHARE = 0.1
HOST_MARGIN_MIN = 1 << 30
PEAK_MARGIN_SHARE = 0.08
PEAK_MARGIN_MIN = 512 << 20
# A VAE call beside resident blocks needs this share of its measured need free on top of it (``vae_room_margin``).
VAE_ROOM_SHARE = 0.25


@dataclass(frozen=True)
class MachineReading:
    """What the machine said, each ``None`` where it could not be read."""

    device: str
    device_free: int | None = None  # bytes free on the card (cudaMemGetInfo)
    device_total: int | None = None
    device_fraction: float | None = None  # the per-process memory fraction set on the allocator (None: not set)
    device_allocated: int = 0  # bytes this process's allocator has handed out
    device_cached: int = 0  # bytes it holds reserved but not handed out (free for our use)
    mem_available: int | None = None  # /proc/meminfo MemAvailable
    cgroup_limit: int | None = None  # memory.max (cgroup v2) or memory.limit_in_bytes (v1); None: no limit
    cgroup_usage: int | None = None

    def describe(self) -> dict[str, str]:
        """The readings, rendered for the report and ``explain``."""
        shown = {"device": self.device}
        for name in ("device_free", "device_total", "device_allocated", "device_cached", "mem_available",
                     "cgroup_limit", "cgroup_usage"):
            value = getattr(self, name)
            if value is not None and not (name.startswith("device_") and self.device == "cpu"):
                shown[name] = format_bytes(value)
        if self.device_fraction is not None:
            shown["device_fraction"] = f"{self.device_fraction:g}"
        return shown


@dataclass(frozen=True)
class AutoBudget:
    """A budget ``"auto"`` chose, with what it read and how it got there."""

    field: str
    nbytes: int
    reading: MachineReading
    steps: list[str] = field(default_factory=list)
    # The device's ceiling: the most bytes this process's allocator may hold there (what it holds already plus what
    # auto found it may still take), before the headroom; ``None`` for the host budget.
    limit: int | None = None

    def explain(self) -> str:
        return f"{self.field}=auto: {format_bytes(self.nbytes)} ({'; '.join(self.steps)})"


def _meminfo(path: str = "/proc/meminfo") -> int | None:
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max" or not text.isdigit():
        return None
    value = int(text)
    return None if value >= 1 << 60 else value  # cgroup v1 writes a huge number for "no limit"


def _stat(path: Path, key: str) -> int:
    """``key``'s value in a cgroup's ``memory.stat`` (0 where absent)."""
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key and value.strip().isdigit():
                return int(value)
    except OSError:
        pass
    return 0


# (version, the limit's file, the usage's file, memory.stat's key for reclaimable page cache)
_CGROUP_FILES = {2: ("memory.max", "memory.current", "inactive_file"),
                 1: ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")}


def own_cgroups(proc_cgroup: str | Path = "/proc/self/cgroup") -> dict[int, str]:
    """This process's cgroup paths from ``/proc/self/cgroup``: the unified (v2) one and v1's memory controller's."""
    found: dict[int, str] = {}
    try:
        lines = Path(proc_cgroup).read_text().splitlines()
    except OSError:
        return found
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if parts[0] == "0" and parts[1] == "":
            found[2] = parts[2].strip()
        elif "memory" in parts[1].split(","):
            found[1] = parts[2].strip()
    return found


def _cgroup(proc_cgroup: str | Path = "/proc/self/cgroup", root: str | Path = "/sys/fs/cgroup"
            ) -> tuple[int | None, int | None]:
    """(limit, usage) of the memory cgroup that leaves this process the least room: its own (v2, else v1's memory
    controller) and each ancestor up to the mount, as the kernel enforces every one of them. Usage leaves out the
    page cache the kernel can reclaim (``inactive_file``, as container runtimes count a working set). Where the
    process's own folder is not visible (a container whose cgroup is mounted as the root), the mount's root is its
    cgroup. ``(None, None)`` where no cgroup limits it."""
    root = Path(root)
    own = own_cgroups(proc_cgroup)
    for version, mount in ((2, root), (2, root / "unified"), (1, root / "memory")):
        limit_file, usage_file, cache_key = _CGROUP_FILES[version]
        if not (mount / ("cgroup.controllers" if version == 2 else "memory.limit_in_bytes")).exists():
            continue
        relative = own.get(version, "/").lstrip("/")
        folder = mount / relative if relative and (mount / relative).is_dir() else mount
        best: tuple[int, int, int] | None = None  # (room, limit, usage)
        while True:
            limit = _read_int(folder / limit_file)
            if limit is not None:
                usage = _read_int(folder / usage_file) or 0
                usage = max(usage - _stat(folder / "memory.stat", cache_key), 0)
                room = limit - usage
                if best is None or room < best[0]:
                    best = (room, limit, usage)
            if folder == mount or mount not in folder.parents:
                break
            folder = folder.parent
        if best is not None:
            return best[1], best[2]
    return None, None


def read_machine(device: torch.device) -> MachineReading:
    """Read device memory (for an accelerator), available RAM and the cgroup limit. The one place the machine is
    read: tests replace it."""
    limit, usage = _cgroup()
    host = {"mem_available": _meminfo(), "cgroup_limit": limit, "cgroup_usage": usage}
    if device.type == "cpu":
        return MachineReading("cpu", **host)
    module = torch.get_device_module(device)
    free, total = module.mem_get_info(device)
    get_fraction = getattr(module, "get_per_process_memory_fraction", None)
    fraction = get_fraction(device) if get_fraction is not None else None
    allocated = module.memory_allocated(device)
    cached = module.memory_reserved(device) - allocated
    return MachineReading(str(device), free, total, None if fraction is None or fraction >= 1 else fraction,
                          allocated, cached, **host)


def _host_available(reading: MachineReading, steps: list[str]) -> int:
    if reading.mem_available is None and reading.cgroup_limit is None:
        raise ValueError("\"auto\" could not read how much RAM is available (no /proc/meminfo MemAvailable, no "
                         "cgroup limit); allowed: a size such as \"32GiB\"")
    candidates = []
    if reading.mem_available is not None:
        candidates.append(reading.mem_available)
        steps.append(f"MemAvailable {format_bytes(reading.mem_available)}")
    if reading.cgroup_limit is not None:
        room = max(reading.cgroup_limit - (reading.cgroup_usage or 0), 0)
        candidates.append(room)
        steps.append(f"cgroup limit {format_bytes(reading.cgroup_limit)} less its usage "
                     f"{format_bytes(reading.cgroup_usage or 0)} = {format_bytes(room)}")
    return min(candidates)


def device_room(reading: MachineReading, steps: list[str] | None = None) -> int | None:
    """The bytes this process may still take on an accelerator: its free memory plus what this process's allocator
    holds cached, capped by the per-process memory fraction less what is allocated; ``None`` on the CPU or where the
    device's memory could not be read. ``steps`` gets how it was found."""
    if reading.device == "cpu" or reading.device_free is None or reading.device_total is None:
        return None
    steps = [] if steps is None else steps
    usable = reading.device_free + reading.device_cached
    steps.append(f"free {format_bytes(reading.device_free)} + cached by this process "
                 f"{format_bytes(reading.device_cached)}")
    if reading.device_fraction is not None:
        cap = int(reading.device_total * reading.device_fraction) - reading.device_allocated
        steps.append(f"per-process fraction {reading.device_fraction:g} of {format_bytes(reading.device_total)} "
                     f"less {format_bytes(reading.device_allocated)} allocated = {format_bytes(cap)}")
        usable = min(usable, cap)
    return usable


def device_budget(reading: MachineReading) -> AutoBudget:
    """``max_device_memory="auto"``: the bytes of weights allowed on the device."""
    steps: list[str] = []
    if reading.device == "cpu":
        usable = _host_available(reading, steps)
        steps.append("the device is the CPU: host memory")
    else:
        usable = device_room(reading, steps)
        if usable is None:
            raise ValueError(f"max_device_memory=\"auto\" could not read the memory of {reading.device}; allowed: a "
                             "size such as \"12GiB\"")
    headroom = max(int(usable * HEADROOM_SHARE), HEADROOM_MIN)
    nbytes = max(usable - headroom, 0)
    steps.append(f"less {format_bytes(headroom)} headroom for activations ({HEADROOM_SHARE:.0%}, at least "
                 f"{format_bytes(HEADROOM_MIN)}; corrected per call shape once measured)")
    # What may be reserved at most: what is allocated now plus what may still be taken (free + cached, or the
    # fraction's cap less what is allocated).
    allocated = 0 if reading.device == "cpu" else reading.device_allocated
    return AutoBudget("max_device_memory", nbytes, reading, steps, limit=allocated + usable)


def peak_margin(limit: int) -> int:
    """What a measured plan leaves free below ``limit``: the allocator's rounding and fragmentation (on an H100 with a
    12 GiB cap, 1.2 to 1.7 GiB reserved but unallocated where steps ran out of memory beside kept blocks), a step's
    shapes that differ a little from the measured one. ``headroom`` lowers its ceiling by as much again at each
    out-of-memory error it could not foresee."""
    return max(int(limit * PEAK_MARGIN_SHARE), PEAK_MARGIN_MIN)


def vae_room_margin(need: int) -> int:
    """What a VAE call, measured to reserve ``need`` bytes, wants free beyond them before it runs beside resident
    blocks: ``VAE_ROOM_SHARE`` of its need, at least ``peak_margin(need)``. cuDNN takes another convolution plan
    (other bits, no error) when the workspace of its first choice does not fit, and that happens before the call
    runs out of memory: on an H100 the FLUX.1 VAE decoding 1024² (2.4 GiB at its peak) kept its bits with 3 GiB
    free and changed them with 2.5 GiB (``benchmarks/results/vae-workspace-probe``), and a Qwen-Image pipeline under
    a 20 GiB budget on a 24 GiB card decoded another image with the former margin
    (``benchmarks/results/pipeline-offload-qwen-auto``)."""
    return max(peak_margin(need), int(need * VAE_ROOM_SHARE))


def read_reserved(device: torch.device, empty_cache: bool = False) -> int | None:
    """The bytes this process's caching allocator holds reserved on ``device`` (``None`` on the CPU: no allocator
    statistics), after first handing its unused cache back to the driver with ``empty_cache``. Reserved, not
    allocated: the card and a per-process fraction cap what is reserved, fragmentation included. Read with
    ``empty_cache`` before a forward and without after it, it is what the forward needed at its peak (the cache
    keeps every segment the forward reserved); nothing resets the allocator's peak statistics (that would corrupt
    the readings of whoever else reads them). Tests replace it."""
    if device.type == "cpu":
        return None
    module = torch.get_device_module(device)
    if empty_cache:
        module.synchronize(device)
        module.empty_cache()
    return module.memory_reserved(device)


def host_budget(reading: MachineReading, weights_in_ram: int, device_in_ram: int = 0) -> AutoBudget:
    """``max_host_memory="auto"``: the bytes of host copies allowed; ``weights_in_ram`` is what the model's weights
    already take in this process's RAM (packing reuses it); ``device_in_ram`` what the device side will take in RAM
    when the device is the CPU (the streaming window, resident blocks' device copies), left out of the budget."""
    steps: list[str] = []
    available = _host_available(reading, steps) + weights_in_ram
    steps.append(f"+ the weights already in RAM {format_bytes(weights_in_ram)}")
    margin = max(int(available * HOST_MARGIN_SHARE), HOST_MARGIN_MIN)
    nbytes = max(available - margin - device_in_ram, 0)
    steps.append(f"less a margin of {format_bytes(margin)} ({HOST_MARGIN_SHARE:.0%}, at least "
                 f"{format_bytes(HOST_MARGIN_MIN)})")
    if device_in_ram:
        steps.append(f"less {format_bytes(device_in_ram)} the device takes in RAM (the device is the CPU: the "
                     "streaming window and resident blocks' device copies)")
    return AutoBudget("max_host_memory", nbytes, reading, steps)


def weights_in_ram(tensors: list[torch.Tensor], is_file_view) -> int:
    """Bytes of ``tensors`` held in this process's RAM as ordinary host tensors (not views of a mapped file)."""
    seen: set[int] = set()
    total = 0
    for tensor in tensors:
        if tensor.device.type != "cpu" or is_file_view(tensor):
            continue
        storage = tensor.untyped_storage()
        if storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        total += storage.nbytes()
    return total


__all__ = ["AUTO", "AutoBudget", "MachineReading", "device_budget", "device_room", "host_budget", "own_cgroups",
           "peak_margin", "read_machine", "read_reserved", "vae_room_margin", "weights_in_ram"]
