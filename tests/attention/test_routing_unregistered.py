"""A routing-table entry naming a backend this build does not register is skipped (issue 13, item 10)."""

import json

import torch

from diffusers_omni.attention import routing, tables
from diffusers_omni.attention.backends.base import AttentionCall
from diffusers_omni.attention.platform import current_platform
from diffusers_omni.attention.selector import resolve


def test_an_unregistered_backend_in_the_routing_table_is_skipped(tmp_path, monkeypatch):
    platform = current_platform()
    table = {
        "tolerance": 0.03,
        "families": {
            platform.family: {"q0/kv0/d64/dense": {"ranking": ["NOT_A_REGISTERED_ATTN", "TORCH_SDPA"]}},
        },
    }
    path = tmp_path / "routing_table.json"
    path.write_text(json.dumps(table))
    monkeypatch.setattr(tables, "TABLE_PATH", path)  # the table routing reads
    routing.load_table.cache_clear()
    try:
        call = AttentionCall(device_type=platform.device_type, dtype=torch.float32, head_dim=64)
        # Before the fix: ValueError "backend='NOT_A_REGISTERED_ATTN' is not registered" from resolution.
        resolution = resolve(None, "flux.joint", "self", call, platform)
    finally:
        routing.load_table.cache_clear()
    assert resolution.backend == "TORCH_SDPA" and resolution.shape_routed == ()
