import logging
import types

import pytest
import torch
import torch.nn.functional as F

from diffusers_omni.attention.backends.sage import backend as sage
from diffusers_omni.attention.backends.base import AttentionCall
from diffusers_omni.attention.backends.sage import SageAttention3Backend, SageAttentionBackend, is_short_kv
from diffusers_omni.attention.platform import Platform
from diffusers_omni.attention.routing import PLATFORM_ROUTES
from diffusers_omni.attention.selector import BackendNotSupportedError, resolve

CPU = Platform("cpu", "CPU")
AMPERE = Platform("cuda", "A100", (8, 0), 90100)
HOPPER = Platform("cuda", "H200", (9, 0), 91900)
B200 = Platform("cuda", "B200", (10, 0), 91000)
RTX6000 = Platform("cuda", "RTX PRO 6000", (12, 0), 91000)
PLATFORMS = (CPU, AMPERE, HOPPER, B200, RTX6000, Platform("cuda", "GB10", (12, 1), 91000), Platform("npu", "Ascend"))


def call(**kw):
    kw.setdefault("dtype", torch.bfloat16)
    kw.setdefault("head_dim", 128)
    return AttentionCall(device_type="cuda", **kw)


@pytest.fixture
def packages_installed(monkeypatch):
    """Pretend every optional package is importable (availability only; no kernel runs)."""
    monkeypatch.setattr("diffusers_omni.attention.backends.base.package_importable", lambda name: True)
    monkeypatch.setattr(sage, "installed_version", lambda *d: "2.2.0")


def test_explicit_sage_on_cpu_and_hopper_raises_with_reasons():
    with pytest.raises(BackendNotSupportedError) as info:
        resolve("SAGE_ATTN", "sdxl.self", "self", AttentionCall("cpu", torch.float32, 64), CPU)
    message = str(info.value)
    assert "platform device is 'cpu'; SAGE_ATTN requires one of ['cuda']" in message
    assert "dtype is float32; SAGE_ATTN requires one of bfloat16, float16" in message
    assert "package 'sageattention' is not importable" in message
    with pytest.raises(BackendNotSupportedError, match="package 'sageattention' is not importable"):
        resolve("SAGE_ATTN", "sdxl.self", "self", call(), HOPPER)


def test_explicit_sage_rules(packages_installed):
    assert resolve("SAGE_ATTN", "wan.self", "self", call(), HOPPER).backend == "SAGE_ATTN"
    assert resolve("SAGE_ATTN", "wan.self", "self", call(), RTX6000).backend == "SAGE_ATTN"
    for platform, bad, expected in [
        (B200, call(), "compute capability is sm_100; SAGE_ATTN requires one of sm_80, sm_86, sm_89, sm_90, sm_120"),
        (HOPPER, call(has_mask=True), "the call passes an attention mask; SAGE_ATTN accepts no mask"),
        (HOPPER, call(head_dim=256), "head_dim is 256; SAGE_ATTN requires head_dim <= 128"),
        (HOPPER, call(gqa=True), "grouped-query attention; SAGE_ATTN requires equal Q and KV heads"),
    ]:
        with pytest.raises(BackendNotSupportedError, match=expected):
            resolve("SAGE_ATTN", "x.role", "self", bad, platform)


def test_sageattention_1x_head_dims(monkeypatch, packages_installed):
    monkeypatch.setattr(sage, "installed_version", lambda *d: "1.0.6")
    assert resolve("SAGE_ATTN", "x", "self", call(head_dim=96), HOPPER).backend == "SAGE_ATTN"
    with pytest.raises(BackendNotSupportedError, match=r"head_dim is 80; sageattention 1.0.6 requires head_dim in \(64, 96, 128\)"):
        resolve("SAGE_ATTN", "x", "self", call(head_dim=80), HOPPER)


