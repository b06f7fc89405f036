"""A lossless code for bfloat16 weights that a GPU decodes at memory speed, and plain tensor operations decode
anywhere.

Each bfloat16 word is split into a *key* byte, its 8-bit exponent, and a *rest* byte, its sign and 7 mantissa bits.
Trained weights use few exponents (their entropy is about 3 of 8 bits), so a buffer's ``2**width - 1`` most frequent
keys get a ``width``-bit code each (``width`` from 1 to 4, chosen per buffer for the smallest size) and every other
key is an *escape*: the top code, its key byte stored in order in a side stream. A buffer of ``n`` words is then
``n`` rest bytes + ``n * width / 8`` code bytes + one byte per escape + one int32 per ``GROUP`` words (how many
escapes come before the group, so every group decodes on its own) + a 16-byte table. On random normal weights that
is about 0.70 of the bytes with 3-bit codes; nothing is approximated: decoding gives back every bit.
float16 is not coded: its 5-bit exponent shares a byte with the sign and two mantissa bits, so no byte of it has few
values, and it passes through as it is, like float32 and quantized weights.

Codes are packed eight to ``width`` bytes (code ``j`` of a group of eight at bits ``[width*j, width*(j+1))`` of the
little-endian ``width``-byte word), so element ``i``'s code is found without decoding the elements before it.

``encode`` runs with tensor operations on whatever device its input is on (the offload codes on the accelerator when
there is one). ``decode_into`` uses ``offload.decode_kernel``'s Triton kernel on a CUDA device where Triton is
installed (one pass: every program decodes ``GROUP`` words, with a prefix sum over its escapes), else tensor
operations, in chunks, that give the same bits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import decode_kernel
from .decode_kernel import GROUP

CODED_DTYPES = (torch.bfloat16,)
WIDTHS = (1, 2, 3, 4)
_CHUNK = GROUP * 4096  # words per step of the tensor-operation paths (their int64 temporaries are 8 bytes a word)


@dataclass
class Encoded:
    """One bfloat16 buffer, coded. Tensors are uint8 unless said."""

    dtype: torch.dtype
    numel: int
    width: int  # bits per code
    table: torch.Tensor  # [16]: the keys of codes 0 .. 2**width - 2 (the rest unused)
    codes: torch.Tensor  # [ceil(numel / 8) * width]: eight codes per ``width`` bytes
    rest: torch.Tensor  # [numel]: sign and mantissa bytes
    escapes: torch.Tensor  # [escapes]: the keys that have no code, in order
    offsets: torch.Tensor  # int32 [ceil(numel / GROUP)]: escapes before each group of GROUP words

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.parts())

    @property
    def escape_code(self) -> int:
        return (1 << self.width) - 1

    def parts(self) -> list[torch.Tensor]:
        return [self.table, self.codes, self.rest, self.escapes, self.offsets]

    def with_parts(self, parts: list[torch.Tensor]) -> "Encoded":
        return Encoded(self.dtype, self.numel, self.width, *parts)


def _split(words: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(key, rest) bytes of int16 ``words`` (bfloat16 bit patterns)."""
    key = (words >> 7) & 0xFF
    rest = ((words >> 8) & 0x80) | (words & 0x7F)
    return key.to(torch.uint8), rest.to(torch.uint8)


def _join(key: torch.Tensor, rest: torch.Tensor) -> torch.Tensor:
    """The int16 bit patterns of (key, rest)."""
    key, rest = key.to(torch.int32), rest.to(torch.int32)
    joined = ((rest & 0x80) << 8) | (key << 7) | (rest & 0x7F)
    return torch.where(joined >= 0x8000, joined - 0x10000, joined).to(torch.int16)


def _ordered(counts: torch.Tensor) -> list[int]:
    return torch.sort(counts.to(torch.int64), descending=True).values.tolist()


def _escapes(ordered: list[int], numel: int, width: int) -> int:
    """Words whose key gets no ``width``-bit code, given the keys' counts in descending order."""
    return numel - sum(ordered[: (1 << width) - 1])


