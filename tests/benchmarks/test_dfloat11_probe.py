"""The DFloat11-format encoder of ``benchmarks/dfloat11_probe.py`` (inputs of any size for the GPU probe): what it
codes, our decoders give back bit for bit (the tensor operations here; the Triton kernel under Triton's interpreter
in ``tests/offload/test_dfloat11.py``)."""

from __future__ import annotations

import pytest
import torch

from benchmarks import dfloat11_probe
from diffusers_omni.offload import dfloat11


def _words(values: torch.Tensor) -> torch.Tensor:
    return values.view(torch.int16)


def weights(kind: str, numel: int = 50_000) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    if kind == "normal":
        values = torch.randn(numel, generator=g) * 0.02
    elif kind == "wide":  # magnitudes over many octaves: many exponents, long codes
        values = torch.randn(numel, generator=g) * torch.exp2(torch.randint(-100, 100, (numel,), generator=g).float())
    elif kind == "one exponent":  # a single symbol: one-bit codes
        values = 1 + torch.rand(numel, generator=g) * 0.9
    else:  # zeros with a few values
        values = torch.zeros(numel)
        values[::97] = torch.randn(values[::97].numel(), generator=g)
    values = values.to(torch.bfloat16)
    return [values[: numel // 3], values[numel // 3: numel // 2], values[numel // 2:]]


@pytest.mark.parametrize("kind", ["normal", "wide", "one exponent", "zeros"])
def test_what_the_probe_codes_decodes_bit_for_bit(kind):
    parts = weights(kind)
    unit = dfloat11_probe.encode_unit(parts)
    decoded = dfloat11.decode_unit(unit)
    assert [d.numel() for d in decoded] == [p.numel() for p in parts]
    assert all(torch.equal(_words(d), _words(p)) for d, p in zip(decoded, parts))
    if kind == "normal":
        assert dfloat11_probe.nbytes(unit) < 0.72 * 2 * sum(p.numel() for p in parts)


def test_a_code_four_table_rows_deep_decodes_bit_for_bit():
    """Exponents with Fibonacci counts: Huffman codes up to 29 bits long, so the tables are followed four rows deep."""
    fib = [1, 1]
    while len(fib) < 30:
        fib.append(fib[-1] + fib[-2])
    exponents = torch.cat([torch.full((count,), 90 + k, dtype=torch.int64) for k, count in enumerate(fib)])
    exponents = exponents[torch.randperm(exponents.numel(), generator=torch.Generator().manual_seed(0))]
    i = torch.arange(exponents.numel(), dtype=torch.int64)
    bits = ((i % 2) << 15) | (exponents << 7) | ((i * 37) & 0x7F)
    values = torch.where(bits >= 0x8000, bits - 0x10000, bits).to(torch.int16).view(torch.bfloat16)
    unit = dfloat11_probe.encode_unit([values])
    lengths = unit["luts"][-1]
    assert int(lengths.max()) == 29 and unit["luts"].shape[0] >= 5  # row 0, three rows deep, the lengths
    assert torch.equal(_words(dfloat11.decode_unit(unit)[0]), _words(values))


def test_what_cannot_be_coded_is_refused():
    with pytest.raises(ValueError, match="exponent bytes >= 240"):
        dfloat11_probe.encode_unit([torch.tensor([2.0 ** 120], dtype=torch.bfloat16)])
    with pytest.raises(ValueError, match="codes bfloat16 weights, got torch.float32"):
        dfloat11_probe.encode_unit([torch.zeros(4)])
