import logging

import pytest
import torch

from diffusers_omni.attention.backends.flashinfer import backend as fi
from diffusers_omni.attention.backends.flash import varlen_attention_reference
from diffusers_omni.attention.backends.flashinfer import FlashInferBackend
from diffusers_omni.attention.backends.sdpa import sdpa_bshd
from diffusers_omni.attention.platform import Platform
from diffusers_omni.config.attention import AttentionSpec

HOPPER = Platform("cuda", "H200", (9, 0), 91900)


class FakeRaggedWrapper:
    """TEST FIXTURE, not FlashInfer: stands in for BatchPrefillWithRaggedKVCacheWrapper at the kernel boundary,
    recording plan() calls and computing run() with pure-torch varlen attention."""

    instances = []

    def __init__(self, variant, device):
        self.variant, self.plans = variant, []
        FakeRaggedWrapper.instances.append(self)

    def plan(self, qo_indptr, kv_indptr, num_qo_heads, num_kv_heads, head_dim_qk, head_dim_vo, **kwargs):
        self.plans.append(dict(qo_indptr=qo_indptr, kv_indptr=kv_indptr, **kwargs))

    def run(self, q, k, v):
        p = self.plans[-1]
        if p["custom_mask"] is not None:
            b = p["qo_indptr"].numel() - 1
            sq, skv = q.shape[0] // b, k.shape[0] // b
            mask = p["custom_mask"].view(b, 1, sq, skv)
            return sdpa_bshd(q.view(b, sq, *q.shape[1:]), k.view(b, skv, *k.shape[1:]).to(q.dtype),
                             v.view(b, skv, *v.shape[1:]).to(q.dtype), mask, scale=p["sm_scale"]).reshape(q.shape)
        return varlen_attention_reference(q, k.to(q.dtype), v.to(q.dtype), p["qo_indptr"], p["kv_indptr"],
                                          p["sm_scale"], p["causal"])


@pytest.fixture(autouse=True)
def _clear():
    FakeRaggedWrapper.instances.clear()


def _qkv(dtype=torch.bfloat16, b=2, s=8, h=4, d=64):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(b, s, h, d, generator=g).to(dtype) for _ in range(3)]


def test_missing_package_and_old_version(monkeypatch):
    reasons = FlashInferBackend.availability_reasons(HOPPER)
    if fi.flashinfer_version() is None:
        assert any("package 'flashinfer' is not importable" in r and "flashinfer-python" in r for r in reasons)
    monkeypatch.setattr(fi, "flashinfer_version", lambda: "0.2.0")
    assert "flashinfer-python 0.2.0 is installed; FLASHINFER_ATTN requires 0.6.4 or newer" in \
        FlashInferBackend.extra_availability_reasons(HOPPER)


def test_mixed_dtype_needs_minimum_version(monkeypatch):
    spec = AttentionSpec("FLASHINFER_ATTN", quant={"dtype_qk": "bfloat16", "dtype_vo": "fp8_e4m3"})
    monkeypatch.setattr(fi, "flashinfer_version", lambda: "0.6.4")
    with pytest.raises(ValueError, match=r"QK16/V8\) needs FlashInfer 0.6.16rc1 or newer; found 0.6.4"):
        FlashInferBackend(spec)
    monkeypatch.setattr(fi, "flashinfer_version", lambda: "0.6.16")
    monkeypatch.setattr(fi, "_plan_takes_v_dtype", lambda: True)
    assert FlashInferBackend(spec).describe()["dtype_vo"] == "float8_e4m3fn"
    # A release whose ragged plan() has no separate V dtype (0.7.4) is refused, not sent an unknown keyword.
    monkeypatch.setattr(fi, "flashinfer_version", lambda: "0.7.4")
    monkeypatch.setattr(fi, "_plan_takes_v_dtype", lambda: False)
    with pytest.raises(ValueError, match=r"0.7.4's BatchPrefillWithRaggedKVCacheWrapper.plan\(\) has no v_data_type"):
        FlashInferBackend(spec)
    # 16-bit V needs no new release.
    monkeypatch.setattr(fi, "flashinfer_version", lambda: "0.6.4")
    FlashInferBackend(AttentionSpec("FLASHINFER_ATTN", quant={"dtype_vo": "float16"}))


