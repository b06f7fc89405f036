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

    with Image.open(docs_tables.path_of(docs_tables.OFFLOAD_BUDGET_HISTORY[0]).with_suffix(".png")) as old:
        old.save(tmp_path / "offload_summary.png")
    assert not docs_tables.plot_is_current("offload_summary.png", tmp_path)


def test_e2e_attention_table_renders_when_results_exist(tmp_path, monkeypatch):
    from benchmarks import results_io

    docs_tables = _module()
    monkeypatch.setattr(docs_tables, "RESULTS", tmp_path)
    assert docs_tables.e2e_attention() == ""
    data = {"device": "GPU X", "torch": "2.11", "script": "benchmarks/e2e.py",
            "models": {"FLUX.1-dev 1024²": {"tokens": 4608, "baseline": "diffusers native",
                                           "steps": {"diffusers native": 0.5, "omni auto": 0.4}}}}
    meta = results_io.collect_meta("hopper", docs_tables.E2E_ATTENTION, ["test"], smoke=False, label=None)
    results_io.write_result(docs_tables.E2E_ATTENTION, data, meta, root=tmp_path)
    rendered = docs_tables.e2e_attention()
    assert "| FLUX.1-dev 1024² | 4,608 | diffusers native (baseline) | 0.500 | 1.00× | — (the baseline) |" in rendered
    assert ("| FLUX.1-dev 1024² | 4,608 | omni auto | **0.400** | 1.25× | exact kernel; output not compared with the "
            "baseline's |") in rendered
    assert "GPU X, torch 2.11; `benchmarks/e2e.py`; `hopper-e2e/latest.json`" in rendered


def _e2e(steps: dict, backends: dict | None = None, rel_err: dict | None = None) -> dict:
    entry = {"tokens": 32760, "baseline": "native", "steps": steps}
    if backends is not None:
        entry["omni_backends"] = backends
    if rel_err is not None:
        entry["rel_err"] = rel_err
    return {"device": "GPU X", "torch": "2.11", "script": "s.py", "models": {"Wan": entry}}


def test_no_lossy_speed_up_without_its_error():
    docs_tables = _module()
    sparse = {"wan.self": {"backend": "RAINFUSION_ATTN", "fp8_routes": {}}}
    fp8 = {"wan.self": {"backend": "FLASH_ATTN", "fp8_routes": {"(32760, 32760, 128)": True}}}
    steps = {"native": 3.0, "omni auto": 2.9, "omni FP8": 2.6, "omni RainFusion": 2.0}
    rendered = docs_tables.render_e2e_attention(_e2e(steps, {"omni FP8": fp8, "omni RainFusion": sparse}))
    # The lossy rows show their time but no speed-up and no bold; the fastest exact row is bold.
    assert "| Wan | 32,760 | omni RainFusion | 2.000 | — | lossy; error: see quality page |" in rendered
    assert "| Wan | 32,760 | omni FP8 | 2.600 | — | lossy; error: see quality page |" in rendered
    assert "| Wan | 32,760 | omni auto | **2.900** | 1.03× | exact kernel; output not compared with the baseline's |" in rendered
    # With its error measured, a lossy row gets its speed-up, the error beside it, and can be the fastest.
    rendered = docs_tables.render_e2e_attention(_e2e(steps, {"omni FP8": fp8, "omni RainFusion": sparse},
                                                     {"omni RainFusion": 0.031}))
    assert "| Wan | 32,760 | omni RainFusion | **2.000** | 1.50× | rel err 3.1e-02 |" in rendered
    # An FP8 spec whose every call was routed to bf16 ran nothing lossy; without recorded backends, the name decides.
    bf16_only = {"wan.self": {"backend": "FLASH_ATTN", "fp8_routes": {"(4608, 4608, 128)": False}}}
    rendered = docs_tables.render_e2e_attention(_e2e({"native": 3.0, "omni FP8": 2.9}, {"omni FP8": bf16_only}))
    assert ("| omni FP8 | **2.900** | 1.03× | exact kernel (no call routed to FP8 at this size); output not compared "
            "with the baseline's |") in rendered
    assert "| omni FP8 | 2.900 | — |" in docs_tables.render_e2e_attention(_e2e({"native": 3.0, "omni FP8": 2.9}))


