"""Names a user types: Diffusers' attention backend names as aliases of ours, and "did you mean" for near misses.

Diffusers selects attention with ``set_attention_backend(name)`` (``AttentionBackendName`` in
``diffusers/models/attention_dispatch.py``, 0.42). Every one of its names is listed here once: either the
diffusers-omni backend that runs the same kernel family, or the reason there is none. Aliases are resolved when a
config is parsed, so reports, traces and fingerprints always show our names.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Iterable


@dataclass(frozen=True)
class DiffusersBackendName:
    """One of Diffusers' attention backend names and what it becomes here.

    Args:
        diffusers (`str`): the name as ``set_attention_backend`` takes it (e.g. ``"_native_cudnn"``).
        omni (`str` or `None`): our backend name, or ``None`` when no backend here runs that kernel.
        note (`str`): how the two differ, or why there is no equivalent.
    """

    diffusers: str
    omni: str | None
    note: str


_FA = "FLASH_ATTN runs the best installed FlashAttention (FA4, FA3, FA3 forward-only, FA2); key-padding masks go through varlen"
_SAGE_KERNEL = "pins one SageAttention 2 CUDA/Triton kernel; SAGE_ATTN runs the installed sageattention package's own dispatch"

DIFFUSERS_BACKEND_NAMES: tuple[DiffusersBackendName, ...] = (
    DiffusersBackendName("native", "TORCH_SDPA", "torch SDPA; on CUDA pinned to flash → memory-efficient → math"),
    DiffusersBackendName("_native_cudnn", "CUDNN_ATTN", "torch's cuDNN attention kernel"),
    DiffusersBackendName("_native_flash", None, "pins SDPA's flash kernel alone; use TORCH_SDPA (flash first, then "
                         "memory-efficient, then math) or FLASH_ATTN"),
    DiffusersBackendName("_native_efficient", None, "pins SDPA's memory-efficient kernel alone; use TORCH_SDPA"),
    DiffusersBackendName("_native_math", None, "pins SDPA's math kernel alone; use TORCH_SDPA (math on CPU)"),
    DiffusersBackendName("_native_npu", None, "Ascend NPU fused attention is not provided; use TORCH_SDPA or "
                         "RAINFUSION_ATTN on Ascend"),
    DiffusersBackendName("_native_xla", None, "XLA flash attention is not provided (no TPU platform here)"),
    DiffusersBackendName("flash", "FLASH_ATTN", _FA),
    DiffusersBackendName("flash_varlen", "FLASH_ATTN", _FA),
    DiffusersBackendName("_flash_3", "FLASH_ATTN", _FA),
    DiffusersBackendName("_flash_varlen_3", "FLASH_ATTN", _FA),
    DiffusersBackendName("flash_hub", "FLASH_ATTN_HUB", "kernels-community/flash-attn2 through `kernels`"),
    DiffusersBackendName("flash_varlen_hub", "FLASH_ATTN_HUB", "kernels-community/flash-attn2 through `kernels`"),
    DiffusersBackendName("_flash_3_hub", "FLASH_ATTN_3_HUB", "kernels-community/flash-attn3 through `kernels`"),
    DiffusersBackendName("_flash_3_varlen_hub", "FLASH_ATTN_3_HUB", "kernels-community/flash-attn3 through `kernels`"),
    DiffusersBackendName("flash_4_hub", None, "no Hub FA4 kernel here; FLASH_ATTN uses FA4 when `flash-attn-4` is "
                         "installed"),
    DiffusersBackendName("aiter_fa2_hub", None, "AMD aiter kernels are not provided (no ROCm platform here)"),
    DiffusersBackendName("flex", None, "flex attention is not provided; use TORCH_SDPA"),
    DiffusersBackendName("sage", "SAGE_ATTN", "sageattention package (lossy INT8 QK); masked roles are refused at "
                         "enable time"),
    DiffusersBackendName("sage_varlen", "SAGE_ATTN", "SAGE_ATTN takes no mask: masked roles are refused at enable "
                         "time with the reason"),
    DiffusersBackendName("sage_hub", None, "Hub SageAttention kernels are not provided; SAGE_ATTN runs the installed "
                         "sageattention package"),
    DiffusersBackendName("sage_blackwell_hub", None, "Hub SageAttention kernels are not provided; on Blackwell use "
                         "SAGE_ATTN_3 (the sageattn3 package)"),
    DiffusersBackendName("_sage_qk_int8_pv_fp8_cuda", None, _SAGE_KERNEL),
    DiffusersBackendName("_sage_qk_int8_pv_fp8_cuda_sm90", None, _SAGE_KERNEL),
    DiffusersBackendName("_sage_qk_int8_pv_fp16_cuda", None, _SAGE_KERNEL),
    DiffusersBackendName("_sage_qk_int8_pv_fp16_triton", None, _SAGE_KERNEL),
    DiffusersBackendName("xformers", None, "xformers is not provided; use TORCH_SDPA or FLASH_ATTN"),
)
_BY_NAME = {entry.diffusers: entry for entry in DIFFUSERS_BACKEND_NAMES}


def diffusers_backend_name(name: str) -> DiffusersBackendName | None:
    """The table entry for one of Diffusers' backend names (case-insensitive), or ``None``."""
    return _BY_NAME.get(name.strip().lower())


def check_diffusers_env_name(value: str, variable: str) -> DiffusersBackendName:
    """The table entry for the value of an environment variable Diffusers reads as a backend name
    (``DIFFUSERS_ATTN_BACKEND``), or ``ValueError`` in one line naming the variable, the value and the allowed names.

    Matched exactly, as Diffusers matches it (``AttentionBackendName(value)`` when ``attention_dispatch`` is
    imported): a value Diffusers would refuse at import, such as ``"NATIVE"`` or ``""``, is refused here first.
    """
    entry = _BY_NAME.get(value)
    if entry is not None:
        return entry
    names = list(_BY_NAME)
    hint = did_you_mean(value, names, prefix=" (did you mean ", suffix="?)")
    raise ValueError(
        f"environment variable {variable}={value!r} is not one of Diffusers' attention backend names{hint}; allowed: "
        f"{', '.join(names)} (exact spelling; Diffusers refuses any other value when it is imported)"
    )


def did_you_mean(value: object, choices: Iterable[str], *, prefix: str = "; did you mean ", suffix: str = "?") -> str:
    """``"; did you mean 'X'?"`` for the closest of ``choices`` to ``value`` (case-insensitive), or ``""``.

    Example:
    ```py
    >>> f"backend={name!r} is not known{did_you_mean(name, names)}"
    ```
    """
    if not isinstance(value, str) or not value.strip():
        return ""
    choices = list(dict.fromkeys(choices))
    folded = {choice.lower(): choice for choice in choices}
    close = difflib.get_close_matches(value.strip().lower(), list(folded), n=1, cutoff=0.6)
    return f"{prefix}{folded[close[0]]!r}{suffix}" if close else ""
