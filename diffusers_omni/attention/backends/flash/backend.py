"""``FLASH_ATTN``: FlashAttention-4, -3 or -2, whichever is installed, best first.

Implementation discovery (each candidate imported once, failures caught: ``attention.availability``):
FlashAttention-4 (``flash_attn.cute``, package ``flash-attn-4``) → FlashAttention-3 (``flash_attn_interface``, built
from the FlashAttention ``hopper/`` tree) → FlashAttention-3 forward only (``fa3_fwd_interface``, PyPI package
``fa3-fwd``) → FlashAttention-2 (``flash_attn`` >= 2.6). PyTorch >= 2.11 can also route its own flash SDPA kernel to
FA3/FA4 (``torch.nn.attention.activate_flash_attention_impl``); that switch is process-global and needs the same
packages, so this backend calls the packages directly and only reports which of PyTorch's implementations are
registered.

Inputs are ``[B, S, H, D]`` in float16/bfloat16. float32 inputs go to ``TORCH_SDPA`` with one warning per
signature.

FP8 (``AttentionSpec("FLASH_ATTN", quant=AttnQuantSpec(dtype_qk="fp8_e4m3", dtype_vo="fp8_e4m3"))``, an extension
of the contract; lossy, forward only): FlashAttention-3 (``FA3`` or ``FA3-fwd``) on sm_90 runs Q, K, V in e4m3 with
one descale per (batch, head), quantised by ``diffusers_omni.attention.backends.flash.fp8_quant`` (two Triton passes, K smoothed).
Per call shape class the committed routing table (``fp8_rule``: ``tables.fp8_choice``) keeps bf16 FA3 where the measured FP8
call, quantisation included, was not faster (short sequences, short KV) and for shapes it never measured; masked,
causal, GQA and dropout calls stay bf16 too. Boolean key-padding masks (``[B, Skv]`` or ``[B, 1, 1, Skv]``) run through unpad + varlen; any other
mask raises for an explicit selection and goes to ``TORCH_SDPA`` (one warning) for a platform default.
"""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass
from typing import Callable, ClassVar

import torch
import torch.nn.functional as F

from ....utils.versions import installed_version, version_at_least
from ...availability import import_failure, package_installed
from ...platform import current_platform
from ...tables import fp8_choice, load_table
from ..base import AttentionBackend, key_padding_mask, package_importable
from ..sdpa.backend import SDPAFallback, sdpa_bshd

logger = logging.getLogger(__name__)

FA2_MIN_VERSION = "2.6"
_HALF = frozenset({torch.float16, torch.bfloat16})


@dataclass(frozen=True)
class FlashImplementation:
    """One FlashAttention implementation: where it lives and what it can run."""

    label: str
    module: str
    distributions: tuple[str, ...]
    install: str
    compute_capabilities: tuple[tuple[int, int], ...] | None  # exact majors allowed (None: min_cc only)
    min_compute_capability: tuple[int, int]
    max_head_dim: int
    head_dim_multiple: int
    supports_backward: bool
    supports_dropout: bool
    min_version: str | None = None


# Preference order. Head-dim limits: FA4 (CuTe DSL) compiles head dims up to 128 on sm_90 (192/128 on sm_100 is not
# exposed here); FA3 and FA2 take any multiple of 8 up to 256.
IMPLEMENTATIONS: tuple[FlashImplementation, ...] = (
    FlashImplementation("FA4", "flash_attn.cute", ("flash-attn-4", "flash_attn_4"), "pip install flash-attn-4",
                        ((9, 0), (10, 0), (10, 3)), (9, 0), 128, 8, True, False),
    FlashImplementation("FA3", "flash_attn_interface", ("flash_attn_3", "flash-attn-3"),
                        "a FlashAttention-3 wheel built from flash-attention/hopper", ((9, 0),), (9, 0), 256, 8,
                        True, False),
    FlashImplementation("FA3-fwd", "fa3_fwd_interface", ("fa3-fwd", "fa3_fwd"), "pip install fa3-fwd",
                        ((9, 0),), (9, 0), 256, 8, False, False),
    FlashImplementation("FA2", "flash_attn", ("flash-attn", "flash_attn"),
                        "pip install 'flash-attn>=2.6' --no-build-isolation",
                        None, (8, 0), 256, 8, True, True, FA2_MIN_VERSION),
)
_BY_LABEL = {impl.label: impl for impl in IMPLEMENTATIONS}


