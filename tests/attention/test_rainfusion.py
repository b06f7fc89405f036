import logging
import types

import pytest
import torch
import torch.nn.functional as F

from diffusers_omni.attention.backends.rainfusion import backend as rainfusion
from diffusers_omni.attention.backends.base import AttentionCall
from diffusers_omni.attention.backends.rainfusion import (
    RainFusionBackend,
    check_sequence_parallel,
    layer_index,
    publish_video_geometry,
)
from diffusers_omni.attention.platform import Platform
from diffusers_omni.attention.backends.rainfusion.plan import BLOCK, VideoGeometry, dense_reason, plan_geometry, video_order
from diffusers_omni.attention.selector import BackendNotSupportedError, resolve
from diffusers_omni.config.attention import AttentionSpec


def test_documented_minimax_h3_case():
    plan = plan_geometry(VideoGeometry(prefix_len=512, grid=(62, 24, 42)))
    assert plan.video_rows == 62_496
    assert plan.spatial_residue_rows == 2_928  # two non-8-wide latent columns over frames 1..61
    assert plan.temporal_residue_rows == 48
    assert plan.promoted_rows == 2_976
    assert plan.sparse_rows == 59_520 and plan.sparse_blocks == 465
    assert plan.first_frame_blocks == 8 and plan.kept_rows == 512 + 2_976
    assert plan.runs_sparse


