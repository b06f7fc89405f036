"""Block-sparse attention on CUDA: pooled block selection and FlashInfer's paged FA3 prefill.

A call ``[B, S, H, D]`` is cut into 128-row query blocks and 128-row key blocks (rows in ``layout.order``: the
RainFusion tile order when the model published a video geometry, the natural order otherwise). Each (batch, head)
picks its own key blocks:

* **selection**: per block, the mean of its Q rows and of its K rows; the score of (query block *i*, key block *j*)
  is ``mean_q_i · mean_k_j``. Forced blocks (the prefix and first-frame key blocks of a video geometry, and the query
  block's own diagonal block) rank first, then by score; equal scores rank by block index, the lower first. Two
  rules pick the kept blocks among the whole key blocks:

  - *top-k* (``sparsity``, ``select_blocks``): each query block keeps ``round((1 - sparsity) · key pages)`` pages,
    the partial tail (below) one of them, so its ``kept`` best whole key blocks are that count less the tail
    (``kept_blocks``);
  - *cumulative mass* (``mass_threshold``, ``select_blocks_by_mass`` then ``mass_kept``): each query block needs
    the smallest set, in rank order, whose share of ``softmax(scale · scores)`` over the whole key blocks reaches the
    threshold; the call keeps ONE count for every query block, the largest needed count rounded up to a bucket
    (``mass_kept``: a multiple of ``ceil(full blocks / 32)``, at most all of them), and each query block keeps its
    top blocks of that count in the same rank order. That is a superset of each row's needed set (every row still
    reaches its mass; most rows keep more than they need), and it makes the plan depend on the shape and the count
    only, so it is cached as under top-k.

  Query blocks of the prefix attend to every key block. Rows past the last whole key block (``S mod 128``) form a
  partial *tail* block that every query block keeps: one of the top-k count's pages, an extra page under cumulative
  mass (outside its count and its mass).
* **kernel** (``BlockSparseRunner``): heads become independent "requests" of FlashInfer's
  ``BatchPrefillWithPagedKVCacheWrapper`` (``backend="fa3"`` on sm_90): each (batch·head, query block) is one
  request whose KV pages are its kept key blocks (page size 128) and whose last page is the partial tail.
  FlashInfer's ``BlockSparseAttentionWrapper`` is the same kernel with one mask shared by all heads and ``S``
  divisible by 128; its ``VariableBlockSparseAttentionWrapper`` gives per-head masks but pages of one row, with Q,
  K and V copied heads-major; the paged wrapper used here gives per-head masks and the partial tail and reads K and
  V in place (pages are strided views of the inputs). Under top-k the number of pages per request depends only on
  the shape and ``kept``, so the plan (FlashInfer's host-side scheduling) is made once per signature and cached;
  each call only writes the selected page ids into the planned index buffer on the device (no host
  synchronisation). Under cumulative mass the kept count varies per call: the host reads one number, the largest
  needed count (one small synchronisation per call), buckets it and takes the cached plan of that count (planned on
  the first call of each bucket, at most ``MASS_PLAN_CACHE_SIZE`` kept per runner); no per-row host work.

A call runs in four stages (``prepare``, ``select``, ``attend``, ``finish``): one Triton launch that copies Q into
per-head rows and mean-pools every query and key block, one Triton launch that scores the blocks and writes the
kept page ids (top-k: each row's kept blocks found without sorting it, written in ascending block order; cumulative
mass: every block in rank order, a sort per row), FlashInfer's ``run``, and one Triton launch that writes the output
back to ``[B, S, H, D]``.

``block_mask`` / ``keep_mask`` and ``block_sparse_reference`` express the same selection as a token mask through
SDPA: the reference the tests (and the H200 benchmark) compare the kernel path against (``reference_mask`` computes
the selection itself in float32 PyTorch). ``ReferencePagedPrefill`` is a pure PyTorch implementation of the
paged-prefill contract (``plan``/``run``) for running the whole path on the CPU.
"""

from __future__ import annotations

import functools
import logging
import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

logger = logging.getLogger("diffusers_omni.attention")

BLOCK = 128
PLAN_CACHE_SIZE = 16
MASS_PLAN_CACHE_SIZE = 8  # cumulative-mass plans (one per bucketed kept count) kept per runner, least recent out
MASS_BUCKETS = 32  # cumulative mass: the kept count is rounded up to a multiple of ceil(full blocks / MASS_BUCKETS)
WORKSPACE_BYTES = 128 * 1024 * 1024
LOG2E = math.log2(math.e)


