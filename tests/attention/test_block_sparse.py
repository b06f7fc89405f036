"""Block-sparse RAINFUSION_ATTN on CUDA (issue 15), run on the CPU: the selection (top-k and cumulative mass), the
paged-prefill page tables (through ``ReferencePagedPrefill``, FlashInfer's contract in PyTorch) against the same mask
applied through SDPA, plan caching, dense steps and skipped layers, the geometry a Wan model publishes, and (under
``TRITON_INTERPRET=1``) the Triton pooling and selection kernels against the PyTorch selection."""

import importlib.util
import logging
import os

import pytest
import torch
import torch.nn.functional as F

from diffusers_omni.attention.backends.rainfusion import block_sparse as bs
from diffusers_omni.attention.backends.rainfusion import RainFusionBackend
from diffusers_omni.installer import apply_attention, attention_report, remove_attention
from diffusers_omni.attention.registry import register_backend, reset_backend
from diffusers_omni.config.attention import AttentionSpec

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton") is not None
interpreted = pytest.mark.skipif(not INTERPRETING, reason="runs in the TRITON_INTERPRET=1 subprocess of "
                                 "test_fp8.py::test_triton_kernels_under_the_interpreter")


def _qkv(b=1, s=700, h=2, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(b, s, h, d, generator=g) for _ in range(3))


def _runner():
    return bs.BlockSparseRunner(lambda device: bs.ReferencePagedPrefill())


