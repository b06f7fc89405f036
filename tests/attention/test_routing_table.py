import json
from pathlib import Path

import torch

from diffusers_omni.attention.routing import ShapeRouter, length_bucket, load_table, rule_key

ROOT = Path(__file__).resolve().parents[2]


def _module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("derive_routing", ROOT / "benchmarks" / "derive_routing.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _derive():
    return _module().derive


def test_committed_routing_check_is_current():
    results = json.loads((ROOT / "benchmarks/results/attention/latest.json").read_text())["payload"]
    report = _module().check(results, load_table())
    assert report == (ROOT / "benchmarks/results/attention/routing_check.md").read_text()
    assert report.count("| yes |") == len(results["shapes"]) == 8


def test_committed_table_is_derived_from_committed_results():
    results = json.loads((ROOT / "benchmarks/results/attention/latest.json").read_text())["payload"]
    hopper = json.loads((ROOT / "benchmarks/results/hopper/latest.json").read_text())["payload"]
    module = _module()
    derived = module.derive([results])
    derived["fp8_margin"] = module.FP8_MARGIN
    derived["fp8"] = module.derive_fp8([hopper])
    derived["sparse"] = module.derive_sparse([hopper])
    lossy_source = "benchmarks/results/tune-lossy/latest.json"
    derived["lossy"] = module.derive_lossy([json.loads((ROOT / lossy_source).read_text())["payload"]], [lossy_source])
    assert derived == load_table()
    # Block-sparse break-even: Wan's 480p/81f self-attention class from its cumulative-mass rows.
    assert 0.7 < derived["sparse"]["hopper"]["q2/kv2/d128/dense"]["dense_above_kept_share"] < 0.8
    # Every lossy setting the warning can name has at least one measured model.
    assert {"FLASH_ATTN fp8_e4m3", "SAGE_ATTN", "RAINFUSION_ATTN sparsity=0.8"} <= set(derived["lossy"])
    # FP8 only where the whole FP8 call won at every measured shape of the class: long self-attention, never
    # short sequences or short KV.
    assert {key for key, rule in derived["fp8"]["hopper"].items() if rule["fp8"]} == {
        "q2/kv2/d128/dense", "q3/kv3/d128/dense"}


def test_hopper_routing_meets_the_3_percent_rule_at_every_benchmark_shape():
    results = json.loads((ROOT / "benchmarks/results/attention/latest.json").read_text())["payload"]
    table = load_table()
    chosen_names = set()
    for shape in results["shapes"]:
        # Distinct exact kernels: a Hub backend that fell back to FLASH_ATTN is that kernel measured again.
        rows = {n: r for n, r in shape["results"].items()
                if r["is_backend"] and not r.get("lossy") and not r.get("runs_as")}
        routable = {n: None for n in rows if not n.endswith("_HUB")}
        router = ShapeRouter("hopper", {"TORCH_SDPA": None, **routable}, table)
        chosen = router.choose(shape["Sq"], shape["Skv"], shape["D"], shape["masked"])
        chosen_names.add(chosen)
        assert rows[chosen]["tflops"] >= 0.97 * max(r["tflops"] for r in rows.values()), shape["shape"]
    assert {"TORCH_SDPA", "FLASH_ATTN", "FLASHINFER_ATTN"} <= chosen_names  # no single kernel wins on Hopper


def test_faster_backend_in_results_takes_the_class():
    fake = {"platform": {"family": "hopper", "device_name": "H200"}, "torch": "x", "date": "d", "shapes": [
        {"Sq": 4608, "Skv": 4608, "D": 128, "masked": False, "results": {
            "TORCH_SDPA": {"tflops": 500.0, "is_backend": True},
            "FLASHINFER_ATTN": {"tflops": 614.0, "is_backend": True},
            "ref: x": {"tflops": 900.0, "is_backend": False}}},
        {"Sq": 32760, "Skv": 512, "D": 128, "masked": False, "results": {
            "TORCH_SDPA": {"tflops": 548.0, "is_backend": True},
            "FLASHINFER_ATTN": {"tflops": 540.0, "is_backend": True}}}]}
    table = _derive()([fake])
    router = ShapeRouter("hopper", {"TORCH_SDPA": None, "FLASHINFER_ATTN": None}, table)
    assert router.choose(4608, 4608, 128, False) == "FLASHINFER_ATTN"
    assert router.choose(32760, 512, 128, False) == "TORCH_SDPA"  # within 3%: the preferred one
    # Not installed: the next in the ranking.
    assert ShapeRouter("hopper", {"TORCH_SDPA": None}, table).choose(4608, 4608, 128, False) == "TORCH_SDPA"
    # Not covered: the first candidate (the platform route's own choice).
    assert router.choose(4608, 4608, 80, False) == "TORCH_SDPA"
    # Base within tolerance of the best installed one keeps the class (the table's tie rule).
    near = {"families": {"hopper": {rule_key(4608, 4608, 128, False): {
        "ranking": ["FLASH_ATTN", "CUDNN_ATTN", "TORCH_SDPA"],
        "worst_ratio": {"FLASH_ATTN": 1.0, "CUDNN_ATTN": 0.89, "TORCH_SDPA": 0.885}}}}, "tolerance": 0.03}
    assert ShapeRouter("hopper", {"TORCH_SDPA": None, "CUDNN_ATTN": None}, near).choose(4608, 4608, 128, False) == (
        "TORCH_SDPA")


class _Counting:
    supports_mask = True
    supports_backward = True

    def __init__(self):
        self.calls = 0

    def __call__(self, q, k, v, *args):
        self.calls += 1
        return q


def test_router_caches_per_signature():
    a, b = _Counting(), _Counting()
    table = {"families": {"hopper": {rule_key(100, 100, 64, False): {"ranking": ["B", "A"]}}}}
    router = ShapeRouter("hopper", {"A": a, "B": b}, table)
    q = torch.zeros(1, 100, 2, 64)
    for _ in range(3):
        router(q, q, q)
    router(q, torch.zeros(1, 50000, 2, 64), q)
    assert (a.calls, b.calls) == (1, 3) and len(router._chosen) == 2
    assert [length_bucket(n) for n in (77, 4096, 32760, 54000)] == [0, 1, 2, 3]


def test_router_traces_under_fullgraph_compile():
    from diffusers_omni.attention.backends.sdpa import TorchSDPABackend

    class Doubled(TorchSDPABackend):
        def __call__(self, *args, **kwargs):
            return 2 * super().__call__(*args, **kwargs)

    table = {"families": {"cpu": {rule_key(64, 64, 32, False): {"ranking": ["B", "A"]}}}, "tolerance": 0.03}
    router = ShapeRouter("cpu", {"A": TorchSDPABackend(), "B": Doubled()}, table)
    q = torch.randn(1, 64, 2, 32)
    long_kv = torch.randn(1, 2048, 2, 32)  # another kv bucket: a class the table does not cover
    compiled = torch.compile(lambda q, k, v: router(q, k, v), fullgraph=True)
    assert torch.allclose(compiled(q, q, q), 2 * TorchSDPABackend()(q, q, q))  # the class the table covers → B
    assert torch.allclose(compiled(q, long_kv, long_kv), TorchSDPABackend()(q, long_kv, long_kv))  # → A
