"""``FLASHINFER_ATTN``: FlashInfer's batch prefill over ragged KV, planned once per call signature.

Each batch entry is one ragged sequence (``qo_indptr``/``kv_indptr``); ``plan()`` runs once per (shape, dtype, mask)
signature and the planned wrapper's ``run()`` is reused by every layer with that signature (the plan/run split of
FlashInfer's wrappers). On sm_90 the FA3 variant (``backend="fa3"``) is planned; elsewhere, and for custom masks,
FlashInfer's FA2 templates. Boolean key-padding masks become ragged KV lengths; other boolean masks become
FlashInfer custom masks; any other mask raises for an explicit selection and runs on ``TORCH_SDPA`` (one warning)
for a platform default.

Mixed-dtype quantised attention (``AttnQuantSpec``): ``dtype_qk`` ∈ {float16, bfloat16} and ``dtype_vo`` ∈
{float16, bfloat16, fp8_e4m3}. QK16/V8 quantises V per tensor to float8_e4m3 (scale = amax / 448) and rescales the
output; it needs FlashInfer ``MIXED_DTYPE_MIN_VERSION`` or newer, checked when the backend is enabled.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Callable, ClassVar

import torch

from ....utils.versions import installed_version, version_at_least
from ..base import AttentionBackend, key_padding_mask
from ..sdpa.backend import SDPAFallback

logger = logging.getLogger(__name__)

# The oldest release this backend was run with (H200, benchmarks/results/attention/latest.json): 0.6.4.
FLASHINFER_MIN_VERSION = "0.6.4"
# Prefill with Q/K in 16 bit and V in fp8 (QK16/V8), per the vLLM-Omni contract; not verified against a release here.
FLASHINFER_DISTRIBUTIONS = ("flashinfer-python", "flashinfer")
MIXED_DTYPE_MIN_VERSION = "0.6.16rc1"
WORKSPACE_BYTES = 128 * 1024 * 1024
PLAN_CACHE_SIZE = 16
FP8_E4M3_MAX = 448.0

_HALF = frozenset({torch.float16, torch.bfloat16})
_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "fp8_e4m3": getattr(torch, "float8_e4m3fn", None)}


def flashinfer_version() -> str | None:
    """The installed FlashInfer (its wheel was ``flashinfer`` before ``flashinfer-python``); ``None`` if absent."""
    return installed_version(*FLASHINFER_DISTRIBUTIONS)


def _plan_takes_v_dtype() -> bool:
    """Whether the ragged prefill plan() accepts a separate V dtype (checked, not assumed: FlashInfer 0.7.4's has
    none; its mixed-V support sits on the Blackwell CuTe-DSL path)."""
    import inspect

    import flashinfer

    return "v_data_type" in inspect.signature(flashinfer.BatchPrefillWithRaggedKVCacheWrapper.plan).parameters


_workspaces: dict[torch.device, torch.Tensor] = {}


def _default_wrapper_factory(variant: str, device: torch.device):
    import flashinfer

    if device not in _workspaces:
        _workspaces[device] = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
    return flashinfer.BatchPrefillWithRaggedKVCacheWrapper(_workspaces[device], kv_layout="NHD", backend=variant)


class FlashInferBackend(SDPAFallback, AttentionBackend):
    """FlashInfer ragged batch prefill; FA3 variant on sm_90; QK16/V8 through ``AttnQuantSpec``."""

    name: ClassVar[str] = "FLASHINFER_ATTN"
    devices = frozenset({"cuda"})
    # float32 is accepted at selection and runs on TORCH_SDPA (one warning).
    dtypes = frozenset({torch.float16, torch.bfloat16, torch.float32})
    max_head_dim = 256
    head_dim_multiple = 64  # FlashInfer's prefill templates are instantiated for head dims 64, 128, 256
    min_compute_capability = (8, 0)
    supports_mask = True
    supports_gqa = True
    supports_backward = False  # FlashInfer prefill is forward only
    deterministic = False
    packages = (("flashinfer", "pip install flashinfer-python apache-tvm-ffi (carried wheels; no compiler needed)"),)

    def __init__(self, spec=None, wrapper_factory: Callable | None = None) -> None:
        super().__init__(spec)
        self._factory = wrapper_factory or _default_wrapper_factory
        self._plans: OrderedDict[tuple, object] = OrderedDict()
        self.plan_count = 0
        quant = spec.quant if spec is not None else None
        self.dtype_qk = _DTYPES[quant.dtype_qk] if quant is not None and quant.dtype_qk else None
        self.dtype_vo = _DTYPES[quant.dtype_vo] if quant is not None and quant.dtype_vo else None
        self.lossy = self.is_lossy(spec)
        if self.dtype_vo is not None and self.dtype_vo not in _HALF:
            found = flashinfer_version()
            if wrapper_factory is None and not version_at_least(found, MIXED_DTYPE_MIN_VERSION):
                raise ValueError(
                    f"{self.name} quant dtype_vo={quant.dtype_vo!r} (QK16/V8) needs FlashInfer "
                    f"{MIXED_DTYPE_MIN_VERSION} or newer; found {found or 'no FlashInfer'}"
                )
            if wrapper_factory is None and not _plan_takes_v_dtype():
                raise ValueError(
                    f"{self.name} quant dtype_vo={quant.dtype_vo!r} (QK16/V8): the installed FlashInfer {found}'s "
                    "BatchPrefillWithRaggedKVCacheWrapper.plan() has no v_data_type argument, so V cannot have its "
                    "own dtype on this path; use dtype_vo equal to the Q/K dtype"
                )

    @classmethod
    def is_lossy(cls, spec) -> bool:
        quant = spec.quant if spec is not None else None
        return quant is not None and quant.dtype_vo == "fp8_e4m3"  # QK16/V8 quantises V

    @classmethod
    def extra_availability_reasons(cls, platform) -> list[str]:
        found = flashinfer_version()
        if found is not None and not version_at_least(found, FLASHINFER_MIN_VERSION):
            return [f"flashinfer-python {found} is installed; {cls.name} requires {FLASHINFER_MIN_VERSION} or newer"]
        return []

    @staticmethod
    def variant_for(device: torch.device, custom_mask: bool) -> str:
        if custom_mask or device.type != "cuda":
            return "fa2"
        return "fa3" if torch.cuda.get_device_capability(device)[0] == 9 else "fa2"

    def _mask_key(self, attn_mask):
        if attn_mask is None:
            return None
        return (attn_mask.data_ptr(), tuple(attn_mask.shape), attn_mask._version)

    def _plan(self, key: tuple, query, key_t, value, attn_mask, is_causal, scale, v_dtype):
        wrapper = self._plans.get(key)
        if wrapper is not None:
            self._plans.move_to_end(key)
            return wrapper
        batch, q_len, hq, dim = query.shape
        kv_len, hkv = key_t.shape[1], key_t.shape[2]
        device = query.device
        qo_indptr = torch.arange(0, (batch + 1) * q_len, q_len, dtype=torch.int32)
        kv_indptr = torch.arange(0, (batch + 1) * kv_len, kv_len, dtype=torch.int32)
        custom = None
        if attn_mask is not None:
            padding = key_padding_mask(attn_mask, batch, kv_len)
            if padding is not None:
                lens = padding.sum(-1, dtype=torch.int32).cpu()
                kv_indptr = torch.nn.functional.pad(torch.cumsum(lens, 0, dtype=torch.int32), (1, 0))
            else:
                custom = attn_mask.expand(batch, 1, q_len, kv_len).reshape(-1) if attn_mask.ndim == 4 else (
                    attn_mask.expand(batch, q_len, kv_len).reshape(-1)
                )
        wrapper = self._factory(self.variant_for(device, custom is not None), device)
        kwargs = dict(
            custom_mask=custom,
            causal=is_causal,
            sm_scale=scale,
            q_data_type=query.dtype,
            kv_data_type=key_t.dtype,
            o_data_type=query.dtype,
        )
        if v_dtype is not None:
            kwargs["v_data_type"] = v_dtype  # unverified keyword: the mixed-dtype plan argument (>= 0.6.16rc1)
        wrapper.plan(qo_indptr.to(device), kv_indptr.to(device), hq, hkv, dim, dim, **kwargs)
        wrapper.kv_indptr_host = kv_indptr
        self.plan_count += 1
        self._plans[key] = wrapper
        if len(self._plans) > PLAN_CACHE_SIZE:
            self._plans.popitem(last=False)
        return wrapper

    def __call__(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        args = (query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
        if query.dtype not in _HALF:
            return self._fallback(("dtype", query.dtype), f"{query.dtype} inputs (FlashInfer takes float16/bfloat16)",
                                  args)
        if dropout_p:
            return self._fallback(("dropout",), f"dropout_p={dropout_p} (FlashInfer prefill has no dropout)", args)
        if attn_mask is not None and attn_mask.dtype != torch.bool:
            what = f"a {attn_mask.dtype} mask (only boolean masks run on FlashInfer)"
            if self.spec is not None:
                raise ValueError(f"{self.name} (selected explicitly) cannot run {what}; select TORCH_SDPA for this role")
            return self._fallback(("mask", attn_mask.dtype), what, args)
        batch, q_len = query.shape[:2]
        kv_len = key.shape[1]
        if self.dtype_qk is not None and query.dtype != self.dtype_qk:
            query, key = query.to(self.dtype_qk), key.to(self.dtype_qk)
        v_scale = None
        v_dtype = None
        if self.dtype_vo is not None and self.dtype_vo != value.dtype:
            v_dtype = self.dtype_vo
            if self.dtype_vo in _HALF:
                value = value.to(self.dtype_vo)
            else:
                v_scale = value.abs().amax().float().clamp(min=1e-12) / FP8_E4M3_MAX
                value = (value.float() / v_scale).to(self.dtype_vo)
        signature = (tuple(query.shape), tuple(key.shape), query.dtype, key.dtype, value.dtype, is_causal, scale,
                     self._mask_key(attn_mask))
        wrapper = self._plan(signature, query, key, value, attn_mask, is_causal, scale, v_dtype)
        q = query.reshape(-1, *query.shape[2:])
        if attn_mask is not None and key_padding_mask(attn_mask, batch, kv_len) is not None:
            padding = key_padding_mask(attn_mask, batch, kv_len).reshape(-1)
            k = key.reshape(-1, *key.shape[2:])[padding]
            v = value.reshape(-1, *value.shape[2:])[padding]
        else:
            k = key.reshape(-1, *key.shape[2:])
            v = value.reshape(-1, *value.shape[2:])
        out = wrapper.run(q, k, v)
        if isinstance(out, tuple):
            out = out[0]
        if v_scale is not None:
            out = (out.float() * v_scale).to(args[0].dtype)
        return out.view(batch, q_len, *out.shape[1:]).to(args[0].dtype)

    def describe(self) -> dict:
        return {
            **super().describe(),
            "implementation": "flashinfer.BatchPrefillWithRaggedKVCacheWrapper (fa3 on sm_90, fa2 otherwise)",
            "version": flashinfer_version(),
            "dtype_qk": str(self.dtype_qk).replace("torch.", "") if self.dtype_qk else None,
            "dtype_vo": str(self.dtype_vo).replace("torch.", "") if self.dtype_vo else None,
        }