# (grid, spatial residue, temporal residue, sparse blocks, runs sparse)
GRIDS = [
    ((21, 64, 112), 0, 0, 1_176, True),  # 8x8-aligned: 150,528 rows = 1,176 blocks, nothing promoted
    ((21, 60, 104), 8_320, 96, 958, True),  # h=60 is not 8-aligned: 20 frames x 416 rows promoted
    ((62, 24, 42), 2_928, 48, 465, True),
    ((13, 30, 52), 12 * (1560 - 24 * 48), (20_280 - 12 * 408) % 128, (20_280 - 12 * 408) // 128, True),
    ((1, 64, 64), 0, 0, 32, True),  # a single frame: 4,096 rows, exactly 32 blocks
    ((1, 60, 60), 0, 3600 % 128, 3600 // 128, False),  # 28 blocks < 32
    ((2, 8, 8), 0, 0, 1, False),
    ((5, 7, 7), 4 * 49, 49, 0, False),  # nothing 8-aligned: everything promoted
]


@pytest.mark.parametrize("grid, spatial, temporal, blocks, sparse", GRIDS)
def test_planner_table(grid, spatial, temporal, blocks, sparse):
    plan = plan_geometry(VideoGeometry(0, grid))
    t, h, w = grid
    assert plan.video_rows == t * h * w
    assert (plan.spatial_residue_rows, plan.temporal_residue_rows, plan.sparse_blocks) == (spatial, temporal, blocks)
    assert plan.promoted_rows + plan.sparse_rows == plan.video_rows
    assert plan.sparse_rows % BLOCK == 0  # no padding: the sparse segment is whole blocks
    assert plan.runs_sparse is sparse
    if not sparse:
        assert f"{blocks} sparse 128-row blocks; RainFusion needs at least 32" in plan.dense_reason
    order = video_order(plan)
    assert sorted(order.tolist()) == list(range(plan.video_rows))  # a permutation: nothing dropped, nothing padded
    assert order[: h * w].tolist() == list(range(h * w))  # first frame first, in natural order


def test_video_order_tiles_and_promotes_residue():
    plan = plan_geometry(VideoGeometry(0, (62, 24, 42)))
    order = video_order(plan)
    frame = 24 * 42
    # The first tile of frame 1 is its top-left 8x8 window.
    tile = order[frame : frame + 64].reshape(8, 8)
    assert tile[0].tolist() == [frame + c for c in range(8)] and tile[1, 0].item() == frame + 42
    promoted = set(order[plan.sparse_rows :].tolist())
    residue = {frame * f + r * 42 + c for f in range(1, 62) for r in range(24) for c in (40, 41)}
    assert residue <= promoted and len(promoted - residue) == 48


def test_geometry_validation():
    with pytest.raises(ValueError, match="prefix_len=-1"):
        VideoGeometry(-1, (1, 1, 1))
    with pytest.raises(ValueError, match="three positive ints"):
        VideoGeometry(0, (1, 0, 1))


def test_dense_reasons():
    plan = plan_geometry(VideoGeometry(0, (21, 60, 104)))
    assert dense_reason(None, step=5, start_step=0, layer=1, skip_layers=()) == "the model published no video geometry"
    assert dense_reason(plan, step=1, start_step=2, layer=1, skip_layers=()) == "denoise step 1 < block_sparse.start_step=2"
    assert dense_reason(plan, step=2, start_step=2, layer=3, skip_layers=(0, 1, 2, 3)) == "layer 3 is in block_sparse.skip_layers"
    assert dense_reason(plan, step=2, start_step=2, layer=4, skip_layers=(0, 1, 2, 3)) is None


def test_explicit_selection_needs_npu_or_hopper(monkeypatch):
    with pytest.raises(BackendNotSupportedError) as info:
        resolve("RAINFUSION_ATTN", "x.self", "self", AttentionCall("cpu", torch.float32, 64), Platform("cpu", "CPU"))
    assert "platform device is 'cpu'; RAINFUSION_ATTN requires one of ['cuda', 'npu']" in str(info.value)
    with pytest.raises(BackendNotSupportedError, match="package 'mindiesd' is not importable"):
        resolve("RAINFUSION_ATTN", "x.self", "self", AttentionCall("npu", torch.bfloat16, 128), Platform("npu", "NPU"))
    hopper = Platform("cuda", "H200", (9, 0), 91900)
    call = AttentionCall("cuda", torch.bfloat16, 128)
    found = {"flashinfer": False}
    monkeypatch.setattr(rainfusion, "package_importable", lambda name: found.get(name, True))
    with pytest.raises(BackendNotSupportedError, match="package 'flashinfer' is not importable"):
        resolve("RAINFUSION_ATTN", "x.self", "self", call, hopper)
    found["flashinfer"] = True
    assert resolve("RAINFUSION_ATTN", "x.self", "self", call, hopper).backend == "RAINFUSION_ATTN"
    ampere = Platform("cuda", "A100", (8, 0), 91900)
    with pytest.raises(BackendNotSupportedError, match="requires sm_90"):
        resolve("RAINFUSION_ATTN", "x.self", "self", AttentionCall("cuda", torch.bfloat16, 128), ampere)


def test_ring_sequence_parallel_refused():
    check_sequence_parallel(1)
    with pytest.raises(ValueError, match="incompatible with ring sequence parallelism \\(ring_degree=2\\)"):
        check_sequence_parallel(2)


def test_layer_index():
    assert layer_index("blocks.12.attn1") == 12 and layer_index("transformer_blocks.0.attn") == 0
    assert layer_index("attn") is None


class TinyDiT(torch.nn.Module):
    def forward(self, x):
        return x


def fake_mindiesd(record):
    """FAKE kernel boundary (not MindIE-SD): records the plan arguments and computes dense attention on the
    permuted rows, so the permutation and its inverse around the call are checked for real."""

    def rain_fusion_attention(q, k, v, **kw):
        record.append(kw)
        return F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (q, k, v)), scale=kw["scale"]).transpose(1, 2)

    return types.SimpleNamespace(rain_fusion_attention=rain_fusion_attention)


