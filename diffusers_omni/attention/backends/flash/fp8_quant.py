"""Per-(batch, head) FP8 e4m3 quantisation of attention inputs, fused into two Triton passes, plus its reference.

FlashAttention-3's FP8 forward takes ``float8_e4m3fn`` Q, K, V with one float32 *descale* per (batch, KV head) and
returns bfloat16. ``quantize_qkv`` produces those inputs from bfloat16/float16 ``[B, S, H, D]`` tensors in two
passes over each tensor:

1. **statistics** (``_stats_kernel``): per (batch, head, channel) running max, min and sum over the tokens;
2. **cast** (``_cast_kernel``): ``(x - mean) / scale`` rounded to e4m3 (saturated at ±448).

Between them ``_finalize_kernel`` (one program per (batch, head), reading only the per-chunk statistics) picks the
scale, ``amax / 448`` per (batch, head), and whether K is smoothed.
K is *smoothed*: the per-(batch, head, channel) mean over the tokens is subtracted before the cast. That does not
change the attention output (every score of one query row moves by the same ``q·mean``, which softmax cancels)
and shrinks K's range wherever K carries a per-channel offset, as real DiT keys do; it is applied per (batch, head)
only where it lowers amax (on zero-mean Gaussian inputs it changes nothing). Q and V are never shifted (that would
change the result).

``quantize_qkv_reference`` computes the same thing in plain PyTorch, and ``fp8_attention_reference`` runs the
dequantised values through SDPA: the contract the FA3 FP8 kernel implements, used by the CPU tests (the Triton
kernels run there under ``TRITON_INTERPRET=1``) and by the H200 benchmark to check the kernels.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

FP8_E4M3_MAX = 448.0
# K is smoothed for a (batch, head) when that lowers its amax below this fraction of the unsmoothed amax.
SMOOTH_GAIN = 0.95
STATS_ROWS = 256  # tokens per statistics program
_TILE_ROWS = 64  # tokens per loop step / per cast program


@dataclass
class QuantizedQKV:
    """FP8 Q, K, V (``[B, S, H, D]``, contiguous) and their ``[B, H]`` float32 descales (FA3's ``*_descale``)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    q_descale: torch.Tensor
    k_descale: torch.Tensor
    v_descale: torch.Tensor
    k_mean: torch.Tensor  # [B, H, D] float32: what was subtracted from K (zeros where not smoothed)


def fp8_dtype() -> torch.dtype:
    dtype = getattr(torch, "float8_e4m3fn", None)
    if dtype is None:  # pragma: no cover - every supported torch has it
        raise RuntimeError("this torch build has no float8_e4m3fn dtype")
    return dtype


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "yes", "on")


