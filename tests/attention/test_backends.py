import logging

import torch
import torch.nn.functional as F

from diffusers_omni.attention.backends.sdpa import CudnnAttentionBackend, TorchSDPABackend


def qkv(batch=2, q_len=12, kv_len=7, heads=3, head_dim=8):
    generator = torch.Generator().manual_seed(0)
    return (
        torch.randn(batch, q_len, heads, head_dim, generator=generator),
        torch.randn(batch, kv_len, heads, head_dim, generator=generator),
        torch.randn(batch, kv_len, heads, head_dim, generator=generator),
    )


def reference(q, k, v, mask=None):
    q, k, v = (x.double().transpose(1, 2) for x in (q, k, v))
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    if mask is not None:
        scores = scores.masked_fill(~mask[:, None, None, :], float("-inf"))
    return (scores.softmax(-1) @ v).transpose(1, 2)


def test_torch_sdpa_matches_a_float64_reference():
    q, k, v = qkv()
    torch.testing.assert_close(TorchSDPABackend()(q, k, v).double(), reference(q, k, v), atol=1e-5, rtol=1e-5)


def test_torch_sdpa_accepts_diffusers_key_padding_masks():
    q, k, v = qkv()
    mask = torch.ones(2, 7, dtype=torch.bool)
    mask[1, 4:] = False
    out = TorchSDPABackend()(q, k, v, attn_mask=mask)
    torch.testing.assert_close(out.double(), reference(q, k, v, mask), atol=1e-5, rtol=1e-5)


def test_torch_sdpa_gradients_match_reference():
    q, k, v = (x.double().requires_grad_() for x in qkv())
    grad = torch.randn(2, 12, 3, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    TorchSDPABackend()(q, k, v).backward(grad)
    ref_inputs = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    reference(*ref_inputs).backward(grad)
    for mine, ref in zip((q, k, v), ref_inputs):
        torch.testing.assert_close(mine.grad, ref.grad, atol=1e-10, rtol=1e-10)


def test_cudnn_falls_back_to_the_default_dispatcher_with_one_warning(caplog):
    caplog.set_level(logging.WARNING)
    backend = CudnnAttentionBackend()
    q, k, v = qkv()
    expected = F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (q, k, v))).transpose(1, 2)
    for _ in range(3):
        assert torch.equal(backend(q, k, v), expected)
    warnings = [r.getMessage() for r in caplog.records if "CUDNN_ATTN" in r.getMessage()]
    assert len(warnings) == 1 and "default SDPA dispatcher" in warnings[0]
