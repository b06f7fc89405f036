"""The Triton kernel that decodes ``offload.codec``'s lossless code on a GPU in one pass.

One program decodes ``codec.GROUP`` consecutive words: it reads their packed codes (``width`` bytes per eight
words), looks each code up in the 16-entry table, and for the escape code reads the key from the escape stream at
``offsets[group] + (escapes before this word in the group)``, a prefix sum inside the program; then it joins key and
rest byte into the bfloat16 bit pattern. Reads are the coded bytes, writes the decoded ones: memory speed, launched on
the stream the caller is on (the offload's copy stream), so the next block decodes while this one computes.

Triton is imported when the kernel is first needed; without it (or off CUDA) ``codec`` decodes with tensor
operations. Under ``TRITON_INTERPRET=1`` the kernel runs on CPU tensors (the tests check it there bit for bit
against the tensor-operation decoder).
"""

from __future__ import annotations

import functools
import importlib.util
import os
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # pragma: no cover
    from .codec import Encoded

GROUP = 2048  # words per program, and per escape-offset entry of the code
_NUM_WARPS = 4


def interpreting() -> bool:
    """Whether Triton's interpreter is on (``TRITON_INTERPRET``): kernels then run on CPU tensors."""
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "yes", "on")


@functools.lru_cache(maxsize=None)
def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def available(device: torch.device) -> bool:
    """Whether ``decode`` runs on ``device``: a CUDA device with Triton installed (or any device while Triton's
    interpreter is on)."""
    if not _triton_installed():
        return False
    return torch.device(device).type == "cuda" or interpreting()


@functools.lru_cache(maxsize=2)
def _kernel(interpret: bool):
    """Build the kernel (once per interpreter setting: ``triton.jit`` reads ``TRITON_INTERPRET``)."""
    import triton
    import triton.language as tl

    @triton.jit
    def _decode(codes_ptr, rest_ptr, table_ptr, escapes_ptr, offsets_ptr, out_ptr, numel,
                WIDTH: tl.constexpr, GROUP: tl.constexpr, HAS_ESCAPES: tl.constexpr):
        group = tl.program_id(0).to(tl.int64)
        words = group * GROUP + tl.arange(0, GROUP).to(tl.int64)
        valid = words < numel
        octet = words // 8
        packed = tl.zeros([GROUP], tl.int64)
        for b in tl.static_range(WIDTH):
            byte = tl.load(codes_ptr + octet * WIDTH + b, mask=valid, other=0).to(tl.int64)
            packed = packed | (byte << (8 * b))
        escape = (1 << WIDTH) - 1
        code = ((packed >> ((words % 8) * WIDTH)) & escape).to(tl.int32)
        key = tl.load(table_ptr + code, mask=valid, other=0).to(tl.int32)
        if HAS_ESCAPES:
            escaped = (code == escape) & valid
            before = tl.cumsum(escaped.to(tl.int32), axis=0) - 1
            index = tl.load(offsets_ptr + group).to(tl.int64) + before.to(tl.int64)
            escaped_key = tl.load(escapes_ptr + index, mask=escaped, other=0).to(tl.int32)
            key = tl.where(escaped, escaped_key, key)
        rest = tl.load(rest_ptr + words, mask=valid, other=0).to(tl.int32)
        joined = ((rest & 0x80) << 8) | (key << 7) | (rest & 0x7F)
        joined = tl.where(joined >= 0x8000, joined - 0x10000, joined)
        tl.store(out_ptr + words, joined.to(tl.int16), mask=valid)

    return _decode


def decode(encoded: "Encoded", words: torch.Tensor) -> None:
    """Decode ``encoded`` into ``words`` (int16, 1-D, ``encoded.numel`` long) on the current stream."""
    kernel = _kernel(interpreting())
    groups = -(-encoded.numel // GROUP)
    has_escapes = encoded.escapes.numel() > 0
    escapes = encoded.escapes if has_escapes else encoded.table  # any valid pointer: never read
    kernel[(groups,)](encoded.codes, encoded.rest, encoded.table, escapes, encoded.offsets, words, encoded.numel,
                      WIDTH=encoded.width, GROUP=GROUP, HAS_ESCAPES=has_escapes, num_warps=_NUM_WARPS)