def test_explicit_sage3_rules(packages_installed):
    with pytest.raises(BackendNotSupportedError, match="compute capability is sm_90; SAGE_ATTN_3 requires one of sm_100, sm_103, sm_120, sm_121"):
        resolve("SAGE_ATTN_3", "x", "self", call(), HOPPER)
    with pytest.raises(BackendNotSupportedError, match="platform device is 'cpu'"):
        resolve("SAGE_ATTN_3", "x", "self", AttentionCall("cpu", torch.float32, 64), CPU)
    with pytest.raises(BackendNotSupportedError, match="accepts no mask"):
        resolve("SAGE_ATTN_3", "x", "self", call(has_mask=True), B200)
    assert resolve("SAGE_ATTN_3", "x", "self", call(gqa=True), RTX6000).backend == "SAGE_ATTN_3"


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("kw", [{}, {"has_mask": True}, {"gqa": True}, {"mask_free_path": True}, {"dtype": torch.float16}])
def test_auto_routing_never_picks_lossy_or_npu_only_backends(platform, kw, packages_installed):
    device = platform.device_type
    c = AttentionCall(device, kw.pop("dtype", torch.bfloat16), 128, **kw)
    backend = resolve(None, "x.self", "self", c, platform).backend
    assert backend not in {"SAGE_ATTN", "SAGE_ATTN_3", "RAINFUSION_ATTN"}
    for routes in PLATFORM_ROUTES.values():
        assert not {r.backend for r in routes} & {"SAGE_ATTN", "SAGE_ATTN_3", "RAINFUSION_ATTN"}


def fake_sageattention(record):
    """FAKE kernel boundary (not SageAttention): records the call and returns exact attention. Like sageattention
    1.0.6 (core.py: ``k -= km``), it smooths K in place unless told not to."""

    def sageattn(q, k, v, tensor_layout, is_causal, sm_scale, smooth_k=True):
        record.append({"kv_len": k.shape[1], "tensor_layout": tensor_layout, "is_causal": is_causal, "sm_scale": sm_scale})
        if smooth_k:
            k -= k.mean(dim=1, keepdim=True)
        return F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (q, k, v)), scale=sm_scale).transpose(1, 2)

    return types.SimpleNamespace(sageattn=sageattn)


def resolution(category, source, role="sdxl.cross"):
    return types.SimpleNamespace(category=category, source=source, role=role)


def qkv(kv_len, q_len=8):
    g = torch.Generator().manual_seed(0)
    return torch.randn(1, q_len, 2, 64, generator=g), torch.randn(1, kv_len, 2, 64, generator=g), torch.randn(1, kv_len, 2, 64, generator=g)


def test_callers_key_is_not_modified(monkeypatch):
    # Found on the H200: sageattention 1.0.6 subtracted the K mean from the caller's tensor, so every later user of
    # that key (the next backend in our benchmark) saw different inputs.
    monkeypatch.setattr(sage, "_import_sageattention", lambda: fake_sageattention([]))
    q, k, v = qkv(1024)
    before = k.clone()
    out = SageAttentionBackend()(q, k, v)
    assert torch.equal(k, before)
    # Smoothing K shifts every score of a query by the same amount: the softmax, and the result, are unchanged.
    exact = F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (q, before, v))).transpose(1, 2)
    torch.testing.assert_close(out, exact, atol=1e-5, rtol=1e-5)


def test_short_kv_rule():
    assert is_short_kv(77) and is_short_kv(512) and is_short_kv(1000) and is_short_kv(32760)
    assert not is_short_kv(1024) and not is_short_kv(4608)


def test_default_sage_routes_short_kv_cross_roles_to_sdpa_with_one_log_line(monkeypatch, caplog):
    record = []
    monkeypatch.setattr(sage, "_import_sageattention", lambda: fake_sageattention(record))
    caplog.set_level(logging.INFO, logger="diffusers_omni.attention")
    base = SageAttentionBackend()
    guarded = base.bind_site(None, None, resolution("cross", "default"))
    q, k, v = qkv(77)
    for _ in range(3):
        out = guarded(q, k, v)
    assert record == []  # the sage kernel was never called
    torch.testing.assert_close(out, F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (q, k, v))).transpose(1, 2))
    lines = [r.getMessage() for r in caplog.records if "SAGE_ATTN is the configured default" in r.getMessage()]
    assert len(lines) == 1 and "'sdxl.cross'" in lines[0] and "77-token KV" in lines[0] and "TORCH_SDPA" in lines[0]
    guarded(*qkv(1024))  # long, block-aligned KV stays on SageAttention
    assert record == [{"kv_len": 1024, "tensor_layout": "NHD", "is_causal": False, "sm_scale": None}]
    env = base.bind_site(None, None, resolution("cross", "env DIFFUSION_ATTENTION_BACKEND"))
    env(*qkv(77))
    assert len(record) == 1