def implementation_reasons(impl: FlashImplementation) -> list[str]:
    """Why ``impl`` cannot be used here (package missing or failing to import, version too old); empty when it can."""
    if not package_importable(impl.module):
        failure = package_installed(impl.module) and import_failure(impl.module)
        if failure:  # found but its import fails (e.g. ImportError: libc10_cuda.so for a wheel built for another torch)
            return [f"{impl.label}: module {impl.module!r} failed to import: {failure}; to install: {impl.install}"]
        return [f"{impl.label}: module {impl.module!r} is not importable; to install: {impl.install}"]
    if impl.min_version is not None:
        found = installed_version(*impl.distributions)
        if found is None:
            return [f"{impl.label}: cannot read the installed version of {impl.distributions[0]}; "
                    f"{impl.min_version} or newer is required"]
        if not version_at_least(found, impl.min_version):
            return [f"{impl.label}: {impl.distributions[0]} {found} is installed; {impl.min_version} or newer is "
                    f"required ({impl.install})"]
    return []


def flash_attention_implementations() -> list[str]:
    """Usable FlashAttention implementations here, best first (``["FA3", "FA2"]``…); each is imported once."""
    return [impl.label for impl in IMPLEMENTATIONS if not implementation_reasons(impl)]


def torch_flash_attention_impls() -> list[str]:
    """FlashAttention implementations PyTorch's own dispatcher can be switched to (torch >= 2.11), if any."""
    attention = torch.nn.attention
    lister = getattr(attention, "list_flash_attention_impls", None)
    return list(lister()) if lister is not None else []


def _cc_reason(impl: FlashImplementation, platform) -> str | None:
    cc = platform.compute_capability
    if platform.device_type != "cuda" or cc is None:
        return None
    if cc < impl.min_compute_capability or (
        impl.compute_capabilities is not None and cc[0] not in {c[0] for c in impl.compute_capabilities}
    ):
        allowed = (
            ", ".join(f"sm_{a}{b}" for a, b in impl.compute_capabilities)
            if impl.compute_capabilities
            else f"sm_{impl.min_compute_capability[0]}{impl.min_compute_capability[1]} or newer"
        )
        return f"{impl.label}: compute capability is {platform.sm}; {impl.label} requires {allowed}"
    return None


def select_implementation(platform) -> tuple[FlashImplementation | None, list[str]]:
    """The best implementation usable on ``platform`` and the reasons every better one was passed over."""
    reasons = []
    for impl in IMPLEMENTATIONS:
        why = implementation_reasons(impl)
        cc = _cc_reason(impl, platform)
        if cc:
            why.append(cc)
        if not why:
            return impl, reasons
        reasons.extend(why)
    return None, reasons


def usable_implementations(platform) -> list[FlashImplementation]:
    """Every implementation installed and able to run on ``platform``, best first (``tune`` times each)."""
    return [impl for impl in IMPLEMENTATIONS if not implementation_reasons(impl) and not _cc_reason(impl, platform)]


