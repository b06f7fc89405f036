"""Diffusers' attention backend names, and "did you mean" for near misses.

Diffusers selects attention with ``set_attention_backend(name)`` (``AttentionBackendName`` in
``diffusers/models/attention_dispatch.py``, 0.42). ``DIFFUSERS_NAMES`` lists every one of its names, as Diffusers
spells them, and ``NO_EQUIVALENT`` says why no backend here runs the kernel of some of them. Which of our backends a
name stands for is declared by the kernel family that runs it (its ``aliases``, in ``attention/backends/<family>/``);
``attention.registry.diffusers_backend_names()`` joins the two into one table. Aliases are resolved when the plan is
built, so reports, traces and fingerprints always show our names.
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


# Every name of Diffusers' ``AttentionBackendName`` (0.42), in the order tables show them.
DIFFUSERS_NAMES: tuple[str, ...] = (
    "native", "_native_cudnn", "_native_flash", "_native_efficient", "_native_math", "_native_npu", "_native_xla",
    "flash", "flash_varlen", "_flash_3", "_flash_varlen_3", "flash_hub", "flash_varlen_hub", "_flash_3_hub",
    "_flash_3_varlen_hub", "flash_4_hub", "aiter_fa2_hub", "flex", "sage", "sage_varlen", "sage_hub",
    "sage_blackwell_hub", "_sage_qk_int8_pv_fp8_cuda", "_sage_qk_int8_pv_fp8_cuda_sm90", "_sage_qk_int8_pv_fp16_cuda",
    "_sage_qk_int8_pv_fp16_triton", "xformers",
)

_SAGE_KERNEL = "pins one SageAttention 2 CUDA/Triton kernel; SAGE_ATTN runs the installed sageattention package's own dispatch"

# Diffusers' names that no backend here runs, and why (the names a kernel family runs are its ``aliases``).
NO_EQUIVALENT: dict[str, str] = {
    "_native_flash": "pins SDPA's flash kernel alone; use TORCH_SDPA (flash first, then memory-efficient, then math) "
                     "or FLASH_ATTN",
    "_native_efficient": "pins SDPA's memory-efficient kernel alone; use TORCH_SDPA",
    "_native_math": "pins SDPA's math kernel alone; use TORCH_SDPA (math on CPU)",
    "_native_npu": "Ascend NPU fused attention is not provided; use TORCH_SDPA or RAINFUSION_ATTN on Ascend",
    "_native_xla": "XLA flash attention is not provided (no TPU platform here)",
    "flash_4_hub": "no Hub FA4 kernel here; FLASH_ATTN uses FA4 when `flash-attn-4` is installed",
    "aiter_fa2_hub": "AMD aiter kernels are not provided (no ROCm platform here)",
    "flex": "flex attention is not provided; use TORCH_SDPA",
    "sage_hub": "Hub SageAttention kernels are not provided; SAGE_ATTN runs the installed sageattention package",
    "sage_blackwell_hub": "Hub SageAttention kernels are not provided; on Blackwell use SAGE_ATTN_3 (the sageattn3 "
                          "package)",
    "_sage_qk_int8_pv_fp8_cuda": _SAGE_KERNEL,
    "_sage_qk_int8_pv_fp8_cuda_sm90": _SAGE_KERNEL,
    "_sage_qk_int8_pv_fp16_cuda": _SAGE_KERNEL,
    "_sage_qk_int8_pv_fp16_triton": _SAGE_KERNEL,
    "xformers": "xformers is not provided; use TORCH_SDPA or FLASH_ATTN",
}


def check_diffusers_env_value(value: str, variable: str) -> str:
    """``value`` when it is one of Diffusers' backend names exactly as Diffusers matches it
    (``AttentionBackendName(value)`` when ``attention_dispatch`` is imported), or ``ValueError`` in one line naming
    the variable, the value and the allowed names: a value Diffusers would refuse at import, such as ``"NATIVE"`` or
    ``""``, is refused here first."""
    if value in DIFFUSERS_NAMES:
        return value
    hint = did_you_mean(value, DIFFUSERS_NAMES, prefix=" (did you mean ", suffix="?)")
    raise ValueError(
        f"environment variable {variable}={value!r} is not one of Diffusers' attention backend names{hint}; allowed: "
        f"{', '.join(DIFFUSERS_NAMES)} (exact spelling; Diffusers refuses any other value when it is imported)"
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