def _structured(b=1, s=700, h=2, d=16, seed=0, strength=2.0):
    """Gaussian Q, K, V plus a random direction per 128-row block added to Q and K, so that pooled scores (and the
    softmax over them) are far from flat, as in real attention."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, s, h, d, generator=g) for _ in range(3))
    blocks = -(-s // bs.BLOCK)
    for x in (q, k):
        x += strength * torch.randn(b, blocks, h, d, generator=g).repeat_interleave(bs.BLOCK, 1)[:, :s]
    return q, k, v


def _mass_by_definition(pooled_q, pooled_k, forced_blocks, threshold, scale):
    """Cumulative-mass selection written out row by row: forced blocks and the diagonal, then the best-scoring blocks
    while the kept mass is below the threshold."""
    g, mb, _ = pooled_q.shape
    nb = pooled_k.shape[1]
    keep = torch.zeros(g, mb, nb, dtype=torch.bool)
    for head in range(g):
        for i in range(mb):
            scores = [float(pooled_q[head, i] @ pooled_k[head, j]) for j in range(nb)]
            mass = torch.softmax(torch.tensor(scores) * scale, 0).tolist()
            forced = set(forced_blocks) | ({i} if i < nb else set())
            rest = sorted((j for j in range(nb) if j not in forced), key=lambda j: -scores[j])
            kept = sum(mass[j] for j in forced)
            for j in forced:
                keep[head, i, j] = True
            for j in rest:
                if kept >= threshold:
                    break
                keep[head, i, j] = True
                kept += mass[j]
    return keep


def test_kept_blocks_and_forced_selection():
    layout = bs.SparseLayout(700, forced_key_blocks=(0, 1))
    assert (layout.full_key_blocks, layout.tail_rows, layout.query_blocks, layout.key_pages) == (5, 60, 6, 6)
    assert bs.kept_blocks(layout, 0.8) == 3  # at least the forced blocks plus the diagonal
    assert bs.kept_blocks(layout, 0.0) == 5
    assert bs.kept_blocks(bs.SparseLayout(700), 0.6) == 1  # round(0.4 · 6 pages) = 2, the partial tail one of them
    q, k, _ = _qkv()
    selected = bs.reference_selection(q, k, layout, 0.6)
    rows = selected.sort(-1).values.tolist()
    for g in range(2):
        for i in range(5):
            assert {0, 1, i} <= set(rows[g][i])  # forced blocks and the diagonal always kept
    mask = bs.block_mask(selected, layout)
    assert mask[:, :, -1].all()  # the partial tail block is visible to every query block
    # Scores rank the rest: the best non-forced block by pooled q·k is kept.
    pooled_q = bs.pool_blocks(q.float().permute(0, 2, 1, 3).reshape(2, 700, 16), 700)
    pooled_k = bs.pool_blocks(k.float().permute(0, 2, 1, 3).reshape(2, 700, 16), 640)
    scores = pooled_q[0, 5] @ pooled_k[0].T
    scores[[0, 1]] = -float("inf")
    assert int(scores.argmax()) in rows[0][5]


def test_top_k_counts_the_partial_tail_among_the_kept_pages():
    """``sparsity`` is the share of key pages skipped, the partial tail page one of the kept ones (it is always kept):
    round((1 - sparsity) · pages) pages, the whole blocks one fewer. Without a tail: the whole blocks, as before."""
    tailed = bs.SparseLayout(10 * 128 + 60)  # 10 whole blocks and a tail: 11 pages
    assert (bs.kept_blocks(tailed, 0.8), bs.kept_pages(tailed, 0.8)) == (1, 2)  # round(0.2 · 11) = 2 pages
    assert (bs.kept_blocks(tailed, 0.5), bs.kept_pages(tailed, 0.5)) == (5, 6)  # round(5.5) = 6
    wan = bs.SparseLayout(32760)  # Wan 480p: 255 whole blocks and a 120-row tail
    assert (bs.kept_blocks(wan, 0.8), bs.kept_pages(wan, 0.8)) == (50, 51)
    assert (bs.kept_blocks(wan, 0.5), bs.kept_pages(wan, 0.5)) == (127, 128)
    whole = bs.SparseLayout(10 * 128)
    assert (bs.kept_blocks(whole, 0.8), bs.kept_pages(whole, 0.8)) == (2, 2)
    assert (bs.kept_blocks(whole, 0.5), bs.kept_pages(whole, 0.5)) == (5, 5)
    # The floor (forced blocks and the diagonal) and the ceiling (every whole block) stay.
    assert bs.kept_blocks(tailed, 1.0) == 1 and bs.kept_blocks(tailed, 0.0) == 10 and bs.kept_pages(tailed, 0.0) == 11
    assert bs.kept_blocks(bs.SparseLayout(10 * 128 + 60, forced_key_blocks=(0, 1, 2)), 0.8) == 4
    # What the runner plans: every sparse query block attends kept_pages pages, the tail among them.
    q, k, v = _qkv(s=10 * 128 + 60)
    out, mask = _runner()(q, k, v, tailed, 0.8, return_mask=True)
    assert (mask.sum(-1) == 2).all() and mask[:, :, -1].all()
    assert torch.equal(mask, bs.reference_mask(q, k, tailed, 0.8))
    torch.testing.assert_close(out, bs.block_sparse_reference(q, k, v, tailed, mask), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("order", [None, "perm"])
@pytest.mark.parametrize("dense_prefix", [0, 1])
def test_runner_matches_the_same_mask_through_sdpa(order, dense_prefix):
    q, k, v = _qkv(b=2, h=3)
    perm = torch.randperm(700, generator=torch.Generator().manual_seed(3)) if order else None
    layout = bs.SparseLayout(700, perm, dense_query_blocks=dense_prefix, forced_key_blocks=(0,))
    runner = _runner()
    out, mask = runner(q, k, v, layout, 0.5, return_mask=True)
    assert torch.equal(mask, bs.block_mask(bs.reference_selection(q, k, layout, 0.5), layout))
    torch.testing.assert_close(out, bs.block_sparse_reference(q, k, v, layout, mask), rtol=2e-5, atol=2e-5)
    if dense_prefix:
        assert mask[:, 0].all()
    assert 0.4 < mask.float().mean() < 0.8
    # The plan (page counts, tail, dense rows) is made once per signature; later calls only rewrite page ids.
    q2, k2, v2 = _qkv(b=2, h=3, seed=5)
    out2, mask2 = runner(q2, k2, v2, layout, 0.5, return_mask=True)
    assert runner.plan_count == 1 and not torch.equal(mask, mask2)
    torch.testing.assert_close(out2, bs.block_sparse_reference(q2, k2, v2, layout, mask2), rtol=2e-5, atol=2e-5)
    runner(q, k, v, layout, 0.2)  # another kept count: another plan
    assert runner.plan_count == 2


@pytest.mark.parametrize("threshold", [0.3, 0.6, 0.9])
def test_cumulative_mass_selection_follows_its_definition(threshold):
    q, k, _ = _structured(s=12 * 128 + 50, h=2, d=16)
    layout = bs.SparseLayout(q.shape[1], forced_key_blocks=(0, 3))
    pooled_q, pooled_k = bs._reference_pooled(q, k, layout)
    order, counts = bs.select_blocks_by_mass(pooled_q, pooled_k, layout, threshold, 0.25)
    keep = bs.mass_indices(order, counts)
    assert torch.equal(keep, _mass_by_definition(pooled_q, pooled_k, (0, 3), threshold, 0.25))
    assert (counts >= 2).all()  # at least the forced blocks (and the diagonal)
    assert counts.min() < counts.max()  # the needed count is per query block
    # The call keeps one count for every query block: the largest needed count, bucketed (12 blocks: a bucket of 1).
    _, needed, kept = bs.mass_selection(pooled_q, pooled_k, layout, threshold, 0.25)
    assert torch.equal(needed, counts) and kept == bs.mass_kept(int(counts.max()), 12) == int(counts.max())
    mask = bs.reference_mask(q, k, layout, mass_threshold=threshold, scale=0.25)
    assert mask[:, :, -1].all()  # plus the partial tail block
    chosen = mask[:, :, :-1]
    assert (chosen.sum(-1) == kept).all()
    assert not (keep & ~chosen).any()  # each row's kept set holds its minimal mass set (rows may keep more)
    # ... and is its top-`kept` blocks in rank order, forced first: the top-k selection at that count.
    assert torch.equal(chosen, bs.block_mask(bs.select_blocks(pooled_q, pooled_k, layout, kept), layout)[:, :, :-1])
    fractions = [bs.reference_mask(q, k, layout, mass_threshold=t, scale=0.25).float().mean() for t in (0.3, 0.6, 0.9)]
    assert fractions[0] <= fractions[1] <= fractions[2] and fractions[0] < fractions[2]


def test_mass_kept_buckets_the_largest_needed_count():
    assert [bs.mass_kept(n, 255) for n in (0, 1, 8, 9, 17, 248, 250, 255)] == [0, 8, 8, 16, 24, 248, 255, 255]
    assert [bs.mass_kept(n, 12) for n in (1, 5, 12)] == [1, 5, 12]  # fewer than 32 blocks: exact counts
    assert [bs.mass_kept(n, 64) for n in (3, 4, 63)] == [4, 4, 64]
    assert len({bs.mass_kept(n, 255) for n in range(1, 256)}) == 32  # at most 32 plans per shape


@pytest.mark.parametrize("order", [None, "perm"])
@pytest.mark.parametrize("dense_prefix", [0, 1])
def test_cumulative_mass_runner_matches_the_same_mask_through_sdpa(order, dense_prefix):
    q, k, v = _structured(b=2, s=8 * 128 + 30, h=3)
    perm = torch.randperm(q.shape[1], generator=torch.Generator().manual_seed(3)) if order else None
    layout = bs.SparseLayout(q.shape[1], perm, dense_query_blocks=dense_prefix, forced_key_blocks=(0,))
    runner = _runner()
    out, mask = runner(q, k, v, layout, mass_threshold=0.7, return_mask=True)
    assert torch.equal(mask, bs.reference_mask(q, k, layout, mass_threshold=0.7))
    torch.testing.assert_close(out, bs.block_sparse_reference(q, k, v, layout, mask), rtol=2e-5, atol=2e-5)
    pooled_q, pooled_k = bs._reference_pooled(q, k, layout)
    order, needed, kept = bs.mass_selection(pooled_q, pooled_k, layout, 0.7, q.shape[-1] ** -0.5)
    sparse = needed[:, dense_prefix:]
    assert sparse.min() < sparse.max()  # rows need different counts ...
    assert (mask[:, dense_prefix:, :-1].sum(-1) == kept).all() and kept == int(sparse.max())  # ... and keep one
    assert not (bs.mass_indices(order, needed) & ~mask[:, :, :-1]).any()  # every row's minimal mass set is kept
    # One small host read per call (the largest needed count); plans are cached per kept count.
    q2, k2, v2 = _structured(b=2, s=8 * 128 + 30, h=3, seed=5)
    out2, mask2 = runner(q2, k2, v2, layout, mass_threshold=0.7, scale=0.3, return_mask=True)
    assert torch.equal(mask2, bs.reference_mask(q2, k2, layout, mass_threshold=0.7, scale=0.3))
    torch.testing.assert_close(out2, bs.block_sparse_reference(q2, k2, v2, layout, mask2, 0.3), rtol=2e-5, atol=2e-5)
    assert runner.host_syncs == 2 and runner.plan_count == 2  # another scale: another plan
    out3, mask3 = runner(q, k, v, layout, mass_threshold=0.7, return_mask=True)  # the first call's count and scale
    assert runner.host_syncs == 3 and runner.plan_count == 2 and torch.equal(mask3, mask)
    torch.testing.assert_close(out3, out, rtol=0, atol=0)
    with pytest.raises(ValueError, match="one of sparsity"):
        runner(q, k, v, layout, 0.5, mass_threshold=0.7)


def test_cumulative_mass_plans_are_cached_per_bucketed_count(monkeypatch):
    """Different thresholds (or inputs) give different kept counts; each bucketed count is planned once and the
    plans are kept in a bounded LRU (``MASS_PLAN_CACHE_SIZE``)."""
    q, k, v = _structured(s=40 * 128, h=1, d=8, strength=3.0)
    layout = bs.SparseLayout(q.shape[1])
    pooled_q, pooled_k = bs._reference_pooled(q, k, layout)
    counts = {t: bs.mass_selection(pooled_q, pooled_k, layout, t, 8 ** -0.5)[2] for t in (0.2, 0.5, 0.8, 0.95)}
    assert len(set(counts.values())) >= 3 and all(c % 2 == 0 or c == 40 for c in counts.values())  # buckets of 2
    runner = _runner()
    for t in counts:
        out, mask = runner(q, k, v, layout, mass_threshold=t, return_mask=True)
        assert (mask.sum(-1) == counts[t]).all()  # no tail, no dense rows
        torch.testing.assert_close(out, bs.block_sparse_reference(q, k, v, layout, mask), rtol=2e-5, atol=2e-5)
    distinct = len(set(counts.values()))
    assert runner.plan_count == distinct and runner.host_syncs == 4
    for t in counts:  # every count again: all cached
        runner(q, k, v, layout, mass_threshold=t)
    assert runner.plan_count == distinct and runner.host_syncs == 8
    monkeypatch.setattr(bs, "MASS_PLAN_CACHE_SIZE", 1)
    small = _runner()
    for t in (0.2, 0.8, 0.2):  # two counts alternating through a cache of one: planned each time
        small(q, k, v, layout, mass_threshold=t)
    assert small.plan_count == 3 and len(small._mass_plans) == 1


def test_strided_pages_read_inputs_in_place():
    q, k, v = _qkv(b=2, h=3)
    pages = bs.strided_pages(k)
    assert pages.data_ptr() == k.data_ptr() and pages.stride() == (16, 48, 16, 1)
    groups = torch.tensor([0, 4])
    ids = bs.page_ids(k, torch.tensor([2, 1]), groups)
    rows = bs.ReferencePagedPrefill._rows(pages, ids, 256, 128)
    torch.testing.assert_close(rows[:128], k[0, 256:384, 0])
    torch.testing.assert_close(rows[128:], k[1, 128:256, 1])
    assert bs.strided_pages(k[:, :100]) is None  # shorter than one page


def test_identical_output_on_the_gathered_and_the_in_place_path():
    q, k, v = _qkv(h=3)
    layout = bs.SparseLayout(700)
    in_place = _runner()(q, k, v, layout, 0.5)
    gathered = _runner()(q, k.clone(), v.transpose(1, 2).contiguous().transpose(1, 2), layout, 0.5)  # strides differ
    torch.testing.assert_close(in_place, gathered, rtol=1e-6, atol=1e-6)


def test_heads_major_query_is_read_without_a_copy():
    q, k, v = _qkv(h=3)
    heads_major = q.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)  # [B, S, H, D] view of [B, H, S, D]
    assert bs.heads_major(heads_major).data_ptr() == heads_major.data_ptr() and bs.heads_major(q) is None
    layout = bs.SparseLayout(700)
    call = _runner().prepare(heads_major, k, v, layout, 0.5)
    assert call.qt.data_ptr() == heads_major.data_ptr()
    torch.testing.assert_close(_runner()(heads_major, k, v, layout, 0.5), _runner()(q, k, v, layout, 0.5))


# Top-k selections (seq_len, dense prefix rows, forced key blocks, kept): 37 whole key blocks (not a power of two) and
# a tail, 35 to 38 sparse query blocks (three selection programs of 16, the last one partial), one kept block, every
# block; 20 whole blocks and no tail.
TOP_K_CASES = [(37 * 128 + 50, 3, (0, 4), 12), (37 * 128 + 50, 0, (), 1), (37 * 128 + 50, 2, (1,), 37),
               (20 * 128, 0, (0,), 6)]


def _top_k_by_definition(pooled_q, pooled_k, forced_blocks, kept):
    """Top-k selection written out row by row: forced blocks and the diagonal first, then by descending score, equal
    scores by the lower block index."""
    g, mb, _ = pooled_q.shape
    nb = pooled_k.shape[1]
    keep = torch.zeros(g, mb, nb, dtype=torch.bool)
    for head in range(g):
        for i in range(mb):
            scores = (pooled_q[head, i] @ pooled_k[head].T).tolist()
            forced = set(forced_blocks) | {i}
            ranked = sorted(range(nb), key=lambda j: (j not in forced, -scores[j], j))
            keep[head, i, ranked[:kept]] = True
    return keep


def _top_k_call(monkeypatch, seq_len, dense, forced, kept, seed=0):
    """A prepared top-k call keeping ``kept`` whole blocks whose block means are small integers: every score is exact
    (the kernel's and PyTorch's agree bit for bit) and many are equal."""
    monkeypatch.setattr(bs, "kept_blocks", lambda layout, sparsity: kept)
    q, k, v = _qkv(b=2, s=seq_len, h=1, d=16, seed=seed)
    layout = bs.SparseLayout(seq_len, dense_query_blocks=dense, forced_key_blocks=forced)
    runner = _runner()
    call = runner.prepare(q, k, v, layout, 0.5)
    g = torch.Generator().manual_seed(seed)
    signs = torch.randint(0, 2, call.pooled.shape, generator=g) * 2 - 1
    call.pooled = (torch.randint(1, 3, call.pooled.shape, generator=g) * signs).float()
    return runner, call


def _check_top_k_pages(runner, call, forced, kept):
    """The pages ``write_pages`` wrote: the top-k selection by its definition (forced blocks, the diagonal, ties to the
    lower block), each row's blocks strictly ascending."""
    layout, plan = call.layout, call.plan
    mb = layout.query_blocks
    pooled_q, pooled_k = call.pooled[:, :mb], call.pooled[:, mb:]
    mask = runner.block_mask(call)
    assert torch.equal(mask, bs.keep_mask(_top_k_by_definition(pooled_q, pooled_k, forced, kept), layout))
    assert torch.equal(mask, bs.block_mask(bs.select_blocks(pooled_q, pooled_k, layout, kept), layout))
    blocks = (plan.selected.long() - plan.base[:, None, None]) // plan.mult
    assert (blocks.diff(dim=-1) > 0).all()
    return plan.selected.clone()


