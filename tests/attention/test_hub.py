import json
import logging

import pytest
import torch

from diffusers_omni.attention.backends.hub import backend as hub
from diffusers_omni.attention.backends.flash import FlashAttentionBackend
from diffusers_omni.attention.backends.hub import FlashAttention3HubBackend, FlashAttentionHubBackend
from diffusers_omni.attention.backends.sdpa import sdpa_bshd
from diffusers_omni.attention.platform import Platform

HOPPER = Platform("cuda", "H200", (9, 0), 91900)
AMPERE = Platform("cuda", "A100", (8, 0), 90100)

# TEST FIXTURE, not a real kernel: a pure-torch "flash_attn_func" in the layout the `kernels` package loads.
FIXTURE_KERNEL = '''
"""Test fixture: pure-torch stand-in for kernels-community/flash-attn2 (not FlashAttention)."""
import torch.nn.functional as F

def flash_attn_func(q, k, v, softmax_scale=None, causal=False, **kwargs):
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=softmax_scale,
                                         enable_gqa=q.shape[1] != k.shape[1])
    return out.transpose(1, 2)
'''


@pytest.fixture
def local_kernel(tmp_path):
    variant = tmp_path / "fake-flash-attn" / "build" / "torch-cpu"
    variant.mkdir(parents=True)
    (variant / "__init__.py").write_text(FIXTURE_KERNEL)
    meta = {"name": "fake-flash-attn", "id": "_fake_flash_attn_test", "version": 1, "license": "Apache-2.0",
            "backend": {"type": "cpu"}, "python-depends": []}
    (variant / "metadata.json").write_text(json.dumps(meta))
    return tmp_path / "fake-flash-attn"


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    hub._warned.clear()
    for name in ("DIFFUSERS_OMNI_HUB_KERNEL_REVISION", "DIFFUSERS_OMNI_HUB_KERNEL_LOCAL_PATH",
                 "DIFFUSERS_OMNI_FLASH_ATTN_HUB_LOCAL_PATH", "DIFFUSERS_OMNI_FLASH_ATTN_3_HUB_REVISION"):
        monkeypatch.delenv(name, raising=False)


def test_local_kernel_loads_offline(local_kernel, monkeypatch):
    pytest.importorskip("kernels")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("DIFFUSERS_OMNI_FLASH_ATTN_HUB_LOCAL_PATH", str(local_kernel))
    backend = FlashAttentionHubBackend(None, platform=HOPPER)
    assert backend.fallback is None
    q, k, v = (torch.randn(1, 6, 2, 16, dtype=torch.bfloat16) for _ in range(3))
    torch.testing.assert_close(backend(q, k, v), sdpa_bshd(q, k, v))
    info = backend.describe()
    assert info["kernel_repo"] == "kernels-community/flash-attn2"
    assert info["kernel_revision"] == f"local:{local_kernel}" and info["fallback"] is None


def test_missing_kernels_warns_once_and_uses_flash_attn(monkeypatch, caplog):
    monkeypatch.setattr(hub, "package_importable", lambda name: False)
    with caplog.at_level(logging.WARNING):
        first = FlashAttentionHubBackend(None, platform=HOPPER)
        FlashAttentionHubBackend(None, platform=HOPPER)
    assert isinstance(first.fallback, FlashAttentionBackend)
    assert caplog.text.count("cannot load kernels-community/flash-attn2") == 1
    assert "package 'kernels' is not importable" in caplog.text
    info = first.describe()
    assert info["backend"] == "FLASH_ATTN_HUB" and info["fallback"] == "FLASH_ATTN" and info["kernel_repo"] is None


def test_unreachable_hub_falls_back(monkeypatch, caplog):
    kernels = pytest.importorskip("kernels")

    def offline(*args, **kwargs):
        raise OSError("We couldn't connect to 'https://huggingface.co'")

    monkeypatch.setattr(kernels, "get_kernel", offline)
    monkeypatch.setenv("DIFFUSERS_OMNI_FLASH_ATTN_3_HUB_REVISION", "v1")
    with caplog.at_level(logging.WARNING):
        backend = FlashAttention3HubBackend(None, platform=HOPPER)
    assert backend.revision == "v1" and backend.fallback.name == "FLASH_ATTN"
    assert "cannot load kernels-community/flash-attn3 (OSError" in caplog.text


def test_fa3_hub_below_sm90_runs_fa2_hub(local_kernel, monkeypatch, caplog):
    pytest.importorskip("kernels")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("DIFFUSERS_OMNI_HUB_KERNEL_LOCAL_PATH", str(local_kernel))
    with caplog.at_level(logging.WARNING):
        backend = FlashAttention3HubBackend(None, platform=AMPERE)
    assert isinstance(backend.fallback, FlashAttentionHubBackend) and backend.fallback.fallback is None
    assert "compute capability is sm_80; FLASH_ATTN_3_HUB requires sm_90; using FLASH_ATTN_HUB" in caplog.text
    info = backend.describe()
    assert (info["backend"], info["fallback"], info["kernel_repo"]) == (
        "FLASH_ATTN_3_HUB", "FLASH_ATTN_HUB", "kernels-community/flash-attn2")


def test_availability_without_kernels_needs_flash_attn(monkeypatch):
    monkeypatch.setattr(hub, "package_importable", lambda name: False)
    from diffusers_omni.attention.backends.flash import backend as flash

    monkeypatch.setattr(flash, "package_importable", lambda name: False)
    reasons = FlashAttentionHubBackend.availability_reasons(HOPPER)
    assert reasons and "FLASH_ATTN fallback cannot run" in reasons[0]
    assert FlashAttentionHubBackend.availability_reasons(Platform("cpu"))[0].startswith("platform device is 'cpu'")