@dataclass(frozen=True)
class SparseLayout:
    """How the rows of a ``[B, S, H, D]`` self-attention call map onto blocks.

    Args:
        seq_len (`int`): ``S``.
        order (`torch.Tensor`, *optional*): a permutation of ``range(S)`` (CPU, int64): row ``r`` of the blocked
            sequence is row ``order[r]`` of the call. ``None``: natural order.
        dense_query_blocks (`int`): leading query blocks (after ``order``) that attend to every key block (a text
            or condition prefix).
        forced_key_blocks (`tuple[int, ...]`): key blocks every query block keeps (prefix, first frame).
        source (`str`): where the layout came from, for logs and reports.
    """

    seq_len: int
    order: torch.Tensor | None = None
    dense_query_blocks: int = 0
    forced_key_blocks: tuple[int, ...] = ()
    source: str = "geometry-free"

    @property
    def full_key_blocks(self) -> int:
        return self.seq_len // BLOCK

    @property
    def tail_rows(self) -> int:
        return self.seq_len % BLOCK

    @property
    def query_blocks(self) -> int:
        return -(-self.seq_len // BLOCK)

    @property
    def key_pages(self) -> int:
        """Key blocks per head in the paged layout: the full blocks plus the partial tail, if any."""
        return self.full_key_blocks + (1 if self.tail_rows else 0)

    @functools.cached_property
    def _signature(self) -> tuple:
        order = None if self.order is None else (self.order.numel(), int(self.order[:64].sum()), int(self.order.sum()))
        return (self.seq_len, order, self.dense_query_blocks, self.forced_key_blocks)

    def signature(self) -> tuple:
        """A hashable key for caches: equal for equal layouts."""
        return self._signature


def kept_blocks(layout: SparseLayout, sparsity: float) -> int:
    """Whole key blocks each sparse query block keeps under top-k.

    ``sparsity`` counts key pages (the whole blocks and the partial tail): a query block keeps
    ``round((1 - sparsity) · key_pages)`` pages, the tail always one of them, so the whole blocks are that count less
    the tail page (at S = 32,760: sparsity 0.8 keeps 50 of 255 whole blocks plus the tail, 51 of 256 pages) — the
    nominal share is the share of pages, hence of the kernel's work, a query block attends. At least the forced
    blocks plus the diagonal, at most all the whole blocks."""
    full, tail = layout.full_key_blocks, (1 if layout.tail_rows else 0)
    wanted = round((1.0 - sparsity) * layout.key_pages) - tail
    floor = min(full, len(set(layout.forced_key_blocks)) + 1)
    return max(floor, min(full, wanted))


def kept_pages(layout: SparseLayout, sparsity: float) -> int:
    """Key pages each sparse query block attends under top-k, of ``layout.key_pages``: ``kept_blocks`` and the tail."""
    return kept_blocks(layout, sparsity) + (1 if layout.tail_rows else 0)


def pool_blocks(x: torch.Tensor, rows: int) -> torch.Tensor:
    """Mean of each 128-row block of ``x`` ``[G, N, D]`` over its first ``rows`` rows, float32 ``[G, ceil(rows/128), D]``
    (a partial last block is averaged over the rows it has)."""
    g, _, d = x.shape
    full = rows // BLOCK
    pooled = x[:, : full * BLOCK].reshape(g, full, BLOCK, d).mean(2, dtype=torch.float32)
    if rows % BLOCK:
        tail = x[:, full * BLOCK : rows].mean(1, dtype=torch.float32, keepdim=True)
        pooled = torch.cat([pooled, tail], dim=1)
    return pooled


_forced_cache: dict[tuple, torch.Tensor] = {}


def _forced(layout: SparseLayout, mb: int, nb: int, device) -> torch.Tensor:
    """``[MB, NB]`` boolean: the forced key blocks of every query block and its diagonal (cached per layout)."""
    key = (layout.signature(), mb, nb, str(device))
    forced = _forced_cache.get(key)
    if forced is None:
        forced = torch.zeros(mb, nb, dtype=torch.bool)
        if layout.forced_key_blocks:
            forced[:, [j for j in layout.forced_key_blocks if j < nb]] = True
        diag = torch.arange(min(mb, nb))
        forced[diag, diag] = True
        forced = forced.to(device)
        if len(_forced_cache) > PLAN_CACHE_SIZE:
            _forced_cache.clear()
        _forced_cache[key] = forced
    return forced


def _rank_blocks(pooled_q: torch.Tensor, pooled_k: torch.Tensor,
                 layout: SparseLayout) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every (head, query block)'s whole key blocks in rank order: forced and diagonal blocks first, then by
    descending pooled score, equal scores by ascending block index (the order the selection kernel ranks by).

    Args:
        pooled_q (`torch.Tensor`): ``[G, query_blocks, D]``.
        pooled_k (`torch.Tensor`): ``[G, full_key_blocks, D]``.

    Returns:
        ``(scores, forced, order)``: ``[G, query_blocks, full_key_blocks]`` float32 scores, the ``[query_blocks,
        full_key_blocks]`` forced mask (``_forced``) and the int64 key blocks in rank order.
    """
    scores = torch.bmm(pooled_q, pooled_k.transpose(1, 2))  # [G, MB, NB]
    forced = _forced(layout, scores.shape[1], scores.shape[2], scores.device)
    ranked = scores.masked_fill(forced, float("inf"))
    return scores, forced, torch.sort(ranked, dim=-1, descending=True, stable=True).indices


def select_blocks(pooled_q: torch.Tensor, pooled_k: torch.Tensor, layout: SparseLayout, kept: int) -> torch.Tensor:
    """Top-``kept`` whole key blocks per (head, query block): the first ``kept`` of ``_rank_blocks``' order.

    Args:
        pooled_q (`torch.Tensor`): ``[G, query_blocks, D]``.
        pooled_k (`torch.Tensor`): ``[G, full_key_blocks, D]``.

    Returns:
        ``[G, query_blocks, kept]`` int64 key-block indices, ascending within a row (the order the selection kernel
        writes them in).
    """
    return _rank_blocks(pooled_q, pooled_k, layout)[2][..., :kept].sort(-1).values


def select_blocks_by_mass(pooled_q: torch.Tensor, pooled_k: torch.Tensor, layout: SparseLayout, threshold: float,
                          scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Cumulative-mass selection: per (head, query block), the forced and diagonal key blocks, then the best-scoring
    others until the kept blocks hold ``threshold`` of ``softmax(scale · mean_q · mean_kᵀ)`` over the whole key
    blocks (the smallest such set; the forced blocks' mass counts).

    Returns:
        ``(order, counts)``: ``[G, query_blocks, full_key_blocks]`` int64 key blocks in rank order (``_rank_blocks``),
        and ``[G, query_blocks]`` int64: row ``r`` keeps ``order[..., :counts]``.
    """
    scores, forced, order = _rank_blocks(pooled_q, pooled_k, layout)
    mass = torch.softmax(scores * scale, dim=-1)
    sorted_mass = mass.gather(-1, order)
    before = sorted_mass.cumsum(-1) - sorted_mass
    keep = forced.expand_as(scores).gather(-1, order) | (before < threshold)
    return order, keep.sum(-1)


def mass_kept(needed: int, full: int) -> int:
    """The one kept count of a cumulative-mass call whose largest needed count is ``needed``: rounded up to a
    multiple of ``max(1, ceil(full / MASS_BUCKETS))`` blocks, at most ``full`` (so at most ``MASS_BUCKETS`` distinct
    counts, hence plans, per shape)."""
    step = max(1, -(-full // MASS_BUCKETS))
    return min(full, -(-max(needed, 0) // step) * step)


def mass_selection(pooled_q: torch.Tensor, pooled_k: torch.Tensor, layout: SparseLayout, threshold: float,
                   scale: float) -> tuple[torch.Tensor, torch.Tensor, int]:
    """What a cumulative-mass call keeps: ``(order, needed, kept)`` with ``order``/``needed`` from
    ``select_blocks_by_mass`` and ``kept = mass_kept(max needed over the sparse query blocks)``; every sparse query
    block keeps ``order[..., :kept]`` (a superset of its needed ``order[..., :needed]``)."""
    order, needed = select_blocks_by_mass(pooled_q, pooled_k, layout, threshold, scale)
    sparse = needed[:, min(layout.dense_query_blocks, needed.shape[1]):]
    kept = mass_kept(int(sparse.max()) if sparse.numel() else 0, layout.full_key_blocks)
    return order, needed, kept


def mass_indices(order: torch.Tensor, counts: torch.Tensor | int) -> torch.Tensor:
    """``[G, MB, NB]`` boolean: the blocks ``order[..., :counts]`` (per row, or one count for all rows): the needed
    sets of ``select_blocks_by_mass``, or with ``mass_selection``'s ``kept`` what a call keeps."""
    if isinstance(counts, int):
        counts = torch.full(order.shape[:-1], counts, dtype=torch.int64, device=order.device)
    keep = torch.arange(order.shape[-1], device=order.device) < counts[..., None]
    mask = torch.zeros(order.shape, dtype=torch.bool, device=order.device)
    return mask.scatter_(-1, order, keep)


def block_mask(indices: torch.Tensor, layout: SparseLayout) -> torch.Tensor:
    """``[G, query_blocks, key_pages]`` boolean: selected blocks, the tail block, and dense prefix query blocks."""
    g, mb, _ = indices.shape
    mask = torch.zeros(g, mb, layout.key_pages, dtype=torch.bool, device=indices.device)
    mask.scatter_(2, indices, True)
    if layout.tail_rows:
        mask[:, :, -1] = True
    mask[:, : layout.dense_query_blocks] = True
    return mask


def token_mask(mask: torch.Tensor, layout: SparseLayout) -> torch.Tensor:
    """A block mask expanded to ``[G, S, S]`` booleans in the call's own row order (True: attend)."""
    s = layout.seq_len
    expanded = mask.repeat_interleave(BLOCK, 1).repeat_interleave(BLOCK, 2)[:, :s, :s]
    if layout.order is None:
        return expanded
    inverse = torch.empty_like(layout.order)
    inverse[layout.order] = torch.arange(s)
    inverse = inverse.to(mask.device)
    return expanded[:, inverse][:, :, inverse]


def block_sparse_reference(query, key, value, layout: SparseLayout, mask: torch.Tensor, scale=None) -> torch.Tensor:
    """The selection ``mask`` applied as a token mask through SDPA (float32): the reference for the kernel path."""
    b, s, h, d = query.shape
    tokens = token_mask(mask, layout).view(b, h, s, s)
    q, k, v = (x.float().permute(0, 2, 1, 3) for x in (query, key, value))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=tokens, scale=scale).permute(0, 2, 1, 3)


def keep_mask(keep: torch.Tensor, layout: SparseLayout) -> torch.Tensor:
    """``[G, query_blocks, full_key_blocks]`` kept blocks → the ``[G, query_blocks, key_pages]`` block mask, with the
    tail block and the dense prefix rows (as ``block_mask``)."""
    g, mb, nb = keep.shape
    mask = torch.ones(g, mb, layout.key_pages, dtype=torch.bool, device=keep.device)
    mask[:, :, :nb] = keep
    mask[:, : layout.dense_query_blocks] = True
    return mask


def _reference_pooled(query, key, layout: SparseLayout) -> tuple[torch.Tensor, torch.Tensor]:
    b, s, h, d = query.shape
    order = layout.order if layout.order is not None else torch.arange(s)
    qt, kt = (x.float().permute(0, 2, 1, 3)[:, :, order.to(x.device)].reshape(b * h, s, d) for x in (query, key))
    return pool_blocks(qt, s), pool_blocks(kt, layout.full_key_blocks * BLOCK)


def reference_selection(query, key, layout: SparseLayout, sparsity: float) -> torch.Tensor:
    """``select_blocks`` computed straight from ``[B, S, H, D]`` inputs (float32 pooling), for tests."""
    pooled_q, pooled_k = _reference_pooled(query, key, layout)
    return select_blocks(pooled_q, pooled_k, layout, kept_blocks(layout, sparsity))


def reference_mask(query, key, layout: SparseLayout, sparsity: float | None = None, *,
                   mass_threshold: float | None = None, scale: float | None = None) -> torch.Tensor:
    """The ``[B·H, query_blocks, key_pages]`` block mask either selection gives, computed in float32 PyTorch from
    ``[B, S, H, D]`` inputs: what the tests and the H200 run compare the kernels' selection with (cumulative mass:
    the call's bucketed count for every query block, ``mass_selection``)."""
    pooled_q, pooled_k = _reference_pooled(query, key, layout)
    if mass_threshold is None:
        return block_mask(select_blocks(pooled_q, pooled_k, layout, kept_blocks(layout, sparsity)), layout)
    scale = scale if scale is not None else query.shape[-1] ** -0.5
    order, _, kept = mass_selection(pooled_q, pooled_k, layout, mass_threshold, scale)
    return keep_mask(mass_indices(order, kept), layout)


def _interpreting() -> bool:
    import os

    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "yes", "on")


def _use_triton(x: torch.Tensor) -> bool:
    """Triton kernels on CUDA (and on CPU under ``TRITON_INTERPRET=1``); PyTorch otherwise."""
    if x.device.type != "cuda" and not _interpreting():
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


# The selection kernel holds a row of scores per query block in registers (and, for cumulative mass, sorts it): up to
# this many key blocks (524,288 tokens); longer sequences select in PyTorch.
MAX_TRITON_KEY_BLOCKS = 4096
_SELECT_ROWS = 16  # query blocks per selection program (tl.dot needs 16)


def _select_configs_to_time(configs, named_args, **kwargs):
    """The selection launch configurations worth timing: those whose threads hold at most 64 of a program's
    ``BQ · NBP`` int64 keys (with fewer warps they spill to local memory: slower, and compiling them only adds to the
    first call), else the one with the most warps. Top-k (``MASS=False``) times at most 8 warps of those: it does not
    sort but sums each row once per key bit it searches, and a row spread over more warps adds a cross-warp step to
    every sum."""
    keys = kwargs["BQ"] * kwargs["NBP"]
    fitting = [config for config in configs if keys <= 64 * 32 * config.num_warps]
    if not kwargs["MASS"]:
        fitting = [config for config in fitting if config.num_warps <= 8]
    return fitting or [max(configs, key=lambda config: config.num_warps)]


@functools.lru_cache(maxsize=2)
def _kernels(interpret: bool):
    """The Triton kernels, built once per ``interpret`` (``TRITON_INTERPRET=1``, what the CPU tests run).

    The prepare and select kernels pick their launch configuration by timing each one on the first call of a key
    (``triton.autotune``: the shape arguments and the dtypes): the pooling pass is bound by how many loads are in
    flight, which its rows per tile and warps set; the selection by how many keys each thread holds. Both
    overwrite their outputs and read none of them, so the repeated timing runs leave the results as one run does.
    The interpreter gets one configuration (nothing to time on the CPU), with tiles of 32 rows so that the pooling
    loop runs more than once per block.
    """
    import triton
    import triton.language as tl

    if interpret:
        prepare_configs = [triton.Config({"TILE": 32}, num_warps=4)]
        select_configs = [triton.Config({}, num_warps=4)]
    else:
        prepare_configs = [triton.Config({"TILE": tile}, num_warps=warps) for tile in (32, 64, 128) for warps in (4, 8)]
        select_configs = [triton.Config({}, num_warps=warps) for warps in (4, 8, 16)]

    @triton.jit
    def _gather_kernel(src_ptr, order_ptr, dst_ptr, rows_out, H, stride_b, stride_s, stride_h,
                       D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_ROWS: tl.constexpr, TILE: tl.constexpr,
                       ORDERED: tl.constexpr):
        # [B, S, H, D] (any strides) -> dst [B*H, rows_out, D]: row r of head g is source row order[r] (or r).
        g = tl.program_id(0)
        blk = tl.program_id(1)
        b = g // H
        h = g % H
        cols = tl.arange(0, BLOCK_D)
        col_ok = cols < D
        for r in range(0, BLOCK_ROWS, TILE):
            pos = blk * BLOCK_ROWS + r + tl.arange(0, TILE)
            row_ok = pos < rows_out
            if ORDERED:
                src_row = tl.load(order_ptr + pos, mask=row_ok, other=0)
            else:
                src_row = pos
            ok = row_ok[:, None] & col_ok[None, :]
            x = tl.load(src_ptr + b * stride_b + h * stride_h + src_row[:, None] * stride_s + cols[None, :], mask=ok,
                        other=0.0)
            tl.store(dst_ptr + (g * rows_out + pos)[:, None] * D + cols[None, :], x, mask=ok)

    @triton.jit
    def _scatter_kernel(src_ptr, order_ptr, dst_ptr, S, H, stride_b, stride_s, stride_h,
                        D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_ROWS: tl.constexpr, TILE: tl.constexpr,
                        ORDERED: tl.constexpr):
        # src [B*H, S, D] contiguous -> dst [B, S, H, D]: row r of head g goes to row order[r] (or r).
        g = tl.program_id(0)
        blk = tl.program_id(1)
        b = g // H
        h = g % H
        cols = tl.arange(0, BLOCK_D)
        col_ok = cols < D
        for r in range(0, BLOCK_ROWS, TILE):
            pos = blk * BLOCK_ROWS + r + tl.arange(0, TILE)
            row_ok = pos < S
            if ORDERED:
                dst_row = tl.load(order_ptr + pos, mask=row_ok, other=0)
            else:
                dst_row = pos
            ok = row_ok[:, None] & col_ok[None, :]
            x = tl.load(src_ptr + (g * S + pos)[:, None] * D + cols[None, :], mask=ok, other=0.0)
            tl.store(dst_ptr + b * stride_b + h * stride_h + dst_row[:, None] * stride_s + cols[None, :], x, mask=ok)

    @triton.autotune(configs=prepare_configs, key=["H", "MB", "NB", "D", "ORDERED", "GATHER_Q"])
    @triton.jit
    def _prepare_kernel(q_ptr, k_ptr, order_ptr, qt_ptr, pooled_ptr, S, H, MB, NB,
                        sqb, sqs, sqh, skb, sks, skh,
                        D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_ROWS: tl.constexpr, TILE: tl.constexpr,
                        ORDERED: tl.constexpr, GATHER_Q: tl.constexpr):
        # One launch for both inputs. Programs blk < MB: query block blk of head g (copied to qt[g] in blocked row
        # order with GATHER_Q) and its mean; programs blk >= MB: the mean of whole key block blk - MB. Means go to
        # pooled[g, blk] ([G, MB + NB, D] float32: query blocks, then key blocks). The sum is kept per row of the tile
        # (masked rows load 0) and reduced across rows once, after the loop: a reduction per tile crosses warps
        # (shared memory and a barrier) and holds back the next tile's loads.
        g = tl.program_id(0)
        blk = tl.program_id(1)
        b = g // H
        h = g % H
        cols = tl.arange(0, BLOCK_D)
        col_ok = cols < D
        is_q = blk < MB
        src = tl.where(is_q, q_ptr + b.to(tl.int64) * sqb + h.to(tl.int64) * sqh,
                       k_ptr + b.to(tl.int64) * skb + h.to(tl.int64) * skh)
        stride = tl.where(is_q, sqs, sks).to(tl.int64)
        j = tl.where(is_q, blk, blk - MB)
        valid = tl.where(is_q, S, NB * BLOCK_ROWS)
        acc = tl.zeros([TILE, BLOCK_D], tl.float32)
        for r in range(0, BLOCK_ROWS, TILE):
            pos = j * BLOCK_ROWS + r + tl.arange(0, TILE)
            row_ok = pos < valid
            if ORDERED:
                src_row = tl.load(order_ptr + pos, mask=row_ok, other=0)
            else:
                src_row = pos
            ok = row_ok[:, None] & col_ok[None, :]
            x = tl.load(src + src_row[:, None].to(tl.int64) * stride + cols[None, :], mask=ok, other=0.0)
            if GATHER_Q:
                dst = qt_ptr + (g.to(tl.int64) * S + pos)[:, None] * D + cols[None, :]
                q_rows = tl.where(is_q, S, 0)  # (a tensor bound: the interpreter rejects scalar-bool masks)
                tl.store(dst, x, mask=(pos < q_rows)[:, None] & col_ok[None, :])
            acc += x.to(tl.float32)
        count = tl.minimum(valid - j * BLOCK_ROWS, BLOCK_ROWS)
        tl.store(pooled_ptr + (g.to(tl.int64) * (MB + NB) + blk) * D + cols, tl.sum(acc, axis=0) / count, mask=col_ok)

    @triton.autotune(configs=select_configs, key=["H", "MB", "NB", "D", "MASS"],
                     prune_configs_by={"early_config_prune": _select_configs_to_time})
    @triton.jit
    def _select_kernel(pooled_ptr, forced_ptr, out_ptr, count_ptr, MB, NB, dense_rows, n_sparse, kept, H,
                       base_b, base_h, mult, out_sg, out_sr, threshold, scale_log2,
                       D: tl.constexpr, BLOCK_D: tl.constexpr, NBP: tl.constexpr, BQ: tl.constexpr,
                       DC: tl.constexpr, MASS: tl.constexpr):
        # BQ sparse query blocks of head g: scores against every whole key block (pooled means, float32), ranked by
        # one int64 key per (query block, key block). Top-k finds the kept blocks without sorting and writes their
        # page ids (block · mult + the head's base page) in ascending block order to out[g, r, :kept]; MASS sorts the
        # keys and writes every block's page id in rank order to out[g, r, :NB] and the count that reaches the mass
        # to count[g, r].
        g = tl.program_id(0)
        r = tl.program_id(1) * BQ + tl.arange(0, BQ)
        r_ok = r < n_sparse
        i = dense_rows + r
        j = tl.arange(0, NBP)
        j_ok = j < NB
        row0 = g.to(tl.int64) * (MB + NB)
        acc = tl.zeros([BQ, NBP], tl.float32)
        for d0 in tl.static_range(0, BLOCK_D, DC):
            dd = d0 + tl.arange(0, DC)
            d_ok = dd < D
            a = tl.load(pooled_ptr + (row0 + i)[:, None] * D + dd[None, :], mask=r_ok[:, None] & d_ok[None, :],
                        other=0.0)
            bt = tl.load(pooled_ptr + (row0 + MB + j)[None, :] * D + dd[:, None], mask=j_ok[None, :] & d_ok[:, None],
                         other=0.0)
            acc += tl.dot(a, bt, input_precision="ieee")
        forced = (tl.load(forced_ptr + j, mask=j_ok, other=0) != 0)[None, :] | (j[None, :] == i[:, None])
        bits = acc.to(tl.int32, bitcast=True).to(tl.int64)
        ordered = tl.where(bits >= 0, bits + 2147483648, -bits - 1)  # float order as unsigned 32-bit
        # One int64 key per (query block, key block), the larger the better: forced bit | score bits | reversed block
        # index (20 bits), so equal scores rank the lower block first and the keys of a row are distinct.
        key = (forced.to(tl.int64) << 52) | (ordered << 20) | (NBP - 1 - j)[None, :]
        key = tl.where(j_ok[None, :], key, -1)
        base = (g // H) * base_b + (g % H) * base_h
        dst = out_ptr + g.to(tl.int64) * out_sg + r[:, None] * out_sr
        if MASS:
            key = tl.sort(key, dim=1, descending=True)  # rank order
            blocks = (NBP - 1) - (key & 1048575)
            unsigned = (key >> 20) & 4294967295
            score = tl.where(unsigned >= 2147483648, unsigned - 2147483648, -unsigned - 1)
            score = score.to(tl.int32).to(tl.float32, bitcast=True)
            valid = key >= 0
            top = tl.max(tl.where(j_ok[None, :], acc, float("-inf")), axis=1)
            p = tl.where(valid, tl.exp2((score - top[:, None]) * scale_log2), 0.0)
            before = tl.cumsum(p, axis=1) - p
            keep = valid & (((key >> 52) != 0) | (before < threshold * tl.sum(p, axis=1)[:, None]))
            n_keep = tl.sum(keep.to(tl.int32), axis=1)
            tl.store(count_ptr + g * n_sparse + r, n_keep, mask=r_ok)
            pos = tl.arange(0, NBP)[None, :]
            tl.store(dst + pos, (blocks * mult + base).to(tl.int32), mask=r_ok[:, None] & (pos < NB))
        else:
            # No sort: per row, a threshold t that exactly `kept` keys reach (keys are distinct, so those are the row's
            # top `kept`), found bit by bit from the top (a radix select): a bit of t stays set when at least `kept`
            # keys still reach t with it. A row is settled once exactly `kept` do; the search stops when every row is
            # (rows past the last sparse query block count as settled), at the latest after the last bit, where t is
            # the kept-th largest key.
            t = tl.zeros([BQ], tl.int64)
            reached = tl.where(r_ok, NB, kept)  # keys >= t, per row
            step = tl.full([], 1 << 52, tl.int64)  # the key's top bit
            while (step > 0) & (tl.max(reached, axis=0) > kept):
                candidate = t | step
                count = tl.sum((key >= candidate[:, None]).to(tl.int32), axis=1)
                t = tl.where(count >= kept, candidate, t)
                reached = tl.where(count >= kept, count, reached)
                step = step >> 1
            keep = key >= t[:, None]
            # Written compactly in ascending block order: a kept block's slot is the number of kept blocks before it
            # (exactly `kept` are kept; the bound only guards the neighbouring rows' pages).
            slot = tl.cumsum(keep.to(tl.int32), axis=1) - keep.to(tl.int32)
            tl.store(dst + slot, (j[None, :] * mult + base).to(tl.int32), mask=r_ok[:, None] & keep & (slot < kept))

    return _gather_kernel, _scatter_kernel, _prepare_kernel, _select_kernel


def _block_d(d: int) -> int:
    return 1 << max(d - 1, 0).bit_length()


def gather_heads(x: torch.Tensor, order: torch.Tensor | None, rows_out: int) -> torch.Tensor:
    """``[B, S, H, D]`` → ``[B·H, rows_out, D]`` (row ``r`` of a head is input row ``order[r]``, or ``r``)."""
    b, s, h, d = x.shape
    if not _use_triton(x):
        rows = order if order is not None else torch.arange(rows_out, device=x.device)
        return x.permute(0, 2, 1, 3).index_select(2, rows).reshape(b * h, rows_out, d)
    gather = _kernels(_interpreting())[0]
    out = torch.empty(b * h, rows_out, d, device=x.device, dtype=x.dtype)
    gather[(b * h, -(-rows_out // BLOCK))](
        x, order if order is not None else out, out, rows_out, h, x.stride(0), x.stride(1), x.stride(2),
        D=d, BLOCK_D=_block_d(d), BLOCK_ROWS=BLOCK, TILE=32, ORDERED=order is not None,
    )
    return out


def scatter_heads(src: torch.Tensor, order: torch.Tensor | None, batch: int) -> torch.Tensor:
    """Inverse of ``gather_heads``: ``[B·H, S, D]`` → ``[B, S, H, D]`` contiguous."""
    g, s, d = src.shape
    h = g // batch
    out = torch.empty(batch, s, h, d, device=src.device, dtype=src.dtype)
    if not _use_triton(src):
        view = src.view(batch, h, s, d).transpose(1, 2)
        if order is None:
            out.copy_(view)
        else:
            out.index_copy_(1, order, view)
        return out
    scatter = _kernels(_interpreting())[1]
    scatter[(g, -(-s // BLOCK))](
        src, order if order is not None else src, out, s, h, out.stride(0), out.stride(1), out.stride(2),
        D=d, BLOCK_D=_block_d(d), BLOCK_ROWS=BLOCK, TILE=32, ORDERED=order is not None,
    )
    return out


def heads_major(x: torch.Tensor) -> torch.Tensor | None:
    """``[B, S, H, D]`` whose memory is ``[B, H, S, D]`` (a processor that wrote its RoPE output heads-major) as the
    ``[B·H, S, D]`` view the kernel reads, without a copy; ``None`` for any other layout."""
    b, s, h, d = x.shape
    heads = x.permute(0, 2, 1, 3)
    return heads.view(b * h, s, d) if heads.is_contiguous() else None


def pool_and_gather(query: torch.Tensor, key: torch.Tensor, layout: SparseLayout, order: torch.Tensor | None,
                    gather_q: bool = True) -> tuple[torch.Tensor | None, torch.Tensor]:
    """The first stage of a call, one Triton launch: the query rows per head in blocked order (``[B·H, S, D]``;
    ``None`` without ``gather_q``) and the float32 block means ``[B·H, query_blocks + full_key_blocks, D]`` (query
    blocks, then whole key blocks, rows in ``order``: ``[key_pages·128]`` int64, or ``None``)."""
    b, s, h, d = query.shape
    groups, mb, nb = b * h, layout.query_blocks, layout.full_key_blocks
    if not _use_triton(query):
        rows = order[:s] if order is not None else torch.arange(s, device=query.device)
        qt = query.permute(0, 2, 1, 3).index_select(2, rows).reshape(groups, s, d)
        kt = key.permute(0, 2, 1, 3).index_select(2, rows[: nb * BLOCK]).reshape(groups, nb * BLOCK, d)
        pooled = torch.cat([pool_blocks(qt, s), pool_blocks(kt, nb * BLOCK)], dim=1)
        return (qt if gather_q else None), pooled
    prepare = _kernels(_interpreting())[2]
    qt = torch.empty(groups, s, d, device=query.device, dtype=query.dtype) if gather_q else None
    pooled = torch.empty(groups, mb + nb, d, device=query.device, dtype=torch.float32)
    prepare[(groups, mb + nb)](
        query, key, order if order is not None else pooled, qt if gather_q else pooled, pooled, s, h, mb, nb,
        query.stride(0), query.stride(1), query.stride(2), key.stride(0), key.stride(1), key.stride(2),
        D=d, BLOCK_D=_block_d(d), BLOCK_ROWS=BLOCK, ORDERED=order is not None, GATHER_Q=gather_q,
    )
    return qt, pooled


def strided_pages(x: torch.Tensor) -> torch.Tensor | None:
    """``[B, S, H, D]`` seen as 128-row KV pages without a copy: page ``p = (b·S·H + j·128·H + h)`` (for a
    contiguous ``x``; ``page_id`` in general) holds rows ``j·128 …`` of head ``h``. The page stride is the head
    stride, so pages overlap in memory; FlashInfer's paged kernel addresses ``page·stride(0) + row·stride(1)`` and
    reads only the rows a page's length allows. The declared page count is 1 (only strides are read). ``None`` when
    the strides do not allow it (the caller copies instead)."""
    b, s, h, d = x.shape
    sb, ss, sh, sd = x.stride()
    if sd != 1 or sh <= 0 or ss % sh or sb % sh or s < BLOCK:
        return None
    return x.as_strided((1, BLOCK, 1, d), (sh, ss, sh, 1), x.storage_offset())


def page_ids(x: torch.Tensor, blocks: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    """Page ids of key block ``blocks`` of group ``groups`` (``b·H + h``) in ``strided_pages(x)``."""
    b, s, h, d = x.shape
    sb, ss, sh, _ = x.stride()
    return (groups // h) * (sb // sh) + blocks * (BLOCK * ss // sh) + (groups % h)


@dataclass
class _Plan:
    """A planned wrapper, planned once per signature (shape, layout, kept count, …): ``selected`` is the view of the
    planned index buffer where each call writes its page ids (top-k, and cumulative mass at its bucketed count)."""

    wrapper: object
    mult: int  # page id = block · mult + base[group]
    base: torch.Tensor  # [G] int64, on the device
    base_b: int  # base[g] = (g // heads) · base_b + (g % heads) · base_h
    base_h: int
    kv_indptr: torch.Tensor  # host int32, of the latest plan
    indices: torch.Tensor | None = None  # the planned device index buffer
    selected: torch.Tensor | None = None


@dataclass
class _MassState:
    """The device buffers of cumulative-mass calls of one signature: every sparse query block's page ids in rank
    order (``ranked``, ``[G, sparse rows, full_key_blocks]`` int32) and its needed count (``counts``)."""

    mult: int
    base: torch.Tensor  # [G] int64, on the device
    base_b: int
    base_h: int
    ranked: torch.Tensor
    counts: torch.Tensor


@dataclass
class BlockSparseCall:
    """One call between the runner's stages (``prepare`` → ``select`` → ``attend`` → ``finish``)."""

    query: torch.Tensor
    layout: SparseLayout
    scale: float | None
    kept: int | None  # top-k count; cumulative mass: None until ``plan_call`` sets the call's bucketed count
    mass_threshold: float | None
    order: torch.Tensor | None
    qt: torch.Tensor  # [G, S, D] query rows per head
    pooled: torch.Tensor  # [G, MB + NB, D] float32 block means
    k_pages: torch.Tensor
    v_pages: torch.Tensor
    plan: _Plan | None  # cumulative mass: set by ``plan_call``
    addressing: tuple = ()
    mass: _MassState | None = None
    out: torch.Tensor | None = None


def flashinfer_paged_factory(device: torch.device):
    """``BatchPrefillWithPagedKVCacheWrapper(backend="fa3")`` on a per-device 128 MiB workspace."""
    import flashinfer

    workspace = _workspaces.get(device)
    if workspace is None:
        workspace = _workspaces[device] = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
    return flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, kv_layout="NHD", backend="fa3")


_workspaces: dict[torch.device, torch.Tensor] = {}
_announced: set[tuple] = set()


class BlockSparseRunner:
    """Runs a selection through a paged-prefill wrapper; plans cached per (shape, layout, kept, dtype, scale, page
    addressing): top-k in one LRU of ``PLAN_CACHE_SIZE``, cumulative mass (one plan per bucketed kept count) in its
    own LRU of ``MASS_PLAN_CACHE_SIZE``.

    A call is four stages, each a method (the H200 benchmark times them one by one):

    1. ``prepare``: one Triton launch copies Q into per-head rows (no copy when Q is already heads-major) and
       mean-pools every query block and every whole key block; K and V are read in place as pages.
    2. ``select``: one Triton launch scores each query block against every key block and writes the kept blocks'
       page ids, in ascending block order, into the planned index buffer (top-k: no host synchronisation).
       Cumulative mass writes every block's page id in rank order and each query block's needed count; the host
       reads their maximum (one small synchronisation), buckets it (``mass_kept``) and copies that many page ids per
       query block into the cached plan of that count.
    3. ``attend``: the wrapper's ``run``.
    4. ``finish``: the output rows back to ``[B, S, H, D]``.

    Args:
        wrapper_factory (`Callable`, *optional*): ``(device) -> wrapper`` with FlashInfer's paged-prefill
            ``plan``/``run``; defaults to FlashInfer's FA3 wrapper (``ReferencePagedPrefill`` runs anywhere).
    """

    def __init__(self, wrapper_factory: Callable | None = None) -> None:
        self._factory = wrapper_factory or flashinfer_paged_factory
        self._plans: OrderedDict[tuple, _Plan] = OrderedDict()
        self._mass_plans: OrderedDict[tuple, _Plan] = OrderedDict()
        self._mass_states: OrderedDict[tuple, _MassState] = OrderedDict()
        self._orders: dict[tuple, tuple[torch.Tensor | None, torch.Tensor]] = {}
        self.plan_count = 0
        self.host_syncs = 0  # host synchronisations of the selection (cumulative mass: one small read per call)
        self.last_kept_share = 0.0

    def _order(self, layout: SparseLayout, device) -> tuple[torch.Tensor | None, torch.Tensor]:
        """(query order [S] or ``None``, key order padded to key_pages·128 rows with repeats of real rows)."""
        key = (layout.signature(), str(device))
        cached = self._orders.get(key)
        if cached is None:
            order = layout.order if layout.order is not None else torch.arange(layout.seq_len)
            pad = layout.key_pages * BLOCK - layout.seq_len
            padded = torch.cat([order, order[:pad]]) if pad else order
            cached = (layout.order.to(device) if layout.order is not None else None, padded.to(device))
            if len(self._orders) > PLAN_CACHE_SIZE:
                self._orders.clear()
            self._orders[key] = cached
        return cached

    def _announce(self, dtype, head_dim: int) -> None:
        if self._factory is flashinfer_paged_factory and (dtype, head_dim) not in _announced:
            _announced.add((dtype, head_dim))
            logger.info("block-sparse attention: loading FlashInfer's paged FA3 prefill for %s head_dim=%d (a first "
                        "use on a machine compiles it, ~90 s; `diffusers-omni warmup` does it ahead of time)",
                        str(dtype).replace("torch.", ""), head_dim)

    @staticmethod
    def _cache(store: OrderedDict, key: tuple, value, size: int):
        store[key] = value
        if len(store) > size:
            store.popitem(last=False)
        return value

    @staticmethod
    def _bases(groups: int, layout: SparseLayout, addressing: tuple) -> tuple[int, int, int, torch.Tensor]:
        if addressing[0] == "strided":  # pages of the input itself (strided_pages)
            _, per_batch, mult, heads = addressing
            base_b, base_h = per_batch, 1
        else:  # gathered [G, pages·128, D] copies
            heads = addressing[1]
            mult, base_b, base_h = 1, heads * layout.key_pages, layout.key_pages
        g = torch.arange(groups)
        return mult, base_b, base_h, (g // heads) * base_b + (g % heads) * base_h

    def _plan(self, groups: int, layout: SparseLayout, kept: int, head_dim: int, dtype, scale, device,
              addressing: tuple, mass: bool = False) -> _Plan:
        """The plan of ``kept`` pages (plus the tail) per sparse request, cached (``mass``: in the mass LRU)."""
        store, size = (self._mass_plans, MASS_PLAN_CACHE_SIZE) if mass else (self._plans, PLAN_CACHE_SIZE)
        key = (groups, layout.signature(), kept, head_dim, dtype, scale, str(device), addressing)
        plan = store.get(key)
        if plan is not None:
            store.move_to_end(key)
            return plan
        s, mb, pages, full = layout.seq_len, layout.query_blocks, layout.key_pages, layout.full_key_blocks
        tail = 1 if layout.tail_rows else 0
        dense_rows = min(layout.dense_query_blocks, mb)
        mult, base_b, base_h, base = self._bases(groups, layout, addressing)
        qo_indptr, last_len = self._request_rows(groups, layout)
        per_request = torch.full((groups, mb), kept + tail, dtype=torch.int32)
        per_request[:, :dense_rows] = pages
        kv_indptr = F.pad(torch.cumsum(per_request.reshape(-1), 0, dtype=torch.int32), (1, 0))
        # Constant parts of the page table (dense prefix rows, the tail page) are written once, here.
        every = torch.arange(pages)[None, None, :] * mult + base[:, None, None]  # [G, 1, pages]
        dense = every.expand(groups, dense_rows, pages).reshape(groups, -1)
        sparse = torch.zeros(groups, mb - dense_rows, kept + tail, dtype=torch.int64)
        if tail:
            sparse[:, :, -1] = (full * mult + base)[:, None]
        table = torch.cat([dense, sparse.reshape(groups, -1)], dim=1)
        indices = table.reshape(-1).to(torch.int32).to(device)
        selected = indices.view(groups, -1)[:, dense.shape[1]:].view(groups, mb - dense_rows, kept + tail)[..., :kept]
        self._announce(dtype, head_dim)
        wrapper = self._factory(device)
        wrapper.plan(qo_indptr, kv_indptr, indices, last_len, 1, 1, head_dim, BLOCK, causal=False, sm_scale=scale,
                     q_data_type=dtype, kv_data_type=dtype, o_data_type=dtype)
        self.plan_count += 1
        plan = _Plan(wrapper, mult, base.to(device), base_b, base_h, kv_indptr, indices=indices, selected=selected)
        return self._cache(store, key, plan, size)

    @staticmethod
    def _request_rows(groups: int, layout: SparseLayout) -> tuple[torch.Tensor, torch.Tensor]:
        """Host ``qo_indptr`` (one 128-row query block per request) and every request's last page length."""
        s, mb = layout.seq_len, layout.query_blocks
        starts = torch.arange(0, s, BLOCK, dtype=torch.int32)
        qo = (torch.arange(groups, dtype=torch.int32)[:, None] * s + starts[None, :]).reshape(-1)
        qo_indptr = torch.cat([qo, torch.tensor([groups * s], dtype=torch.int32)])
        last_len = torch.full((groups * mb,), layout.tail_rows or BLOCK, dtype=torch.int32)
        return qo_indptr, last_len

    def _mass_state(self, groups: int, layout: SparseLayout, device, addressing: tuple) -> _MassState:
        """The ranked page ids and needed counts of cumulative-mass calls of one signature (cached)."""
        key = (groups, layout.signature(), str(device), addressing)
        state = self._mass_states.get(key)
        if state is not None:
            self._mass_states.move_to_end(key)
            return state
        n_sparse = layout.query_blocks - min(layout.dense_query_blocks, layout.query_blocks)
        mult, base_b, base_h, base = self._bases(groups, layout, addressing)
        state = _MassState(mult, base.to(device), base_b, base_h,
                           ranked=torch.empty(groups, n_sparse, layout.full_key_blocks, dtype=torch.int32,
                                              device=device),
                           counts=torch.zeros(groups, n_sparse, dtype=torch.int32, device=device))
        return self._cache(self._mass_states, key, state, MASS_PLAN_CACHE_SIZE)

    def prepare(self, query, key, value, layout: SparseLayout, sparsity: float | None = None, scale=None, *,
                mass_threshold: float | None = None) -> BlockSparseCall:
        """Stage 1: pages of K and V, Q rows per head, block means; the plan (top-k: cached; cumulative mass: the
        ranking buffers, the plan comes with the call's count in ``plan_call``)."""
        b, s, h, d = query.shape
        groups = b * h
        order, padded = self._order(layout, query.device)
        k_pages = v_pages = None
        if layout.order is None and key.stride() == value.stride():
            k_pages, v_pages = strided_pages(key), strided_pages(value)
        if k_pages is not None and v_pages is not None:
            sb, ss, sh, _ = key.stride()
            addressing = ("strided", sb // sh, BLOCK * ss // sh, h)
        else:  # copies of K and V in blocked row order (a layout with a row order, or strides FlashInfer cannot page)
            rows = layout.key_pages * BLOCK
            kt = gather_heads(key, padded, rows)
            vt = gather_heads(value, padded, rows)
            k_pages = kt.view(groups * layout.key_pages, BLOCK, 1, d)
            v_pages = vt.view(groups * layout.key_pages, BLOCK, 1, d)
            addressing = ("copied", h)
        qt = heads_major(query) if order is None else None
        qt_gathered, pooled = pool_and_gather(query, key, layout, padded if order is not None else None,
                                              gather_q=qt is None)
        qt = qt if qt is not None else qt_gathered
        mass = None
        if mass_threshold is None:
            kept = kept_blocks(layout, sparsity)
            plan = self._plan(groups, layout, kept, d, query.dtype, scale, query.device, addressing)
        else:
            kept = plan = None
            mass = self._mass_state(groups, layout, query.device, addressing)
        return BlockSparseCall(query, layout, scale, kept, mass_threshold, order, qt, pooled, k_pages, v_pages, plan,
                               addressing, mass)

    def select(self, call: BlockSparseCall) -> BlockSparseCall:
        """Stage 2: write the selected page ids (``write_pages``) and, for cumulative mass, pick the call's kept
        count and its cached plan (``plan_call``)."""
        self.write_pages(call)
        if call.mass_threshold is not None:
            self.plan_call(call)
        return call

    def write_pages(self, call: BlockSparseCall) -> BlockSparseCall:
        """The selection itself: score the blocks and write the kept page ids in ascending block order (one Triton
        launch; PyTorch without Triton); cumulative mass writes every block's page id in rank order and the needed
        counts instead."""
        layout = call.layout
        plan = call.mass if call.mass_threshold is not None else call.plan
        groups = call.qt.shape[0]
        mb, nb = layout.query_blocks, layout.full_key_blocks
        dense_rows = min(layout.dense_query_blocks, mb)
        n_sparse = mb - dense_rows
        mass = call.mass_threshold is not None
        scale = call.scale if call.scale is not None else call.query.shape[-1] ** -0.5
        out = plan.ranked if mass else plan.selected
        if n_sparse and _use_triton(call.pooled) and nb <= MAX_TRITON_KEY_BLOCKS:
            kernel = _kernels(_interpreting())[3]
            nbp = max(16, 1 << max(nb - 1, 0).bit_length())
            d = call.qt.shape[-1]
            block_d = max(16, _block_d(d))
            kernel[(groups, -(-n_sparse // _SELECT_ROWS))](
                call.pooled, self._forced_blocks(layout, call.pooled.device), out,
                plan.counts if mass else out, mb, nb, dense_rows, n_sparse, call.kept or 0, call.query.shape[2],
                plan.base_b, plan.base_h, plan.mult, out.stride(0), out.stride(1),
                float(call.mass_threshold or 0.0), scale * LOG2E,
                D=d, BLOCK_D=block_d, NBP=nbp, BQ=_SELECT_ROWS, DC=16 if block_d == 16 else 32, MASS=mass,
            )
        elif n_sparse:
            pooled_q, pooled_k = call.pooled[:, :mb], call.pooled[:, mb:]
            if not mass:
                chosen = select_blocks(pooled_q, pooled_k, layout, call.kept)[:, dense_rows:]
                out.copy_(chosen * plan.mult + plan.base[:, None, None])
            else:
                order, counts = select_blocks_by_mass(pooled_q, pooled_k, layout, call.mass_threshold, scale)
                out.copy_(order[:, dense_rows:] * plan.mult + plan.base[:, None, None])
                plan.counts.copy_(counts[:, dense_rows:])
        return call

    def plan_call(self, call: BlockSparseCall) -> BlockSparseCall:
        """The kept count of a cumulative-mass call: read the largest needed count (one small host
        synchronisation), bucket it (``mass_kept``), take the cached plan of that count (planned on a bucket's first
        call) and copy each query block's first ``kept`` ranked page ids into it, on the device. Every query block
        keeps that many blocks: a superset of its needed set, so each still reaches the mass."""
        layout, state = call.layout, call.mass
        groups, _, d = call.qt.shape
        if state.counts.numel():
            needed = int(state.counts.max())  # the host synchronisation (one int32)
            self.host_syncs += 1
        else:  # every query block is a dense prefix row
            needed = 0
        kept = mass_kept(needed, layout.full_key_blocks)
        plan = self._plan(groups, layout, kept, d, call.query.dtype, call.scale, call.query.device, call.addressing,
                          mass=True)
        if kept:
            plan.selected.copy_(state.ranked[..., :kept])
        call.kept, call.plan = kept, plan
        return call

    _forced_vectors: dict[tuple, torch.Tensor] = {}

    @classmethod
    def _forced_blocks(cls, layout: SparseLayout, device) -> torch.Tensor:
        """``[full_key_blocks]`` int8: the layout's forced key blocks (the diagonal is added in the kernel)."""
        key = (layout.signature(), str(device))
        forced = cls._forced_vectors.get(key)
        if forced is None:
            forced = torch.zeros(max(layout.full_key_blocks, 1), dtype=torch.int8)
            ids = [j for j in layout.forced_key_blocks if j < layout.full_key_blocks]
            if ids:
                forced[ids] = 1
            forced = forced.to(device)
            if len(cls._forced_vectors) > PLAN_CACHE_SIZE:
                cls._forced_vectors.clear()
            cls._forced_vectors[key] = forced
        return forced

    def attend(self, call: BlockSparseCall) -> BlockSparseCall:
        """Stage 3: the paged prefill over the selected pages, into ``call.out`` (``[G·S, 1, D]``)."""
        groups, s, d = call.qt.shape
        out = torch.empty(groups * s, 1, d, device=call.qt.device, dtype=call.qt.dtype)
        result = call.plan.wrapper.run(call.qt.view(groups * s, 1, d), (call.k_pages, call.v_pages), out=out)
        call.out = result[0] if isinstance(result, tuple) else result
        return call

    def finish(self, call: BlockSparseCall) -> torch.Tensor:
        """Stage 4: the output rows back to ``[B, S, H, D]`` in the call's own row order."""
        groups, s, d = call.qt.shape
        return scatter_heads(call.out.view(groups, s, d), call.order, call.query.shape[0])

    def block_mask(self, call: BlockSparseCall) -> torch.Tensor:
        """The ``[B·H, query_blocks, key_pages]`` block mask the planned pages of ``call`` encode."""
        layout, plan = call.layout, call.plan
        groups = call.qt.shape[0]
        mb = layout.query_blocks
        lengths = (plan.kv_indptr[1:] - plan.kv_indptr[:-1]).long()
        rows = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
        pages = plan.indices.long().cpu()
        blocks = (pages - plan.base.cpu()[rows // mb]) // plan.mult
        mask = torch.zeros(groups * mb, layout.key_pages, dtype=torch.bool)
        mask[rows, blocks] = True
        return mask.view(groups, mb, layout.key_pages).to(call.qt.device)

    def __call__(self, query, key, value, layout: SparseLayout, sparsity: float | None = None, scale=None,
                 return_mask: bool = False, *, mass_threshold: float | None = None, dense_above: float | None = None):
        """Block-sparse attention on ``[B, S, H, D]`` inputs (equal head counts); returns ``[B, S, H, D]`` (and the
        ``[B·H, query_blocks, key_pages]`` block mask with ``return_mask``). ``sparsity`` selects the top-k blocks,
        ``mass_threshold`` (instead) the cumulative-mass set (see ``BlockSparseSpec``).

        ``dense_above``: a cumulative-mass call whose kept count is above this share of the key blocks returns
        ``None`` after its selection instead of attending (the caller runs dense attention: past the measured
        break-even the sparse kernel is slower); ``self.last_kept_share`` holds the share of the last call."""
        if (sparsity is None) == (mass_threshold is None):
            raise ValueError("pass one of sparsity (top-k) and mass_threshold (cumulative mass)")
        call = self.select(self.prepare(query, key, value, layout, sparsity, scale, mass_threshold=mass_threshold))
        self.last_kept_share = (call.kept or 0) / max(layout.full_key_blocks, 1)
        if dense_above is not None and mass_threshold is not None and self.last_kept_share > dense_above:
            return None
        call = self.attend(call)
        result = self.finish(call)
        if return_mask:
            return result, self.block_mask(call)
        return result


class ReferencePagedPrefill:
    """FlashInfer's paged-prefill ``plan``/``run`` contract in plain PyTorch (one attention per request): NHD pages of
    ``page_size`` rows addressed as the kernel does (``page · stride(0) + row · stride(1)`` from the cache's data
    pointer, so strided page views work), per-request page lists (``kv_indptr``/``indices``) whose last page holds
    ``last_page_len`` rows. Runs the whole block-sparse path on any device, for tests and as documentation."""

    def __init__(self, device=None) -> None:
        self.planned = None
        self.plan_calls = 0

    def plan(self, qo_indptr, kv_indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size,
             causal=False, sm_scale=None, q_data_type=None, kv_data_type=None, o_data_type=None):
        if num_qo_heads != 1 or num_kv_heads != 1 or causal:
            raise ValueError("ReferencePagedPrefill implements the single-head, non-causal layout only")
        self.plan_calls += 1
        self.planned = (qo_indptr.cpu(), kv_indptr.cpu(), indices, last_page_len.cpu(), page_size, sm_scale)

    @staticmethod
    def _rows(cache: torch.Tensor, ids: torch.Tensor, count: int, page: int) -> torch.Tensor:
        flat = cache.as_strided((cache.untyped_storage().nbytes() // cache.element_size(),), (1,), 0)
        entries = torch.arange(count, device=ids.device)
        start = cache.storage_offset() + ids[entries // page] * cache.stride(0) + (entries % page) * cache.stride(1)
        return flat[start[:, None] + torch.arange(cache.shape[-1], device=ids.device)[None, :]]

    def run(self, q, kv, out=None):
        qo, kvp, indices, last, page, scale = self.planned
        k_pages, v_pages = kv
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device) if out is None else out
        scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
        for r in range(qo.numel() - 1):
            ids = indices[kvp[r] : kvp[r + 1]].long()
            count = (ids.numel() - 1) * page + int(last[r])
            k = self._rows(k_pages, ids, count, page).float()
            v = self._rows(v_pages, ids, count, page).float()
            qs = q[qo[r] : qo[r + 1], 0].float()
            attn = torch.softmax(qs @ k.T * scale, dim=-1)
            out[qo[r] : qo[r + 1], 0] = (attn @ v).to(q.dtype)
        return out