@pytest.mark.parametrize("res", [resolution("cross", "per_role['sdxl.cross']"), resolution("cross", "per_role['cross']"), resolution("self", "default")])
def test_explicit_per_role_or_self_roles_keep_sage(monkeypatch, res):
    record = []
    monkeypatch.setattr(sage, "_import_sageattention", lambda: fake_sageattention(record))
    base = SageAttentionBackend()
    bound = base.bind_site(None, None, res)
    assert bound is base
    bound(*qkv(77))
    assert record[0]["kv_len"] == 77


def test_sage_backends_are_forward_only():
    assert SageAttentionBackend.supports_backward is False and SageAttention3Backend.supports_backward is False


def fake_sageattn3(record):
    """FAKE kernel boundary (not sageattn3): takes [B, H, S, D] like sageattn3_blackwell."""

    def sageattn3_blackwell(q, k, v, is_causal=False):
        record.append(tuple(q.shape))
        return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal)

    return types.SimpleNamespace(sageattn3_blackwell=sageattn3_blackwell)


def test_sage3_layout_scale_and_gqa_fallback(monkeypatch, caplog):
    record = []
    monkeypatch.setattr(sage, "_import_sageattn3", lambda: fake_sageattn3(record))
    backend = SageAttention3Backend()
    q, k, v = qkv(16)
    expected = F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (q, k, v))).transpose(1, 2)
    torch.testing.assert_close(backend(q, k, v), expected)
    torch.testing.assert_close(backend(q, k, v, scale=64**-0.5), expected)
    assert record == [(1, 2, 8, 64), (1, 2, 8, 64)]
    with pytest.raises(ValueError, match="scale=0.5 is not the default 1/sqrt\\(64\\)"):
        backend(q, k, v, scale=0.5)
    with pytest.raises(ValueError, match="no attention mask"):
        backend(q, k, v, attn_mask=torch.ones(1, 16, dtype=torch.bool))
    caplog.set_level(logging.INFO, logger="diffusers_omni.attention")
    gq = torch.randn(1, 8, 4, 64)
    for _ in range(2):
        out = backend(gq, k, v, enable_gqa=True)
    assert len(record) == 2  # GQA never reached sageattn3
    ref = F.scaled_dot_product_attention(gq.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), enable_gqa=True).transpose(1, 2)
    torch.testing.assert_close(out, ref)
    assert len([r for r in caplog.records if "GQA/MQA" in r.getMessage()]) == 1


def test_install_binds_the_guard_per_role_on_a_tiny_wan(monkeypatch, caplog, packages_installed):
    """End to end through apply_attention (simulated Hopper, FAKE sageattention at the kernel boundary): with
    SAGE_ATTN as the default, Wan's self-attention runs SageAttention and its 7-token text cross-attention runs
    TORCH_SDPA; with SAGE_ATTN chosen per role for the cross role, SageAttention serves it."""
    from diffusers_omni import apply_attention
    from diffusers_omni.attention.platform import use_platform
    from diffusers_omni.testing.tiny import _TEXT_DIM, _wan_transformer

    record = []
    monkeypatch.setattr(sage, "_import_sageattention", lambda: fake_sageattention(record))
    torch.manual_seed(0)
    model = _wan_transformer(4).to(torch.bfloat16)
    inputs = dict(
        hidden_states=torch.randn(1, 4, 1, 4, 4, dtype=torch.bfloat16),
        timestep=torch.tensor([500]),
        encoder_hidden_states=torch.randn(1, 7, _TEXT_DIM, dtype=torch.bfloat16),
    )
    caplog.set_level(logging.INFO, logger="diffusers_omni.attention")
    with use_platform(HOPPER):
        apply_attention(model, {"default": "SAGE_ATTN"})
    with torch.no_grad():
        model(**inputs)
    assert [r["kv_len"] for r in record] == [4]  # self-attention only (2x2 patches of a 4x4 latent)
    assert any("role 'wan.cross'" in r.getMessage() and "7-token KV" in r.getMessage() for r in caplog.records)
    record.clear()
    with use_platform(HOPPER):
        apply_attention(model, {"default": "SAGE_ATTN", "per_role": {"wan.cross": "SAGE_ATTN"}})
    with torch.no_grad():
        model(**inputs)
    assert sorted(r["kv_len"] for r in record) == [4, 7]
