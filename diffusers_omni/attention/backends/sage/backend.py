"""SageAttention backends: ``SAGE_ATTN`` (``sageattention.sageattn``) and ``SAGE_ATTN_3`` (``sageattn3``).

Both are lossy (INT8 / FP4 Q·K) and forward only: neither package ships a backward, so ``supports_backward = False``
and a backward through them raises (``RoleAttention``). Neither takes an attention mask; a role the model declares
masked is refused at enable time with the reason.

Short-KV cross attention and SAGE_ATTN
--------------------------------------
On an H200, ``sageattention`` 1.0.6 (its Triton kernels) gave relative error 0.28 on SDXL's 77-token text
cross-attention and 1.3e-2 everywhere else (shared BASELINE.md). The most likely cause, from the algorithm: K is
quantised per block of 64 rows (``BLKK = 64``; Q per 128) after *smoothing* (subtracting K's mean over tokens). A
77-token KV is one full block plus a 13-row block padded to 64 with zeros. The padded rows are masked out of V but —
in that kernel — not out of the softmax: each contributes ``exp(q·0 − m)`` to the normaliser. Because smoothing
centres the real scores on 0, a zero key scores like a typical real key, so 51 phantom keys dilute 77 real ones. For
unit-variance scores the real keys weigh ``77·E[e^s] ≈ 77·e^{0.5} ≈ 127`` against ``51·e^0 = 51``: the output shrinks
by ≈ 127/178 and the relative error is ≈ 0.29 — the measured 0.28. An exact emulation of this softmax
(``benchmarks/sage_bench.py``, ``predicted_padding_error``) gives 0.284 at 77 tokens on random inputs and 0 at 64, 128
and 512; the H200 run of that script measures the same KV sweep. Shapes whose KV is a multiple of 64 (512, 4096,
4608) have no padding and show 1e-2; for long unaligned KVs (Wan's 32,760) the ≤ 63 phantom rows are negligible.
Short KVs are also slow in SageAttention (6 vs 30 TFLOP/s at 77 tokens, 254 vs 548 at 512).

Therefore, when SAGE_ATTN is the *configured default* (``default`` or the environment variable, not a per-role
choice), cross-attention roles whose KV is shorter than ``SHORT_KV_TOKENS`` or not a multiple of ``K_BLOCK`` are
delegated call by call to the dense ``TORCH_SDPA`` backend, with one INFO line per role. The KV length is known only
at call time, so the decision is a call-time guard bound per role at enable time (``bind_site``); a model-declared
text length would miss pipelines that change it (prompt embeds of other lengths, IP adapters). A per-role
``SAGE_ATTN`` is honoured as is.
"""

from __future__ import annotations

import copy
import importlib
import logging
import math
from typing import ClassVar

import torch

from ....utils.versions import installed_version
from ..base import AttentionBackend
from ..sdpa.backend import TorchSDPABackend

logger = logging.getLogger("diffusers_omni.attention")

K_BLOCK = 64
SHORT_KV_TOKENS = 1024
_SAGE_DTYPES = frozenset({torch.float16, torch.bfloat16})


def is_short_kv(kv_len: int) -> bool:
    """True for a KV that SAGE_ATTN (as default) hands to the dense backend on cross roles."""
    return kv_len < SHORT_KV_TOKENS or kv_len % K_BLOCK != 0


def configured_as_default(source: str) -> bool:
    """Whether a resolution's ``source`` is the config's default or the environment variable (not per-role)."""
    return source == "default" or source.startswith("env ")


def _import_sageattention():
    """Kernel boundary for SAGE_ATTN (tests replace it with a fake module)."""
    return importlib.import_module("sageattention")


def _import_sageattn3():
    """Kernel boundary for SAGE_ATTN_3 (tests replace it with a fake module)."""
    return importlib.import_module("sageattn3")


