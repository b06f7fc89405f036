"""The counters of a streaming offload: what it planned, what it moved, where the bytes are."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class LayerwiseStats:
    streamed_blocks: int = 0
    resident_blocks: int = 0
    slot_count: int = 0  # largest blocks that fit in the in-flight window (prefetch depth + 1)
    slot_bytes: int = 0  # the largest streamed block
    in_flight_capacity: int = 0  # bytes of streamed blocks on the device at once, at most
    in_flight_blocks: int | None = None  # streamed blocks on the device at once, at most (None: bytes only)
    max_in_flight_bytes: int = 0  # the most bytes of streamed blocks that were on the device at once
    hook_seconds: float = 0.0  # host time spent in the block hooks (loads, rebinding, releasing)
    streamed_bytes_per_pass: int = 0
    resident_device_bytes: int = 0
    host_bytes: int = 0
    host_memory_mode: str = ""
    loads: int = 0
    on_demand_loads: int = 0
    copied_bytes: int = 0
    phase_units: int = 0  # encoders' non-block weights and VAEs, on the device for their phase only
    phase_bytes: int = 0  # the largest of them
    phase_onloads: int = 0
    phase_onloaded_bytes: int = 0
    # max_host_memory: blocks with no host copy, read from their checkpoint files at each load
    disk_blocks: int = 0
    disk_bytes_per_pass: int = 0  # file bytes those blocks read per pass
    staging_bytes: int = 0  # the page-locked staging ring they are read into
    # compression="lossless" on an accelerator: the code's device buffers (``stores.lossless.CodeRing``)
    code_buffers: int = 0
    code_buffer_bytes: int = 0  # all of them, made on the first load
    disk_reads: int = 0
    disk_read_bytes: int = 0
    disk_read_seconds: float = 0.0  # the reader thread's time in reads (overlapping compute)
    disk_waits: int = 0  # loads that waited for their block's read
    disk_wait_seconds: float = 0.0
    # max_host_memory, alternating DiTs: blocks at one position share one host buffer, read when their DiT is back
    shared_buffers: int = 0
    shared_blocks: int = 0
    shared_bytes: int = 0
    shared_hits: int = 0  # loads that found their block in its shared buffer (nothing read)
    # "auto" budgets: what each chose and how (budget.AutoBudget.explain), and what the machine said
    auto: list[str] = field(default_factory=list)
    auto_readings: dict[str, str] = field(default_factory=dict)
    # per block store (``stores``, by name): how many streamed blocks it holds and their bytes
    store_blocks: dict[str, int] = field(default_factory=dict)
    store_bytes: dict[str, int] = field(default_factory=dict)
    store_host_bytes: dict[str, int] = field(default_factory=dict)  # what each store holds in host memory for them
    # per store and component (the first part of a block's path): the sums of the store's ``counters()``
    store_counters: dict[str, dict[str, dict[str, int]]] = field(default_factory=dict)
    # compression_cache_dir: the folder, and what this enable read from and wrote to it (``CodedCache.counters``)
    cache_dir: str | None = None
    cache_counters: dict[str, int] = field(default_factory=dict)
    cache_seconds: dict[str, float] = field(default_factory=dict)  # ``CodedCache.seconds``: where its time went
    tiled_vaes: list[str] = field(default_factory=list)  # VAEs switched to tiling after running out of memory
    residents_left: int = 0  # times the resident DiT blocks left the device to make room for a VAE
    residents_left_bytes: int = 0
    residents_shrunk: int = 0  # resident DiT blocks that stream since a step ran out of memory beside them
    residents_shrunk_bytes: int = 0  # their bytes, released from the device
    window_shrunk: int = 0  # times a step ran out of memory with nothing resident: the window keeps one block since
    # max_device_memory="auto": the resident set follows what each call shape needs (``headroom``)
    headroom_ceiling: int | None = None  # the peak a plan stays under: the ceiling auto read less a margin
    headroom: dict[str, int] = field(default_factory=dict)  # shape → bytes it needs beside the resident weights
    headroom_kept: int = 0  # streamed blocks that stay on the device since a shape was measured to leave room
    headroom_kept_bytes: int = 0
    headroom_streamed: int = 0  # resident blocks that stream since a (larger) shape needed their room
    headroom_streamed_bytes: int = 0
    headroom_lowered: int = 0  # times an out-of-memory error brought the ceiling down by a margin
