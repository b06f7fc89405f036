"""``TRTLLM_ATTN``: FlashInfer's trtllm-gen FMHA on datacenter Blackwell (sm_100 / sm_103).

Dense bf16, ``head_dim == 128``, no attention mask (the call is packed as ragged ``[total_tokens, heads, 128]`` with
cumulative sequence lengths instead), GQA native, forward only. Two options on top of dense:

- Skip-Softmax (``SkipSoftmaxSpec``): a KV tile whose contribution falls below λ is skipped. ``threshold`` is λ;
  ``target_sparsity`` reads λ off the model's calibration (``diffusers_omni.attention.backends.trtllm.calibration``). The kernel
  takes ``skip_softmax_threshold_scale_factor = λ × kv_len`` (it divides by the KV length itself). Layers the
  calibration ignores stay dense; ``disabled_until_timestep`` keeps steps dense until the normalised timestep
  ``t <= D``.
- SAGE quantisation (``AttnQuantSpec``): Q/K per-block int8 or fp8_e4m3, V per-channel fp8_e4m3
  (``flashinfer.trtllm_sage_attention_quantize``). fp8 Q/K kernels exist for sm_100 and sm_103, int8 for sm_100 only.
  A KV shorter than ``k_block_size`` runs dense bf16 (one warning).

Kernel entry: ``flashinfer.prefill.trtllm_ragged_attention_deepseek`` with the positional order of FlashInfer's own DiT
tests (``tests/attention/test_trtllm_ragged_dit.py``: q, k, v, workspace, seq_lens, max_q_len, max_kv_len,
bmm1_scale, bmm2_scale, o_sf_scale, batch_size, window_left, cum_seq_lens_q, cum_seq_lens_kv, enable_pdl, is_causal,
return_lse, then ``sage_attn_sfs`` / ``num_elts_per_sage_attn_blk`` by keyword). ``skip_softmax_threshold_scale_factor``
is passed by keyword as FlashInfer documents it for its trtllm-gen context and MLA entries; that this ragged entry
accepts it under that name has NOT been verified on hardware (no sm_100 here) — the H200 cannot run it either.
"""

from __future__ import annotations

import copy
import importlib
import logging
import math
from typing import TYPE_CHECKING, ClassVar

import torch

from ....utils.versions import parse_version, version_at_least
from ..base import AttentionBackend, package_importable
from ..flashinfer.backend import flashinfer_version

if TYPE_CHECKING:
    from ....config.attention import AttentionSpec
    from ...platform import Platform

logger = logging.getLogger(__name__)

FLASHINFER_MIN_VERSION = "0.6.16rc1"
HEAD_DIM = 128
WORKSPACE_BYTES = 256 * 1024 * 1024
_QK_DTYPE_ARCHS = {"fp8_e4m3": ((10, 0), (10, 3)), "int8": ((10, 0),)}


def version_reasons(found: str | None, required: str = FLASHINFER_MIN_VERSION) -> list[str]:
    """Reasons the installed FlashInfer version is too old (empty: new enough, or not installed at all)."""
    if found is None:
        return []
    if parse_version(found) is None:
        return [f"FlashInfer version is {found!r} (unparsable); TRTLLM_ATTN requires flashinfer >= {required}"]
    if not version_at_least(found, required):
        return [f"FlashInfer version is {found}; TRTLLM_ATTN requires flashinfer >= {required}"]
    return []


def quant_reasons(spec: "AttentionSpec | None", platform: "Platform") -> list[str]:
    """Why ``spec.quant`` cannot run on ``platform`` (the spec's values were validated at construction)."""
    if spec is None or spec.quant is None or platform.device_type != "cuda":
        return []
    dtype = spec.quant.dtype_qk
    archs = _QK_DTYPE_ARCHS[dtype]
    if platform.compute_capability not in archs:
        allowed = " or ".join(f"sm_{a}{b}" for a, b in archs)
        return [f"quant.dtype_qk={dtype!r} has trtllm-gen kernels only on {allowed}; compute capability is {platform.sm}"]
    return []


def _import_flashinfer():
    """The kernel boundary: FlashInfer's module (tests replace this function with a fake)."""
    return importlib.import_module("flashinfer")


