"""The lossless bfloat16 code (``offload.codec``) and its Triton decoder (``offload.decode_kernel``): every bit
back, in every code width, through both decoders.

The Triton kernel runs on the CPU under Triton's interpreter, which must be on before ``triton`` is first imported:
those tests run only with ``TRITON_INTERPRET=1``, and ``test_decode_kernel_under_the_interpreter`` runs this module
in a subprocess with it set."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from diffusers_omni.offload import codec, decode_kernel
from diffusers_omni.offload.coded_block import code_block, coded_nbytes
from offload_helpers import run_interpreted

HAS_TRITON = importlib.util.find_spec("triton") is not None
INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
interpreted = pytest.mark.skipif(not (HAS_TRITON and INTERPRETING),
                                 reason="runs in the TRITON_INTERPRET=1 subprocess of "
                                        "test_decode_kernel_under_the_interpreter")
SPECIALS = [float("inf"), float("-inf"), float("nan"), -0.0, 0.0, 1e-38, 3e38, 2.0 ** -133, -2.0 ** -126]


def _values(numel: int, scale: float = 0.02, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    values = (torch.randn(numel, generator=generator) * scale).to(torch.bfloat16)
    specials = torch.tensor(SPECIALS, dtype=torch.bfloat16)
    values[: min(numel, specials.numel())] = specials[: min(numel, specials.numel())]
    return values


def _every_pattern() -> torch.Tensor:
    words = torch.arange(1 << 16, dtype=torch.int32)
    return torch.where(words >= 1 << 15, words - (1 << 16), words).to(torch.int16).view(torch.bfloat16)


def _encode_with_width(values: torch.Tensor, width: int, monkeypatch) -> codec.Encoded:
    monkeypatch.setattr(codec, "choose_width", lambda counts, numel: width)
    return codec.encode(values)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int16), b.view(torch.int16))


@pytest.mark.parametrize("numel", [1, 7, 8, 9, codec.GROUP - 1, codec.GROUP + 1, 100_003, codec._CHUNK + 13])
def test_round_trips_every_bit_including_specials(numel):
    values = _values(numel, seed=numel)
    encoded = codec.encode(values)
    assert _same_bits(codec.decode(encoded, use_kernel=False), values)
    assert encoded.codes.numel() == -(-numel // 8) * encoded.width
    assert encoded.offsets.numel() == -(-numel // codec.GROUP)


@pytest.mark.parametrize("width", codec.WIDTHS)
def test_every_width_decodes_every_bit_pattern(width, monkeypatch):
    values = _every_pattern()
    encoded = _encode_with_width(values, width, monkeypatch)
    assert encoded.width == width and encoded.escapes.numel() == (1 << 16) - 256 * ((1 << width) - 1)
    assert _same_bits(codec.decode(encoded, use_kernel=False), values)


def test_random_weights_code_to_about_070_and_the_width_is_the_smallest():
    values = _values(1 << 20)
    encoded = codec.encode(values)
    assert encoded.width == 3
    assert 0.69 < encoded.nbytes / values.nbytes < 0.71
    key = ((values.view(torch.int16) >> 7) & 0xFF).to(torch.int64)
    counts = torch.bincount(key, minlength=256)
    sizes = {}
    for width in codec.WIDTHS:
        top = torch.sort(counts, descending=True).values[: (1 << width) - 1].sum().item()
        sizes[width] = -(-values.numel() // 8) * width + values.numel() - top
    assert min(sizes, key=sizes.get) == encoded.width


def test_one_value_and_empty_buffers():
    constant = torch.full((5000,), 1.5, dtype=torch.bfloat16)
    encoded = codec.encode(constant)
    assert encoded.width == 1 and encoded.escapes.numel() == 0
    assert _same_bits(codec.decode(encoded, use_kernel=False), constant)
    empty = codec.encode(torch.empty(0, dtype=torch.bfloat16))
    assert codec.decode(empty, use_kernel=False).numel() == 0


def test_refuses_what_it_does_not_code():
    with pytest.raises(ValueError, match=r"encode takes a 1-D bfloat16 tensor, got torch.float16"):
        codec.encode(torch.zeros(4, dtype=torch.float16))
    encoded = codec.encode(_values(16))
    with pytest.raises(ValueError, match=r"decode_into: out is 8 × torch.bfloat16, the code holds 16"):
        codec.decode_into(encoded, torch.empty(8, dtype=torch.bfloat16))


@pytest.mark.skipif(INTERPRETING, reason="Triton's interpreter runs the kernel on any device")
def test_the_kernel_is_used_only_on_cuda_with_triton():
    assert not decode_kernel.available(torch.device("cpu"))
    assert codec.kernel_name(torch.device("cpu")) == "tensor operations"
    assert decode_kernel.available(torch.device("cuda")) is HAS_TRITON


@pytest.mark.skipif(not HAS_TRITON or INTERPRETING, reason="needs Triton; this is the driver of the interpreted run")
def test_decode_kernel_under_the_interpreter():
    run_interpreted("tests/offload/test_codec.py")


@interpreted
@pytest.mark.parametrize("numel", [1, 9, codec.GROUP - 1, codec.GROUP + 1, 3 * codec.GROUP + 17])
@pytest.mark.parametrize("scale", [0.02, 1e6, 1e-30])
def test_interpreted_kernel_matches_every_bit(numel, scale):
    values = _values(numel, scale, seed=numel)
    encoded = codec.encode(values)
    assert _same_bits(codec.decode(encoded, use_kernel=True), values)


@interpreted
@pytest.mark.parametrize("width", codec.WIDTHS)
def test_interpreted_kernel_every_width_every_pattern(width, monkeypatch):
    values = _every_pattern()
    encoded = _encode_with_width(values, width, monkeypatch)
    assert _same_bits(codec.decode(encoded, use_kernel=True), values)


@pytest.mark.parametrize("case", ["normal", "few", "one", "wide", "empty", "mixed"])
def test_coded_nbytes_is_the_size_code_block_makes(case):
    generator = torch.Generator().manual_seed(3)
    numel = 10_000 + 37
    flat = {}
    if case == "normal":
        flat[torch.bfloat16] = torch.randn(numel, generator=generator).to(torch.bfloat16)
    elif case == "few":  # two exponents: 1-bit codes
        flat[torch.bfloat16] = (torch.randint(0, 2, (numel,), generator=generator).float() + 1).to(torch.bfloat16)
    elif case == "one":  # one value
        flat[torch.bfloat16] = torch.full((numel,), 0.5, dtype=torch.bfloat16)
    elif case == "wide":  # exponents everywhere: many escapes
        flat[torch.bfloat16] = torch.randint(-2**15, 2**15, (numel,), generator=generator,
                                             dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    elif case == "empty":
        flat[torch.bfloat16] = torch.empty(0, dtype=torch.bfloat16)
    else:
        flat[torch.bfloat16] = torch.randn(numel, generator=generator).to(torch.bfloat16)
        flat[torch.float32] = torch.randn(77, generator=generator)
        flat[torch.float16] = torch.randn(5, generator=generator).half()
    device = torch.device("cpu")
    block = code_block(flat, device, lambda nbytes: torch.empty(nbytes, dtype=torch.uint8))
    assert coded_nbytes(flat, device) == block.nbytes
