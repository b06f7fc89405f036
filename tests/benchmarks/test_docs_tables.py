"""Every measured number in docs/ comes from committed results: the generated tables must be current."""

from pathlib import Path

from benchmarks import docs_tables as _docs_tables

ROOT = Path(__file__).resolve().parents[2]


def _module():
    return _docs_tables


def test_docs_tables_match_committed_results():
    docs_tables = _module()
    pages = docs_tables.pages()
    assert len(pages) >= 5
    stale = [p.name for p in pages if docs_tables.render_page(p.read_text()) != p.read_text()]
    assert stale == [], f"run python -m benchmarks.docs_tables: {stale}"


def test_every_renderer_is_used_once():
    docs_tables = _module()
    used = [m["name"] for p in docs_tables.pages() for m in docs_tables.MARKER.finditer(p.read_text())]
    assert sorted(used) == sorted(docs_tables.RENDERERS)


def test_plots_show_the_numbers_of_their_tables():
    docs_tables = _module()
    for name in docs_tables.PLOTS:
        assert docs_tables.plot_is_current(name), f"run python benchmarks/docs_tables.py: {name}"
    # The plot's bars are the offload-summary table's rows: same runs, same step times.
    bars = docs_tables.offload_plot_data()
    summary = docs_tables.offload_summary()
    for bar in bars:
        if bar["variant"].startswith("omni"):
            assert f"| {bar['variant']} | {bar['step_s']:.3f} |" in summary


def test_a_stale_plot_is_detected(tmp_path):
    docs_tables = _module()
    assert not docs_tables.plot_is_current("offload_summary.png", tmp_path)
    docs_tables.plot_offload_summary(tmp_path / "offload_summary.png")
    assert docs_tables.plot_is_current("offload_summary.png", tmp_path)
    # A plot drawn from other numbers (the first FLUX run's 12 GiB bar) is stale.
    from PIL import Image

    with Image.open(ROOT / "benchmarks" / "results" / "offload_h200_flux.png") as old:
        old.save(tmp_path / "offload_summary.png")
    assert not docs_tables.plot_is_current("offload_summary.png", tmp_path)


def test_e2e_attention_table_renders_when_results_exist(tmp_path, monkeypatch):
    import json

    docs_tables = _module()
    monkeypatch.setattr(docs_tables, "RESULTS", tmp_path)
    assert docs_tables.e2e_attention() == ""
    data = {"device": "GPU X", "torch": "2.11", "script": "benchmarks/e2e.py",
            "models": {"FLUX.1-dev 1024²": {"tokens": 4608, "baseline": "diffusers native",
                                           "steps": {"diffusers native": 0.5, "omni auto": 0.4}}}}
    (tmp_path / "e2e_attention_h200.json").write_text(json.dumps(data))
    rendered = docs_tables.e2e_attention()
    assert "| FLUX.1-dev 1024² | 4,608 | diffusers native (baseline) | 0.500 | 1.00× |" in rendered
    assert "| FLUX.1-dev 1024² | 4,608 | omni auto | **0.400** | 1.25× |" in rendered
    assert "GPU X, torch 2.11; `benchmarks/e2e.py`" in rendered


def test_schedule_bound_takes_the_run_whose_copies_outlast_its_compute_and_the_window():
    docs_tables = _module()
    # Two copy-bound blocks (3 s to copy, 1 s to compute) between two compute-bound ones; a window worth 2 s of
    # copies: the copy-bound pair runs at least 3 + 3 − 2 = 4 s, the others compute 2 × 5 s.
    blocks = [{"block": name, "compute_s": compute, "copy_s": copy, "packed_bytes": 1}
              for name, compute, copy in (("a", 5.0, 1.0), ("b", 1.0, 3.0), ("c", 1.0, 3.0), ("d", 5.0, 1.0))]
    bound, run = docs_tables.schedule_bound(blocks, window_bytes=2, bandwidth=1.0)
    assert bound == 14.0 and run == ["b", "c"]
    # A wider window hides the pair's copies: the bound is the compute.
    assert docs_tables.schedule_bound(blocks, window_bytes=6, bandwidth=1.0) == (12.0, [])
