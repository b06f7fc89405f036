"""The Triton kernel that decodes one DFloat11 unit on a GPU in one launch (``offload.dfloat11`` reads the format).

A DFloat11 unit's exponents are one Huffman-coded bit stream cut into 8-byte chunks; its ``gaps`` say where the
first code starting in each chunk starts, and its ``output_positions`` where each block of ``threads_per_block``
chunks (DFloat11's CUDA thread block: 512 chunks, 4096 bytes of stream) starts in the output. One program decodes
one such block, one chunk per lane: a first pass counts the codes starting in each lane's chunk, a prefix sum over
the lanes gives each lane its first output index, and a second pass decodes again and writes each weight: its
exponent joined with its sign and mantissa byte into the bfloat16 bit pattern. The tables are followed up to four
rows deep (codes of at most 32 bits), as DFloat11's kernel does. Reads are the coded bytes, writes the decoded
ones, on the stream the caller is on.

This is our kernel for DFloat11's published format (DFloat11 ships its own CUDA kernel through CuPy, which this
package does not depend on). Triton is imported when the kernel is first needed; without it (or off CUDA) the
tensor-operation decoder of ``offload.dfloat11`` runs instead. Under ``TRITON_INTERPRET=1`` the kernel runs on CPU
tensors (the tests check it there bit for bit against DFloat11's own encoder's outputs).
"""

from __future__ import annotations

import functools

import torch

from .decode_kernel import interpreting, available  # the same conditions as the lossless code's kernel

__all__ = ["available", "decode"]

CHUNK_BYTES = 8  # bytes of stream per lane: DFloat11's bytes_per_thread
_NUM_WARPS = 4


@functools.lru_cache(maxsize=2)
def _kernel(interpret: bool):
    """Build the kernel (once per interpreter setting: ``triton.jit`` reads ``TRITON_INTERPRET``)."""
    import triton
    import triton.language as tl

    @triton.jit
    def _decode(stream_ptr, gaps_ptr, luts_ptr, positions_ptr, sign_mantissa_ptr, out_ptr, n_bytes, n_chunks,
                n_elements, rows, max_codes, BLOCK: tl.constexpr):
        block = tl.program_id(0).to(tl.int64)
        chunk = block * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
        valid = chunk < n_chunks
        first = chunk * 8
        w0 = tl.zeros([BLOCK], tl.int64)
        w1 = tl.zeros([BLOCK], tl.int64)
        w2 = tl.zeros([BLOCK], tl.int64)
        for k in tl.static_range(4):  # the 12 bytes a chunk's codes can read, as three big-endian words
            w0 = (w0 << 8) | tl.load(stream_ptr + first + k, mask=valid & (first + k < n_bytes), other=0).to(tl.int64)
            w1 = (w1 << 8) | tl.load(stream_ptr + first + 4 + k, mask=valid & (first + 4 + k < n_bytes),
                                     other=0).to(tl.int64)
            w2 = (w2 << 8) | tl.load(stream_ptr + first + 8 + k, mask=valid & (first + 8 + k < n_bytes),
                                     other=0).to(tl.int64)
        bit = chunk * 5  # the chunk's 5-bit gap, most significant bit first
        two = (tl.load(gaps_ptr + bit // 8, mask=valid, other=0).to(tl.int64) << 8) | \
            tl.load(gaps_ptr + bit // 8 + 1, mask=valid, other=0).to(tl.int64)
        gap = (two >> (11 - bit % 8)) & 31
        lengths_ptr = luts_ptr + (rows - 1) * 256
        count = tl.zeros([BLOCK], tl.int64)
        index = tl.zeros([BLOCK], tl.int64)
        for second_pass in tl.static_range(2):  # 0: count the codes starting in each chunk; 1: decode and write
            if second_pass == 1:
                index = tl.load(positions_ptr + block).to(tl.int64) + tl.cumsum(count, axis=0) - count
            offset = gap
            for _ in range(max_codes):
                active = valid & (offset < 64)
                # the 32 bits from ``offset`` (0 … 63) on, out of the chunk's three words
                upper = offset >= 32
                shift = tl.where(upper, offset - 32, offset)
                window = ((tl.where(upper, w1, w0) << shift) & 0xFFFFFFFF) | (tl.where(upper, w2, w1) >> (32 - shift))
                # the exponent: table rows followed while a value points to another (at most four rows)
                value = tl.load(luts_ptr + (window >> 24), mask=active, other=0).to(tl.int64)
                for depth in tl.static_range(1, 4):
                    pointer = value >= 240
                    row = tl.minimum(tl.where(pointer, 256 - value, 0), rows - 2)
                    byte = (window >> (24 - 8 * depth)) & 0xFF
                    value = tl.where(pointer, tl.load(luts_ptr + row * 256 + byte, mask=active, other=0).to(tl.int64),
                                     value)
                length = tl.load(lengths_ptr + value, mask=active, other=0).to(tl.int64)
                if second_pass == 0:
                    count += active.to(tl.int64)
                else:
                    write = active & (index < n_elements)
                    rest = tl.load(sign_mantissa_ptr + index, mask=write, other=0).to(tl.int32)
                    joined = ((rest & 0x80) << 8) | (value.to(tl.int32) << 7) | (rest & 0x7F)
                    joined = tl.where(joined >= 0x8000, joined - 0x10000, joined)
                    tl.store(out_ptr + index, joined.to(tl.int16), mask=write)
                    index += active.to(tl.int64)
                offset = tl.where(active, offset + length, offset)

    return _decode


def max_codes(luts: torch.Tensor) -> int:
    """The most codes that can start in one 8-byte chunk: 64 bits over the shortest code's length (from the
    lengths row, the tables' last, read on the host: a few hundred bytes)."""
    lengths = luts.reshape(-1, 256)[-1].to(torch.int64).cpu()
    shortest = int(lengths[lengths > 0].min()) if bool((lengths > 0).any()) else 1
    return -(-64 // shortest)


def decode(encoded: torch.Tensor, gaps: torch.Tensor, luts: torch.Tensor, positions: torch.Tensor,
           sign_mantissa: torch.Tensor, out: torch.Tensor, threads_per_block: int, codes: int | None = None) -> None:
    """Decode one unit into ``out`` (int16, 1-D, as many words as ``sign_mantissa`` has bytes) on the current
    stream. ``positions`` are the unit's ``output_positions`` as int32 (one per block of ``threads_per_block``
    chunks); every tensor on ``out``'s device. ``codes``: ``max_codes(luts)`` when known (else read here, which
    waits for the device when the tables are there)."""
    chunks = -(-encoded.numel() // CHUNK_BYTES)
    if chunks == 0 or out.numel() == 0:
        return
    blocks = -(-chunks // threads_per_block)
    luts = luts.reshape(-1, 256)
    kernel = _kernel(interpreting())
    kernel[(blocks,)](encoded, gaps, luts, positions, sign_mantissa, out, encoded.numel(), chunks, out.numel(),
                      luts.shape[0], max_codes(luts) if codes is None else codes, BLOCK=threads_per_block,
                      num_warps=_NUM_WARPS)
