"""Which streamed blocks keep a host copy under ``max_host_memory``, which share one, and which are read from disk.

Three ways a streamed block can be held on the host:

- its own host copy (page-locked when pinning is on): loads copy from it, nothing is read;
- a *shared buffer*: DiTs that run one at a time (declared by the pipeline as alternating, e.g. Wan 2.2's high-
  and low-noise experts: each denoising step runs one of them) share one buffer per block position. The buffer
  holds the block of whichever DiT used it last; the first load after the other DiT ran reads it from the
  checkpoint into the buffer, every later load of the same DiT finds it there. Reads happen once per switch of
  DiT, not once per step;
- no host copy: read from the checkpoint at every load, through the staging ring (a few block-sized buffers).

``plan_host_memory`` takes the least disk traffic that fits: encoder blocks first (an encoder runs once per call),
then shared buffers for the alternating DiTs (one read per block per switch), then DiT blocks read at every load
(one read per block per forward), each kind a few blocks more at a time, evenly spread through its stack.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator

from ..config.offload import format_bytes


def spread_positions(count: int, total: int) -> list[int]:
    """``count`` positions out of ``range(total)``, evenly spread (``2, 8`` → ``[2, 6]``)."""
    if count <= 0:
        return []
    return sorted({min(int((k + 0.5) * total / count), total - 1) for k in range(count)})


@dataclass
class HostCandidate:
    """A streamed block as ``plan_host_memory`` sees it: its host copy's bytes, its stack, whether it is an
    encoder's, why it must keep its host copy (``""``: it may be read from its checkpoint instead), and, for a
    block of an alternating DiT, that group (``group >= 0``) and its position among its DiT's streamed blocks
    (blocks of one group at one position may share a buffer)."""

    key: Any
    label: str
    nbytes: int
    stack: int
    encoder: bool
    reason: str = ""
    group: int = -1
    position: int = 0
    kept: int = 0  # bytes it keeps on the host even without a host copy (tensors no file holds as the model does)


@dataclass
class HostPlan:
    """``disk``: blocks read from their checkpoint at every load (through the staging ring); ``shared``: groups of
    blocks (one per alternating DiT, same position) that share one buffer of their largest block's size, read into
    it when their DiT runs after the other. Every other candidate keeps its own host copy."""

    disk: list[HostCandidate] = field(default_factory=list)
    shared: list[list[HostCandidate]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.disk or self.shared)

    @property
    def blocks(self) -> list[HostCandidate]:
        """Every block that keeps no host copy of its own (disk and shared)."""
        return self.disk + [c for group in self.shared for c in group]

    def host_bytes(self, candidates: list[HostCandidate], staging_count: int) -> int:
        """The host bytes of ``candidates`` under this plan: own copies, shared buffers, and a staging ring of
        ``staging_count`` buffers (at most one per disk block) of the largest disk block."""
        gone = {id(c) for c in self.blocks}
        own = sum(c.nbytes for c in candidates if id(c) not in gone) + sum(c.kept for c in self.blocks)
        shared = sum(max(c.nbytes for c in group) for group in self.shared)
        largest = max((c.nbytes for c in self.disk), default=0)
        return own + shared + min(staging_count, len(self.disk)) * largest


def plan_host_memory(candidates: list[HostCandidate], fixed: dict[str, int], budget: int,
                     staging_count: int) -> HostPlan:
    """The plan (see the module) whose host copies (``fixed``: what always has one, by part; then the candidates
    under the plan) take at most ``budget`` bytes with the least disk traffic, in the order the module gives; an
    empty plan when everything fits with host copies. Raises ``ValueError`` with the minimum and what makes it up
    when nothing fits."""
    fixed_total = sum(fixed.values())

    def pinned(plan: HostPlan) -> int:
        return fixed_total + plan.host_bytes(candidates, staging_count)

    best = HostPlan()
    best_bytes = pinned(best)
    if best_bytes <= budget:
        return best
    for plan in _levels(candidates):
        total = pinned(plan)
        if total <= budget:
            return plan
        if total < best_bytes:
            best, best_bytes = plan, total
    raise ValueError(_too_small(candidates, fixed, budget, staging_count, best, best_bytes))


def _too_small(candidates: list[HostCandidate], fixed: dict[str, int], budget: int, staging_count: int,
               best: HostPlan, needed: int) -> str:
    taken = {id(c) for c in best.blocks}
    own = [c for c in candidates if id(c) not in taken]  # blocks that keep their own host copy
    parts = [f"{name} {format_bytes(nbytes)}" for name, nbytes in fixed.items() if nbytes]
    if own:
        parts.append(f"{len(own)} streamed blocks that keep their host copy {format_bytes(sum(c.nbytes for c in own))}")
    held = sum(c.kept for c in best.blocks)
    if held:
        parts.append(f"the tensors that blocks read from disk keep (in no file as the model holds them) "
                     f"{format_bytes(held)}")
    if best.shared:
        shared = sum(max(c.nbytes for c in group) for group in best.shared)
        parts.append(f"{len(best.shared)} buffers shared by the alternating DiTs {format_bytes(shared)}")
    if best.disk:
        largest = max(c.nbytes for c in best.disk)
        parts.append(f"the staging ring, {min(staging_count, len(best.disk))} × {format_bytes(largest)} (the largest "
                     f"of the {len(best.disk)} blocks read from disk)")
    if any(not c.reason for c in own):
        parts[-1] += (f"; {sum(1 for c in own if not c.reason)} more blocks read from disk would need a larger "
                      "staging ring than they free")
    reasons: dict[str, int] = {}
    for c in own:
        if c.reason:
            reasons[c.reason] = reasons.get(c.reason, 0) + 1
    why = "; ".join(f"{count} block{'s' if count > 1 else ''}: {reason}" for reason, count in reasons.items())
    return (f"max_host_memory={budget} ({format_bytes(budget)}) is too small; allowed: at least {needed} "
            f"({format_bytes(needed)}) = {' + '.join(parts) or 'nothing'}"
            + (f". Blocks that cannot be read from disk keep their host copy: {why}" if why else ""))


def _levels(candidates: list[HostCandidate]) -> Iterator[HostPlan]:
    """Ever cheaper plans in host bytes: encoder blocks to disk (evenly spread, one more at a time), then with all
    of them there, shared buffers for more and more positions of the alternating DiTs, then DiT blocks to disk,
    evenly spread through each stack (stacks share the count by their sizes; a shared position counts as one
    block of its group and sends all its blocks)."""
    readable = [c for c in candidates if not c.reason]
    encoders = _by_stack([c for c in readable if c.encoder])
    by_position: dict[tuple[int, int], list[HostCandidate]] = {}
    for c in readable:
        if not c.encoder and c.group >= 0:
            by_position.setdefault((c.group, c.position), []).append(c)
    positions = {key: group for key, group in by_position.items() if len(group) > 1}
    in_positions = {id(c) for group in positions.values() for c in group}
    alone = _by_stack([c for c in readable if not c.encoder and id(c) not in in_positions])

    every_encoder: list[HostCandidate] = []
    for count in range(1, sum(len(s) for s in encoders) + 1):
        every_encoder = _spread_over(encoders, count)
        yield HostPlan(disk=list(every_encoder))
    groups: dict[int, list[list[HostCandidate]]] = {}
    for (group, _), members in sorted(positions.items(), key=lambda item: item[0]):
        groups.setdefault(group, []).append(members)
    shared_stacks = [groups[g] for g in sorted(groups)]
    every_shared: list[list[HostCandidate]] = []
    for count in range(1, sum(len(s) for s in shared_stacks) + 1):
        every_shared = _spread_over(shared_stacks, count)
        yield HostPlan(disk=list(every_encoder), shared=list(every_shared))
    # A shared position sent to disk is one unit of its group's pseudo-stack (a list of its blocks); a lone DiT
    # block is a unit of its own.
    units: list[list[Any]] = [[[c] for c in stack] for stack in alone] + shared_stacks
    for count in range(1, sum(len(s) for s in units) + 1):
        chosen = _spread_over(units, count)
        sent = {id(unit) for unit in chosen}
        disk = list(every_encoder) + [c for unit in chosen for c in unit]
        yield HostPlan(disk=disk, shared=[g for g in every_shared if id(g) not in sent])


def _by_stack(candidates: list[HostCandidate]) -> list[list[HostCandidate]]:
    found: dict[int, list[HostCandidate]] = {}
    for c in candidates:
        found.setdefault(c.stack, []).append(c)
    return [found[k] for k in sorted(found)]


def _spread_over(stacks: list[list[Any]], count: int) -> list[Any]:
    """``count`` items over ``stacks`` in proportion to their sizes (largest remainders), each stack's evenly
    spread."""
    total = sum(len(s) for s in stacks)
    shares = [count * len(s) // total for s in stacks]
    remainders = sorted(range(len(stacks)), key=lambda i: (-(count * len(stacks[i]) % total), i))
    for i in remainders[: count - sum(shares)]:
        shares[i] += 1
    return [stack[p] for stack, share in zip(stacks, shares) for p in spread_positions(share, len(stack))]
