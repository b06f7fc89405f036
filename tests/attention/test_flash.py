import logging

import pytest
import torch

from diffusers_omni.attention.backends.flash import backend as flash
from diffusers_omni.attention.backends.base import AttentionCall
from diffusers_omni.attention.backends.flash import (
    FlashAttentionBackend,
    FlashKernels,
    dense_cu_seqlens,
    pad_input,
    unpad_input,
    varlen_attention_reference,
)
from diffusers_omni.attention.backends.sdpa import sdpa_bshd
from diffusers_omni.attention.platform import Platform
from diffusers_omni.config.attention import AttentionSpec

HOPPER = Platform("cuda", "H200", (9, 0), 91900)
AMPERE = Platform("cuda", "A100", (8, 0), 90100)


def _pretend_installed(monkeypatch, modules, versions=None):
    monkeypatch.setattr(flash, "package_importable", lambda name: name in modules)
    versions = versions or {}
    monkeypatch.setattr(flash, "installed_version", lambda *names: next((versions[n] for n in names if n in versions),
                                                                          None))


def test_no_implementation_lists_every_reason(monkeypatch):
    _pretend_installed(monkeypatch, set())
    reasons = FlashAttentionBackend.availability_reasons(HOPPER)
    assert len(reasons) == 1 and "no usable FlashAttention implementation" in reasons[0]
    for hint in ("pip install flash-attn-4", "pip install fa3-fwd", "flash-attn>=2.6"):
        assert hint in reasons[0]


def test_fa2_version_is_checked(monkeypatch):
    _pretend_installed(monkeypatch, {"flash_attn"}, {"flash-attn": "2.5.9"})
    reasons = FlashAttentionBackend.availability_reasons(AMPERE)
    assert "flash-attn 2.5.9 is installed; 2.6 or newer is required" in reasons[0]
    _pretend_installed(monkeypatch, {"flash_attn"}, {"flash-attn": "2.7.4.post1"})
    assert FlashAttentionBackend.availability_reasons(AMPERE) == []
    assert flash.flash_attention_implementations() == ["FA2"]


def test_discovery_order_and_compute_capability(monkeypatch):
    _pretend_installed(monkeypatch, {"flash_attn_interface", "fa3_fwd_interface", "flash_attn"}, {"flash-attn": "2.8.0"})
    assert flash.flash_attention_implementations() == ["FA3", "FA3-fwd", "FA2"]
    assert flash.select_implementation(HOPPER)[0].label == "FA3"
    impl, passed_over = flash.select_implementation(AMPERE)
    assert impl.label == "FA2" and any("FA3: compute capability is sm_80; FA3 requires sm_90" in r for r in passed_over)
    _pretend_installed(monkeypatch, {"fa3_fwd_interface"})
    assert flash.select_implementation(HOPPER)[0].supports_backward is False
    assert FlashAttentionBackend.availability_reasons(AMPERE)  # fa3-fwd only runs on sm_90


def test_head_dim_dtype_device_reasons(monkeypatch):
    _pretend_installed(monkeypatch, {"flash_attn.cute"})
    call = AttentionCall("cuda", torch.bfloat16, head_dim=256)
    assert any("FLASH_ATTN (FA4) requires head_dim <= 128" in r for r in FlashAttentionBackend.not_supported_reasons(call, HOPPER))
    call = AttentionCall("cuda", torch.bfloat16, head_dim=100)
    assert any("multiple of 8" in r for r in FlashAttentionBackend.not_supported_reasons(call, HOPPER))
    assert FlashAttentionBackend.not_supported_reasons(AttentionCall("cuda", torch.float16, head_dim=128), HOPPER) == []
    cpu = FlashAttentionBackend.not_supported_reasons(AttentionCall("cpu", torch.float32, 64), Platform("cpu"))
    assert "platform device is 'cpu'; FLASH_ATTN requires one of ['cuda']" in cpu
    int8 = FlashAttentionBackend.not_supported_reasons(AttentionCall("cuda", torch.int8, 128), HOPPER)
    assert any("dtype is int8" in r for r in int8)


# --- test fixture: pure-torch stand-ins injected at the kernel boundary (not FlashAttention) -------------------
def _fake_func(q, k, v, softmax_scale=None, causal=False, **_):
    return sdpa_bshd(q, k, v, is_causal=causal, scale=softmax_scale, enable_gqa=q.shape[2] != k.shape[2]), None