@functools.lru_cache(maxsize=2)
def _kernels(interpret: bool):
    """Build the Triton kernels (once per interpreter setting: ``triton.jit`` reads ``TRITON_INTERPRET``)."""
    import triton
    import triton.language as tl

    @triton.jit
    def _stats_kernel(x_ptr, parts_ptr, S, H, n_chunks, stride_b, stride_s, stride_h,
                      D: tl.constexpr, BLOCK_D: tl.constexpr, TILE: tl.constexpr, ROWS: tl.constexpr):
        # One program: ROWS tokens of one (batch, head); per-channel max, min and sum into parts[bh, chunk, 3, :].
        bh = tl.program_id(0)
        chunk = tl.program_id(1)
        b = bh // H
        h = bh % H
        cols = tl.arange(0, BLOCK_D)
        col_ok = cols < D
        base = x_ptr + b * stride_b + h * stride_h
        run_max = tl.full([BLOCK_D], float("-inf"), tl.float32)
        run_min = tl.full([BLOCK_D], float("inf"), tl.float32)
        run_sum = tl.zeros([BLOCK_D], tl.float32)
        for r in range(0, ROWS, TILE):
            rows = chunk * ROWS + r + tl.arange(0, TILE)
            ok = (rows < S)[:, None] & col_ok[None, :]
            x = tl.load(base + rows[:, None] * stride_s + cols[None, :], mask=ok, other=0.0).to(tl.float32)
            run_max = tl.maximum(run_max, tl.max(tl.where(ok, x, float("-inf")), axis=0))
            run_min = tl.minimum(run_min, tl.min(tl.where(ok, x, float("inf")), axis=0))
            run_sum += tl.sum(x, axis=0)
        out = parts_ptr + (bh * n_chunks + chunk) * 3 * BLOCK_D + cols
        tl.store(out, run_max)
        tl.store(out + BLOCK_D, run_min)
        tl.store(out + 2 * BLOCK_D, run_sum)

    @triton.jit
    def _finalize_kernel(parts_ptr, scale_ptr, inv_ptr, mean_ptr, S, n_chunks,
                         D: tl.constexpr, BLOCK_D: tl.constexpr, SMOOTH: tl.constexpr, GAIN: tl.constexpr):
        # One program per (batch, head): reduce the partials, pick smoothing, write scale, 1/scale and the mean.
        bh = tl.program_id(0)
        cols = tl.arange(0, BLOCK_D)
        col_ok = cols < D
        mx = tl.full([BLOCK_D], float("-inf"), tl.float32)
        mn = tl.full([BLOCK_D], float("inf"), tl.float32)
        total = tl.zeros([BLOCK_D], tl.float32)
        for c in range(0, n_chunks):
            part = parts_ptr + (bh * n_chunks + c) * 3 * BLOCK_D + cols
            mx = tl.maximum(mx, tl.load(part))
            mn = tl.minimum(mn, tl.load(part + BLOCK_D))
            total += tl.load(part + 2 * BLOCK_D)
        raw = tl.max(tl.where(col_ok, tl.maximum(tl.abs(mx), tl.abs(mn)), 0.0), axis=0)
        mean = tl.zeros([BLOCK_D], tl.float32)
        amax = raw
        if SMOOTH:
            m = tl.where(col_ok, total / S, 0.0)
            shifted = tl.max(tl.where(col_ok, tl.maximum(tl.abs(mx - m), tl.abs(mn - m)), 0.0), axis=0)
            use = shifted < GAIN * raw
            amax = tl.where(use, shifted, raw)
            mean = tl.where(use, m, 0.0)
        scale = tl.maximum(amax / 448.0, 1.1754943508222875e-38)
        tl.store(scale_ptr + bh, scale)
        tl.store(inv_ptr + bh, 1.0 / scale)
        tl.store(mean_ptr + bh * BLOCK_D + cols, mean)

    @triton.jit
    def _cast_kernel(x_ptr, y_ptr, inv_ptr, mean_ptr, S, H,
                     stride_b, stride_s, stride_h, out_stride_b, out_stride_s, out_stride_h,
                     D: tl.constexpr, BLOCK_D: tl.constexpr, TILE: tl.constexpr,
                     HAS_MEAN: tl.constexpr, ROUND_IN_FP32: tl.constexpr):
        # One program: TILE tokens of one (batch, head); (x - mean) / scale rounded to e4m3.
        bh = tl.program_id(0)
        b = bh // H
        h = bh % H
        cols = tl.arange(0, BLOCK_D)
        col_ok = cols < D
        rows = tl.program_id(1) * TILE + tl.arange(0, TILE)
        ok = (rows < S)[:, None] & col_ok[None, :]
        x = tl.load(x_ptr + b * stride_b + h * stride_h + rows[:, None] * stride_s + cols[None, :], mask=ok,
                    other=0.0).to(tl.float32)
        if HAS_MEAN:
            x = x - tl.load(mean_ptr + bh * BLOCK_D + cols)[None, :]
        y = tl.minimum(tl.maximum(x * tl.load(inv_ptr + bh), -448.0), 448.0)
        if ROUND_IN_FP32:
            # Triton's interpreter rounds float32 -> e4m3 wrongly where rounding carries into the exponent; round to
            # nearest-even in float32 first (normals keep 3 mantissa bits; below 2**-6 the step is 2**-9) so its cast
            # is exact. On the GPU the hardware conversion (cvt.rn.satfinite) does the same rounding.
            bits = y.to(tl.int32, bitcast=True)
            bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576
            normal = bits.to(tl.float32, bitcast=True)
            sub = ((tl.abs(y) * 512.0 + 12582912.0) - 12582912.0) * 0.001953125
            sub = tl.where(y < 0, -sub, sub)  # keep the sign of values rounding to zero (-0.0, as torch)
            y = tl.minimum(tl.maximum(tl.where(tl.abs(y) < 0.015625, sub, normal), -448.0), 448.0)
        out = y_ptr + b * out_stride_b + h * out_stride_h + rows[:, None] * out_stride_s + cols[None, :]
        tl.store(out, y.to(tl.float8e4nv), mask=ok)

    return _stats_kernel, _finalize_kernel, _cast_kernel


