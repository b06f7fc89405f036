"""Kernel fingerprints: contents, JSON round trip, role-by-role comparison."""

import copy

import pytest

from diffusers_omni import apply_attention, omnify
from diffusers_omni.alignment import compare_fingerprints, kernel_fingerprint, load_fingerprint, save_fingerprint
from diffusers_omni.testing import tiny_flux_components, tiny_wan_i2v_pipeline

IDENTITY_KEYS = {
    "backend", "implementation", "version", "kernel_repo", "kernel_revision", "deterministic", "call",
    "torch", "cuda", "cudnn", "device_name", "compute_capability", "source", "modules",
}


def test_fingerprint_lists_every_role_with_its_kernel_identity():
    model = tiny_flux_components()["transformer"]
    apply_attention(model, {"default": "TORCH_SDPA", "deterministic": True})
    fp = kernel_fingerprint(model)
    assert set(fp["roles"]) == {"flux.joint", "flux.single"}
    for entry in fp["roles"].values():
        assert IDENTITY_KEYS <= set(entry)
        assert entry["backend"] == "TORCH_SDPA" and entry["deterministic"] is True and entry["kernel_repo"] is None
    assert {"torch", "diffusers", "diffusers_omni", "device_name", "torch_deterministic_algorithms"} <= set(fp["environment"])


def test_fingerprint_of_a_pipeline_and_of_stock_diffusers():
    pipe = tiny_wan_i2v_pipeline()
    stock = kernel_fingerprint(pipe)
    assert all(role.startswith("stock:") for role in stock["roles"])
    omni = omnify(pipe, {"default": "TORCH_SDPA"})
    assert set(kernel_fingerprint(omni)["roles"]) == {"wan.self", "wan.cross", "wan.image_cross"}


def test_fingerprint_round_trips_through_json(tmp_path):
    model = tiny_flux_components()["transformer"]
    apply_attention(model, "TORCH_SDPA")
    fp = kernel_fingerprint(model)
    loaded = load_fingerprint(save_fingerprint(fp, tmp_path / "job" / "fp.json"))
    assert loaded == fp
    assert compare_fingerprints(fp, loaded).matches
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="not a diffusers-omni kernel fingerprint"):
        load_fingerprint(tmp_path / "bad.json")


def test_comparison_reports_mismatches_role_by_role():
    model = tiny_flux_components()["transformer"]
    apply_attention(model, "TORCH_SDPA")
    train = kernel_fingerprint(model)
    rollout = copy.deepcopy(train)
    rollout["roles"]["flux.single"].update(backend="FLASH_ATTN_HUB", kernel_repo="kernels-community/flash-attn3", kernel_revision="abc123")
    rollout["roles"]["flux.joint"]["source"] = "per_role['flux.joint']"  # informational only
    rollout["roles"]["flux.joint"]["cudnn"] = 91900
    del rollout["roles"]["flux.single"]["modules"]
    rollout["roles"]["extra.role"] = dict(rollout["roles"]["flux.joint"])
    rollout["environment"]["torch"] = "9.9"
    result = compare_fingerprints(train, rollout)
    rows = {row.role: row for row in result.roles}
    assert not result.matches
    assert rows["flux.single"].status == "mismatch"
    assert rows["flux.single"].differences["kernel_revision"] == (None, "abc123")
    assert "modules" in rows["flux.single"].notes
    assert rows["flux.joint"].status == "mismatch" and set(rows["flux.joint"].differences) == {"cudnn"}
    assert "source" in rows["flux.joint"].notes
    assert rows["extra.role"].status == "only in b"
    assert result.environment["torch"][1] == "9.9"
    text = result.table()
    assert "flux.single" in text and "kernels-community/flash-attn3" in text and "environment differences" in text
    assert result.to_dict()["roles"][0]["role"] == "extra.role"
