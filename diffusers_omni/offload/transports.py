"""Transports: how a streamed block's bytes reach its device buffers.

Two transports, chosen by the strategy's config (``LayerwiseOffloadBackend._transport``):

- ``memory.Transfers``, the copy transport: a store's bytes are copied on the copy stream, after the event the
  streamer recorded when it allocated the block's buffers, and record the block's ``ready`` event.
- ``AllGatherTransfers`` (AllGather): each rank copies its shard (``stores.shard.ShardStore``) into its own part
  of the block's buffers on the copy stream, then the ranks all-gather the parts in place on a communication
  stream, which records ``ready``::

      copy stream:   wait allocated ─ H2D this rank's shard → buffer[rank part] ─ record staged
      comm stream:   wait staged ─ all_gather_into_tensor(buffer, buffer[rank part]) ─ record ready
      compute:       wait ready ─ run the block ─ free its memory

  Collectives gather bytes (``uint8`` views), so every dtype (float8 included) takes the same path and the
  rebuilt block is byte-exact. Every rank must load the same blocks in the same order: the streamer's decisions
  depend only on the block layout (the same on every rank, checked when enabling) and the calls, which run in
  lockstep.

A store asks its transport for what it needs (``copy``/``run`` of the copy transport, ``gather`` of this one); the
streamer only uses what both have (events, ``compute_waits_for``, ``record_on_compute``, ``synchronize``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from .memory import Transfers

__all__ = ["AllGatherTransfers", "Transfers", "all_gather_bytes"]


def all_gather_bytes(output: torch.Tensor, shard: torch.Tensor, group: Any) -> None:
    """Gather every rank's ``shard`` into ``output`` (``world_size × shard`` elements, rank order).

    Both tensors are viewed as ``uint8`` so dtypes the backend does not know (gloo has no float8) travel as bytes.
    ``shard`` may be this rank's part of ``output`` (in place: NCCL documents it; gloo gathers into a scratch
    tensor and copies out). Uses the one-tensor collective (``all_gather_into_tensor``, or its successor
    ``all_gather_single``), which NCCL and (since torch 2.x) gloo implement.
    """
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(output.view(torch.uint8), shard.view(torch.uint8), group=group)


class AllGatherTransfers(Transfers):
    """The all-gather transport: shard copies on the copy stream, all-gathers on a communication stream (see the
    module's docstring); synchronous with ``device='cpu'``. ``stats.gathers`` (when given) counts collectives."""

    def __init__(self, device: torch.device, group: Any, rank: int, stats: Any = None) -> None:
        super().__init__(device)
        self.group = group
        self.rank = rank
        self.stats = stats
        if self.asynchronous:
            self.comm_stream = self._module.Stream(device)
            # Waited for by the comm stream right after it is recorded (a wait binds the latest record), so one
            # event serves every load.
            self._staged = self._module.Event()

    def gather(self, parts: list[tuple[torch.Tensor, torch.Tensor]], wait_for=None, done=None) -> None:
        """For each ``(shard, output)``: copy this rank's ``shard`` into its part of ``output`` (``world_size ×
        shard.numel()`` elements) after ``wait_for``, then all-gather ``output`` in place; record ``done`` after
        the last collective."""
        staged = [(shard, output, output.narrow(0, self.rank * shard.numel(), shard.numel()))
                  for shard, output in parts]
        if not self.asynchronous:
            for shard, _, own in staged:
                own.copy_(shard)
            for _, output, own in staged:
                all_gather_bytes(output, own, self.group)
        else:
            with self._module.stream(self.copy_stream):
                if wait_for is not None:
                    self.copy_stream.wait_event(wait_for)
                for shard, _, own in staged:
                    own.copy_(shard, non_blocking=True)
                self._staged.record(self.copy_stream)
            with self._module.stream(self.comm_stream):
                self.comm_stream.wait_event(self._staged)
                # async_op=False: the collective is ordered on (and completes before later work of) the comm
                # stream; the host does not wait for it.
                for _, output, own in staged:
                    all_gather_bytes(output, own, self.group)
                done.record(self.comm_stream)
        if self.stats is not None:
            self.stats.gathers += len(staged)
