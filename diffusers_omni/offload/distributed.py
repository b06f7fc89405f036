"""Distributed layerwise offload: the layerwise streaming backend on every rank of a ``torch.distributed`` group.

Both modes are the layerwise backend's enable steps, streamer and hooks, between agreements of the ranks (a rank
that fails tells the others, and every rank rolls back). They differ only in the parts their config chooses:

- AllGather mode (default): the shard store (``stores.shard.ShardStore``: each rank pins 1/N of every block's
  per-dtype flat buffer, ceil-padded to a multiple of N, so host weights per rank are ≈ model ÷ N) behind the
  all-gather transport (``transports.AllGatherTransfers``: a load copies this rank's shard into its part of the
  block's device buffers on the copy stream, then the ranks all-gather the rest in place on a communication
  stream). The window holds the running block and the next one (``prefetch_depth=1``), so device weights are
  bounded by two blocks whatever the model size; the next pass's first block loads when the last block ends.
  Collectives gather bytes (``uint8`` views), so every dtype (float8 included) is rebuilt byte-exact. Every rank
  must run the same sequence of DiT forwards (lockstep); different prompts and seeds per rank are fine, see
  :mod:`.dataparallel`. The full weights exist on no rank: ``state_dict()`` and ``save_pretrained`` are refused;
  disable gathers every block back into full host tensors (collective).
- No-AllGather mode: each rank streams its own full host copy (the pinned or lossless store, copied on the copy
  stream) exactly as the single-device layerwise backend does; ``resident_layers`` keeps the first blocks of the
  main DiT on the device.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from ..config.offload import OffloadStrategy, format_bytes
from ..utils.journal import Journal
from .base import EnableStep
from .guards import GuardInstaller
from .hooks import ForwardLock
from .layerwise import LayerwiseOffloadBackend, LayerwiseState, LayerwiseStats
from .stores.shard import ShardGroup, host_bytes_per_rank, shard_numel, shard_range
from .transports import all_gather_bytes

logger = logging.getLogger("diffusers_omni")


def require_process_group(group: Any = None) -> Any:
    """The group to shard over (``None`` → the default group); raises when torch.distributed is not set up."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "distributed layerwise offload needs an initialised torch.distributed process group; launch with "
            "`torchrun --nproc-per-node N ...` (or accelerate launch) and call "
            "torch.distributed.init_process_group('nccl' on GPUs, 'gloo' on CPU) before enabling it; for one "
            "process use enable_layerwise_offload()"
        )
    return group if group is not None else dist.group.WORLD


@dataclass
class DistributedStats(LayerwiseStats):
    rank: int = 0
    world_size: int = 1
    use_allgather: bool = True
    gathers: int = 0
    host_bytes_per_dtype: dict = field(default_factory=dict)