def unpad_input(x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Drop masked-out tokens. ``x`` is ``[B, S, H, D]``, ``mask`` ``[B, S]`` boolean (True keeps).

    Returns ``(tokens [nnz, H, D], indices [nnz] into B*S, cu_seqlens [B + 1] int32, max_seqlen)``.
    """
    seqlens = mask.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(mask.flatten(), as_tuple=False).flatten()
    cu_seqlens = F.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32), (1, 0))
    max_seqlen = int(seqlens.max()) if seqlens.numel() else 0
    tokens = x.reshape(-1, *x.shape[2:]).index_select(0, indices)
    return tokens, indices, cu_seqlens, max_seqlen


def pad_input(tokens: torch.Tensor, indices: torch.Tensor, batch: int, seqlen: int) -> torch.Tensor:
    """Inverse of ``unpad_input``: scatter ``[nnz, H, D]`` back to ``[B, S, H, D]`` with zeros elsewhere."""
    out = tokens.new_zeros(batch * seqlen, *tokens.shape[1:])
    out.index_copy_(0, indices, tokens)
    return out.view(batch, seqlen, *tokens.shape[1:])


def dense_cu_seqlens(batch: int, seqlen: int, device) -> torch.Tensor:
    return torch.arange(0, (batch + 1) * seqlen, seqlen, dtype=torch.int32, device=device)


def varlen_attention_reference(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale=None, causal=False):
    """Pure-torch varlen attention on ``[nnz, H, D]`` tensors (one SDPA per sequence): the contract the FlashAttention
    varlen kernels implement, used by tests and as documentation."""
    outs = []
    for i in range(cu_seqlens_q.numel() - 1):
        qs = q[cu_seqlens_q[i] : cu_seqlens_q[i + 1]]
        ks = k[cu_seqlens_k[i] : cu_seqlens_k[i + 1]]
        vs = v[cu_seqlens_k[i] : cu_seqlens_k[i + 1]]
        out = sdpa_bshd(qs[None], ks[None], vs[None], is_causal=causal, scale=softmax_scale,
                        enable_gqa=qs.shape[1] != ks.shape[1])
        outs.append(out[0])
    return torch.cat(outs)


@dataclass
class FlashKernels:
    """The two entry points this backend calls, resolved once. Tests inject pure-torch stand-ins here."""

    func: Callable
    varlen_func: Callable | None
    label: str


def _first(out):
    return out[0] if isinstance(out, tuple) else out


FP8_IMPLEMENTATIONS = ("FA3", "FA3-fwd")  # FlashAttention-3's forward takes float8_e4m3fn with q/k/v descales

def fp8_rule(family: str, q_len: int, kv_len: int, head_dim: int) -> bool:
    """Whether an unmasked call of this shape runs FP8 on ``family``: the committed routing table's ``fp8`` rule
    (``tables.fp8_choice``; classes it does not cover stay bf16). The flash family owns this rule: nothing has to
    be imported or installed elsewhere for it to apply."""
    return fp8_choice(load_table(), family, q_len, kv_len, head_dim, False)


def load_kernels(impl: FlashImplementation) -> FlashKernels:
    module = importlib.import_module(impl.module)
    varlen = getattr(module, "flash_attn_varlen_func", None)
    return FlashKernels(func=module.flash_attn_func, varlen_func=varlen, label=impl.label)


class FlashAttentionBackend(SDPAFallback, AttentionBackend):
    """FlashAttention through the best implementation installed (FA4 → FA3 → fa3-fwd → FA2)."""

    name: ClassVar[str] = "FLASH_ATTN"
    devices = frozenset({"cuda"})
    # float32 is accepted at selection and runs on TORCH_SDPA (one warning); the kernels take float16/bfloat16.
    dtypes = frozenset({torch.float16, torch.bfloat16, torch.float32})
    min_compute_capability = (8, 0)
    supports_mask = True  # boolean key-padding masks, through unpad + varlen
    supports_gqa = True
    supports_backward = True  # per implementation; see __init__ (fa3-fwd has none)
    deterministic = False

    def __init__(self, spec=None, kernels: FlashKernels | None = None,
                 fp8_rule: Callable[[int, int, int], bool] | None = None) -> None:
        super().__init__(spec)
        self._impl = None
        if kernels is None:
            impl, _ = select_implementation(current_platform())
            self._impl = impl
            self.supports_backward = impl.supports_backward if impl else True
        self._kernels = kernels
        self.fp8 = spec is not None and spec.quant is not None
        self._fp8_routes: dict[tuple, bool] = {}
        self._fp8_rule = fp8_rule
        if self.fp8:
            self.lossy = True
            self.supports_backward = False  # the FP8 forward has no backward
            self._check_fp8()

    @classmethod
    def is_lossy(cls, spec) -> bool:
        return spec is not None and spec.quant is not None

    def _check_fp8(self) -> None:
        """FP8 needs FlashAttention-3 (its forward takes descales) and Triton (the quantisation kernels); checked at
        enable time so that nothing is installed when it cannot run."""
        label = self._kernels.label if self._kernels is not None else (self._impl.label if self._impl else None)
        if label not in FP8_IMPLEMENTATIONS:
            raise ValueError(
                f"{self.name} quant dtype_qk='fp8_e4m3' needs FlashAttention-3 on sm_90 ({' or '.join(FP8_IMPLEMENTATIONS)}"
                f": pip install fa3-fwd); found {label or 'no FlashAttention implementation'}"
            )
        from .fp8_quant import triton_available

        if not triton_available():
            raise ValueError(f"{self.name} quant dtype_qk='fp8_e4m3' needs Triton for its quantisation kernels "
                             "(pip install triton); it is not importable")

    def fp8_route(self, q_len: int, kv_len: int, head_dim: int) -> bool:
        """Whether an unmasked call of this shape runs in FP8 (``fp8_rule``, the committed routing table's rule, or
        the ``fp8_rule`` given to the constructor; cached per shape)."""
        signature = (q_len, kv_len, head_dim)
        chosen = self._fp8_routes.get(signature)
        if chosen is None:
            if self._fp8_rule is not None:
                chosen = self._fp8_rule(q_len, kv_len, head_dim)
            else:
                chosen = fp8_rule(current_platform().family, q_len, kv_len, head_dim)
            if not torch.compiler.is_compiling():
                self._fp8_routes[signature] = chosen
        return chosen

    def _run_fp8(self, query, key, value, scale):
        from .fp8_quant import fp8_attention

        return fp8_attention(self.kernels.func, query, key, value, scale)

    @classmethod
    def determinism_reasons(cls, platform) -> list[str]:
        return [
            f"{cls.name}: FlashAttention backwards accumulate dQ with atomics (FA2's deterministic flag and FA3's "
            "are not wired here); use TORCH_SDPA in deterministic mode"
        ]

    @classmethod
    def extra_availability_reasons(cls, platform) -> list[str]:
        if platform.device_type != "cuda":
            return []
        impl, reasons = select_implementation(platform)
        if impl is None:
            return ["no usable FlashAttention implementation: " + "; ".join(reasons)]
        return []

    @classmethod
    def extra_call_reasons(cls, call, platform) -> list[str]:
        if platform.device_type != "cuda" or call.head_dim is None:
            return []
        impl, _ = select_implementation(platform)
        if impl is None:
            return []
        reasons = []
        if call.head_dim > impl.max_head_dim:
            reasons.append(f"head_dim is {call.head_dim}; {cls.name} ({impl.label}) requires head_dim <= "
                           f"{impl.max_head_dim}")
        if call.head_dim % impl.head_dim_multiple:
            reasons.append(f"head_dim is {call.head_dim}; {cls.name} ({impl.label}) requires a multiple of "
                           f"{impl.head_dim_multiple}")
        return reasons

    @property
    def kernels(self) -> FlashKernels:
        if self._kernels is None:
            if self._impl is None:
                raise RuntimeError(f"{self.name}: no usable FlashAttention implementation is installed")
            self._kernels = load_kernels(self._impl)
        return self._kernels

    def __call__(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        args = (query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
        if query.dtype not in _HALF:
            return self._fallback(("dtype", query.dtype), f"{query.dtype} inputs (FlashAttention takes float16/"
                                  "bfloat16)", args)
        if dropout_p and not (self._impl is None or self._impl.supports_dropout):
            return self._fallback(("dropout",), f"dropout_p={dropout_p} ({self._impl.label} has no dropout)", args)
        kernels = self.kernels
        if (
            self.fp8
            and attn_mask is None
            and not is_causal
            and not dropout_p
            and query.shape[2] == key.shape[2]
            and self.fp8_route(query.shape[1], key.shape[1], query.shape[-1])
        ):
            return self._run_fp8(query, key, value, scale)
        if attn_mask is None:
            extra = {"dropout_p": dropout_p} if dropout_p else {}
            return _first(kernels.func(query, key, value, softmax_scale=scale, causal=is_causal, **extra))
        batch, q_len, kv_len = query.shape[0], query.shape[1], key.shape[1]
        mask = key_padding_mask(attn_mask, batch, kv_len)
        if mask is None or kernels.varlen_func is None or is_causal:
            what = (
                f"a {attn_mask.dtype} mask of shape {tuple(attn_mask.shape)} (only boolean key-padding masks "
                f"[B, Skv] run on FlashAttention)"
                if mask is None
                else f"{kernels.label} has no varlen entry point" if kernels.varlen_func is None
                else "causal + key-padding mask"
            )
            if self.spec is not None:
                raise ValueError(f"{self.name} (selected explicitly) cannot run {what}; select TORCH_SDPA for this "
                                 "role")
            return self._fallback(("mask", attn_mask.dtype, attn_mask.ndim), what, args)
        k, indices, cu_k, max_k = unpad_input(key, mask)
        v = value.reshape(-1, *value.shape[2:]).index_select(0, indices)
        q = query.reshape(-1, *query.shape[2:])
        cu_q = dense_cu_seqlens(batch, q_len, query.device)
        out = _first(kernels.varlen_func(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=q_len,
                                         max_seqlen_k=max_k, softmax_scale=scale, causal=False))
        return out.view(batch, q_len, *out.shape[1:])

    def describe(self) -> dict:
        impl = self._impl
        label = self._kernels.label if self._kernels is not None else (impl.label if impl else None)
        impl = _BY_LABEL.get(label, impl)
        return {
            **super().describe(),
            "implementation": f"{impl.module}.flash_attn_func ({impl.label})" if impl else None,
            "version": installed_version(*impl.distributions) if impl else None,
            "supports_backward": self.supports_backward,
            "torch_flash_attention_impls": torch_flash_attention_impls(),
            "quant": (
                "fp8_e4m3 Q/K/V, one scale per (batch, head), K smoothed; bf16 for shapes routing_table.json does not "
                "route to FP8" if self.fp8 else None
            ),
            "lossy": self.lossy,
        }
