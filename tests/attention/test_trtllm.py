import logging
import math
import types

import pytest
import torch
import torch.nn.functional as F

from diffusers_omni.attention.backends.trtllm import backend as trtllm
from diffusers_omni.attention.plan import AttentionPlan
from diffusers_omni.attention.backends.base import AttentionCall
from diffusers_omni.attention.backends.trtllm import TrtllmAttentionBackend, quant_reasons, version_reasons
from diffusers_omni.attention.backends.trtllm.calibration import CalibrationError, attach_calibration
from diffusers_omni.attention.platform import Platform, use_platform
from diffusers_omni.attention.selector import BackendNotSupportedError, resolve
from diffusers_omni.config.attention import AttentionSpec

CPU = Platform("cpu", "CPU")
HOPPER = Platform("cuda", "H200", (9, 0), 91900)
B200 = Platform("cuda", "B200", (10, 0), 91000)
B300 = Platform("cuda", "B300", (10, 3), 91000)
RTX6000 = Platform("cuda", "RTX PRO 6000", (12, 0), 91000)


def call(**kw):
    kw.setdefault("dtype", torch.bfloat16)
    kw.setdefault("head_dim", 128)
    kw.setdefault("mask_free_path", True)
    return AttentionCall(device_type="cuda", **kw)


@pytest.fixture
def flashinfer_installed(monkeypatch):
    """Pretend FlashInfer is importable at the required version (availability only; no kernel runs)."""
    monkeypatch.setattr(trtllm, "package_importable", lambda name: True)
    monkeypatch.setattr("diffusers_omni.attention.backends.base.package_importable", lambda name: True)
    monkeypatch.setattr(trtllm, "flashinfer_version", lambda: trtllm.FLASHINFER_MIN_VERSION)


@pytest.mark.parametrize("platform", [CPU, HOPPER, RTX6000])
def test_explicit_selection_raises_with_reasons_off_datacenter_blackwell(platform):
    c = call() if platform.device_type == "cuda" else AttentionCall("cpu", torch.float32, 128)
    with pytest.raises(BackendNotSupportedError) as info:
        resolve("TRTLLM_ATTN", "wan.self", "self", c, platform)
    message = str(info.value)
    assert "package 'flashinfer' is not importable" in message
    if platform.device_type == "cpu":
        assert "platform device is 'cpu'; TRTLLM_ATTN requires one of ['cuda']" in message
    else:
        assert f"compute capability is {platform.sm}; TRTLLM_ATTN requires one of sm_100, sm_103" in message


def test_call_rules_on_blackwell(flashinfer_installed):
    assert resolve("TRTLLM_ATTN", "wan.self", "self", call(), B200).backend == "TRTLLM_ATTN"
    assert resolve("TRTLLM_ATTN", "wan.self", "self", call(gqa=True), B300).backend == "TRTLLM_ATTN"
    for bad, expected in [
        (call(head_dim=64), "head_dim is 64; TRTLLM_ATTN requires head_dim == 128"),
        (call(dtype=torch.float16), "dtype is float16; TRTLLM_ATTN requires one of bfloat16"),
        (call(has_mask=True), "the call passes an attention mask; TRTLLM_ATTN accepts no mask"),
    ]:
        with pytest.raises(BackendNotSupportedError, match=expected):
            resolve("TRTLLM_ATTN", "wan.self", "self", bad, B200)


def test_flashinfer_version_is_checked(monkeypatch, flashinfer_installed):
    assert version_reasons("0.6.16") == [] and version_reasons("0.7.0") == []
    assert version_reasons("0.6.16rc1") == []
    assert version_reasons("0.6.4") == ["FlashInfer version is 0.6.4; TRTLLM_ATTN requires flashinfer >= 0.6.16rc1"]
    monkeypatch.setattr(trtllm, "flashinfer_version", lambda: "0.6.4")
    with pytest.raises(BackendNotSupportedError, match="FlashInfer version is 0.6.4; TRTLLM_ATTN requires flashinfer >= 0.6.16rc1"):
        resolve("TRTLLM_ATTN", "wan.self", "self", call(), B200)


def test_auto_routing(flashinfer_installed):
    # Picked only on datacenter Blackwell, for mask-free head_dim-128 bf16 paths.
    assert resolve(None, "wan.self", "self", call(), B200).backend == "TRTLLM_ATTN"
    assert resolve(None, "wan.self", "self", call(mask_free_path=False), B200).backend == "CUDNN_ATTN"
    assert resolve(None, "wan.self", "self", call(head_dim=64), B200).backend == "CUDNN_ATTN"
    assert resolve(None, "wan.self", "self", call(dtype=torch.float16), B300).backend == "CUDNN_ATTN"
    for platform in (HOPPER, RTX6000):
        assert resolve(None, "wan.self", "self", call(), platform).backend != "TRTLLM_ATTN"