class SageAttentionBackend(AttentionBackend):
    """``sageattention.sageattn`` on ``[B, S, H, D]`` (its ``"NHD"`` layout), CUDA sm_80/86/89/90/120.

    Head dims: SageAttention 2.x pads to 64 or 128 and accepts up to 128; 1.x (Triton) accepts 64, 96 and 128.
    Equal Q and KV heads are required (GQA is refused rather than expanded).
    """

    name: ClassVar[str] = "SAGE_ATTN"
    devices = frozenset({"cuda"})
    dtypes = _SAGE_DTYPES
    max_head_dim = 128
    compute_capabilities = frozenset({(8, 0), (8, 6), (8, 9), (9, 0), (12, 0)})
    supports_mask = False
    supports_gqa = False
    supports_backward = False
    deterministic = False
    lossy = True
    packages = (("sageattention", "pip install 'diffusers-omni[sage]' or build thu-ml/SageAttention from source"),)

    def __init__(self, spec=None) -> None:
        super().__init__(spec)
        self.dense: AttentionBackend | None = None
        self.role: str | None = None
        self._logged = False

    @classmethod
    def extra_call_reasons(cls, call, platform) -> list[str]:
        version = installed_version("sageattention")
        if version and version.startswith("1.") and call.head_dim not in (None, 64, 96, 128):
            return [f"head_dim is {call.head_dim}; sageattention {version} requires head_dim in (64, 96, 128)"]
        return []

    def bind_site(self, model, site, resolution) -> "SageAttentionBackend":
        """Cross roles under a configured-default SAGE_ATTN get the short-KV guard."""
        if resolution.category != "cross" or not configured_as_default(resolution.source):
            return self
        bound = copy.copy(self)
        bound.dense = TorchSDPABackend()
        bound.role = resolution.role
        bound._logged = False
        return bound

    def __call__(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        kv_len = key.shape[1]
        if self.dense is not None and is_short_kv(kv_len):
            if not self._logged:
                self._logged = True
                logger.info(
                    "SAGE_ATTN is the configured default, but role %r is cross-attention with a %d-token KV "
                    "(shorter than %d or not a multiple of SageAttention's %d-row K block, where padded K rows "
                    "distort its softmax); running it on TORCH_SDPA",
                    self.role,
                    kv_len,
                    SHORT_KV_TOKENS,
                    K_BLOCK,
                )
            return self.dense(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
        if attn_mask is not None or dropout_p:
            raise ValueError("SAGE_ATTN takes no attention mask and no dropout")
        sage = _import_sageattention()
        # sageattention 1.x smooths K in place (``k -= k.mean(seq)``), changing the caller's tensor; smooth it out
        # of place instead (same arithmetic, same result: a per-query constant shift leaves the softmax unchanged).
        key = key - key.mean(dim=1, keepdim=True)
        return sage.sageattn(query, key, value, tensor_layout="NHD", is_causal=is_causal, sm_scale=scale, smooth_k=False)

    def describe(self) -> dict:
        return {
            **super().describe(),
            "implementation": "sageattention.sageattn",
            "version": installed_version("sageattention"),
            "short_kv_guard": self.dense is not None,
        }


class SageAttention3Backend(AttentionBackend):
    """``sageattn3.sageattn3_blackwell`` (FP4 SageAttention3) on Blackwell: sm_100/103/120/121.

    Its kernel assumes equal Q and KV heads: GQA/MQA calls run on TORCH_SDPA instead (one log line). Masks are
    refused at enable time; a scale other than ``1/sqrt(head_dim)`` is refused at call time (the kernel has no scale
    argument). The entry point and its ``[B, H, S, D]`` layout follow the SageAttention repository's
    ``sageattention3_blackwell`` README; not run here (no Blackwell GPU).
    """

    name: ClassVar[str] = "SAGE_ATTN_3"
    devices = frozenset({"cuda"})
    dtypes = _SAGE_DTYPES
    max_head_dim = 128
    compute_capabilities = frozenset({(10, 0), (10, 3), (12, 0), (12, 1)})
    supports_mask = False
    supports_gqa = True  # served by the SDPA fallback
    supports_backward = False
    deterministic = False
    lossy = True
    packages = (("sageattn3", "build thu-ml/SageAttention's sageattention3_blackwell from source"),)

    def __init__(self, spec=None) -> None:
        super().__init__(spec)
        self.dense = TorchSDPABackend()
        self._gqa_logged = False

    def __call__(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if attn_mask is not None or dropout_p:
            raise ValueError("SAGE_ATTN_3 takes no attention mask and no dropout")
        head_dim = query.shape[-1]
        if scale is not None and not math.isclose(scale, head_dim**-0.5, rel_tol=1e-6):
            raise ValueError(
                f"SAGE_ATTN_3: scale={scale} is not the default 1/sqrt({head_dim}); sageattn3 has no scale "
                "argument — select another backend for this role"
            )
        if enable_gqa or key.shape[2] != query.shape[2]:
            if not self._gqa_logged:
                self._gqa_logged = True
                logger.info(
                    "SAGE_ATTN_3: %d query heads vs %d KV heads (GQA/MQA); sageattn3 needs equal heads, running "
                    "these calls on TORCH_SDPA",
                    query.shape[2],
                    key.shape[2],
                )
            return self.dense(query, key, value, None, 0.0, is_causal, scale, enable_gqa=True)
        sage3 = _import_sageattn3()
        q, k, v = (x.transpose(1, 2) for x in (query, key, value))
        out = sage3.sageattn3_blackwell(q, k, v, is_causal=is_causal)
        return out.transpose(1, 2)

    def describe(self) -> dict:
        return {
            **super().describe(),
            "implementation": "sageattn3.sageattn3_blackwell",
            "version": installed_version("sageattn3"),
        }