@pytest.mark.parametrize("seq_len, dense, forced, kept", TOP_K_CASES)
def test_top_k_selection_breaks_ties_by_block_and_writes_ascending_pages(monkeypatch, seq_len, dense, forced, kept):
    """The PyTorch selection (``write_pages`` without Triton): equal scores keep the lower block, as the kernel does,
    and each query block's page ids are written in ascending block order, as the kernel writes them."""
    runner, call = _top_k_call(monkeypatch, seq_len, dense, forced, kept)
    runner.write_pages(call)
    _check_top_k_pages(runner, call, forced, kept)


@interpreted
def test_interpreted_triton_layout_kernels_match_pytorch():
    q, k, v = _qkv(b=2, h=3, d=24)
    perm = torch.randperm(700, generator=torch.Generator().manual_seed(1))
    for order in (None, perm):
        out = bs.gather_heads(q, order, 700)
        rows = order if order is not None else torch.arange(700)
        want = q.permute(0, 2, 1, 3)[:, :, rows].reshape(6, 700, 24)
        assert torch.equal(out, want)
        assert torch.equal(bs.scatter_heads(out, order, 2), q)
    layout = bs.SparseLayout(700, perm, dense_query_blocks=1, forced_key_blocks=(0,))
    out, mask = _runner()(q, k, v, layout, 0.5, return_mask=True)
    torch.testing.assert_close(out, bs.block_sparse_reference(q, k, v, layout, mask), rtol=2e-5, atol=2e-5)