def test_backend_delegates_and_runs_sparse(monkeypatch, caplog):
    record = []
    monkeypatch.setattr(rainfusion, "_import_mindiesd", lambda: fake_mindiesd(record))
    caplog.set_level(logging.INFO, logger="diffusers_omni.attention")
    model = TinyDiT()
    spec = AttentionSpec("RAINFUSION_ATTN", block_sparse={"sparsity": 0.8, "start_step": 1, "skip_layers": "0"})
    backend = RainFusionBackend(spec)
    backend.kernel = "rf_v2"  # the Ascend path, with the fake kernel boundary above
    layer0 = backend.bind_site(model, types.SimpleNamespace(name="blocks.0.attn1"), None)
    layer1 = backend.bind_site(model, types.SimpleNamespace(name="blocks.1.attn1"), None)
    prefix, grid = 5, (3, 40, 40)  # 4,800 video rows: 2 · 0 residue, 4,800 mod 128 = 64 promoted, 37 blocks
    n = prefix + 3 * 40 * 40
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, n, 1, 8, generator=g) for _ in range(3))
    ref = F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (q, k, v))).transpose(1, 2)

    model(None)  # step 0, no geometry published
    torch.testing.assert_close(layer1(q, k, v), ref)
    publish_video_geometry(model, VideoGeometry(prefix, grid))
    model(None)  # step 1
    layer0(q, k, v)  # skip_layers: dense
    assert record == []
    out = layer1(q, k, v)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)  # permutation undone exactly
    assert record == [
        {"sparse_rows": 4_736, "kept_rows": prefix + 64, "first_frame_blocks": 13, "block_size": 128, "sparsity": 0.8, "scale": None, "layout": "BSND"}
    ]
    messages = " ".join(r.getMessage() for r in caplog.records)
    assert "no video geometry" in messages and "skip_layers" in messages
    publish_video_geometry(model, VideoGeometry(prefix, grid), step=0)
    model(None)
    layer1(q, k, v)
    assert len(record) == 1 and "start_step=1" in " ".join(r.getMessage() for r in caplog.records)
    # A cross-attention call (KV not the video sequence) is dense.
    layer1(q, k[:, :7], v[:, :7])
    assert len(record) == 1


def test_zero_sparsity_is_dense():
    backend = RainFusionBackend(AttentionSpec("RAINFUSION_ATTN", block_sparse={"sparsity": 0.0}))
    q = torch.randn(1, 4, 1, 8)
    assert backend.why_dense(q, q) == "block_sparse.sparsity is 0"


def test_top_k_above_the_measured_break_even_runs_dense(monkeypatch):
    """A block-sparse setting that keeps more key blocks than the measured break-even (``sparse`` in the routing
    table) runs dense for that call, saying why."""
    from diffusers_omni.attention import routing

    backend = RainFusionBackend(AttentionSpec("RAINFUSION_ATTN", block_sparse={"sparsity": 0.1}))
    q = torch.randn(1, 64 * BLOCK, 1, 8)
    monkeypatch.setattr(rainfusion, "sparse_dense_above", lambda family, q_len, kv_len, d: 0.755)
    reason = backend.why_dense_cuda(q, q)
    assert reason is not None and "above the measured break-even 76%" in reason and "keeps 91%" in reason
    monkeypatch.setattr(rainfusion, "sparse_dense_above", lambda family, q_len, kv_len, d: None)
    assert backend.why_dense_cuda(q, q) is None
    # The committed table carries the Hopper break-even of Wan's 480p/81f self-attention class.
    assert routing.sparse_dense_above("hopper", 32760, 32760, 128) == pytest.approx(0.755, abs=0.01)


def test_explain_lists_the_break_evens_for_a_rainfusion_role(monkeypatch, capsys):
    from diffusers_omni.cli.main import main

    monkeypatch.setattr(RainFusionBackend, "not_supported_reasons", classmethod(lambda cls, call, platform: []))
    config = '{"per_role": {"wan.self": {"backend": "RAINFUSION_ATTN", "block_sparse": {"sparsity": 0.8}}}}'
    assert main(["explain", "--model", "tiny-wan", "--platform", "sm_90", "--attention", config]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "wan.self: LOSSY" in out
    assert "calls of class q2/kv2/d128/dense keeping more than 76% of the key blocks run dense" in out
