"""How fast DFloat11's code decodes on the GPU with our Triton kernel, against the transfer it would hide behind (#37).

Streaming a DFloat11 checkpoint's own code (moving it to the device at each load and decoding it there, instead of
decoding it once at load and streaming our lossless code) pays only if the decode keeps up with the copy. This probe
codes one FLUX.1-dev-double-block-sized unit of bf16 weights (``--millions`` of them, random normal: no trained
checkpoint of that size is at hand on the GPU machine) in DFloat11's format, and measures on the GPU, side by side:

- the DFloat11 unit decoded by ``offload.dfloat11_kernel`` (median of ``--repeats``, CUDA events) and, once, by the
  tensor-operation decoder ``load_dfloat11`` uses without Triton;
- the same weights in our lossless code (``offload.codec``) decoded by ``offload.decode_kernel``;
- the pinned host→device copy of each code, which a streamed load waits for anyway;
- every decode checked bit for bit against the weights.

The DFloat11-format encoder here is ours, vectorised with tensor operations (canonical Huffman codes of the exponent
bytes, at most 32 bits: four table rows; the stream most significant bit first; 5-bit gaps per 8-byte chunk; output
positions per block of 512 chunks), written to make inputs of any size for this probe: DFloat11's own encoder
(``dfloat11`` on PyPI, pure Python ``dahuffman``) made the bit-exact fixtures the tests check our decoders with, and
is far too slow for a unit of this size. ``tests/benchmarks/test_dfloat11_probe.py`` checks that both our decoders
give back every bit of what this encoder codes.

    python -m benchmarks run dfloat11-decode-probe          # --smoke: a small unit on the CPU (tensor operations)
"""

from __future__ import annotations

import argparse
import heapq
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from diffusers_omni.offload import codec, decode_kernel, dfloat11

POINTER = dfloat11.POINTER
MAX_ROWS = 256 - POINTER  # rows a pointer can name (1 … 16)


def huffman_lengths(counts: list[int]) -> dict[int, int]:
    """Code length per symbol with a nonzero count (Huffman's merge; one symbol alone gets one bit)."""
    heap = [(count, symbol, [symbol]) for symbol, count in enumerate(counts) if count > 0]
    if len(heap) == 1:
        return {heap[0][1]: 1}
    heapq.heapify(heap)
    lengths = {symbol: 0 for _, symbol, _ in heap}
    while len(heap) > 1:
        c1, s1, m1 = heapq.heappop(heap)
        c2, s2, m2 = heapq.heappop(heap)
        for symbol in m1 + m2:
            lengths[symbol] += 1
        heapq.heappush(heap, (c1 + c2, min(s1, s2), m1 + m2))
    return lengths


def canonical_codes(lengths: dict[int, int]) -> dict[int, int]:
    """Canonical Huffman codes: by (length, symbol), each the previous plus one, shifted to its length."""
    codes, code, previous = {}, 0, 0
    for symbol, length in sorted(lengths.items(), key=lambda item: (item[1], item[0])):
        code <<= length - previous
        codes[symbol] = code
        code, previous = code + 1, length
    return codes


def tables(codes: dict[int, int], lengths: dict[int, int]) -> torch.Tensor:
    """DFloat11's decoding tables for these codes: row 0 and the rows pointers lead to, then the lengths row."""
    rows = [[0] * 256]
    children: dict[tuple[int, int], int] = {}  # (row, byte) → the row that byte points to
    for symbol, code in codes.items():
        length, row, used = lengths[symbol], 0, 0
        while length - used > 8:
            byte = (code >> (length - used - 8)) & 0xFF
            if (row, byte) not in children:
                if len(rows) > MAX_ROWS:
                    raise ValueError("the code needs more than 16 pointer rows")
                children[(row, byte)] = len(rows)
                rows[row][byte] = 256 - len(rows)
                rows.append([0] * 256)
            row, used = children[(row, byte)], used + 8
        left = length - used
        prefix = (code & ((1 << left) - 1)) << (8 - left)
        for entry in range(prefix, prefix + (1 << (8 - left))):
            rows[row][entry] = symbol
    lengths_row = [lengths.get(symbol, 0) for symbol in range(256)]
    return torch.tensor(rows + [lengths_row], dtype=torch.uint8)