def test_auto_routing_without_flashinfer_skips_it():
    resolution = resolve(None, "wan.self", "self", call(), B200)
    assert resolution.backend == "CUDNN_ATTN"
    assert any("flashinfer" in r for c in resolution.candidates if c.backend == "TRTLLM_ATTN" for r in c.reasons)


@pytest.mark.parametrize(
    "dtype, platform, ok",
    [("fp8_e4m3", B200, True), ("fp8_e4m3", B300, True), ("int8", B200, True), ("int8", B300, False), ("fp8_e4m3", HOPPER, False)],
)
def test_sage_quant_arch_rules(dtype, platform, ok):
    spec = AttentionSpec("TRTLLM_ATTN", quant={"dtype_qk": dtype})
    reasons = quant_reasons(spec, platform)
    assert (reasons == []) is ok
    if not ok:
        assert f"quant.dtype_qk={dtype!r}" in reasons[0] and f"compute capability is {platform.sm}" in reasons[0]
        with use_platform(platform), pytest.raises(BackendNotSupportedError, match="trtllm-gen kernels only on"):
            TrtllmAttentionBackend(spec)


def test_quant_spec_values_validated_at_construction():
    # Checked by the trtllm family when the plan is built from the spec (was: in the spec's constructor).
    with pytest.raises(ValueError, match="q_block_size=8 is not allowed with TRTLLM_ATTN"):
        AttentionPlan.build(AttentionSpec("TRTLLM_ATTN", quant={"dtype_qk": "int8", "q_block_size": 8}))
    with pytest.raises(ValueError, match="dtype_qk='bfloat16' is not allowed with TRTLLM_ATTN"):
        AttentionPlan.build(AttentionSpec("TRTLLM_ATTN", quant={"dtype_qk": "bfloat16"}))


class TinyDiT(torch.nn.Module):
    """Stands in for a DiT: records nothing itself; the timestep gate hooks its forward."""

    def forward(self, hidden_states, timestep=None):
        return hidden_states


def site(name):
    return types.SimpleNamespace(name=name)


CAL = {"g": {"formula": "a*exp(b*target_sparsity)", "coefficients": {"a": 0.001, "b": 5.0}, "ignore": ["blocks.0.*"]}}


def test_target_sparsity_without_calibration_fails_at_enable_time():
    backend = TrtllmAttentionBackend(AttentionSpec("TRTLLM_ATTN", skip_softmax={"target_sparsity": 0.65}))
    with pytest.raises(CalibrationError, match="target_sparsity=0.65 needs a calibration for TinyDiT"):
        backend.bind_site(TinyDiT(), site("blocks.3.attn1"), None)


def test_calibrated_lambda_and_ignored_layers():
    model = TinyDiT()
    attach_calibration(model, CAL)
    backend = TrtllmAttentionBackend(AttentionSpec("TRTLLM_ATTN", skip_softmax={"target_sparsity": 0.6}))
    bound = backend.bind_site(model, site("blocks.3.attn1"), None)
    assert math.isclose(bound.threshold, 0.001 * math.exp(3.0))
    assert math.isclose(bound.scale_factor(4096), 0.001 * math.exp(3.0) * 4096)
    ignored = backend.bind_site(model, site("blocks.0.attn1"), None)
    assert ignored.threshold is None and ignored.scale_factor(4096) is None


def test_threshold_sets_lambda_directly():
    backend = TrtllmAttentionBackend(AttentionSpec("TRTLLM_ATTN", skip_softmax={"threshold": 0.01}))
    bound = backend.bind_site(TinyDiT(), site("blocks.1.attn1"), None)
    assert bound.scale_factor(512) == pytest.approx(5.12)
    assert TrtllmAttentionBackend(None).scale_factor(512) is None


def test_timestep_gate(caplog):
    model = TinyDiT()
    backend = TrtllmAttentionBackend(
        AttentionSpec("TRTLLM_ATTN", skip_softmax={"threshold": 0.01, "disabled_until_timestep": 0.86})
    )
    bound = backend.bind_site(model, site("blocks.1.attn1"), None)
    caplog.set_level(logging.WARNING)
    # No timestep seen yet: dense, one warning.
    assert bound.scale_factor(100) is None and bound.scale_factor(100) is None
    assert len([r for r in caplog.records if "no timestep seen" in r.getMessage()]) == 1
    x = torch.zeros(1)
    model(x, timestep=torch.tensor([999.0]))  # t = 0.999 > 0.86: high noise, dense
    assert bound.gate.t == pytest.approx(0.999) and bound.scale_factor(100) is None
    model(x, timestep=torch.tensor([860.0]))  # t = 0.86 <= D: sparse
    assert bound.scale_factor(100) == pytest.approx(1.0)
    model(x, timestep=0.5)  # already normalised (t <= 1) for a model without a registered normaliser
    assert bound.gate.t == 0.5
    model(x)  # a forward without timestep: back to dense
    assert bound.scale_factor(100) is None


