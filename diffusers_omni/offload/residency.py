"""Which blocks stay on the device under a device-memory budget: a pure function of block sizes and the budget."""

from __future__ import annotations

from collections.abc import Callable

from ..config.offload import format_bytes
from .host_plan import spread_positions


def plan_residency(
    block_bytes: list[int], forced: list[bool], fixed_bytes: int, budget: int | None, slot_count: int,
    never: list[bool] | None = None, labels: list[str] | None = None, fixed_detail: str = "",
    stream_extra: int = 0, stream_extra_detail: str = "",
) -> list[bool]:
    """Which blocks stay on the device.

    ``forced`` blocks are always resident; ``never`` blocks (an encoder's, run once per call where a DiT's run every
    step) stay resident only when everything fits, and otherwise stream, sizing the window like any other streamed
    block. Without a budget the rest stream. With one, everything is resident if
    it fits; otherwise ``slot_count`` slots for the largest candidate (the streaming window) and ``stream_extra``
    bytes (what streaming needs beside the window: the lossless code's device buffers) are reserved and the
    rest of the budget keeps blocks resident: size class by size class, the largest first (``size_classes``),
    each class as an evenly spread set, and no run of consecutive resident blocks longer than the window (or than
    an evenly spread set of the same budget would have; ``_longest_chosen_run``), so the streamed ones copy while
    resident ones compute.
    """
    resident = list(forced)
    never = never or [False] * len(block_bytes)
    streamable = [i for i, f in enumerate(forced) if not f]
    candidates = [i for i in streamable if not never[i]]
    if budget is None or not streamable:
        return resident
    forced_bytes = sum(b for b, f in zip(block_bytes, forced) if f)
    if fixed_bytes + forced_bytes + sum(block_bytes[i] for i in streamable) <= budget:
        return [True] * len(block_bytes)
    window = slot_count * max(block_bytes[i] for i in streamable)
    available = budget - fixed_bytes - forced_bytes - window - stream_extra
    if available < 0:
        needed = fixed_bytes + forced_bytes + window + stream_extra
        largest = max(streamable, key=lambda i: block_bytes[i])
        block = f" (the largest streamed block, {labels[largest]!r})" if labels else ""
        raise ValueError(
            f"max_device_memory={budget} ({format_bytes(budget)}) is too small; allowed: at least "
            f"{needed} ({format_bytes(needed)}) = non-block weights {format_bytes(fixed_bytes)}{fixed_detail} + "
            f"resident blocks {format_bytes(forced_bytes)} + {slot_count} streaming slots of "
            f"{format_bytes(window // slot_count)}{block}"
            + (f" + {format_bytes(stream_extra)} {stream_extra_detail}" if stream_extra else "")
        )
    if not candidates:
        return resident
    # The longest resident run allowed: the window, or as long as an evenly spread set filling the same budget
    # would have (a budget near the model's size keeps long runs either way; its few streamed blocks copy in time).
    spread, _ = _spread_fill(block_bytes, resident, candidates, available)
    cap = max(window, _longest_chosen_run(block_bytes, forced, spread))
    for group in size_classes(block_bytes, candidates):
        resident, used = _spread_fill(block_bytes, resident, group, available,
                                      accept=lambda plan: _longest_chosen_run(block_bytes, forced, plan) <= cap)
        available -= used
    return resident


def _spread_fill(block_bytes: list[int], resident: list[bool], group: list[int], available: int,
                 accept: Callable[[list[bool]], bool] = lambda plan: True) -> tuple[list[bool], int]:
    """``resident`` plus the most blocks of ``group``, evenly spread among them, that fit in ``available`` bytes
    and that ``accept`` takes; and the bytes they add."""
    for count in range(len(group), 0, -1):
        chosen = [group[p] for p in spread_positions(count, len(group))]
        used = sum(block_bytes[i] for i in chosen)
        if used > available:
            continue
        plan = list(resident)
        for i in chosen:
            plan[i] = True
        if accept(plan):
            return plan, used
    return list(resident), 0


def _longest_chosen_run(block_bytes: list[int], forced: list[bool], resident: list[bool]) -> int:
    """Bytes of the longest run of consecutive resident blocks (cyclic: the last blocks run right before the next
    step's first) holding at least one block the plan chose. While such a run computes, the copy engine can only
    fill the window; a longer run leaves it idle where a copy-bound model (a bf16 DiT) needs it busy."""
    n = len(resident)
    if all(resident):
        return sum(block_bytes)
    start = next(i for i in range(n) if not resident[i])  # a run never wraps past a streamed block
    longest = run_bytes = 0
    chose = False
    for k in range(1, n + 1):
        i = (start + k) % n
        if resident[i]:
            run_bytes += block_bytes[i]
            chose = chose or not forced[i]
            continue
        if chose:
            longest = max(longest, run_bytes)
        run_bytes, chose = 0, False
    return longest


# Blocks within this fraction of a size class's largest block are one class: GGUF mixes (e.g. Q4_K_M) make blocks of
# one kind differ by a few percent, and a last block carrying the output layers is ~14% larger than its FLUX peers.
_SIZE_CLASS_TOLERANCE = 0.8


def size_classes(block_bytes: list[int], candidates: list[int]) -> list[list[int]]:
    """The candidates in size classes, largest first, each in stack order.

    Where a stack mixes block sizes (FLUX's and HunyuanVideo's double-stream blocks are ~2.4x their single-stream
    ones), the larger blocks carry a second stream's weights that only see the text tokens: the most bytes per
    unit of compute, so theirs are the copies that outrun compute in a run of them (FLUX int8 and Q8_0 on an H200).
    Keeping those resident first leaves the streamed bytes where compute can hide them. A stack of equal blocks
    (Wan) is one class.
    """
    order = sorted(candidates, key=lambda i: (-block_bytes[i], i))
    groups: list[list[int]] = []
    for i in order:
        if groups and block_bytes[i] >= _SIZE_CLASS_TOLERANCE * block_bytes[groups[-1][0]]:
            groups[-1].append(i)
        else:
            groups.append([i])
    return [sorted(group) for group in groups]