@interpreted
@pytest.mark.parametrize("seq_len", [16 * 128 + 40, 16 * 128])  # with and without a partial tail block
@pytest.mark.parametrize("selection", [{"sparsity": 0.75}, {"mass_threshold": 0.6}])
def test_interpreted_pooling_and_selection_kernels_match_pytorch(seq_len, selection):
    """The fused prepare kernel (Q rows per head, every block mean: a partial last query block averaged over its rows,
    rows in natural or permuted order) and the selection kernel against the float32 PyTorch path."""
    q, k, v = _structured(b=2, s=seq_len, h=1, d=24)
    perm = torch.randperm(seq_len, generator=torch.Generator().manual_seed(2))
    for layout in (bs.SparseLayout(seq_len), bs.SparseLayout(seq_len, dense_query_blocks=2, forced_key_blocks=(0, 1, 2)),
                   bs.SparseLayout(seq_len, perm, forced_key_blocks=(0,))):
        runner = _runner()
        call = runner.prepare(q, k, v, layout, **selection)
        pooled_q, pooled_k = bs._reference_pooled(q, k, layout)
        torch.testing.assert_close(call.pooled, torch.cat([pooled_q, pooled_k], 1), rtol=1e-5, atol=1e-6)
        rows = layout.order if layout.order is not None else torch.arange(seq_len)
        torch.testing.assert_close(call.qt, q.permute(0, 2, 1, 3)[:, :, rows].reshape(2, seq_len, 24), rtol=0, atol=0)
        out = runner.finish(runner.attend(runner.select(call)))
        mask = runner.block_mask(call)
        assert torch.equal(mask, bs.reference_mask(q, k, layout, **selection))
        torch.testing.assert_close(out, bs.block_sparse_reference(q, k, v, layout, mask), rtol=2e-5, atol=2e-5)