class DistributedLayerwiseOffloadBackend(LayerwiseOffloadBackend):
    """Layerwise offload on every rank of a process group. This class is the no-AllGather mode (a full host copy
    per rank, streamed as in single-process layerwise offload); ``AllGatherLayerwiseOffloadBackend`` keeps 1/N host
    shards per rank and gathers each block. ``for_config`` picks by ``config.use_allgather``. Enable and disable are
    collective: call them on every rank.
    """

    strategy = OffloadStrategy.DISTRIBUTED_LAYERWISE
    # The DiT's output layers stay resident on every rank (they are not streamed with the last block).
    fold_tail = False
    manages_components = False  # encoders and VAEs stay on each rank's device
    use_allgather: bool = False
    # Whether prime runs a collective (AllGather: it gathers the first block): a rank failing inside it cannot
    # join the agreement after it, since the others may be inside the collective.
    prime_is_collective: bool = False

    @classmethod
    def for_config(cls, config) -> "DistributedLayerwiseOffloadBackend":
        variant = AllGatherLayerwiseOffloadBackend if config.use_allgather else DistributedLayerwiseOffloadBackend
        return variant(config)

    def __init__(self, config) -> None:
        if config.use_allgather != self.use_allgather:
            raise ValueError(
                f"{type(self).__name__} serves use_allgather={self.use_allgather}, got use_allgather="
                f"{config.use_allgather}; build it with DistributedLayerwiseOffloadBackend.for_config(config)"
            )
        super().__init__(config)
        self.group = require_process_group(config.process_group)
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        backend = str(dist.get_backend(self.group)).lower()
        if self.device.type == "cpu" and backend == "nccl":
            raise ValueError("device='cpu' cannot use an NCCL process group; allowed: a gloo group for CPU runs")

    def _enable_steps(self) -> Sequence[EnableStep]:
        # Every rank runs the local steps between two agreements (``_agree``): discover ends with one, the local
        # steps with ``agree_local`` (before prime, whose AllGather is a collective), prime with ``agree_primed``. A
        # rank that fails in between joins the next agreement with its error (``enable``), so every rank rolls back.
        # Both modes run these steps; AllGather's differ only in the parts chosen (``_shards``: the shard store and
        # the all-gather transport).
        return (self._discover, self._agree_layout, self._move_residents, self._pack_blocks, self._count_host_bytes,
                self._allocate_slots, self._install_hooks, self._install_step_check, self._install_guards,
                self._agree_local, self._prime, self._agree_primed)

    # A rank that started its step again would put its collectives out of step with the other ranks'.
    retries_out_of_memory = False

    @property
    def max_device_memory(self) -> None:
        """No byte budget: ``resident_layers`` chooses the resident blocks and every other block streams."""
        return None

    @property
    def stats(self) -> DistributedStats:
        return super().stats

    def _new_state(self, target: Any) -> LayerwiseState:
        state = super()._new_state(target)
        state.keep_residues = False  # every rank must lay blocks out alike (the layout digest, the shards)
        state.stats = DistributedStats(rank=self.rank, world_size=self.world_size, use_allgather=self.use_allgather)
        return state

    # Enable is collective: every rank's failure becomes every rank's failure --------------------------------

    def enable(self, target: Any) -> "DistributedLayerwiseOffloadBackend":
        """Enable on every rank (collective). If any rank fails at any stage, every rank rolls back and raises:
        the failing rank its own error (with a note naming it), the others a ``RuntimeError`` naming the failing
        rank and its error; within one agreement, not after the process group's timeout."""
        # The agreement this rank owes the others if it fails now: discovery is followed by the layout agreement.
        self._pending_agreement: str | None = "agree_layout"
        try:
            return super().enable(target)  # a failing stage is rolled back here (the journal), then re-raised
        except BaseException as error:
            pending, self._pending_agreement = self._pending_agreement, None
            if pending is not None:
                try:
                    self._agree(pending, error)  # the others wait there: tell them, then raise here
                except Exception as agreeing:  # noqa: BLE001 - this rank's own error is the one to raise
                    logger.warning("distributed offload rank %d: telling the other ranks that enabling failed "
                                   "failed too (%s: %s)", self.rank, type(agreeing).__name__, agreeing)
                else:
                    error.add_note(
                        f"distributed layerwise offload: rank {self.rank} of {self.world_size} (this rank) failed "
                        "while enabling; the other ranks were told, and every rank rolled back: none enabled it"
                    )
            raise

    def _agree(self, point: str, error: BaseException | None = None, extra: Any = None) -> list[Any]:
        """Agreement ``point``: all ranks exchange their error text (``None``: this rank succeeded) and ``extra``.
        When any rank failed, every other rank raises here, naming it (a failing rank passes its own ``error``,
        which its caller raises). Returns every rank's ``extra``, in rank order."""
        answers: list[Any] = [None] * self.world_size
        text = None if error is None else f"{type(error).__name__}: {error}"
        dist.all_gather_object(answers, (point, text, extra), group=self.group)
        failed = [(r, message) for r, (_, message, _) in enumerate(answers) if message is not None]
        if failed and error is None:
            rank, message = failed[0]
            others = f" (and ranks {[r for r, _ in failed[1:]]})" if len(failed) > 1 else ""
            raise RuntimeError(
                f"distributed layerwise offload: rank {rank}{others} could not enable ({message}); every rank "
                "rolled back, no rank enabled it"
            )
        return [value for _, _, value in answers]

    def _agree_local(self, state: LayerwiseState, journal: Journal) -> None:
        self._pending_agreement = None  # from here on this rank is in the agreement itself
        self._agree("agree_local")
        self._pending_agreement = None if self.prime_is_collective else "agree_primed"

    def _agree_primed(self, state: LayerwiseState, journal: Journal) -> None:
        self._pending_agreement = None
        self._agree("agree_primed")

    # After discovery: local checks, then every rank agrees (a rank that failed in discovery joins this agreement
    # with its error through ``enable``, so no rank is left waiting in a collective).

    def _agree_layout(self, state: LayerwiseState, journal: Journal) -> None:
        """Place ``resident_layers`` and check that every rank discovered the same model (block layouts)."""
        error: BaseException | None = None
        digest = ""
        try:
            self._check_and_place_residents(state)
            digest = _layout_digest(state)
        except Exception as exc:  # noqa: BLE001 - re-raised below, after the other ranks heard about it
            error = exc
        self._pending_agreement = None  # from here on this rank is in the agreement itself
        digests = self._agree("agree_layout", error, extra=digest)
        if error is not None:
            raise error
        if len(set(digests)) > 1:
            raise ValueError(
                "distributed layerwise offload: ranks hold different models (block layouts differ: "
                f"{[d[:8] for d in digests]}); every rank must load the same model and pipeline"
            )
        self._pending_agreement = "agree_local"  # the ranks agreed: a failure from here on is told at agree_local

    def _check_and_place_residents(self, state: LayerwiseState) -> None:
        layers = self.config.resident_layers
        if layers:
            main = state.weights[0]
            if layers > len(main):
                raise ValueError(
                    f"resident_layers={layers} exceeds the {len(main)} blocks of {state.stacks[0].name!r}; allowed: "
                    f"0..{len(main)}"
                )
            for i in range(layers):
                state.resident[0][i] = True
        flat = [(w, r) for ws, rs in zip(state.weights, state.resident) for w, r in zip(ws, rs)]
        stats = state.stats
        stats.streamed_blocks = sum(1 for w, r in flat if not r and not w.empty)
        stats.resident_blocks = sum(1 for w, r in flat if r and not w.empty)
        stats.streamed_bytes_per_pass = sum(w.nbytes for w, r in flat if not r)

    def _count_host_bytes(self, state: LayerwiseState, journal: Journal) -> None:
        """Host bytes per dtype of the packed blocks, as each block's store holds them (a full host copy without
        AllGather, this rank's shard with it; resident blocks: their full host copy)."""
        per_dtype: dict[str, int] = {}
        for row_weights, row in zip(state.weights, state.streamed):
            for weights, block in zip(row_weights, row):
                if weights.empty:
                    continue
                held = (block.store.host_bytes_per_dtype if block is not None
                        else {d: n * d.itemsize for d, n in weights.numel.items()})
                for dtype, nbytes in held.items():
                    per_dtype[str(dtype)] = per_dtype.get(str(dtype), 0) + nbytes
        state.stats.host_bytes_per_dtype = per_dtype
        logger.info("distributed offload rank %d/%d: host copies %s (of %s)", self.rank, self.world_size,
                    format_bytes(sum(per_dtype.values())),
                    format_bytes(sum(w.nbytes for row in state.weights for w in row)))

    def _prime(self, state: LayerwiseState, journal: Journal) -> None:
        super()._prime(state, journal)  # AllGather: the first blocks' gathers are collectives
        self._pending_agreement = "agree_primed"  # past them: a failure now is told at agree_primed

    def _forward_lock(self) -> ForwardLock:
        # Waiting would not help: this rank's collectives (block gathers, the step check) must come in the order of
        # every other rank's, and two threads taking turns on one rank interleave their calls in any order.
        return ForwardLock(
            f"distributed layerwise offload (rank {self.rank}/{self.world_size})",
            refusal=(
                "distributed layerwise offload runs every rank in lockstep (its forwards and step checks are "
                "collectives that must come in the same order on every rank), so each rank's pipeline and DiT calls "
                "must come from one thread at a time; nothing was run for this call. Allowed: call from one "
                "thread per rank (queue concurrent requests to one worker thread), or use "
                "enable_layerwise_offload() in each process, which serves concurrent callers one after another"
            ),
        )

    def _inference_only(self, state: LayerwiseState, label: str) -> str:
        return super()._inference_only(state, label).replace("() first", "() on every rank first")

    def _install_step_check(self, state: LayerwiseState, journal: Journal) -> None:
        from .dataparallel import install_step_check

        remove = install_step_check(state.target, self.group, lock=state.lock)
        if remove is not None:
            journal.record("remove step check", remove)
            self._remove_step_check = remove

    def _guard_installer(self, state: LayerwiseState, guards: Journal) -> GuardInstaller:
        # Disabling and enabling are collective, so nothing may suspend the offload on one rank.
        installer = super()._guard_installer(state, guards)
        installer.suspend = None
        installer.suspend_refusal = ("disabling and enabling distributed offload are collective; do it on every "
                                     "rank")
        installer.way_out = installer.way_out.replace("()", "() on every rank")
        return installer

    # Disable ---------------------------------------------------------------------------------------------

    def disable(self) -> None:
        """Collective, like enable. Refused (``ConcurrentCallError``, nothing changed) while another thread of this
        rank runs a forward: the lock is taken before the guards come off."""
        state = self._state
        if not self._enabled or state is None or state.lock is None:
            return super().disable()
        with state.lock:
            super().disable()

    def _disable(self) -> None:
        self._remove_step_check_hook()
        super()._disable()  # re-enters the forward lock disable() holds

    def _remove_step_check_hook(self) -> None:
        remove = self.__dict__.pop("_remove_step_check", None)
        if remove is not None:
            remove()