def test_readme_lossy_rows_carry_no_speed_up_without_an_error():
    import re

    readme = (ROOT / "README.md").read_text()
    block = re.search(r"<!-- results: e2e-attention -->\n(.*?)<!-- /results -->", readme, re.S)[1]
    for row in block.splitlines():
        if "RainFusion" in row or ("FP8 |" in row and "no call routed" not in row):
            cells = [c.strip() for c in row.strip("|").split("|")]
            assert "**" not in row and (cells[4] == "—" or "rel err" in cells[5]), row


def test_readme_offload_claims_and_the_plot_are_the_same_rows():
    docs_tables = _module()
    readme = (ROOT / "README.md").read_text()
    wins, costs = docs_tables.readme_wins(), docs_tables.readme_costs()
    assert wins in readme and costs in readme
    bars = docs_tables.offload_plot_data()
    runs = {bar["run"] for bar in bars}
    # Every run the README quotes is a run of the plot, named where its numbers are.
    for name, _ in docs_tables.README_OFFLOAD_RUNS:
        assert name in runs and f"`{docs_tables.cite(name, '.json')}`" in wins
        assert f"`{docs_tables.cite(name, '')}`" in costs
    budget_run = docs_tables.README_BUDGET_RUN[0]
    assert budget_run in runs and f"`{docs_tables.cite(budget_run, '')}`" in costs
    # Every bar of the plot (step and peak, as it prints them) is a number of the README's offload sections.
    for bar in bars:
        assert f"{bar['step_s']:.3f} s" in wins + costs, bar
        assert f"{bar['peak_gib']:.2f} GiB" in wins + costs, bar
    # The old table quoted another FLUX run than the plot's (0.43 s / 1.76 GiB "same" against the plot's 0.435 s /
    # 1.72 GiB).
    assert "| same |" not in wins and "| 1.76 GiB | 1.76 GiB | same |" not in readme


def test_readme_speed_ups_say_what_they_divide_and_enable_is_once_per_process():
    docs_tables = _module()
    wins = docs_tables.readme_wins()
    for row in wins.splitlines():
        if "faster" in row:
            assert "÷" in row or "first time only" in row, row
        if "enable offloading" in row:
            assert "first time only" in row and "next enable in the same process took" in row
    costs = docs_tables.readme_costs()
    for needle in ("whole model resident on the GPU", "÷ resident", "peak during enable", "after enable",
                   "Enable, first time", "Enable again"):
        assert needle in costs


def test_peak_difference_is_worded_from_the_bytes():
    docs_tables = _module()
    GiB = 2**30
    assert docs_tables._delta_bytes(GiB, GiB) == "same"
    assert docs_tables._delta_bytes(GiB - 36 * 2**20, GiB) == "36 MiB lower (3.5%)"
    assert docs_tables._delta_bytes(3 * GiB, GiB) == "2.00 GiB higher (200.0%)"


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


def test_no_measured_number_is_typed_outside_a_rendered_block():
    # Numbers that read as measurements (×, %, GiB, GB/s, seconds) in the README and the number-bearing pages live
    # only in <!-- results --> blocks; config values in code spans and the target's definition are not measurements.
    import re

    block = re.compile(r"<!-- results: [a-z0-9-]+ -->\n.*?<!-- /results -->", re.S)
    code = re.compile(r"```.*?```|`[^`\n]*`", re.S)
    measured = re.compile(r"\d+(\.\d+)?\s?(×|%|GiB|GB/s|MiB|ms\b)|\d+\.\d+\s?s\b")
    allowed = ("1 GiB or more", "at 4 and 5 GiB", "up to 1 MiB", "≤ 1 MiB", "1.05 × max(")
    typed = []
    for page in ("README.md", "docs/index.md", "docs/coming_from_diffusers.md", "docs/user_guide/offload.md"):
        text = code.sub("", block.sub("", (ROOT / page).read_text()))
        typed += [f"{page}: {line.strip()}" for line in text.splitlines()
                  if measured.search(line) and not any(a in line for a in allowed)]
    assert typed == []


def test_readme_costs_show_steady_host_memory_once_the_runs_record_it(monkeypatch):
    import copy

    docs_tables = _module()
    assert "while steps run" not in docs_tables.readme_costs()  # the committed runs predate the measurement
    original = docs_tables.result

    def with_host_memory(name):
        data = copy.deepcopy(original(name))
        for entry in data.get("models", []):
            for v in entry["variants"]:
                v.update(host_rss_steady=30 * 2**30, pinned_host_bytes=0, registered_host_bytes=22 * 2**30)
        return data

    monkeypatch.setattr(docs_tables, "result", with_host_memory)
    costs = docs_tables.readme_costs()
    assert "| Host memory (process RSS) while steps run: layerwise / group offload | 30.00 GiB / 30.00 GiB |" in costs
    assert "(pinned or registered): layerwise / group offload | 22.00 GiB / 22.00 GiB |" in costs