@interpreted
@pytest.mark.parametrize("seq_len, dense, forced, kept", TOP_K_CASES)
def test_interpreted_top_k_selection_kernel_matches_pytorch(monkeypatch, seq_len, dense, forced, kept):
    """The selection kernel's top-k (a radix select per row, no sort) keeps exactly the PyTorch selection's blocks,
    ties included, and writes the same page table: each row's page ids in ascending block order."""
    runner, call = _top_k_call(monkeypatch, seq_len, dense, forced, kept, seed=1)
    runner.write_pages(call)
    triton_pages = _check_top_k_pages(runner, call, forced, kept)
    monkeypatch.setattr(bs, "_use_triton", lambda x: False)
    runner.write_pages(call)
    assert torch.equal(call.plan.selected, triton_pages)


class _Ops(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the ATen operators run outside Triton launches (``paused`` while a kernel runs: the interpreter's
    own tensor handling is not the caller's work)."""

    def __init__(self):
        super().__init__()
        self.ops, self.paused = [], False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.paused:
            self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


@interpreted
def test_interpreted_selection_is_one_launch_and_top_k_never_synchronises(monkeypatch):
    """The selection stage: one Triton launch; top-k writes into the planned index buffer with no PyTorch operator
    (so nothing that could synchronise with the host); cumulative mass adds exactly one host read (the largest
    needed count)."""
    names = ("gather", "scatter", "prepare", "select")
    real = bs._kernels(True)
    launches, ops = [], _Ops()

    class Counted:
        def __init__(self, name, kernel):
            self.name, self.kernel = name, kernel

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launches.append(self.name)
                ops.paused = True
                try:
                    return self.kernel[grid](*args, **kwargs)
                finally:
                    ops.paused = False
            return launch

    monkeypatch.setattr(bs, "_kernels", lambda interpret: tuple(Counted(n, k) for n, k in zip(names, real)))
    q, k, v = _structured(s=16 * 128 + 40, h=2, d=16)
    layout = bs.SparseLayout(q.shape[1])
    runner = _runner()
    runner(q, k, v, layout, 0.75)  # plans once (host work, cached)
    call = runner.prepare(q, k, v, layout, 0.75)
    assert launches[-1:] == ["prepare"]  # Q rows and every block mean: one launch
    launches.clear()
    with ops:
        runner.select(call)
    assert launches == ["select"] and ops.ops == [] and runner.host_syncs == 0
    call = runner.prepare(q, k, v, layout, mass_threshold=0.6)
    launches.clear()
    runner.select(call)
    assert launches == ["select"] and runner.host_syncs == 1


def _ptxas_available() -> bool:
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        return os.path.exists(get_ptxas(90).path)
    except Exception:
        return False


@pytest.mark.skipif(importlib.util.find_spec("triton") is None or INTERPRETING or not _ptxas_available(),
                    reason="needs Triton's CUDA compiler (ptxas)")
def test_triton_kernels_compile_for_sm90():
    """The interpreter runs the kernels' semantics on the CPU; this lowers them to sm_90 machine code (Triton ships
    ptxas, no GPU needed), which catches what only the compiler checks (types across branches, tl.dot and tl.sort
    shapes) before an H200 run."""
    from triton import compile as triton_compile
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    _, _, prepare, select = bs._kernels(False)  # autotuned: every configuration they may launch
    ints = lambda *names: {name: "i32" for name in names}  # noqa: E731
    prepare_sig = {"q_ptr": "*bf16", "k_ptr": "*bf16", "order_ptr": "*i64", "qt_ptr": "*bf16", "pooled_ptr": "*fp32",
                   **ints("S", "H", "MB", "NB", "sqb", "sqs", "sqh", "skb", "sks", "skh")}
    select_sig = {"pooled_ptr": "*fp32", "forced_ptr": "*i8", "out_ptr": "*i32", "count_ptr": "*i32",
                  **ints("MB", "NB", "dense_rows", "n_sparse", "kept", "H", "base_b", "base_h", "mult", "out_sg",
                         "out_sr"), "threshold": "fp32", "scale_log2": "fp32"}
    target = GPUTarget("cuda", 90, 32)
    for ordered, gather in ((False, True), (True, True), (False, False)):
        for config in prepare.configs:
            constants = {"D": 128, "BLOCK_D": 128, "BLOCK_ROWS": 128, "ORDERED": ordered, "GATHER_Q": gather,
                         **config.kwargs}
            signature = {**prepare_sig, **{name: "constexpr" for name in constants}}
            compiled = triton_compile(ASTSource(prepare.fn, signature, constants), target=target,
                                      options={"num_warps": config.num_warps})
            assert compiled.asm["cubin"]
    for mass in (False, True):
        for config in select.configs:
            constants = {"D": 64, "BLOCK_D": 64, "NBP": 64, "BQ": 16, "DC": 32, "MASS": mass}
            signature = {**select_sig, **{name: "constexpr" for name in constants}}
            compiled = triton_compile(ASTSource(select.fn, signature, constants), target=target,
                                      options={"num_warps": config.num_warps})
            assert compiled.asm["cubin"]


@pytest.mark.skipif(importlib.util.find_spec("triton") is None or INTERPRETING, reason="needs Triton")
def test_selection_launch_configurations_worth_timing():
    """Cumulative mass sorts its keys: the configurations whose threads hold at most 64 of them, else the most warps.
    Top-k does not sort: at most 8 warps of those."""
    configs = bs._kernels(False)[3].configs

    def warps(mass, nbp):
        return sorted(c.num_warps for c in bs._select_configs_to_time(configs, {}, BQ=16, NBP=nbp, MASS=mass))

    assert warps(True, 256) == [4, 8, 16] and warps(False, 256) == [4, 8]
    assert warps(True, 1024) == [8, 16] and warps(False, 1024) == [8]
    assert warps(True, 4096) == warps(False, 4096) == [16]


class CpuRainFusion(RainFusionBackend):
    """RAINFUSION_ATTN's CUDA path with FlashInfer's paged prefill replaced by its PyTorch contract (CPU tests)."""

    devices = frozenset({"cpu"})
    dtypes = None

    def __init__(self, spec=None):
        super().__init__(spec, runner=_runner())

    @classmethod
    def extra_availability_reasons(cls, platform):
        return []


@pytest.fixture
def cpu_rainfusion():
    register_backend("RAINFUSION_ATTN", CpuRainFusion)
    yield
    reset_backend("RAINFUSION_ATTN")


def _wan():
    from diffusers_omni.testing.tiny import _WAN_LATENT_CHANNELS, _wan_transformer

    torch.manual_seed(0)
    model = _wan_transformer(_WAN_LATENT_CHANNELS).eval()
    inputs = (torch.randn(1, _WAN_LATENT_CHANNELS, 4, 64, 64), torch.tensor([500]), torch.randn(1, 8, model.config.text_dim))
    return model, inputs


class _Recording:
    """Wraps a runner: keeps, for every call, its output and the SDPA output of the same block mask."""

    def __init__(self, runner):
        self.runner, self.calls = runner, []

    def __call__(self, q, k, v, layout, sparsity=None, scale=None, return_mask=False, **kwargs):
        out, mask = self.runner(q, k, v, layout, sparsity, scale, return_mask=True, **kwargs)
        self.calls.append((out, bs.block_sparse_reference(q, k, v, layout, mask, scale), layout, mask))
        return out


def _record(model):
    backend = model.blocks[0].attn1.processor.attend["wan.self"].backend
    backend.runner = _Recording(backend.runner)
    return backend


def test_wan_dense_steps_skip_layers_and_sparse_steps(cpu_rainfusion, caplog):
    caplog.set_level(logging.INFO, logger="diffusers_omni.attention")
    model, inputs = _wan()
    with torch.no_grad():
        stock = model(*inputs, return_dict=False)[0]
    spec = {"backend": "RAINFUSION_ATTN", "block_sparse": {"sparsity": 0.5, "start_step": 1}}
    report = apply_attention(model, {"per_role": {"wan.self": spec}})
    assert report[0]["lossy"] and "block-sparse" in report[0]["quality"] and not report[1]["lossy"]
    try:
        with torch.no_grad():
            dense_step = model(*inputs, return_dict=False)[0]
            assert torch.equal(dense_step, stock)  # step 0 < start_step: the dense delegate, bitwise
            backend = _record(model)
            sparse_step = model(*inputs, return_dict=False)[0]
        assert len(backend.runner.calls) == 1
        out, reference, layout, mask = backend.runner.calls[0]
        torch.testing.assert_close(out, reference.to(out.dtype), rtol=1e-4, atol=1e-5)
        assert layout.forced_key_blocks == tuple(range(8)) and layout.source.startswith("geometry")  # first frame
        assert mask[:, :, :8].all() and 0.45 < mask.float().mean() < 0.75
        assert not torch.equal(sparse_step, stock)
        assert backend.state.plan.geometry.grid == (4, 32, 32)
        messages = " ".join(r.getMessage() for r in caplog.records)
        assert "denoise step 0 < block_sparse.start_step=1" in messages and "16 of 32 key blocks" in messages
    finally:
        remove_attention(model)
    assert not hasattr(model, "_omni_rainfusion_state") and not attention_report(model)
    skip = {"backend": "RAINFUSION_ATTN", "block_sparse": {"sparsity": 0.5, "skip_layers": "0"}}
    apply_attention(model, {"per_role": {"wan.self": skip}})
    try:
        with torch.no_grad():
            assert torch.equal(model(*inputs, return_dict=False)[0], stock)  # layer 0 is the only layer
    finally:
        remove_attention(model)


def test_geometry_free_selection_without_published_geometry(cpu_rainfusion):
    backend = RainFusionBackend.__new__(CpuRainFusion)
    CpuRainFusion.__init__(backend, AttentionSpec("RAINFUSION_ATTN", block_sparse={"sparsity": 0.5}))
    q, k, v = _qkv(s=4096 + 40, h=2, d=8)
    assert backend.why_dense_cuda(q, k) is None
    layout = backend.layout_for(q.shape[1])
    assert layout.source == "geometry-free" and layout.forced_key_blocks == () and layout.tail_rows == 40
    out, mask = backend.runner(q, k, v, layout, 0.5, return_mask=True)
    torch.testing.assert_close(backend(q, k, v), out)
    torch.testing.assert_close(out, bs.block_sparse_reference(q, k, v, layout, mask), rtol=2e-5, atol=2e-5)
    # Dense: cross-attention, too few blocks, everything kept.
    assert "cross-attention" in backend.why_dense_cuda(q, k[:, :77])
    assert "needs at least 32" in backend.why_dense_cuda(q[:, :4000], k[:, :4000])
    zero = CpuRainFusion(AttentionSpec("RAINFUSION_ATTN", block_sparse={"sparsity": 0.001}))
    assert "keeps every key block" in zero.why_dense_cuda(q, k)
    dense = F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (q, k[:, :77], v[:, :77]))).transpose(1, 2)
    torch.testing.assert_close(backend(q, k[:, :77], v[:, :77]), dense)


