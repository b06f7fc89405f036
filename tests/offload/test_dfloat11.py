"""Reading DFloat11 checkpoints (#37): every unit decoded bit for bit, a tiny FLUX.1 transformer loaded from one.

The fixtures were coded by DFloat11's own encoder (``dfloat11`` 0.5.0 from PyPI, its ``dfloat11_utils``, run outside
this repository): ``units.safetensors`` holds three units with their original weights (normal weights in two
tensors, a wide skewed spread of magnitudes, normal weights with a run of zeros); ``fib.safetensors`` a unit whose
exponents have Fibonacci counts (codes up to 24 bits: four table rows), its weights rebuilt here by the same rule;
``flux/`` a tiny FLUX.1 transformer (two double- and two single-stream blocks) coded with DFloat11's FLUX.1 pattern,
and ``flux_reference.safetensors`` its bfloat16 weights."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from diffusers import FluxTransformer2DModel
from safetensors.torch import load_file, save_file

from diffusers_omni import load_dfloat11
from diffusers_omni.offload import dfloat11
from diffusers_omni.offload.dfloat11 import DFloat11Error, decode_unit
from offload_helpers import run_interpreted

FIXTURES = Path(__file__).parent / "fixtures" / "dfloat11"
HAS_TRITON = importlib.util.find_spec("triton") is not None
INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
interpreted = pytest.mark.skipif(not (HAS_TRITON and INTERPRETING),
                                 reason="runs in the TRITON_INTERPRET=1 subprocess of "
                                        "test_dfloat11_kernel_under_the_interpreter")


def _units(path: Path) -> dict[str, dict[str, torch.Tensor]]:
    units: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in load_file(path).items():
        unit, _, leaf = key.partition(".")
        units.setdefault(unit, {})[leaf] = value
    return units


def _fibonacci_weights() -> torch.Tensor:
    fib = [1, 1]
    while len(fib) < 25:
        fib.append(fib[-1] + fib[-2])
    exponents = torch.cat([torch.full((count,), 100 + k, dtype=torch.int32) for k, count in enumerate(fib)])
    n = exponents.numel()
    exponents = exponents[(torch.arange(n, dtype=torch.int64) * 7919) % n]
    i = torch.arange(n, dtype=torch.int32)
    bits = ((i % 2) << 15) | (exponents << 7) | ((i * 37) & 0x7F)
    return torch.where(bits >= 0x8000, bits - 0x10000, bits).to(torch.int16).view(torch.bfloat16)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.int16), b.view(torch.int16))


@pytest.mark.parametrize("unit", ["u1", "u2", "u3"])
def test_each_unit_decodes_to_its_weights_bit_for_bit(unit):
    tensors = _units(FIXTURES / "units.safetensors")[unit]
    original = tensors.pop("original")
    decoded = decode_unit(tensors)
    assert len(decoded) == len(tensors["split_positions"]) + 1
    assert _same_bits(torch.cat(decoded), original)


def test_codes_four_table_rows_deep_decode_bit_for_bit():
    tensors = _units(FIXTURES / "fib.safetensors")["fib"]
    assert tensors["luts"].shape[0] == 5  # four rows of prefixes and the lengths
    first, second = decode_unit(tensors)
    expected = _fibonacci_weights()
    assert _same_bits(first, expected[:100000]) and _same_bits(second, expected[100000:])


@pytest.mark.skipif(INTERPRETING, reason="Triton's interpreter runs the kernel on any device")
def test_the_tensor_operation_decoder_runs_where_the_kernel_cannot():
    tensors = _units(FIXTURES / "units.safetensors")["u1"]
    tensors.pop("original")
    assert not dfloat11.kernel_serves(tensors, 8, 512)  # the CPU, without Triton's interpreter


@pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed (the kernel needs it; CI installs it)")
def test_dfloat11_kernel_under_the_interpreter():
    run_interpreted("tests/offload/test_dfloat11.py")


@interpreted
@pytest.mark.parametrize("unit", ["u1", "u2", "u3"])
def test_interpreted_kernel_decodes_each_unit_bit_for_bit(unit):
    tensors = _units(FIXTURES / "units.safetensors")[unit]
    original = tensors.pop("original")
    assert dfloat11.kernel_serves(tensors, 8, 512)
    assert _same_bits(torch.cat(decode_unit(tensors)), original)


@interpreted
def test_interpreted_kernel_decodes_codes_four_rows_deep():
    tensors = _units(FIXTURES / "fib.safetensors")["fib"]
    assert dfloat11.kernel_serves(tensors, 8, 512)
    assert _same_bits(torch.cat(decode_unit(tensors)), _fibonacci_weights())


@interpreted
def test_interpreted_kernel_loads_a_tiny_flux_bit_for_bit():
    reference = load_file(FIXTURES / "flux_reference.safetensors")
    state = load_dfloat11(_flux(), FIXTURES / "flux", device="cpu").state_dict()
    assert all(_same_bits(state[k], v) if v.dtype == torch.bfloat16 else torch.equal(state[k], v)
               for k, v in reference.items())


@interpreted
@pytest.mark.parametrize("kind", ["normal", "wide", "one exponent", "zeros"])
def test_interpreted_kernel_decodes_what_the_probe_codes_over_many_blocks(kind):
    from benchmarks import dfloat11_probe
    from tests.benchmarks.test_dfloat11_probe import weights

    parts = weights(kind, numel=60_000)
    unit = dfloat11_probe.encode_unit(parts)
    assert dfloat11.kernel_serves(unit, 8, 512) and unit["output_positions"].numel() // 4 > 2
    decoded = decode_unit(unit)
    assert all(_same_bits(d, p) for d, p in zip(decoded, parts))


@interpreted
def test_interpreted_kernel_leaves_a_block_size_it_cannot_take_to_the_tensor_operations():
    tensors = _units(FIXTURES / "units.safetensors")["u3"]
    original = tensors.pop("original")
    assert not dfloat11.kernel_serves(tensors, 8, 384)  # not a power of two
    assert not dfloat11.kernel_serves({**tensors, "output_positions": tensors["output_positions"][:4]}, 8, 512)
    assert _same_bits(torch.cat(decode_unit(tensors, threads_per_block=384)), original)


def test_a_damaged_unit_is_refused_naming_what_is_wrong():
    tensors = _units(FIXTURES / "units.safetensors")["u1"]
    tensors.pop("original")
    with pytest.raises(DFloat11Error, match="missing: gaps"):
        decode_unit({k: v for k, v in tensors.items() if k != "gaps"})
    with pytest.raises(DFloat11Error, match="gaps holds 8 bits"):
        decode_unit({**tensors, "gaps": tensors["gaps"][:1]})
    with pytest.raises(DFloat11Error, match=r"bytes_per_thread=4 is not supported; allowed: 8"):
        decode_unit(tensors, bytes_per_thread=4)
    with pytest.raises(DFloat11Error, match="the stream decodes to"):
        decode_unit({**tensors, "encoded_exponent": tensors["encoded_exponent"][:100]})


def _flux(layers: int = 2, device: str = "meta", single: int | None = None) -> FluxTransformer2DModel:
    config = {k: v for k, v in json.loads((FIXTURES / "flux" / "config.json").read_text()).items()
              if not k.startswith("_") and k != "dfloat11_config"}
    config["num_layers"] = layers
    if single is not None:
        config["num_single_layers"] = single
    with torch.device(device):
        return FluxTransformer2DModel(**config).to(torch.bfloat16)


def _inputs() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"hidden_states": torch.randn(1, 16, 16, generator=g).to(torch.bfloat16),
            "encoder_hidden_states": torch.randn(1, 8, 32, generator=g).to(torch.bfloat16),
            "pooled_projections": torch.randn(1, 32, generator=g).to(torch.bfloat16),
            "timestep": torch.tensor([0.5]), "guidance": torch.tensor([3.5]),
            "img_ids": torch.zeros(16, 3), "txt_ids": torch.zeros(8, 3)}


def test_a_tiny_flux_loads_from_its_dfloat11_checkpoint_bit_for_bit(tmp_path):
    reference = load_file(FIXTURES / "flux_reference.safetensors")
    model = load_dfloat11(_flux(), FIXTURES / "flux")
    assert not model.training
    state = model.state_dict()
    assert set(state) == set(reference) and all(_same_bits(state[k], v) if v.dtype == torch.bfloat16
                                                 else torch.equal(state[k], v) for k, v in reference.items())
    assert all(t.device.type == "cpu" for t in state.values())
    save_file(state, tmp_path / "saved.safetensors")  # each weight its own storage: safetensors takes them
    resident = _flux(device="cpu")
    resident.load_state_dict(reference)
    resident.eval()
    with torch.inference_mode():
        expected = resident(**_inputs(), return_dict=False)[0]
        assert torch.equal(model(**_inputs(), return_dict=False)[0], expected)
    # and streamed with the lossless code: the same output
    from diffusers_omni import LayerwiseOffloadConfig, apply_offload

    backend = apply_offload(model, LayerwiseOffloadConfig(device="cpu", compression="lossless"))
    try:
        with torch.inference_mode():
            assert torch.equal(model(**_inputs(), return_dict=False)[0], expected)
    finally:
        backend.disable()


def test_a_checkpoint_that_does_not_match_the_model_is_refused_before_anything_changes(tmp_path):
    model = _flux(layers=1, device="cpu")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(DFloat11Error, match=r"codes a unit 'transformer_blocks.1' the model has no module for"):
        load_dfloat11(model, FIXTURES / "flux")
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
    folder = tmp_path / "flux"
    shutil.copytree(FIXTURES / "flux", folder)
    (folder / "config.json").write_text(json.dumps({"num_layers": 2}))
    with pytest.raises(DFloat11Error, match="holds no dfloat11_config"):
        load_dfloat11(_flux(), folder)
    shutil.copy(FIXTURES / "flux" / "config.json", folder / "config.json")
    tensors = load_file(folder / "diffusion_pytorch_model.safetensors")
    tensors.pop("proj_out.bias")
    tensors["not_a_tensor.weight"] = torch.zeros(1)
    save_file(tensors, folder / "diffusion_pytorch_model.safetensors")
    with pytest.raises(DFloat11Error, match=r"not in the model: not_a_tensor.weight; not given: proj_out.bias"):
        load_dfloat11(_flux(), folder)


def test_a_meta_model_with_buffers_no_checkpoint_holds_is_refused():
    model = _flux()
    model.register_buffer("computed", torch.empty(4, device="meta"), persistent=False)
    with pytest.raises(DFloat11Error, match="buffers computed are on the meta device .* build the model on the CPU"):
        load_dfloat11(model, FIXTURES / "flux")



def test_a_dfloat11_model_codes_once_into_the_cache_and_reads_it_back(tmp_path):
    """A transformer loaded from a DFloat11 checkpoint has no file of its own bf16 weights: with
    compression="lossless" and compression_cache_dir its blocks' code is written to the folder once, and the next
    enable reads it instead of coding again; the output is the resident one, bit for bit, throughout."""
    from diffusers_omni import LayerwiseOffloadConfig, apply_offload

    reference = load_file(FIXTURES / "flux_reference.safetensors")
    resident = _flux(device="cpu")
    resident.load_state_dict(reference)
    with torch.inference_mode():
        expected = resident.eval()(**_inputs(), return_dict=False)[0]
    counters = []
    for _ in range(2):
        model = load_dfloat11(_flux(), FIXTURES / "flux")
        backend = apply_offload(model, LayerwiseOffloadConfig(device="cpu", compression="lossless",
                                                              compression_cache_dir=str(tmp_path / "cache")))
        try:
            assert backend.stats.store_blocks.get("lossless", 0) == 4  # every block streams coded
            with torch.inference_mode():
                assert torch.equal(model(**_inputs(), return_dict=False)[0], expected)
            counters.append(dict(backend.stats.cache_counters))
        finally:
            backend.disable()
        with torch.inference_mode():
            assert torch.equal(model(**_inputs(), return_dict=False)[0], expected)
    assert counters[0]["cache blocks written"] == 4 and counters[0]["cache blocks read"] == 0
    assert counters[1]["cache blocks written"] == 0 and counters[1]["cache blocks read"] == 4


def _write_dfloat11(model: torch.nn.Module, folder: Path) -> None:
    """A DFloat11 checkpoint of ``model`` in ``folder``, coded by the probe's DFloat11-format encoder
    (``benchmarks/dfloat11_probe.py``) with DFloat11's FLUX.1 pattern: the store's tests need more blocks than
    the fixture DFloat11's own encoder made (four: a host budget then never pays for its staging ring)."""
    import re

    from benchmarks.dfloat11_probe import encode_unit

    config = json.loads((FIXTURES / "flux" / "config.json").read_text())
    patterns = config["dfloat11_config"]["pattern_dict"]
    state = model.state_dict()
    tensors, coded = {}, set()
    for name, module in model.named_modules():
        for pattern, attributes in patterns.items():
            if re.fullmatch(pattern, name):
                weights = [f"{name}.{attribute}.weight" for attribute in attributes]
                for key, value in encode_unit([state[w] for w in weights]).items():
                    tensors[f"{name}.{key}"] = value.contiguous()
                coded.update(weights)
    tensors.update({k: v.contiguous() for k, v in state.items() if k not in coded})
    folder.mkdir(parents=True)
    save_file(tensors, folder / "diffusion_pytorch_model.safetensors")
    (folder / "config.json").write_text(json.dumps({**model.config, "dfloat11_config": config["dfloat11_config"]}))


