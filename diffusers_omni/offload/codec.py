"""A lossless code for 16-bit floating-point weights that decodes with plain tensor operations on any device.

Each bfloat16 word is split into a *key* byte, its 8-bit exponent, and a *rest* byte, its sign and 7 mantissa bits.
Trained weights use few exponents (their entropy is about 3 of 8 bits), so the 15 most
frequent keys of a buffer get a 4-bit code each and every other key is an *escape* (code 15) stored beside it with
its position. A buffer of ``n`` words is then ``n`` rest bytes + ``n / 2`` code bytes + 5 bytes per escape + a
15-byte table: about 0.75 of its size when escapes are rare, whatever the values (nothing is approximated: decoding
gives back every bit). float16 is not coded: its 5-bit exponent shares a byte with the sign and two mantissa bits,
so no byte of it has few values (measured: 1.85 of its size with this code on random weights), and it passes
through as it is, like float32 and quantized weights.

``encode`` runs on the host when an offload is enabled; ``decode`` is a handful of element-wise operations, a
16-entry table lookup (in chunks, to bound the index tensor) and one scatter, on the device the buffer is decoded on.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

CODED_DTYPES = (torch.bfloat16,)
_ESCAPE = 15
_CHUNK = 1 << 24  # elements decoded per table lookup (its int64 index is 8 bytes an element)


@dataclass
class Encoded:
    """One bfloat16 buffer, coded. Tensors are uint8 unless said; ``positions`` is int32."""

    dtype: torch.dtype
    numel: int
    table: torch.Tensor  # [16]: the keys of codes 0..14 (entry 15 unused)
    codes: torch.Tensor  # [ceil(numel / 2)]: two 4-bit codes a byte, the even element in the low nibble
    rest: torch.Tensor  # [numel]
    positions: torch.Tensor  # int32 [escapes]: elements whose key has no code
    keys: torch.Tensor  # [escapes]: their keys

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.parts())

    def parts(self) -> list[torch.Tensor]:
        return [self.table, self.codes, self.rest, self.positions, self.keys]

    def with_parts(self, parts: list[torch.Tensor]) -> "Encoded":
        return Encoded(self.dtype, self.numel, *parts)


def _split(words: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(key, rest) bytes of int32 ``words`` (the 16-bit patterns, 0..65535)."""
    key = (words >> 7) & 0xFF
    rest = ((words >> 8) & 0x80) | (words & 0x7F)
    return key.to(torch.uint8), rest.to(torch.uint8)


def _join(key: torch.Tensor, rest: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The int32 16-bit patterns of (key, rest)."""
    key, rest = key.to(torch.int32), rest.to(torch.int32)
    return ((rest & 0x80) << 8) | (key << 7) | (rest & 0x7F)


def _words(flat: torch.Tensor) -> torch.Tensor:
    """The 16-bit patterns of ``flat`` (bfloat16, 1-D) as int32 0..65535."""
    return flat.view(torch.int16).to(torch.int32) & 0xFFFF


def encode(flat: torch.Tensor) -> Encoded:
    """Code a 1-D bfloat16 tensor (on the host)."""
    if flat.dtype not in CODED_DTYPES or flat.dim() != 1:
        raise ValueError(f"encode takes a 1-D bfloat16 tensor, got {flat.dtype} of shape "
                         f"{list(flat.shape)}")
    numel = flat.numel()
    key, rest = _split(_words(flat), flat.dtype)
    counts = torch.bincount(key.to(torch.int64), minlength=256)
    order = torch.argsort(counts, descending=True, stable=True)[:_ESCAPE]
    order = order[counts[order] > 0]
    table = torch.zeros(16, dtype=torch.uint8)
    table[: order.numel()] = order.to(torch.uint8)
    code_of = torch.full((256,), _ESCAPE, dtype=torch.uint8)
    code_of[order] = torch.arange(order.numel(), dtype=torch.uint8)
    codes = code_of[key.to(torch.int64)]
    escaped = torch.nonzero(codes == _ESCAPE).flatten()
    if numel % 2:
        codes = torch.cat([codes, torch.zeros(1, dtype=torch.uint8)])
    packed = codes[0::2] | (codes[1::2] << 4)
    return Encoded(flat.dtype, numel, table, packed.contiguous(), rest, escaped.to(torch.int32), key[escaped])


def decode_into(encoded: Encoded, out: torch.Tensor) -> None:
    """Decode into ``out`` (1-D, ``encoded.numel`` elements of its dtype, on the device the parts are on)."""
    if out.dtype != encoded.dtype or out.numel() != encoded.numel:
        raise ValueError(f"decode_into: out is {out.numel()} × {out.dtype}, the code holds {encoded.numel} × "
                         f"{encoded.dtype}")
    words = out.view(torch.int16)
    table = encoded.table.to(torch.int64)
    for start in range(0, encoded.numel, _CHUNK):
        stop = min(start + _CHUNK, encoded.numel)
        first, last = start // 2, (stop + 1) // 2
        packed = encoded.codes[first:last]
        codes = torch.stack([packed & 0x0F, packed >> 4], dim=1).flatten()[: stop - start]
        key = table[codes.to(torch.int64)]
        joined = _join(key, encoded.rest[start:stop], encoded.dtype)
        words[start:stop] = torch.where(joined >= 0x8000, joined - 0x10000, joined).to(torch.int16)
    if encoded.positions.numel():
        positions = encoded.positions.to(torch.int64)
        rest = encoded.rest[positions]
        joined = _join(encoded.keys, rest, encoded.dtype)
        words[positions] = torch.where(joined >= 0x8000, joined - 0x10000, joined).to(torch.int16)


def decode(encoded: Encoded) -> torch.Tensor:
    out = torch.empty(encoded.numel, dtype=encoded.dtype, device=encoded.codes.device)
    decode_into(encoded, out)
    return out