def test_timestep_normalisers_per_model():
    from diffusers_omni.attention.backends.trtllm.timestep_gate import normalizer_for

    assert normalizer_for("wan")(500.0) == 0.5
    assert normalizer_for("flux")(0.5) == 0.5


def fake_flashinfer(record):
    """FAKE kernel boundary (not FlashInfer): records the arguments and computes the same attention with SDPA on the
    ragged tensors, so the packing and unpacking around the call are checked for real."""

    def ragged(q, k, v, workspace, seq_lens, max_q, max_kv, bmm1, bmm2, o_sf, batch, window, cum_q, cum_kv, pdl, causal, lse, **kw):
        record.update(args=(seq_lens, max_q, max_kv, bmm1, bmm2, o_sf, batch, window, cum_q, cum_kv, pdl, causal, lse), kw=kw)
        qb = q.reshape(batch, max_q, q.shape[1], -1).transpose(1, 2)
        kb = k.reshape(batch, max_kv, k.shape[1], -1).transpose(1, 2)
        vb = v.reshape(batch, max_kv, v.shape[1], -1).transpose(1, 2)
        out = F.scaled_dot_product_attention(qb, kb, vb, scale=bmm1, enable_gqa=True)
        return out.transpose(1, 2).reshape(q.shape[0], q.shape[1], -1)

    def quantize(q, k, v, q_block_size, k_block_size, qk_quant_dtype):
        record["quantize"] = (q_block_size, k_block_size, qk_quant_dtype)
        return q, k, v, "q_sfs", "k_sfs", "v_sfs"

    return types.SimpleNamespace(prefill=types.SimpleNamespace(trtllm_ragged_attention_deepseek=ragged), trtllm_sage_attention_quantize=quantize)


def qkv(batch=2, q_len=6, kv_len=20, heads=4, kv_heads=2):
    g = torch.Generator().manual_seed(0)
    return (
        torch.randn(batch, q_len, heads, 128, generator=g),
        torch.randn(batch, kv_len, kv_heads, 128, generator=g),
        torch.randn(batch, kv_len, kv_heads, 128, generator=g),
    )


def test_kernel_arguments_dense_and_skip_softmax(monkeypatch):
    record = {}
    monkeypatch.setattr(trtllm, "_import_flashinfer", lambda: fake_flashinfer(record))
    q, k, v = qkv()
    expected = F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (q, k, v)), enable_gqa=True).transpose(1, 2)
    out = TrtllmAttentionBackend(None)(q, k, v)
    torch.testing.assert_close(out, expected)
    seq_lens, max_q, max_kv, bmm1, bmm2, o_sf, batch, window, cum_q, cum_kv, pdl, causal, lse = record["args"]
    assert seq_lens.tolist() == [20, 20] and (max_q, max_kv, batch) == (6, 20, 2)
    assert cum_q.tolist() == [0, 6, 12] and cum_kv.tolist() == [0, 20, 40] and cum_q.dtype == torch.int32
    assert bmm1 == pytest.approx(1 / math.sqrt(128)) and bmm2 == 1.0 and (o_sf, window) == (-1, -1)
    assert record["kw"] == {}
    sparse = TrtllmAttentionBackend(AttentionSpec("TRTLLM_ATTN", skip_softmax={"threshold": 0.05}))
    sparse.bind_site(TinyDiT(), site("blocks.1.attn1"), None)(q, k, v)
    assert record["kw"] == {"skip_softmax_threshold_scale_factor": pytest.approx(0.05 * 20)}


def test_kernel_arguments_sage_and_short_kv(monkeypatch, caplog):
    record = {}
    monkeypatch.setattr(trtllm, "_import_flashinfer", lambda: fake_flashinfer(record))
    backend = TrtllmAttentionBackend(AttentionSpec("TRTLLM_ATTN", quant={"dtype_qk": "int8", "q_block_size": 4, "k_block_size": 16}))
    backend(*qkv(kv_len=20))
    assert record["quantize"] == (4, 16, torch.int8)
    assert record["kw"]["sage_attn_sfs"] == ("q_sfs", "k_sfs", None, "v_sfs")
    assert record["kw"]["num_elts_per_sage_attn_blk"] == (4, 16, 0, 1)
    caplog.set_level(logging.WARNING)
    record.clear()
    for _ in range(2):
        backend(*qkv(kv_len=10))  # KV 10 < k_block_size 16: dense bf16
    assert "quantize" not in record and "sage_attn_sfs" not in record["kw"]
    assert len([r for r in caplog.records if "shorter than quant.k_block_size=16" in r.getMessage()]) == 1


def test_forward_only():
    assert TrtllmAttentionBackend.supports_backward is False