def test_a_cuda_out_of_memory_error_is_rendered_with_the_cards_limit_only():
    message = ("CUDA out of memory. Tried to allocate 72.00 MiB. GPU 0 has a total capacity of 139.80 GiB of which "
               "115.13 GiB is free. Including non-PyTorch memory, this process has 24.66 GiB memory in use. 24.00 GiB "
               "allowed; Of the allocated memory 23.99 GiB is allocated by PyTorch")
    assert _docs_tables._short_error(message) == "CUDA out of memory (24.00 GiB allowed)"
    assert _docs_tables._short_error("CUDA out of memory.") == "CUDA out of memory"
    assert _docs_tables._short_error("RuntimeError: something else") == "RuntimeError"


def test_a_strategy_run_with_fewer_steps_is_compared_with_its_denoise_scaled():
    row = {"steps": 4, "end_to_end_s": 28.9, "phases": {"encode_s": 2.0, "denoise_s": 26.0, "decode_s": 0.9}}
    assert _docs_tables._end_to_end(row, 20) == 2.0 + 26.0 * 5 + 0.9
    assert _docs_tables._end_to_end({**row, "steps": 20}, 20) == 28.9


def _block(text: str, name: str) -> str:
    import re

    return re.search(rf"<!-- results: {name} -->\n(.*?)<!-- /results -->", text, re.S)[1]


def _quality(tokens: int, errors: dict[str, tuple[str, float]]) -> dict:
    candidates = {name: {"output_rel_err": err, "candidate": {"backends": [{"role": "r", "backend": backend,
                                                                           "lossy": False, "modules": 1}]}}
                  for name, (backend, err) in errors.items()}
    return {"full_size": {"Wan": {"tokens": tokens, "candidates": candidates}}}


def test_an_exact_kernel_whose_output_differs_from_native_is_not_called_error_free():
    docs_tables = _module()
    fa3 = {"wan.self": {"backend": "FLASH_ATTN", "fp8_routes": {}}}
    sdpa = {"wan.self": {"backend": "TORCH_SDPA", "fp8_routes": {}}}
    data = _e2e({"Diffusers native": 3.0, "Diffusers _flash_3": 2.8, "omni FLASH_ATTN bf16": 2.8, "omni auto": 2.9},
                {"omni FLASH_ATTN bf16": fa3, "omni auto": sdpa})
    data["models"]["Wan"]["baseline"] = "Diffusers native"
    quality = _quality(32760, {"FLASH_ATTN bf16 (exact)": ("FLASH_ATTN", 0.0092)})
    rendered = docs_tables.render_e2e_attention(data, quality)
    assert "none (exact)" not in rendered
    # Diffusers' _flash_3 and ours run the same FA3 kernel: both say how far from native its output was.
    assert "| Diffusers _flash_3 | **2.800** | 1.07× | exact kernel, 0.92% from native (quality run, FLASH_ATTN bf16) |" in rendered
    assert "| omni FLASH_ATTN bf16 | **2.800** | 1.07× | exact kernel, 0.92% from native" in rendered
    assert "| omni auto | 2.900 | 1.03× | same kernel as the baseline (TORCH_SDPA); output not compared" in rendered
    # Measured at another size only: not borrowed.
    rendered = docs_tables.render_e2e_attention(data, _quality(4608, {"x (exact)": ("FLASH_ATTN", 0.0153)}))
    assert "| Diffusers _flash_3 | **2.800** | 1.07× | exact kernel; output not compared with the baseline's |" in rendered


def test_the_readme_e2e_table_says_how_far_from_native_each_exact_kernel_is():
    docs_tables = _module()
    readme = (ROOT / "README.md").read_text()
    block = _block(readme, "e2e-attention")
    assert "none (exact)" not in block
    quality = docs_tables.result("quality")["full_size"]
    e2e = docs_tables.result(docs_tables.E2E_ATTENTION)["models"]
    for model, entry in e2e.items():
        [measured] = [q for q in quality.values() if q["tokens"] == entry["tokens"]]
        fa3 = measured["candidates"]["FLASH_ATTN bf16 (exact)"]["output_rel_err"]
        assert fa3 > 0
        for variant in ("Diffusers _flash_3", "omni FLASH_ATTN bf16"):
            [row] = [r for r in block.splitlines() if r.startswith(f"| {model} |") and f"| {variant} |" in r]
            assert f"exact kernel, {fa3:.2%} from native" in row, row
    # A result whose date is unknown or whose tree was dirty says so beside it.
    assert "`hopper-e2e/latest.json` (run date unknown)" in block
    pipelines = _block(readme, "readme-pipelines")
    assert "`pipeline-offload-wan-mmgp/latest.json` (run from a tree with uncommitted changes on 03e88bd)" in pipelines
    # The tuning claim is not a count typed by hand (it went stale: "one of the six cases short of its target").
    assert "of the six cases" not in readme