def _pack(starts: torch.Tensor, values: torch.Tensor, widths: torch.Tensor, nbytes: int) -> torch.Tensor:
    """``values`` (int64, each ``widths`` <= 32 bits) written most significant bit first at bit ``starts`` of a
    zeroed stream of ``nbytes`` bytes (the bits never overlap, so adding them is OR-ing them)."""
    words = torch.zeros(-(-nbytes // 4) + 2, dtype=torch.int64, device=values.device)
    index, offset = starts // 32, starts % 32
    end = offset + widths
    high = torch.where(end <= 32, values << (32 - end).clamp(min=0), values >> (end - 32).clamp(min=0))
    low = torch.where(end > 32, (values << (64 - end).clamp(max=63)) & 0xFFFFFFFF, torch.zeros_like(values))
    words.index_add_(0, index, high)
    words.index_add_(0, index + 1, low)
    octets = torch.stack([(words >> shift) & 0xFF for shift in (24, 16, 8, 0)], dim=1).flatten()
    return octets[:nbytes].to(torch.uint8)


def encode_unit(weights: list[torch.Tensor], threads_per_block: int = 512) -> dict[str, torch.Tensor]:
    """One DFloat11 unit of ``weights`` (bfloat16, concatenated in order), coded with tensor operations on their
    device: the six tensors ``offload.dfloat11.decode_unit`` takes."""
    flat = torch.cat([w.flatten() for w in weights])
    if flat.dtype != torch.bfloat16:
        raise ValueError(f"DFloat11 codes bfloat16 weights, got {flat.dtype}")
    device = flat.device
    bits = flat.view(torch.int16).to(torch.int64) & 0xFFFF
    exponent = (bits >> 7) & 0xFF
    sign_mantissa = (((bits >> 8) & 0x80) | (bits & 0x7F)).to(torch.uint8)
    counts = torch.bincount(exponent, minlength=256).cpu().tolist()
    if any(counts[POINTER:]):
        raise ValueError(f"exponent bytes >= {POINTER} (magnitudes above 2**112) cannot be coded: DFloat11's tables "
                         "read such bytes as pointers")
    lengths = huffman_lengths(counts)
    if max(lengths.values()) > 32:
        raise ValueError(f"a code of {max(lengths.values())} bits; DFloat11's tables hold at most 32")
    codes = canonical_codes(lengths)
    luts = tables(codes, lengths)
    code_of = torch.zeros(256, dtype=torch.int64)
    length_of = torch.zeros(256, dtype=torch.int64)
    for symbol, code in codes.items():
        code_of[symbol], length_of[symbol] = code, lengths[symbol]
    code, length = code_of.to(device)[exponent], length_of.to(device)[exponent]
    del bits, exponent
    starts = torch.cumsum(length, 0) - length
    total_bits = int(starts[-1] + length[-1]) if flat.numel() else 0
    stream_bytes = -(-total_bits // 8)
    encoded = _pack(starts, code, length, stream_bytes)
    del code, length
    chunks = -(-stream_bytes // 8)
    blocks = -(-chunks // threads_per_block)
    chunk_start = torch.arange(blocks * threads_per_block, device=device, dtype=torch.int64) * 64
    first = torch.searchsorted(starts, chunk_start)
    present = first < starts.numel()
    gap = torch.where(present, starts[first.clamp(max=max(starts.numel() - 1, 0))] - chunk_start, 0)
    if bool((gap >= 32).any()):
        raise ValueError("a chunk's first code starts 32 bits or more in: not a code of at most 32 bits")
    gaps = _pack(torch.arange(gap.numel(), device=device, dtype=torch.int64) * 5, gap,
                 torch.full_like(gap, 5), -(-gap.numel() * 5 // 8))
    block_start = torch.arange(blocks + 1, device=device, dtype=torch.int64) * threads_per_block * 64
    positions = torch.searchsorted(starts, block_start).to(torch.int32).contiguous().view(torch.uint8)
    ends = torch.tensor([w.numel() for w in weights], dtype=torch.int64).cumsum(0)[:-1]
    return {"encoded_exponent": encoded, "sign_mantissa": sign_mantissa, "luts": luts.to(device),
            "gaps": gaps, "output_positions": positions, "split_positions": ends.to(device)}


def nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _timed(fn, repeats: int, cuda: bool) -> list[float]:
    times = []
    for _ in range(repeats):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1000)
        else:
            began = time.perf_counter()
            fn()
            times.append(time.perf_counter() - began)
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--millions", type=float, default=340.0,
                        help="weights in the unit, in millions (a FLUX.1-dev double-stream block: about 340)")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--smoke", action="store_true", help="a small unit on the CPU (checks the script)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    if args.smoke:
        device, numel, repeats = torch.device("cpu"), 300_000, 2
    elif not torch.cuda.is_available():
        raise SystemExit("dfloat11-decode-probe needs a CUDA device; --smoke checks the script on the CPU")
    else:
        device, numel, repeats = torch.device("cuda", torch.cuda.current_device()), int(args.millions * 1e6), \
            args.repeats
    cuda = device.type == "cuda"
    generator = torch.Generator(device=device).manual_seed(0)
    weights = (torch.randn(numel, generator=generator, device=device) * 0.02).to(torch.bfloat16)
    halves = [weights[: numel // 3], weights[numel // 3:]]  # two weights in one unit, as DFloat11's blocks have
    began = time.perf_counter()
    unit = encode_unit(halves)
    encode_s = time.perf_counter() - began
    ours = codec.encode(weights)
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if cuda else "CPU (smoke)", "torch": torch.__version__,
        "smoke": args.smoke, "numel": numel, "bf16_bytes": 2 * numel, "repeats": repeats,
        "dfloat11_bytes": nbytes(unit), "lossless_bytes": ours.nbytes, "encode_s": encode_s,
        "table_rows": int(unit["luts"].shape[0]), "runs": []}

    def row(name: str, times: list[float], moved: int, bitwise: bool | None) -> None:
        median = statistics.median(times)
        entry = {"run": name, "median_s": median, "bytes": moved, "GBps_of_bf16": 2 * numel / median / 1e9,
                 "bitwise": bitwise}
        report["runs"].append(entry)
        print(json.dumps(entry), flush=True)

    def same(decoded: list[torch.Tensor]) -> bool:
        return bool(torch.equal(torch.cat(decoded).view(torch.int16), weights.view(torch.int16)))

    kernel_serves = dfloat11.kernel_serves(unit, 8, 512)
    if kernel_serves:
        decoded: list[list[torch.Tensor]] = []
        row("DFloat11 code, our Triton kernel (offload.dfloat11_kernel)",
            _timed(lambda: decoded.append(dfloat11.decode_unit(unit)), repeats, cuda), nbytes(unit),
            same(decoded[-1]))
        decoded.clear()
    tensor_ops: list[list[torch.Tensor]] = []
    serves, dfloat11.kernel_serves = dfloat11.kernel_serves, (lambda *a: False)
    try:
        row("DFloat11 code, tensor operations (load_dfloat11 without Triton)",
            _timed(lambda: tensor_ops.append(dfloat11.decode_unit(unit)), 1, cuda), nbytes(unit), same(tensor_ops[-1]))
    finally:
        dfloat11.kernel_serves = serves
    tensor_ops.clear()
    out = torch.empty_like(weights)
    row("our lossless code (offload.codec), its kernel" if decode_kernel.available(device)
        else "our lossless code (offload.codec), tensor ops",
        _timed(lambda: codec.decode_into(ours, out), repeats, cuda), ours.nbytes,
        bool(torch.equal(out.view(torch.int16), weights.view(torch.int16))))
    if cuda:
        for name, size in (("pinned host→device copy of the DFloat11 code", nbytes(unit)),
                           ("pinned host→device copy of our lossless code", ours.nbytes),
                           ("pinned host→device copy of the bf16 weights", 2 * numel)):
            host = torch.empty(size, dtype=torch.uint8, pin_memory=True)
            target = torch.empty(size, dtype=torch.uint8, device=device)
            row(name, _timed(lambda: target.copy_(host, non_blocking=True), repeats, cuda), size, None)
            del host, target
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{path}.json").write_text(json.dumps(report, indent=1))
    lines = ["# DFloat11's code decoded on the device: our Triton kernel against the transfer", "",
             f"{report['device']}, torch {report['torch']}; one unit of {numel:,} bf16 weights (random normal, two "
             f"weights), coded by this probe's DFloat11-format encoder to {report['dfloat11_bytes'] / (2 * numel):.3f} "
             f"of the bf16 bytes ({report['table_rows']} table rows), our lossless code to "
             f"{report['lossless_bytes'] / (2 * numel):.3f}; median of {repeats}.", "",
             "| run | time | bf16 GB/s | bytes | bitwise |", "|---|---|---|---|---|"]
    for entry in report["runs"]:
        bitwise = "" if entry["bitwise"] is None else "yes" if entry["bitwise"] else "**NO**"
        lines.append(f"| {entry['run']} | {entry['median_s'] * 1e3:.2f} ms | {entry['GBps_of_bf16']:.1f} | "
                     f"{entry['bytes'] / 1e6:.1f} MB | {bitwise} |")
    Path(f"{path}.md").write_text("\n".join(lines) + "\n")
    return 0 if all(entry["bitwise"] is not False for entry in report["runs"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
