import pytest
import torch

from diffusers_omni.attention.backends.sdpa import TorchSDPABackend, sdpa_bshd
from diffusers_omni.attention.registry import register_backend, reset_backend


class PerturbedAttention(TorchSDPABackend):
    """SDPA plus a small offset: a stand-in for a different kernel with different rounding."""

    name = "PERTURBED_TEST"

    def __call__(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        return sdpa_bshd(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa) + 1e-3


class ForwardOnlyAttention(TorchSDPABackend):
    """SDPA computed outside autograd, declaring no backward (like an inference-only kernel)."""

    name = "FORWARD_ONLY_TEST"
    supports_backward = False
    deterministic = False

    def __call__(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        with torch.no_grad():
            return sdpa_bshd(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)


@pytest.fixture
def test_backends():
    register_backend("PERTURBED_TEST", PerturbedAttention)
    register_backend("FORWARD_ONLY_TEST", ForwardOnlyAttention)
    yield
    reset_backend("PERTURBED_TEST")
    reset_backend("FORWARD_ONLY_TEST")


@pytest.fixture(autouse=True)
def _no_deterministic_env(monkeypatch):
    monkeypatch.delenv("DIFFUSERS_OMNI_DETERMINISTIC", raising=False)