def test_plan_once_per_signature_reused_across_layers():
    backend = FlashInferBackend(None, wrapper_factory=FakeRaggedWrapper)
    q, k, v = _qkv()
    for _layer in range(5):
        out = backend(q, k, v)
    torch.testing.assert_close(out, sdpa_bshd(q, k, v), atol=2e-2, rtol=2e-2)
    assert backend.plan_count == 1 and FakeRaggedWrapper.instances[0].variant == "fa2"  # CPU tensors: fa2
    backend(*_qkv(torch.float16))
    backend(*_qkv(s=16))
    assert backend.plan_count == 3
    plan = FakeRaggedWrapper.instances[0].plans[0]
    assert plan["q_data_type"] == torch.bfloat16 and plan["custom_mask"] is None


def test_key_padding_becomes_ragged_kv_and_other_bool_masks_custom_masks():
    backend = FlashInferBackend(None, wrapper_factory=FakeRaggedWrapper)
    q, k, v = _qkv()
    pad = torch.ones(2, 8, dtype=torch.bool)
    pad[0, 5:] = False
    torch.testing.assert_close(backend(q, k, v, pad), sdpa_bshd(q, k, v, pad), atol=2e-2, rtol=2e-2)
    assert FakeRaggedWrapper.instances[-1].plans[-1]["kv_indptr"].tolist() == [0, 5, 13]
    general = torch.rand(2, 1, 8, 8, generator=torch.Generator().manual_seed(1)) > 0.3
    general[..., 0] = True
    torch.testing.assert_close(backend(q, k, v, general), sdpa_bshd(q, k, v, general), atol=2e-2, rtol=2e-2)
    assert FakeRaggedWrapper.instances[-1].plans[-1]["custom_mask"].numel() == 2 * 8 * 8


def test_non_bool_masks_and_fp32(caplog):
    q, k, v = _qkv()
    additive = torch.zeros(2, 1, 8, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="only boolean masks run on FlashInfer"):
        FlashInferBackend(AttentionSpec("FLASHINFER_ATTN"), wrapper_factory=FakeRaggedWrapper)(q, k, v, additive)
    default = FlashInferBackend(None, wrapper_factory=FakeRaggedWrapper)
    with caplog.at_level(logging.WARNING):
        default(q, k, v, additive)
        q32, k32, v32 = _qkv(torch.float32)
        for _ in range(2):
            assert torch.equal(default(q32, k32, v32), sdpa_bshd(q32, k32, v32))
    assert caplog.text.count("float32 inputs") == 1 and default.plan_count == 0


@pytest.mark.skipif(not hasattr(torch, "float8_e4m3fn"), reason="torch without float8_e4m3fn")
def test_qk16_v8_quantises_v_per_tensor(monkeypatch):
    monkeypatch.setattr(fi, "flashinfer_version", lambda: "0.6.16")
    spec = AttentionSpec("FLASHINFER_ATTN", quant={"dtype_qk": "bfloat16", "dtype_vo": "fp8_e4m3"})
    backend = FlashInferBackend(spec, wrapper_factory=FakeRaggedWrapper)
    q, k, v = _qkv()
    out = backend(q, k, v)
    ref = sdpa_bshd(*(x.float() for x in (q, k, v)))
    assert out.dtype == torch.bfloat16
    assert ((out.float() - ref).norm() / ref.norm()).item() < 5e-2
    assert FakeRaggedWrapper.instances[-1].plans[-1]["v_data_type"] == torch.float8_e4m3fn


def test_backward_is_refused():
    assert FlashInferBackend.supports_backward is False