def _deep_dfloat11(tmp_path: Path, layers: int = 6) -> tuple[FluxTransformer2DModel, torch.Tensor]:
    """A FLUX.1 transformer of ``layers`` double- and single-stream blocks with random weights, its output, and the
    same transformer loaded back from the DFloat11 checkpoint written of it."""
    torch.manual_seed(0)
    resident = _flux(layers=layers, device="cpu", single=layers).eval()
    with torch.inference_mode():
        expected = resident(**_inputs(), return_dict=False)[0]
    _write_dfloat11(resident, tmp_path / "df11")
    return load_dfloat11(_flux(layers=layers, single=layers), tmp_path / "df11"), expected


def _resident_output() -> torch.Tensor:
    resident = _flux(device="cpu")
    resident.load_state_dict(load_file(FIXTURES / "flux_reference.safetensors"))
    with torch.inference_mode():
        return resident.eval()(**_inputs(), return_dict=False)[0]


def _weights_bytes(model: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


@pytest.mark.parametrize("compression", [None, "lossless"])
def test_a_host_budget_reads_blocks_coded_from_the_dfloat11_checkpoint(compression, tmp_path):
    """A model loaded from a DFloat11 checkpoint has no file of its bf16 weights: under max_host_memory the blocks
    that keep no host copy are read from the DFloat11 checkpoint itself, coded, and decoded (no cache folder)."""
    _reads_blocks_from_the_dfloat11_checkpoint(compression, tmp_path)


@interpreted
def test_interpreted_kernel_decodes_the_blocks_read_from_the_dfloat11_checkpoint(tmp_path, monkeypatch):
    """The same through the Triton kernel (as on a GPU): the staged code's views, tables and sizes as it takes them."""
    from diffusers_omni.offload import dfloat11_kernel

    calls, decode = [], dfloat11_kernel.decode
    monkeypatch.setattr(dfloat11_kernel, "decode", lambda *args: calls.append(args[-1]) or decode(*args))
    _reads_blocks_from_the_dfloat11_checkpoint("lossless", tmp_path)
    assert calls and all(codes is not None for codes in calls[-4:])  # the offload's loads: no read of the tables


def _reads_blocks_from_the_dfloat11_checkpoint(compression, tmp_path):
    from diffusers_omni import LayerwiseOffloadConfig, apply_offload
    from diffusers_omni.offload.report import offload_report
    from diffusers_omni.offload.stores import DFloat11FileStore

    model, expected = _deep_dfloat11(tmp_path)
    reference = {k: v.clone() for k, v in model.state_dict().items()}
    budget = _weights_bytes(model) // 2
    backend = apply_offload(model, LayerwiseOffloadConfig(device="cpu", max_host_memory=budget,
                                                          compression=compression))
    try:
        stats, state = backend.stats, backend._state
        on_disk = [b for row in state.streamed for b in row if b is not None and isinstance(b.store, DFloat11FileStore)]
        assert len(on_disk) == stats.disk_blocks > 0
        assert stats.disk_bytes_per_pass < 0.8 * sum(b.weights.nbytes for b in on_disk)  # read coded
        assert stats.host_bytes + stats.staging_bytes + stats.shared_bytes <= budget
        for _ in range(2):
            with torch.inference_mode():
                assert torch.equal(model(**_inputs(), return_dict=False)[0], expected)
        assert stats.disk_reads >= 2 * stats.disk_blocks
        report = str(offload_report(model, backend, None))
        assert "are read from the DFloat11 checkpoint, coded" in report
        assert "disk (DFloat11): " in report and "DFloat11's Huffman code of the bfloat16 exponents" in report
        state_dict = model.state_dict()  # the disk-backed blocks decoded back
        assert all(torch.equal(state_dict[k].view(torch.uint8), v.view(torch.uint8)) for k, v in reference.items())
    finally:
        backend.disable()
    after = model.state_dict()
    assert all(torch.equal(after[k].view(torch.uint8), v.view(torch.uint8)) for k, v in reference.items())
    with torch.inference_mode():
        assert torch.equal(model(**_inputs(), return_dict=False)[0], expected)


def test_a_block_changed_since_loading_is_not_read_from_the_dfloat11_checkpoint(caplog, tmp_path):
    from diffusers_omni import LayerwiseOffloadConfig, apply_offload
    from diffusers_omni.offload.stores import DFloat11FileStore

    model, _ = _deep_dfloat11(tmp_path)
    with torch.no_grad():
        model.transformer_blocks[0].attn.to_q.weight.add_(1)  # as a fused LoRA would
    with torch.inference_mode():
        expected = model(**_inputs(), return_dict=False)[0]
    with caplog.at_level("WARNING", logger="diffusers_omni"):
        backend = apply_offload(model, LayerwiseOffloadConfig(device="cpu", max_host_memory=_weights_bytes(model) // 2))
    try:
        assert any("'transformer_blocks.0'" in r.getMessage() and "changed since it was loaded" in r.getMessage()
                   for r in caplog.records)
        stores = {b.weights.path: b.store for row in backend._state.streamed for b in row if b is not None}
        assert not isinstance(stores["transformer_blocks.0"], DFloat11FileStore)  # kept in RAM: no file has it
        assert any(isinstance(store, DFloat11FileStore) for store in stores.values())
        with torch.inference_mode():
            assert torch.equal(model(**_inputs(), return_dict=False)[0], expected)
    finally:
        backend.disable()


def test_a_device_budget_reserves_the_code_ring_for_blocks_read_from_a_dfloat11_checkpoint(tmp_path):
    """On a GPU, blocks read from a DFloat11 checkpoint pass through the code ring even without
    compression="lossless": a device plan must reserve it whenever a host budget may read such blocks."""
    from diffusers_omni import LayerwiseOffloadConfig
    from diffusers_omni.offload.layerwise import streams_coded

    model, _ = _deep_dfloat11(tmp_path, layers=1)
    plain = _flux(layers=1, device="cpu")
    assert streams_coded(LayerwiseOffloadConfig(device="cpu", max_host_memory=1 << 30), [model])
    assert not streams_coded(LayerwiseOffloadConfig(device="cpu"), [model])  # no host budget: nothing read from it
    assert not streams_coded(LayerwiseOffloadConfig(device="cpu", max_host_memory=1 << 30), [plain])
    assert streams_coded(LayerwiseOffloadConfig(device="cpu", compression="lossless"), [plain])
    # and the plan of an offload on an accelerator reserves it: one buffer per window block, at the bf16 size
    from diffusers_omni import apply_offload

    backend = apply_offload(model, LayerwiseOffloadConfig(device="cpu", max_host_memory=_weights_bytes(model)))
    try:
        flat = [w for row in backend._state.weights for w in row]
        forced = [w.empty for w in flat]
        assert backend._code_ring_planned(backend._state, flat, forced) == 0  # the CPU decodes from the host
        backend.device = torch.device("cuda")
        largest = max(w.nbytes for w, f in zip(flat, forced) if not f)
        assert backend._code_ring_planned(backend._state, flat, forced) == 2 * largest
    finally:
        backend.device = torch.device("cpu")
        backend.disable()