def test_backend_cumulative_mass_selection(cpu_rainfusion, caplog):
    caplog.set_level(logging.INFO, logger="diffusers_omni.attention")
    backend = CpuRainFusion(AttentionSpec("RAINFUSION_ATTN", block_sparse={"mass_threshold": 0.6}))
    backend.site_name = "blocks.0.attn1"
    q, k, v = _structured(s=32 * 128 + 40, h=2, d=8)
    assert backend.why_dense_cuda(q, k) is None
    layout = backend.layout_for(q.shape[1])
    mask = bs.reference_mask(q, k, layout, mass_threshold=0.6)
    torch.testing.assert_close(backend(q, k, v), bs.block_sparse_reference(q, k, v, layout, mask), rtol=2e-5, atol=2e-5)
    assert 0.03 < mask.float().mean() < 0.9
    assert "holding 0.6 of its pooled attention mass" in caplog.text
    described = backend.describe()
    assert described["mass_threshold"] == 0.6 and described["sparsity"] is None
    assert "cumulative-mass" in described["implementation"]
    assert "cross-attention" in backend.why_dense_cuda(q, k[:, :77])  # the dense rules are the same


def test_ascend_rf_v2_refuses_cumulative_mass():
    from diffusers_omni.attention.platform import Platform, use_platform

    with use_platform(Platform("npu", "Ascend")), pytest.raises(ValueError, match="mass_threshold=0.9 is not supported "
                                                                "by MindIE-SD rf_v2"):
        RainFusionBackend(AttentionSpec("RAINFUSION_ATTN", block_sparse={"mass_threshold": 0.9}))


def test_cumulative_mass_above_the_break_even_returns_none_for_a_dense_run():
    """``dense_above``: a cumulative-mass call keeping more than that share of the key blocks attends nothing (the
    caller runs dense: past the measured break-even block-sparse is slower); below it, the call runs sparse."""
    q, k, v = _structured(s=40 * 128, h=1, d=8, strength=0.0)  # near-uniform attention: most blocks are needed
    layout = bs.SparseLayout(q.shape[1])
    runner = _runner()
    assert runner(q, k, v, layout, mass_threshold=0.95, dense_above=0.5) is None
    assert runner.last_kept_share > 0.5
    out = runner(q, k, v, layout, mass_threshold=0.95, dense_above=1.0)
    assert out is not None and out.shape == q.shape
    assert runner(q, k, v, layout, 0.5, dense_above=0.1) is not None  # top-k shares are decided by the backend
