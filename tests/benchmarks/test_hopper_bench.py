"""hopper_bench's block-sparse stage timing and report on the CPU (reference kernels): every stage is timed, the kept
share is the planned mask's, and the report renders top-k and cumulative-mass rows."""

import argparse

import torch

from benchmarks import hopper_bench
from diffusers_omni.attention.backends.rainfusion import block_sparse as bs


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(1, 32 * 128 + 40, 2, 16, generator=g) for _ in range(3))


def test_stage_times_cover_every_stage_and_the_kept_share():
    q, k, v = _inputs()
    layout = bs.SparseLayout(q.shape[1])
    for selection in ({"sparsity": 0.75}, {"mass_threshold": 0.4}):
        runner = bs.BlockSparseRunner(lambda device: bs.ReferencePagedPrefill())
        stages = hopper_bench.stage_times(runner, q, k, v, layout, 1, 1, **selection)
        assert {"pool_ms", "prepare_ms", "write_pages_ms", "kernel_ms", "finish_ms"} <= set(stages)
        assert stages["selection_ms"] == stages["pool_ms"] + stages["write_pages_ms"]
        assert ("plan_ms" in stages) == ("mass_threshold" in selection)
        _, mask = runner(q, k, v, layout, return_mask=True, **selection)
        assert abs(stages["kept_share"] - mask.float().mean().item()) < 1e-6


def test_smoke_sparse_section_and_report(tmp_path):
    args = argparse.Namespace(device="cpu", smoke=True)
    _, factory = hopper_bench.kernels(True)
    out = {}
    saves = []
    hopper_bench.sparse_section(args, lambda q, k, v: hopper_bench.reference(q, k, v).to(q.dtype), factory, out,
                                lambda: saves.append(len(out["timings"])))
    assert [c["layout"] for c in out["checks"]] == ["geometry-free", "geometry", "geometry-free, cumulative mass"]
    assert all(c["mask_rows_equal_to_float32_selection"] == 1.0 for c in out["checks"])
    assert len(out["timings"]) == 4 and saves[-1] == 4  # written as it goes
    for row in out["timings"]:  # top-k rows, no dense query blocks: every request attends the same pages
        assert abs(row["kept_fraction"] - row["kept_pages"] / row["key_pages"]) < 1e-9
        if row["layout"] == "geometry-free":
            layout = bs.SparseLayout(row["S"])
            assert (row["kept_pages"], row["key_pages"]) == (bs.kept_pages(layout, row["sparsity"]), layout.key_pages)
    row = dict(out["timings"][0], mass_threshold=0.5, sparsity=None, kept_pages=None, plan_ms=1.0)
    report = hopper_bench.to_markdown({"device": "cpu", "torch": torch.__version__, "date": "today", "script": "x",
                                       "sparse": {"timings": [*out["timings"], row], "checks": out["checks"]},
                                       "elapsed_s": {"sparse": 1.0}})
    assert "top-k, sparsity 0.5" in report and "mass ≥ 0.5" in report and "elapsed: sparse 1 s" in report
    assert f"| {out['timings'][0]['kept_pages']}/{out['timings'][0]['key_pages']} pages |" in report