class AllGatherLayerwiseOffloadBackend(DistributedLayerwiseOffloadBackend):
    """Distributed layerwise offload in AllGather mode: each rank pins 1/N of every block (the shard store), and a
    block is rebuilt on the device by an all-gather of the shards before it runs (the all-gather transport). The
    enable steps, streamer and hooks are the no-AllGather mode's; only these parts differ."""

    use_allgather = True
    prime_is_collective = True

    def _shards(self) -> ShardGroup:
        return ShardGroup(self.group, self.rank, self.world_size)

    def _packing_progress(self) -> str:
        return f"distributed offload rank {self.rank}/{self.world_size}: packing shards"


def _layout_digest(state: LayerwiseState) -> str:
    """A hash of every block's path, tensor shapes and dtypes: equal on every rank that loaded the same model."""
    h = hashlib.sha256()
    for stack_weights, resident in zip(state.weights, state.resident):
        for w, r in zip(stack_weights, resident):
            h.update(f"{w.path}|{r}|".encode())
            for s in w.slots:
                h.update(f"{s.dtype}:{tuple(s.shape)}:{s.offset};".encode())
    return h.hexdigest()


__all__ = [
    "AllGatherLayerwiseOffloadBackend",
    "DistributedLayerwiseOffloadBackend",
    "all_gather_bytes",
    "host_bytes_per_rank",
    "require_process_group",
    "shard_numel",
    "shard_range",
]