def choose_width(counts: torch.Tensor, numel: int) -> int:
    """The code width (bits) giving the fewest code + escape bytes for these per-key ``counts``."""
    ordered = _ordered(counts)
    best, best_size = WIDTHS[-1], None
    for width in WIDTHS:
        escapes = _escapes(ordered, numel, width)
        size = -(-numel // 8) * width + escapes
        if best_size is None or size < best_size:
            best, best_size = width, size
    return best


def _check(flat: torch.Tensor, what: str) -> None:
    if flat.dtype not in CODED_DTYPES or flat.dim() != 1:
        raise ValueError(f"{what} takes a 1-D bfloat16 tensor, got {flat.dtype} of shape {list(flat.shape)}")


def key_counts(flat: torch.Tensor) -> torch.Tensor:
    """How often each key (exponent byte) occurs in a 1-D bfloat16 tensor: int64 [256], on its device."""
    words = flat.view(torch.int16)
    counts = torch.zeros(256, dtype=torch.int64, device=flat.device)
    for start in range(0, flat.numel(), _CHUNK):
        key, _ = _split(words[start:start + _CHUNK])
        counts += torch.bincount(key.to(torch.int64), minlength=256)
    return counts


def part_nbytes(flat: torch.Tensor) -> list[int]:
    """The bytes of each part of ``encode(flat)`` (``Encoded.parts`` order), from the keys' counts alone: what the
    code of ``flat`` will take, without coding it."""
    _check(flat, "part_nbytes")
    numel = flat.numel()
    counts = key_counts(flat).cpu()
    width = choose_width(counts, numel)
    return [16, -(-numel // 8) * width, numel, _escapes(_ordered(counts), numel, width), 4 * -(-numel // GROUP)]


def encode(flat: torch.Tensor) -> Encoded:
    """Code a 1-D bfloat16 tensor, with tensor operations on its device; the parts are on that device."""
    _check(flat, "encode")
    device, numel = flat.device, flat.numel()
    words = flat.view(torch.int16)
    counts = key_counts(flat)
    width = choose_width(counts.cpu(), numel)
    escape = (1 << width) - 1
    order = torch.argsort(counts, descending=True, stable=True)[:escape]
    order = order[counts[order] > 0]
    table = torch.zeros(16, dtype=torch.uint8, device=device)
    table[: order.numel()] = order.to(torch.uint8)
    code_of = torch.full((256,), escape, dtype=torch.uint8, device=device)
    code_of[order] = torch.arange(order.numel(), dtype=torch.uint8, device=device)
    shifts = torch.arange(8, device=device, dtype=torch.int64) * width
    byte_shifts = torch.arange(width, device=device, dtype=torch.int64) * 8
    rest = torch.empty(numel, dtype=torch.uint8, device=device)
    codes = torch.empty(-(-numel // 8) * width, dtype=torch.uint8, device=device)
    groups = -(-numel // GROUP)
    per_group = torch.empty(groups, dtype=torch.int64, device=device)
    escapes = []
    for start in range(0, numel, _CHUNK):
        stop = min(start + _CHUNK, numel)
        key, rest[start:stop] = _split(words[start:stop])
        code = code_of[key.to(torch.int64)]
        escaped = code == escape
        escapes.append(key[escaped])
        pad = (-(stop - start)) % GROUP
        padded = torch.nn.functional.pad(escaped.to(torch.int64), (0, pad))
        per_group[start // GROUP: start // GROUP + padded.numel() // GROUP] = padded.view(-1, GROUP).sum(1)
        code = torch.nn.functional.pad(code, (0, (-(stop - start)) % 8)).to(torch.int64).view(-1, 8)
        word = (code << shifts).sum(1)
        packed = ((word[:, None] >> byte_shifts) & 0xFF).to(torch.uint8).flatten()
        codes[start // 8 * width: start // 8 * width + packed.numel()] = packed
    offsets = (torch.cumsum(per_group, 0) - per_group).to(torch.int32)
    escapes = torch.cat(escapes) if escapes else torch.empty(0, dtype=torch.uint8, device=device)
    return Encoded(flat.dtype, numel, width, table, codes, rest, escapes, offsets)


def _decode_with_tensor_ops(encoded: Encoded, words: torch.Tensor) -> None:
    width, escape = encoded.width, encoded.escape_code
    device = encoded.codes.device
    shifts = torch.arange(8, device=device, dtype=torch.int64) * width
    byte_shifts = torch.arange(width, device=device, dtype=torch.int64) * 8
    table = encoded.table.to(torch.int64)
    for start in range(0, encoded.numel, _CHUNK):
        stop = min(start + _CHUNK, encoded.numel)
        first, last = start // 8 * width, -(-stop // 8) * width
        packed = encoded.codes[first:last].to(torch.int64).view(-1, width)
        word = (packed << byte_shifts).sum(1)
        code = ((word[:, None] >> shifts) & escape).flatten()[: stop - start]
        key = table[code]
        escaped = code == escape
        if encoded.escapes.numel():
            index = torch.cumsum(escaped.to(torch.int64), 0) - 1 + encoded.offsets[start // GROUP].to(torch.int64)
            index = index.clamp_(0, encoded.escapes.numel() - 1)
            key = torch.where(escaped, encoded.escapes[index].to(torch.int64), key)
        words[start:stop] = _join(key, encoded.rest[start:stop])


def decode_into(encoded: Encoded, out: torch.Tensor, use_kernel: bool | None = None) -> None:
    """Decode into ``out`` (1-D, ``encoded.numel`` elements of its dtype, on the device the parts are on).
    ``use_kernel``: None picks the Triton kernel where it runs (a CUDA device with Triton installed)."""
    if out.dtype != encoded.dtype or out.numel() != encoded.numel:
        raise ValueError(f"decode_into: out is {out.numel()} × {out.dtype}, the code holds {encoded.numel} × "
                         f"{encoded.dtype}")
    if encoded.numel == 0:
        return
    if use_kernel is None:
        use_kernel = decode_kernel.available(out.device)
    if use_kernel:
        decode_kernel.decode(encoded, out.view(torch.int16))
    else:
        _decode_with_tensor_ops(encoded, out.view(torch.int16))


def decode(encoded: Encoded, use_kernel: bool | None = None) -> torch.Tensor:
    out = torch.empty(encoded.numel, dtype=encoded.dtype, device=encoded.codes.device)
    decode_into(encoded, out, use_kernel)
    return out


def kernel_name(device: torch.device) -> str:
    """Which decoder ``decode_into`` uses on ``device`` (for the report)."""
    return "Triton kernel" if decode_kernel.available(device) else "tensor operations"
