"""Block-sparse attention on CUDA: pooled block selection and FlashInfer's paged FA3 prefill, planned once per shape.

A call ``[B, S, H, D]`` is cut into 128-row query blocks and 128-row key blocks (rows in ``layout.order``: the
RainFusion tile order when the model published a video geometry, the natural order otherwise). Each (batch, head)
picks its own key blocks:

* **selection** (``select_blocks``): per block, the mean of its Q rows and of its K rows; the score of (query
  block *i*, key block *j*) is ``mean_q_i · mean_k_j``; each query block keeps its ``kept`` best key blocks (top-k).
  Forced blocks (the prefix and first-frame key blocks of a video geometry, and the query block's own diagonal
  block) rank first. Query blocks of the prefix attend to every key block. Rows past the last whole key block
  (``S mod 128``) form a partial *tail* block that every query block keeps.
* **kernel** (``BlockSparseRunner``): heads become independent "requests" of FlashInfer's
  ``BatchPrefillWithPagedKVCacheWrapper`` (``backend="fa3"`` on sm_90): each (batch·head, query block) is one
  request whose KV pages are its kept key blocks (page size 128) and whose last page is the partial tail.
  FlashInfer's ``BlockSparseAttentionWrapper`` is the same kernel with one mask shared by all heads and ``S``
  divisible by 128; the paged wrapper gives per-head masks and the partial tail (Wan 480p: 32,760 = 255·128 + 120
  rows). The number of pages per request depends only on the shape and ``kept``, so the plan (FlashInfer's host-side
  scheduling) is made once per signature and cached; each call only writes the selected page ids into the planned
  index buffer on the device (no host synchronisation).

``block_mask`` and ``block_sparse_reference`` express the same selection as a token mask through SDPA: the
reference the tests (and the H200 benchmark) compare the kernel path against. ``ReferencePagedPrefill`` is a pure
PyTorch implementation of the paged-prefill contract (``plan``/``run``) for running the whole path on the CPU.
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
WORKSPACE_BYTES = 128 * 1024 * 1024


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
    """Whole key blocks each sparse query block keeps: ``round((1 - sparsity) · full blocks)``, at least the forced
    blocks plus the diagonal, at most all of them."""
    full = layout.full_key_blocks
    wanted = round((1.0 - sparsity) * full)
    floor = min(full, len(set(layout.forced_key_blocks)) + 1)
    return max(floor, min(full, wanted))


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


def select_blocks(pooled_q: torch.Tensor, pooled_k: torch.Tensor, layout: SparseLayout, kept: int) -> torch.Tensor:
    """Top-``kept`` whole key blocks per (head, query block) by pooled score, forced and diagonal blocks first.

    Args:
        pooled_q (`torch.Tensor`): ``[G, query_blocks, D]``.
        pooled_k (`torch.Tensor`): ``[G, full_key_blocks, D]``.

    Returns:
        ``[G, query_blocks, kept]`` int64 key-block indices (in no particular order within a row).
    """
    scores = torch.bmm(pooled_q, pooled_k.transpose(1, 2))  # [G, MB, NB]
    scores = scores.masked_fill(_forced(layout, scores.shape[1], scores.shape[2], scores.device), float("inf"))
    return scores.topk(kept, dim=-1, sorted=False).indices


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


def reference_selection(query, key, layout: SparseLayout, sparsity: float) -> torch.Tensor:
    """``select_blocks`` computed straight from ``[B, S, H, D]`` inputs (float32 pooling), for tests."""
    b, s, h, d = query.shape
    order = layout.order if layout.order is not None else torch.arange(s)
    qt, kt = (x.float().permute(0, 2, 1, 3)[:, :, order.to(x.device)].reshape(b * h, s, d) for x in (query, key))
    pooled_q = pool_blocks(qt, s)
    pooled_k = pool_blocks(kt, layout.full_key_blocks * BLOCK)
    return select_blocks(pooled_q, pooled_k, layout, kept_blocks(layout, sparsity))


def _interpreting() -> bool:
    import os

    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "yes", "on")


def _use_triton(x: torch.Tensor) -> bool:
    """Triton kernels for the layout copies on CUDA (and on CPU under ``TRITON_INTERPRET=1``); PyTorch otherwise."""
    if x.device.type != "cuda" and not _interpreting():
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@functools.lru_cache(maxsize=2)
def _kernels(interpret: bool):
    import triton
    import triton.language as tl

    @triton.jit
    def _gather_kernel(src_ptr, order_ptr, dst_ptr, pooled_ptr, rows_out, valid, H, n_blocks,
                       stride_b, stride_s, stride_h,
                       D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_ROWS: tl.constexpr, TILE: tl.constexpr,
                       ORDERED: tl.constexpr, POOL: tl.constexpr):
        # [B, S, H, D] (any strides) -> dst [B*H, rows_out, D]: row r of head g is source row order[r] (or r);
        # with POOL, the mean of the block's rows below ``valid`` goes to pooled[g, block].
        g = tl.program_id(0)
        blk = tl.program_id(1)
        b = g // H
        h = g % H
        cols = tl.arange(0, BLOCK_D)
        col_ok = cols < D
        acc = tl.zeros([BLOCK_D], tl.float32)
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
            if POOL:
                acc += tl.sum(tl.where((pos < valid)[:, None] & ok, x.to(tl.float32), 0.0), axis=0)
        if POOL:
            count = tl.minimum(valid - blk * BLOCK_ROWS, BLOCK_ROWS)
            if count > 0:
                tl.store(pooled_ptr + (g * n_blocks + blk) * D + cols, acc / count, mask=col_ok)

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

    return _gather_kernel, _scatter_kernel


def _block_d(d: int) -> int:
    return 1 << max(d - 1, 0).bit_length()


def gather_heads(x: torch.Tensor, order: torch.Tensor | None, rows_out: int, pool_rows: int | None = None):
    """``[B, S, H, D]`` → ``[B·H, rows_out, D]`` (row ``r`` of a head is input row ``order[r]``, or ``r``), and with
    ``pool_rows`` the float32 means of its 128-row blocks over the first ``pool_rows`` rows (``pool_blocks``)."""
    b, s, h, d = x.shape
    if not _use_triton(x):
        rows = order if order is not None else torch.arange(rows_out, device=x.device)
        out = x.permute(0, 2, 1, 3).index_select(2, rows).reshape(b * h, rows_out, d)
        return out, (pool_blocks(out, pool_rows) if pool_rows is not None else None)
    gather, _ = _kernels(_interpreting())
    n_blocks = -(-rows_out // BLOCK)
    out = torch.empty(b * h, rows_out, d, device=x.device, dtype=x.dtype)
    pooled = torch.empty(b * h, n_blocks, d, device=x.device, dtype=torch.float32) if pool_rows is not None else out
    gather[(b * h, n_blocks)](
        x, order if order is not None else out, out, pooled, rows_out, pool_rows or 0, h, n_blocks,
        x.stride(0), x.stride(1), x.stride(2),
        D=d, BLOCK_D=_block_d(d), BLOCK_ROWS=BLOCK, TILE=32, ORDERED=order is not None, POOL=pool_rows is not None,
    )
    if pool_rows is None:
        return out, None
    return out, pooled[:, : -(-pool_rows // BLOCK)]


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
    _, scatter = _kernels(_interpreting())
    scatter[(g, -(-s // BLOCK))](
        src, order if order is not None else src, out, s, h, out.stride(0), out.stride(1), out.stride(2),
        D=d, BLOCK_D=_block_d(d), BLOCK_ROWS=BLOCK, TILE=32, ORDERED=order is not None,
    )
    return out


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
    wrapper: object
    indices: torch.Tensor  # the planned device index buffer
    selected: torch.Tensor  # view of ``indices`` where each call writes its selected page ids
    mult: int  # page id = block · mult + base[group]
    base: torch.Tensor  # [G, 1, 1] int64


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
    """Runs a selection through a paged-prefill wrapper; plans cached per (shape, layout, kept, dtype, scale,
    page addressing).

    Args:
        wrapper_factory (`Callable`, *optional*): ``(device) -> wrapper`` with FlashInfer's paged-prefill
            ``plan``/``run``; defaults to FlashInfer's FA3 wrapper (``ReferencePagedPrefill`` runs anywhere).
    """

    def __init__(self, wrapper_factory: Callable | None = None) -> None:
        self._factory = wrapper_factory or flashinfer_paged_factory
        self._plans: OrderedDict[tuple, _Plan] = OrderedDict()
        self._orders: dict[tuple, tuple[torch.Tensor | None, torch.Tensor]] = {}
        self.plan_count = 0

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

    def _plan(self, groups: int, layout: SparseLayout, kept: int, head_dim: int, dtype, scale, device,
              addressing: tuple) -> _Plan:
        key = (groups, layout.signature(), kept, head_dim, dtype, scale, str(device), addressing)
        plan = self._plans.get(key)
        if plan is not None:
            self._plans.move_to_end(key)
            return plan
        s, mb, pages, full = layout.seq_len, layout.query_blocks, layout.key_pages, layout.full_key_blocks
        tail = 1 if layout.tail_rows else 0
        dense_rows = min(layout.dense_query_blocks, mb)
        if addressing[0] == "strided":  # pages of the input itself (strided_pages)
            _, per_batch, mult, heads = addressing
            g = torch.arange(groups)
            base = (g // heads) * per_batch + g % heads
        else:  # gathered [G, pages·128, D] copies
            mult = 1
            base = torch.arange(groups) * pages
        starts = torch.arange(0, s, BLOCK, dtype=torch.int32)
        qo = (torch.arange(groups, dtype=torch.int32)[:, None] * s + starts[None, :]).reshape(-1)
        qo_indptr = torch.cat([qo, torch.tensor([groups * s], dtype=torch.int32)])
        per_request = torch.full((groups, mb), kept + tail, dtype=torch.int32)
        per_request[:, :dense_rows] = pages
        kv_indptr = F.pad(torch.cumsum(per_request.reshape(-1), 0, dtype=torch.int32), (1, 0))
        last_len = torch.full((groups * mb,), layout.tail_rows or BLOCK, dtype=torch.int32)
        # Constant parts of the page table (dense prefix rows, the tail page) are written once, here.
        every = torch.arange(pages)[None, None, :] * mult + base[:, None, None]  # [G, 1, pages]
        dense = every.expand(groups, dense_rows, pages).reshape(groups, -1)
        sparse = torch.zeros(groups, mb - dense_rows, kept + tail, dtype=torch.int64)
        if tail:
            sparse[:, :, -1] = (full * mult + base)[:, None]
        table = torch.cat([dense, sparse.reshape(groups, -1)], dim=1)
        indices = table.reshape(-1).to(torch.int32).to(device)
        selected = indices.view(groups, -1)[:, dense.shape[1]:].view(groups, mb - dense_rows, kept + tail)[..., :kept]
        if self._factory is flashinfer_paged_factory and (dtype, head_dim) not in _announced:
            _announced.add((dtype, head_dim))
            logger.info("block-sparse attention: loading FlashInfer's paged FA3 prefill for %s head_dim=%d (a first "
                        "use on a machine compiles it, ~90 s; `diffusers-omni warmup` does it ahead of time)",
                        str(dtype).replace("torch.", ""), head_dim)
        wrapper = self._factory(device)
        wrapper.plan(qo_indptr, kv_indptr, indices, last_len, 1, 1, head_dim, BLOCK, causal=False, sm_scale=scale,
                     q_data_type=dtype, kv_data_type=dtype, o_data_type=dtype)
        plan = _Plan(wrapper, indices, selected, mult, base.to(device)[:, None, None])
        self.plan_count += 1
        self._plans[key] = plan
        if len(self._plans) > PLAN_CACHE_SIZE:
            self._plans.popitem(last=False)
        return plan

    def __call__(self, query, key, value, layout: SparseLayout, sparsity: float, scale=None,
                 return_mask: bool = False):
        """Block-sparse attention on ``[B, S, H, D]`` inputs (equal head counts); returns ``[B, S, H, D]`` (and the
        ``[B·H, query_blocks, key_pages]`` block mask with ``return_mask``)."""
        b, s, h, d = query.shape
        groups = b * h
        kept = kept_blocks(layout, sparsity)
        full = layout.full_key_blocks
        order, padded = self._order(layout, query.device)
        qt, pooled_q = gather_heads(query, order, s, pool_rows=s)
        k_pages = v_pages = None
        if layout.order is None and key.stride() == value.stride():
            k_pages, v_pages = strided_pages(key), strided_pages(value)
        if k_pages is not None and v_pages is not None:
            # K and V are read in place; only their block means are computed here.
            pooled_k = key[:, : full * BLOCK].unflatten(1, (full, BLOCK)).mean(2, dtype=torch.float32)
            pooled_k = pooled_k.permute(0, 2, 1, 3).reshape(groups, full, d)
            sb, ss, sh, _ = key.stride()
            addressing = ("strided", sb // sh, BLOCK * ss // sh, h)
        else:
            rows = layout.key_pages * BLOCK
            kt, pooled_k = gather_heads(key, padded, rows, pool_rows=full * BLOCK)
            vt, _ = gather_heads(value, padded, rows)
            k_pages = kt.view(groups * layout.key_pages, BLOCK, 1, d)
            v_pages = vt.view(groups * layout.key_pages, BLOCK, 1, d)
            addressing = ("copied",)
        selected = select_blocks(pooled_q, pooled_k, layout, kept)
        plan = self._plan(groups, layout, kept, d, query.dtype, scale, query.device, addressing)
        dense_rows = min(layout.dense_query_blocks, layout.query_blocks)
        plan.selected.copy_(selected[:, dense_rows:] * plan.mult + plan.base)
        out = torch.empty(groups * s, 1, d, device=query.device, dtype=query.dtype)
        out = plan.wrapper.run(qt.view(groups * s, 1, d), (k_pages, v_pages), out=out)
        out = out[0] if isinstance(out, tuple) else out
        result = scatter_heads(out.view(groups, s, d), order, b)
        if return_mask:
            return result, block_mask(selected, layout)
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