def test_provenance_says_an_unknown_date_and_a_dirty_tree():
    docs_tables = _module()
    assert docs_tables.provenance("hopper-e2e") == " (run date unknown)"
    assert docs_tables.provenance("pipeline-offload-qwen-diffusers") == (
        " (run from a tree with uncommitted changes on 8f08c41)")
    assert docs_tables.provenance("pipeline-offload-wan") == ""  # dated, clean tree
    assert docs_tables.source("pipeline-offload-wan", ".json") == "`pipeline-offload-wan/latest.json`"


def test_a_pipelines_time_is_one_value_in_the_readme_the_guide_and_the_plot_with_its_method_said():
    docs_tables = _module()
    readme = _block((ROOT / "README.md").read_text(), "readme-pipelines")
    guide = _block((ROOT / "docs/user_guide/offload.md").read_text(), "pipeline-offload")
    bars = docs_tables.pipeline_plot_data()
    labels = dict(docs_tables.PIPELINE_RUNS)
    names = {"diffusers-group": "Diffusers `enable_group_offload`", "diffusers-sequential":
             "Diffusers `enable_sequential_cpu_offload`", "mmgp2": "mmgp `profile` 2"}
    checked = 0
    for name, label in labels.items():
        [readme_row] = [r for r in readme.splitlines() if r.startswith(f"| {label},")]
        cells = [c.strip() for c in readme_row.strip("|").split("|")]
        section = guide.split(f"**{label}**", 1)[1].split("\n**", 1)[0]
        for bar in (b for b in bars if b["group"].startswith(label + ",") and b["strategy"] in names):
            value = f"{bar['seconds']:.1f} s"
            [guide_row] = [r for r in section.splitlines() if r.startswith(f"| {names[bar['strategy']]}")]
            assert f"| {value}" in guide_row, (bar, guide_row)  # the guide's table shows the plot's value
            in_readme = (cells[2] if bar["strategy"].startswith("diffusers") else cells[3])
            if bar["strategy"] in in_readme or bar["strategy"] == "mmgp2":
                assert in_readme.startswith(value), (bar, in_readme)  # and so does the README
                checked += 1
                if bar["measured_steps"] != bar["steps"]:
                    how = f"ran {bar['measured_steps']} steps in"
                    assert how in in_readme and "denoise scaled" in in_readme
            if bar["measured_steps"] != bar["steps"]:
                assert f"ran {bar['measured_steps']} steps in" in guide_row and "denoise scaled" in guide_row
    assert checked >= 5
    # Qwen's sequential offload ran 4 of 20 steps: one value (denoise scaled), never the 4-step time drawn in a
    # 20-step panel, never rescaled by another run's resident.
    [qwen] = [b for b in bars if b["strategy"] == "diffusers-sequential" and b["group"].startswith("Qwen")]
    row = next(r for r, *_ in docs_tables._pipeline_rows("pipeline-offload-qwen")
               if r["strategy"] == "diffusers-sequential")
    assert qwen["measured_steps"] == 4 and qwen["steps"] == 20
    assert qwen["seconds"] == round(docs_tables._end_to_end(row, 20), 3) != round(row["end_to_end_s"], 3)
    check = docs_tables._pipeline_checks("pipeline-offload-qwen")["omni"]["vs_diffusers"][0]
    omni = next(r for r in docs_tables.result("pipeline-offload-qwen")["strategies"] if r["strategy"] == "omni")
    assert check == docs_tables._end_to_end(row, 20) / omni["end_to_end_s"]


def test_the_readme_says_where_a_pipelines_output_is_not_the_resident_ones():
    readme = _block((ROOT / "README.md").read_text(), "readme-pipelines")
    assert "same output as the resident pipeline;" not in readme
    [wan] = [r for r in readme.splitlines() if r.startswith("| Wan2.2")]
    assert "output not the resident pipeline's" in wan.split("|")[4]  # mmgp's video differs (its sha256)