def _fake_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=None, causal=False):
    return varlen_attention_reference(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal)


FAKE = FlashKernels(_fake_func, _fake_varlen, "FAKE-FA (test fixture)")


def _qkv(b=2, sq=7, skv=9, h=4, hkv=4, d=16, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(b, sq, h, d, generator=g).to(dtype), torch.randn(b, skv, hkv, d, generator=g).to(dtype),
            torch.randn(b, skv, hkv, d, generator=g).to(dtype))


def test_unpad_pad_round_trip_and_varlen_matches_sdpa_with_mask():
    q, k, v = _qkv(dtype=torch.float32)
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[0, 6:] = False
    mask[1, 2:4] = False  # not only trailing padding
    tokens, indices, cu, max_len = unpad_input(k, mask)
    assert cu.tolist() == [0, 6, 13] and max_len == 7 and tokens.shape == (13, 4, 16)
    assert torch.equal(pad_input(tokens, indices, 2, 9), k * mask[..., None, None])
    vt = v.reshape(-1, 4, 16)[indices]
    out = varlen_attention_reference(q.reshape(-1, 4, 16), tokens, vt, dense_cu_seqlens(2, 7, "cpu"), cu)
    ref = sdpa_bshd(q, k, v, attn_mask=mask)
    torch.testing.assert_close(out.view(2, 7, 4, 16), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("hkv", [4, 2])
def test_backend_with_injected_kernels_matches_sdpa(hkv):
    q, k, v = _qkv(hkv=hkv)
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[1, 5:] = False
    backend = FlashAttentionBackend(AttentionSpec("FLASH_ATTN"), kernels=FAKE)
    gqa = hkv != 4
    torch.testing.assert_close(backend(q, k, v, enable_gqa=gqa), sdpa_bshd(q, k, v, enable_gqa=gqa))
    for m in (mask, mask[:, None, None, :]):
        torch.testing.assert_close(backend(q, k, v, m, enable_gqa=gqa), sdpa_bshd(q, k, v, mask, enable_gqa=gqa),
                                   atol=2e-2, rtol=2e-2)


def test_float32_goes_to_sdpa_with_one_warning(caplog):
    q, k, v = _qkv(dtype=torch.float32)
    backend = FlashAttentionBackend(None, kernels=FlashKernels(None, None, "must not be called"))
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            out = backend(q, k, v)
    assert torch.equal(out, sdpa_bshd(q, k, v))
    assert len([r for r in caplog.records if "float32 inputs" in r.getMessage()]) == 1


def test_other_masks_raise_when_explicit_and_fall_back_for_platform_default(caplog):
    q, k, v = _qkv()
    additive = torch.zeros(2, 1, 7, 9, dtype=torch.bfloat16)
    square = torch.ones(2, 1, 7, 9, dtype=torch.bool)
    explicit = FlashAttentionBackend(AttentionSpec("FLASH_ATTN"), kernels=FAKE)
    for mask in (additive, square):
        with pytest.raises(ValueError, match="only boolean key-padding masks"):
            explicit(q, k, v, mask)
    default = FlashAttentionBackend(None, kernels=FAKE)
    with caplog.at_level(logging.WARNING):
        out = default(q, k, v, additive)
    assert torch.equal(out, sdpa_bshd(q, k, v, additive))
    assert "run on TORCH_SDPA" in caplog.text


def test_describe_names_implementation(monkeypatch):
    _pretend_installed(monkeypatch, {"fa3_fwd_interface"}, {"fa3-fwd": "0.0.3"})
    from diffusers_omni.attention.platform import use_platform

    with use_platform(HOPPER):
        backend = FlashAttentionBackend(None)
    info = backend.describe()
    assert info["implementation"] == "fa3_fwd_interface.flash_attn_func (FA3-fwd)" and info["version"] == "0.0.3"
    assert backend.supports_backward is False and info["kernel_repo"] is None


def test_info_names_implementations():
    from diffusers_omni.cli.info import collect_info

    info = collect_info(Platform("cpu"))
    assert info["flash_attention_implementations"] == flash.flash_attention_implementations()