def _block_d(d: int) -> int:
    return 1 << max(d - 1, 0).bit_length()


def _quantize_one(x: torch.Tensor, smooth: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One tensor through the three kernels: (fp8 tensor, scale [B·H], mean [B·H, D] or None)."""
    interpret = _interpreting()
    stats_kernel, finalize_kernel, cast_kernel = _kernels(interpret)
    b, s, h, d = x.shape
    block_d = _block_d(d)
    n_chunks = -(-s // STATS_ROWS)
    parts = torch.empty(b * h, n_chunks, 3, block_d, device=x.device, dtype=torch.float32)
    stats_kernel[(b * h, n_chunks)](
        x, parts, s, h, n_chunks, x.stride(0), x.stride(1), x.stride(2),
        D=d, BLOCK_D=block_d, TILE=_TILE_ROWS, ROWS=STATS_ROWS,
    )
    scale = torch.empty(b * h, device=x.device, dtype=torch.float32)
    inv = torch.empty_like(scale)
    mean = torch.empty(b * h, block_d, device=x.device, dtype=torch.float32)
    finalize_kernel[(b * h,)](parts, scale, inv, mean, s, n_chunks, D=d, BLOCK_D=block_d, SMOOTH=smooth,
                              GAIN=SMOOTH_GAIN)
    out = torch.empty(b, s, h, d, device=x.device, dtype=fp8_dtype())
    cast_kernel[(b * h, -(-s // _TILE_ROWS))](
        x, out, inv, mean, s, h, x.stride(0), x.stride(1), x.stride(2), out.stride(0), out.stride(1), out.stride(2),
        D=d, BLOCK_D=block_d, TILE=_TILE_ROWS, HAS_MEAN=smooth, ROUND_IN_FP32=interpret,
    )
    return out, scale, mean[:, :d] if smooth else None


def _scales(amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = (amax / FP8_E4M3_MAX).clamp(min=torch.finfo(torch.float32).tiny)
    return scale, 1.0 / scale


def _smoothing(mx: torch.Tensor, mn: torch.Tensor, total: torch.Tensor, tokens: int, d: int, smooth: bool):
    """amax per (batch·head) and the mean to subtract (zeros where smoothing does not lower amax)."""
    mx, mn, total = mx[:, :d], mn[:, :d], total[:, :d]
    raw = torch.maximum(mx.abs(), mn.abs()).amax(-1)
    if not smooth:
        return raw, None
    mean = total / tokens
    shifted = torch.maximum((mx - mean).abs(), (mn - mean).abs()).amax(-1)
    use = shifted < SMOOTH_GAIN * raw
    return torch.where(use, shifted, raw), torch.where(use[:, None], mean, torch.zeros_like(mean))


def _check(x: torch.Tensor, name: str) -> None:
    if x.ndim != 4:
        raise ValueError(f"{name} must be [B, S, H, D], got shape {tuple(x.shape)}")
    if x.stride(-1) != 1:
        raise ValueError(f"{name} must have a contiguous last dimension, got strides {x.stride()}")


def quantize_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, smooth_k: bool = True) -> QuantizedQKV:
    """Quantise ``[B, S, H, D]`` Q, K, V to FP8 e4m3 with per-(batch, head) scales, two Triton passes per tensor.

    Args:
        q, k, v (`torch.Tensor`): bfloat16/float16 (float32 works too) with equal head counts.
        smooth_k (`bool`, defaults to `True`): subtract K's per-(batch, head, channel) token mean where that lowers
            its amax (output-preserving, see the module docstring).

    Returns:
        ``QuantizedQKV`` whose descales multiply back to the input scale (``x ≈ x8.float() * descale``).
    """
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check(x, name)
    b, _, h, d = q.shape
    q8, q_scale, _ = _quantize_one(q, False)
    k8, k_scale, k_mean = _quantize_one(k, smooth_k)
    v8, v_scale, _ = _quantize_one(v, False)
    k_mean = k_mean.reshape(b, h, d) if k_mean is not None else torch.zeros(b, h, d, device=q.device)
    return QuantizedQKV(q8, k8, v8, q_scale.view(b, h), k_scale.view(b, h), v_scale.view(b, h), k_mean)


def quantize_qkv_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, smooth_k: bool = True) -> QuantizedQKV:
    """``quantize_qkv`` in plain PyTorch (any device): the contract the Triton kernels implement."""
    b, s, h, d = q.shape
    out = {}
    for name, x in (("q", q), ("k", k), ("v", v)):
        xf = x.float().permute(0, 2, 1, 3).reshape(b * h, x.shape[1], d)
        amax, mean = _smoothing(xf.amax(1), xf.amin(1), xf.sum(1), x.shape[1], d, smooth_k and name == "k")
        scale, inv = _scales(amax)
        shifted = xf - mean[:, None, :] if mean is not None else xf
        x8 = (shifted * inv[:, None, None]).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(fp8_dtype())
        out[name] = (x8.view(b, h, x.shape[1], d).permute(0, 2, 1, 3).contiguous(), scale.view(b, h), mean)
    k_mean = out["k"][2].view(b, h, d) if out["k"][2] is not None else torch.zeros(b, h, d, device=q.device)
    return QuantizedQKV(out["q"][0], out["k"][0], out["v"][0], out["q"][1], out["k"][1], out["v"][1], k_mean)


def dequantize(x8: torch.Tensor, descale: torch.Tensor) -> torch.Tensor:
    """``[B, S, H, D]`` float32 values an FP8 tensor stands for (``descale`` is ``[B, H]``)."""
    return x8.float() * descale[:, None, :, None]


def fp8_attention_reference(quant: QuantizedQKV, scale: float | None = None) -> torch.Tensor:
    """Attention on the dequantised values in float32 through SDPA: what FA3's FP8 forward computes (up to its
    internal rounding of P), used to check the kernels and as the CPU reference. Returns ``[B, S, H, D]``."""
    q, k, v = (dequantize(x, s).permute(0, 2, 1, 3) for x, s in (
        (quant.q, quant.q_descale), (quant.k, quant.k_descale), (quant.v, quant.v_descale)))
    return F.scaled_dot_product_attention(q, k, v, scale=scale).permute(0, 2, 1, 3)


# FlashAttention-3's FP8 forward on sm_90 (hopper/tile_size.h, element size 1): key tile kBlockN by head dim.
FA3_FP8_BLOCK_N = {64: 160, 96: 128, 128: 224, 192: 160, 256: 128}
# FA3's softmax runs with Max_offset = 8 in FP8 (hopper/flash_fwd_kernel_sm90.h): P = 2^(scaled score - max + 8).
FA3_FP8_MAX_OFFSET = 8.0


def fa3_fp8_emulation(quant: QuantizedQKV, scale: float | None = None, rows: slice | None = None,
                      block_n: int | None = None) -> torch.Tensor:
    """What FA3's FP8 forward computes, in float32 PyTorch (any device): the reference its error is studied with.

    Beyond ``fp8_attention_reference`` (SDPA on the dequantised Q, K, V) it rounds the softmax probabilities the way
    the kernel does before the P·V product: key tiles of ``block_n`` (``FA3_FP8_BLOCK_N``) processed last to first
    with a running row maximum, ``P = 2^((s - m)·scale·log2 e + 8)`` (at most 256) rounded to e4m3 for the P·V
    product, while the row sum accumulates the unrounded P; the output is divided by that sum and multiplied by the
    V descale. Q·Kᵀ is exact in float32 here (the tensor cores accumulate e4m3 products in reduced precision; for a
    head dim of 128 that is far below the e4m3 rounding of the inputs).

    Args:
        quant (`QuantizedQKV`): the FP8 inputs and their descales.
        scale (`float`, *optional*): softmax scale; defaults to ``1/sqrt(D)``.
        rows (`slice`, *optional*): the query rows to compute (all by default): the per-(batch, head) scales still
            come from the whole tensors, so a slice of a long sequence gives that slice's exact emulated output.
        block_n (`int`, *optional*): the key tile; defaults to FA3's for the head dim.

    Returns:
        ``[B, S_q (or the slice), H, D]`` float32.
    """
    q8, k8, v8 = (x.float() for x in (quant.q, quant.k, quant.v))
    if rows is not None:
        q8 = q8[:, rows]
    d = q8.shape[-1]
    scale = scale if scale is not None else d ** -0.5
    block_n = block_n or FA3_FP8_BLOCK_N.get(d, 128)
    q, k, v = (x.permute(0, 2, 1, 3) for x in (q8, k8, v8))  # [B, H, S, D]
    scale_log2 = (scale * quant.q_descale * quant.k_descale * math.log2(math.e))[:, :, None, None].float()
    b, h, sq, _ = q.shape
    row_max = torch.full((b, h, sq, 1), float("-inf"), device=q.device)
    row_sum = torch.zeros(b, h, sq, 1, device=q.device)
    acc = torch.zeros(b, h, sq, v.shape[-1], device=q.device)
    for start in reversed(range(0, k.shape[2], block_n)):
        scores = q @ k[:, :, start:start + block_n].transpose(-1, -2)
        new_max = torch.maximum(row_max, scores.amax(-1, keepdim=True))
        rescale = torch.exp2((row_max - new_max) * scale_log2)
        p = torch.exp2(scores * scale_log2 - (new_max * scale_log2 - FA3_FP8_MAX_OFFSET))
        row_sum = row_sum * rescale + p.sum(-1, keepdim=True)
        p8 = p.clamp(max=FP8_E4M3_MAX).to(fp8_dtype()).float()
        acc = acc * rescale + p8 @ v[:, :, start:start + block_n]
        row_max = new_max
    out = acc / row_sum * quant.v_descale[:, :, None, None]
    return out.permute(0, 2, 1, 3)


def fp8_attention(func, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None,
                  quantize=quantize_qkv) -> torch.Tensor:
    """Quantise Q, K, V and run ``func`` (FA3's ``flash_attn_func``) on them with per-(batch, head) descales.
    Returns the kernel's output in the input dtype."""
    quant = quantize(q, k, v)
    out = func(quant.q, quant.k, quant.v, softmax_scale=scale, q_descale=quant.q_descale,
               k_descale=quant.k_descale, v_descale=quant.v_descale)
    out = out[0] if isinstance(out, tuple) else out
    return out if out.dtype == q.dtype else out.to(q.dtype)
