"""Data-parallel requests under distributed layerwise offload: N ranks, N different requests, one lockstep.

With AllGather, every block forward is a collective, so every rank must run the same number of DiT forwards.
Prompts, seeds and guidance *values* may differ per rank; the number of denoising steps (and anything else that
changes how often the DiT runs, such as switching classifier-free guidance on or off) must not.

The step count is checked before the first step: the offload backend wraps the pipeline scheduler's
``set_timesteps`` (every Diffusers pipeline calls it before denoising), and all ranks exchange their step counts.
A mismatch raises the same ``ValueError`` on every rank instead of hanging in the next collective.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist


class StepMismatchError(ValueError):
    """Ranks asked for different numbers of denoising steps."""


def check_same_steps(num_inference_steps: int | None, group: Any = None, what: str = "num_inference_steps") -> int:
    """All-gather ``num_inference_steps`` across ``group`` and return it; raise ``StepMismatchError`` on every rank
    when the ranks disagree or any rank passed ``None``. Collective: call it on every rank."""
    group = group if group is not None else dist.group.WORLD
    value = -1 if num_inference_steps is None else int(num_inference_steps)
    world = dist.get_world_size(group)
    device = _collective_device(group)
    gathered = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
    dist.all_gather(gathered, torch.tensor([value], dtype=torch.int64, device=device), group=group)
    steps = [int(t.item()) for t in gathered]
    if len(set(steps)) > 1 or -1 in steps:
        shown = ", ".join(f"rank {r}: {'None' if s == -1 else s}" for r, s in enumerate(steps))
        raise StepMismatchError(
            f"data-parallel requests under distributed layerwise offload run in lockstep, so every rank must use "
            f"the same explicit {what}; got {shown}. Allowed: one value on every rank (prompts and seeds may differ)"
        )
    return steps[0]


def _collective_device(group: Any) -> torch.device:
    if str(dist.get_backend(group)).lower() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def install_step_check(target: Any, group: Any, lock: Any = None) -> Callable[[], None] | None:
    """Wrap ``target.scheduler.set_timesteps`` so each pipeline call checks its step count across ranks before
    the first step. Returns the undo function, or ``None`` when ``target`` has no scheduler (a bare model: call
    ``check_same_steps`` yourself). With ``lock`` (the offload's ``ForwardLock``) the check runs under it, so a
    second thread's check is refused like its forwards."""
    scheduler = getattr(target, "scheduler", None)
    original = getattr(scheduler, "set_timesteps", None)
    if scheduler is None or original is None or isinstance(target, torch.nn.Module):
        return None
    had_own = "set_timesteps" in scheduler.__dict__

    @functools.wraps(original)
    def set_timesteps(*args: Any, **kwargs: Any) -> Any:
        if lock is not None:
            lock.acquire("scheduler.set_timesteps")
        try:
            result = original(*args, **kwargs)
            timesteps = getattr(scheduler, "timesteps", None)
            check_same_steps(None if timesteps is None else len(timesteps), group, what="number of denoising steps")
        finally:
            if lock is not None:
                lock.release()
        return result

    scheduler.set_timesteps = set_timesteps

    def remove() -> None:
        if had_own:
            scheduler.set_timesteps = original
        else:
            scheduler.__dict__.pop("set_timesteps", None)

    return remove


def rank_values(values: Sequence[Any] | None, default: Any, rank: int, world_size: int, what: str) -> Any:
    """This rank's entry of a per-rank list (one value for every rank, or one per rank)."""
    if not values:
        return default
    if len(values) == 1:
        return values[0]
    if len(values) != world_size:
        raise ValueError(f"{what} has {len(values)} values for {world_size} ranks; allowed: 1 or {world_size}")
    return values[rank]
