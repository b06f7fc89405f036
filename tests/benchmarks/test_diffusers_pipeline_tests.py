"""The harness that runs Diffusers' own pipeline tests with offload enabled in setup (benchmarks/diffusers_pipeline_tests.py)."""

from __future__ import annotations

import pytest
from diffusers import FluxPipeline

from benchmarks import diffusers_pipeline_tests
from benchmarks.diffusers_pipeline_tests import _offloaded_class, compare, summarize
from diffusers_omni.pipelines.flux import OmniFluxPipeline
from diffusers_omni.testing.tiny import tiny_flux_components


@pytest.mark.parametrize("mode", ["layerwise", "model_level"])
def test_offloaded_class_enables_offload_and_keeps_diffusers_component_names(mode):
    cls = _offloaded_class(OmniFluxPipeline, mode)
    assert cls.__name__ == "OmniFluxPipeline" and issubclass(cls, OmniFluxPipeline)
    pipe = cls(**tiny_flux_components())
    try:
        assert pipe.omni_offload_backend is not None and pipe.omni_offload_backend.strategy.value == mode
        # Diffusers reads the component names from __init__'s signature (components, from_pipe, save/load)
        assert set(pipe.components) == set(FluxPipeline(**tiny_flux_components()).components)
        # a second pipeline built from the same components (as Diffusers' tests do) adopts the offload
        second = cls(**pipe.components)
        assert second.omni_offload_backend is pipe.omni_offload_backend
    finally:
        pipe.disable_omni_offload()


def test_offloaded_class_leaves_a_pipeline_without_its_dit_resident():
    components = {name: (value if name.startswith(("text_encoder", "tokenizer")) else None)
                  for name, value in tiny_flux_components().items()}
    pipe = _offloaded_class(OmniFluxPipeline, "layerwise")(**components)
    assert pipe.omni_offload_backend is None


def test_summarize_counts_only_failures_of_tests_that_pass_in_stock():
    runs = {"stock": {"outcomes": {"a": "passed", "b": "failed", "c": "passed"}, "errors": {"b": "x"}},
            "layerwise": {"outcomes": {"a": "failed", "b": "failed", "c": "error"},
                          "errors": {"a": "boom", "b": "x", "c": "setup"}}}
    out = summarize(runs)
    assert out["stock"]["beyond_stock"] == []
    assert out["layerwise"]["beyond_stock"] == ["a", "c"]
    assert out["layerwise"]["failures"] == {"a": "boom", "b": "x", "c": "setup"}


def test_compare_restricts_the_committed_run_to_the_files_run_now_and_lists_what_differs():
    committed = {"meta": {}, "payload": {"commit": "old", "runs": {
        "stock": {"outcomes": {"t/a.py::A::x": "passed", "t/a.py::A::y": "passed"}},
        "layerwise": {"commit": "lw", "failures": {"t/a.py::A::z": "boom"},
                      "outcomes": {"t/a.py::A::x": "passed", "t/a.py::A::y": "passed", "t/a.py::A::z": "failed",
                                   "t/b.py::B::x": "failed"}}}}}
    now = {"runs": {"layerwise": {"files": ["t/a.py"], "failures": {"t/a.py::A::y": "new"},
                                  "outcomes": {"t/a.py::A::x": "passed", "t/a.py::A::y": "failed",
                                               "t/a.py::A::w": "skipped"}}}}
    diff = compare(now, committed)["layerwise"]
    assert diff["counts_now"] == {"passed": 1, "failed": 1, "skipped": 1, "error": 0}
    assert diff["counts_committed"] == {"passed": 2, "failed": 1, "skipped": 0, "error": 0}  # t/b.py left out
    assert diff["committed_commit"] == "lw"
    assert diff["only_now"] == ["t/a.py::A::w"] and diff["only_committed"] == ["t/a.py::A::z"]
    assert diff["differences"] == [{"test": "t/a.py::A::y", "now": "failed", "committed": "passed",
                                    "stock_committed": "passed", "error_now": "new", "error_committed": ""}]


def test_a_run_stops_before_pytest_when_a_module_diffusers_tests_import_is_missing(tmp_path, monkeypatch, capsys):
    (tmp_path / "tests" / "pipelines").mkdir(parents=True)
    (tmp_path / "tests" / "pipelines" / "test_pipelines_common.py").write_text("")
    monkeypatch.setattr(diffusers_pipeline_tests, "TEST_MODULES", ("pytest", "no_such_module_xyz"))
    assert diffusers_pipeline_tests.missing_test_modules() == ["no_such_module_xyz"]
    with pytest.raises(SystemExit):
        diffusers_pipeline_tests.main([str(tmp_path), "--modes", "omni", "--hub", str(tmp_path / "hub")])
    assert "no_such_module_xyz, not installed" in capsys.readouterr().err
    assert not (tmp_path / "hub").exists()  # stopped before building the stand-ins