class TrtllmAttentionBackend(AttentionBackend):
    """FlashInfer trtllm-gen FMHA (dense, Skip-Softmax, SAGE). See the module docstring."""

    name: ClassVar[str] = "TRTLLM_ATTN"
    devices = frozenset({"cuda"})
    dtypes = frozenset({torch.bfloat16})
    compute_capabilities = frozenset({(10, 0), (10, 3)})
    supports_mask = False
    supports_gqa = True
    supports_backward = False
    deterministic = False
    packages = (("flashinfer", "pip install 'diffusers-omni[flashinfer]' (flashinfer-python)"),)

    def __init__(self, spec: "AttentionSpec | None" = None) -> None:
        super().__init__(spec)
        from ...platform import current_platform

        reasons = quant_reasons(spec, current_platform())
        if reasons:
            from ...selector import BackendNotSupportedError

            raise BackendNotSupportedError("TRTLLM_ATTN cannot run this spec here:\n  - " + "\n  - ".join(reasons))
        self.skip = spec.skip_softmax if spec is not None else None
        self.quant = spec.quant if spec is not None else None
        # Per-site state, filled by ``bind_site``.
        self.site_name: str | None = None
        self.threshold: float | None = self.skip.threshold if self.skip is not None else None
        self.gate = None
        self._short_kv_warned = False
        self._workspace: dict[torch.device, torch.Tensor] = {}

    @classmethod
    def extra_availability_reasons(cls, platform: "Platform") -> list[str]:
        if not package_importable("flashinfer"):
            return []  # the package reason is already given
        return version_reasons(flashinfer_version())

    @classmethod
    def extra_call_reasons(cls, call, platform) -> list[str]:
        if call.head_dim is not None and call.head_dim != HEAD_DIM:
            return [f"head_dim is {call.head_dim}; TRTLLM_ATTN requires head_dim == {HEAD_DIM}"]
        return []

    def bind_site(self, model, site, resolution) -> "TrtllmAttentionBackend":
        """Enable-time, once per attention site: resolve λ for this module and attach the timestep gate.

        Raises ``CalibrationError`` when ``target_sparsity`` is set and the model has no calibration.
        """
        if self.skip is None:
            return self
        bound = copy.copy(self)
        bound.site_name = site.name
        if self.skip.target_sparsity is not None:
            from .calibration import CalibrationError, calibration_for_model

            calibration = calibration_for_model(model)
            if calibration is None:
                raise CalibrationError(
                    f"skip_softmax.target_sparsity={self.skip.target_sparsity} needs a calibration for "
                    f"{type(model).__name__}, and none was found (no 'sparse_attention_config' in its config.json, "
                    "nor one given with diffusers_omni.attention.backends.trtllm.calibration.attach_calibration); set "
                    "skip_softmax.threshold instead, or calibrate the model with NVIDIA ModelOpt"
                )
            bound.threshold = calibration.threshold(site.name, self.skip.target_sparsity)
        if bound.threshold is not None and self.skip.disabled_until_timestep > 0:
            from .timestep_gate import timestep_state

            # ``site.model_name``: the declaration that found the site (sites made by hand may not say).
            bound.gate = timestep_state(model, getattr(site, "model_name", ""))
        return bound

    def scale_factor(self, kv_len: int) -> float | None:
        """``skip_softmax_threshold_scale_factor`` for this call, or ``None`` for a dense call."""
        if self.threshold is None or self.threshold == 0:
            return None
        if self.gate is not None and not self.gate.allows_sparse(self.skip.disabled_until_timestep, self.name):
            return None
        return self.threshold * kv_len

    def _workspace_for(self, device: torch.device) -> torch.Tensor:
        buf = self._workspace.get(device)
        if buf is None:
            buf = self._workspace[device] = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        return buf

    def __call__(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if attn_mask is not None:
            raise ValueError("TRTLLM_ATTN takes no attention mask; select a mask-capable backend for this role")
        if dropout_p:
            raise ValueError(f"TRTLLM_ATTN has no dropout; got dropout_p={dropout_p}")
        flashinfer = _import_flashinfer()
        batch, q_len, heads, head_dim = query.shape
        kv_len, kv_heads = key.shape[1], key.shape[2]
        device = query.device
        q = query.reshape(batch * q_len, heads, head_dim)
        k = key.reshape(batch * kv_len, kv_heads, head_dim)
        v = value.reshape(batch * kv_len, kv_heads, head_dim)
        kv_lens = torch.full((batch,), kv_len, dtype=torch.int32, device=device)
        cum_q = torch.arange(0, batch + 1, dtype=torch.int32, device=device) * q_len
        cum_kv = torch.arange(0, batch + 1, dtype=torch.int32, device=device) * kv_len
        bmm1_scale = scale if scale is not None else 1.0 / math.sqrt(head_dim)
        kwargs = {}
        factor = self.scale_factor(kv_len)
        if factor is not None:
            kwargs["skip_softmax_threshold_scale_factor"] = factor
        if self.quant is not None:
            if kv_len < self.quant.k_block_size:
                if not self._short_kv_warned:
                    self._short_kv_warned = True
                    logger.warning(
                        "TRTLLM_ATTN: KV length %d is shorter than quant.k_block_size=%d; running this call dense bf16",
                        kv_len,
                        self.quant.k_block_size,
                    )
            else:
                qk_dtype = torch.int8 if self.quant.dtype_qk == "int8" else torch.float8_e4m3fn
                q, k, v, q_sfs, k_sfs, v_sfs = flashinfer.trtllm_sage_attention_quantize(
                    q, k, v, q_block_size=self.quant.q_block_size, k_block_size=self.quant.k_block_size,
                    qk_quant_dtype=qk_dtype,
                )
                kwargs["sage_attn_sfs"] = (q_sfs, k_sfs, None, v_sfs)
                kwargs["num_elts_per_sage_attn_blk"] = (self.quant.q_block_size, self.quant.k_block_size, 0, 1)
        out = flashinfer.prefill.trtllm_ragged_attention_deepseek(
            q, k, v, self._workspace_for(device), kv_lens, q_len, kv_len, bmm1_scale, 1.0, -1, batch, -1,
            cum_q, cum_kv, False, is_causal, False, **kwargs,
        )
        if isinstance(out, tuple):
            out = out[0]
        return out.reshape(batch, q_len, heads, head_dim)

    def describe(self) -> dict:
        return {
            **super().describe(),
            "implementation": "flashinfer.prefill.trtllm_ragged_attention_deepseek",
            "version": flashinfer_version(),
            "skip_softmax_threshold": self.threshold,
            "quant": self.quant.dtype_qk if self.quant else None,
        }
