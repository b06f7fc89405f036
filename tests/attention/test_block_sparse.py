"""Block-sparse RAINFUSION_ATTN on CUDA (issue 15), run on the CPU: the selection, the paged-prefill page tables
(through ``ReferencePagedPrefill``, FlashInfer's contract in PyTorch) against the same mask applied through SDPA,
plan caching, dense steps and skipped layers, and the geometry a Wan model publishes."""

import importlib.util
import logging
import os

import pytest
import torch
import torch.nn.functional as F

from diffusers_omni.attention import block_sparse as bs
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


def test_kept_blocks_and_forced_selection():
    layout = bs.SparseLayout(700, forced_key_blocks=(0, 1))
    assert (layout.full_key_blocks, layout.tail_rows, layout.query_blocks, layout.key_pages) == (5, 60, 6, 6)
    assert bs.kept_blocks(layout, 0.8) == 3  # at least the forced blocks plus the diagonal
    assert bs.kept_blocks(layout, 0.0) == 5 and bs.kept_blocks(bs.SparseLayout(700), 0.6) == 2
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


@interpreted
def test_interpreted_triton_layout_kernels_match_pytorch():
    q, k, v = _qkv(b=2, h=3, d=24)
    perm = torch.randperm(700, generator=torch.Generator().manual_seed(1))
    for order in (None, perm):
        out, pooled = bs.gather_heads(q, order, 700, pool_rows=700)
        rows = order if order is not None else torch.arange(700)
        want = q.permute(0, 2, 1, 3)[:, :, rows].reshape(6, 700, 24)
        assert torch.equal(out, want)
        torch.testing.assert_close(pooled, bs.pool_blocks(want, 700))
        assert torch.equal(bs.scatter_heads(out, order, 2), q)
    layout = bs.SparseLayout(700, perm, dense_query_blocks=1, forced_key_blocks=(0,))
    out, mask = _runner()(q, k, v, layout, 0.5, return_mask=True)
    torch.testing.assert_close(out, bs.block_sparse_reference(q, k, v, layout, mask), rtol=2e-5, atol=2e-5)


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

    def __call__(self, q, k, v, layout, sparsity, scale=None, return_mask=False):
        out, mask = self.runner(q, k, v, layout, sparsity, scale, return_mask=True)
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
