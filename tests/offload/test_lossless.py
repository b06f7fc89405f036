"""``compression="lossless"`` (#37, the CPU part): bfloat16 blocks kept coded in host memory and decoded into
their device buffers bit for bit; other dtypes pass through; the report says what was coded and by how much."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from diffusers_omni.config.offload import LayerwiseOffloadConfig
from diffusers_omni.offload.coded_block import CodedBlock, code_block
from diffusers_omni.offload.memory import Transfers
from diffusers_omni.offload.stores import LosslessStore
from diffusers_omni.offload.stores.lossless import CodeRing
from offload_helpers import assert_same_snapshot, flux_pipe, generate, pipeline_snapshot, wan22_pipe


def test_config_refuses_an_unknown_mode_naming_the_field():
    assert LayerwiseOffloadConfig(device="cpu", compression=" Lossless").compression == "lossless"
    assert LayerwiseOffloadConfig(device="cpu", compression="none").compression is None
    with pytest.raises(ValueError, match=r"compression='zstd' is not a known mode; allowed: 'lossless' or None"):
        LayerwiseOffloadConfig(device="cpu", compression="zstd")
    with pytest.raises(TypeError, match="compression must be a str or None"):
        LayerwiseOffloadConfig(device="cpu", compression=1)


@pytest.mark.parametrize("make", [flux_pipe, wan22_pipe], ids=["flux", "wan2.2"])
def test_lossless_offload_is_bitwise_the_resident_pipeline(make):
    pipe = make()
    pipe.to(torch.bfloat16)
    reference = generate(pipe, steps=2)
    expected = {k: v.clone() for k, v in pipe.transformer.state_dict().items()}
    backend = pipe.enable_layerwise_offload(device="cpu", compression="lossless")
    stats = backend.stats
    assert stats.store_blocks.get("lossless", 0) > 0
    assert stats.store_host_bytes["lossless"] < 0.8 * stats.store_bytes["lossless"]
    assert stats.host_bytes >= sum(stats.store_host_bytes.values())  # the coded blocks' bytes are counted
    for _ in range(2):
        assert torch.equal(generate(pipe, steps=2), reference)
    actual = pipe.transformer.state_dict()  # decoded for state_dict()
    assert all(torch.equal(actual[k], v) for k, v in expected.items())
    report = str(pipe.omni_offload_report())
    assert "lossless: " in report and "held coded" in report
    pipe.disable_omni_offload()
    assert all(torch.equal(pipe.transformer.state_dict()[k], v) for k, v in expected.items())
    assert torch.equal(generate(pipe, steps=2), reference)


def test_float32_blocks_pass_through_uncoded():
    pipe = flux_pipe()  # float32
    reference = generate(pipe, steps=2)
    backend = pipe.enable_layerwise_offload(device="cpu", compression="lossless")
    assert "lossless" not in backend.stats.store_blocks
    assert torch.equal(generate(pipe, steps=2), reference)
    pipe.disable_omni_offload()


def test_cli_compression_lossless_writes_the_same_image(tmp_path):
    from diffusers_omni.cli.main import main

    plain, coded = tmp_path / "plain.png", tmp_path / "coded.png"
    common = ["generate", "--model", "tiny-flux", "--dtype", "bfloat16", "--offload", "layerwise"]
    assert main([*common, "--output", str(plain)]) == 0
    assert main([*common, "--compression", "lossless", "--output", str(coded)]) == 0
    assert plain.read_bytes() == coded.read_bytes()


def test_distributed_allgather_refuses_compression_naming_the_way_out():
    from diffusers_omni.config.offload import DistributedLayerwiseOffloadConfig

    assert DistributedLayerwiseOffloadConfig(device="cpu", use_allgather=False, compression="lossless").compression
    with pytest.raises(ValueError, match=r"compression='lossless' with use_allgather=True is not built yet.*"
                                         r"use_allgather=False"):
        DistributedLayerwiseOffloadConfig(device="cpu", compression="lossless")


def test_lossless_enable_failing_part_way_rolls_back_from_the_coded_copy_exactly(monkeypatch):
    pipe = wan22_pipe()
    pipe.to(torch.bfloat16)
    reference = generate(pipe, steps=2)
    before = pipeline_snapshot(pipe)
    take, calls = LosslessStore.take, []

    def failing_take(self, journal):
        calls.append(self.weights.path)
        if len(calls) == 3:  # two blocks already coded and parked, their originals gone
            raise RuntimeError("injected failure while coding")
        take(self, journal)

    monkeypatch.setattr(LosslessStore, "take", failing_take)
    with pytest.raises(RuntimeError, match="injected failure while coding"):
        pipe.enable_layerwise_offload(device="cpu", compression="lossless")
    assert pipe.omni_offload_backend is None
    assert_same_snapshot(before, pipeline_snapshot(pipe))
    monkeypatch.setattr(LosslessStore, "take", take)
    assert torch.equal(generate(pipe, steps=2), reference)


def test_a_budget_that_keeps_everything_resident_codes_nothing():
    """Nothing streamed: the blocks are resident and plain (no decode on the step's path), as without compression."""
    pipe = flux_pipe()
    pipe.to(torch.bfloat16)
    reference = generate(pipe, steps=2)
    backend = pipe.enable_layerwise_offload(device="cpu", compression="lossless", max_device_memory="64GiB")
    stats = backend.stats
    assert stats.streamed_blocks == 0 and stats.resident_blocks > 0 and "lossless" not in stats.store_blocks
    assert stats.loads == 0
    for _ in range(2):
        assert torch.equal(generate(pipe, steps=2), reference)
    assert stats.loads == 0  # nothing moved, nothing decoded
    pipe.disable_omni_offload()


def _coded(numel: int, seed: int) -> tuple[CodedBlock, dict[torch.dtype, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    flat = {torch.bfloat16: (torch.randn(numel, generator=generator) * 0.02).to(torch.bfloat16),
            torch.float32: torch.randn(7, generator=generator)}
    return code_block(flat, torch.device("cpu"), lambda n: torch.empty(n, dtype=torch.uint8)), flat


def test_code_ring_reuses_its_buffers_in_turn_and_decodes_every_bit():
    """The code's device buffers (``CodeRing``), exercised on the CPU: made once, as large as the largest code it
    was told of, written in turn; each load decodes bit for bit; a code larger than planned remakes them."""
    ring = CodeRing(3)
    blocks = [_coded(numel, seed) for seed, numel in enumerate((4096, 9000, 2048, 9000, 5000))]
    for block, _ in blocks[:4]:
        ring.want(block.nbytes)
    largest = max(block.nbytes for block, _ in blocks[:4])
    transfers = Transfers(torch.device("cpu"))
    pointers = []
    for index, (block, flat) in enumerate(blocks[:4] * 2):
        buffers = {dtype: torch.full_like(tensor, 7) for dtype, tensor in flat.items()}
        ring.upload(block, block.buffer, buffers, transfers, None, None)
        assert all(torch.equal(buffers[dtype].view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                               tensor.view(torch.int16 if dtype == torch.bfloat16 else torch.int32))
                   for dtype, tensor in flat.items())
        assert [b.numel() for b in ring.buffers] == [largest] * 3
        pointers.append(ring.buffers[index % 3].data_ptr())
        assert torch.equal(ring.buffers[index % 3][:block.nbytes], block.buffer)  # this load's buffer, in turn
    assert len({b.data_ptr() for b in ring.buffers}) == 3 and set(pointers) == {b.data_ptr() for b in ring.buffers}
    assert ring.device_nbytes == 3 * largest
    bigger, flat = _coded(20000, 9)
    buffers = {dtype: torch.empty_like(tensor) for dtype, tensor in flat.items()}
    ring.upload(bigger, bigger.buffer, buffers, transfers, None, None)
    assert [b.numel() for b in ring.buffers] == [bigger.nbytes] * 3
    assert torch.equal(buffers[torch.bfloat16].view(torch.int16), flat[torch.bfloat16].view(torch.int16))
    with pytest.raises(ValueError, match="CodeRing count=0 is not allowed"):
        CodeRing(0)


def test_the_offload_sizes_one_code_ring_for_its_coded_blocks():
    """Every coded block told the offload's ring its size at enable (one buffer per window block, of the largest
    code); on the CPU none is made (the code decodes from the host buffer) and the report says nothing of it."""
    pipe = flux_pipe()
    pipe.to(torch.bfloat16)
    backend = pipe.enable_layerwise_offload(device="cpu", compression="lossless", prefetch_depth=2)
    state = backend._state
    ring = state.stores.code_ring
    coded = [b.store for row in state.streamed for b in row if b is not None and isinstance(b.store, LosslessStore)]
    assert coded and ring.count == 3 and ring.nbytes == max(store.block.nbytes for store in coded)
    generate(pipe, steps=1)
    assert ring.buffers == [] and backend.stats.code_buffers == 0
    assert "buffers of" not in str(pipe.omni_offload_report())
    pipe.disable_omni_offload()


def test_an_accelerator_plan_reserves_the_code_ring_at_the_bf16_size(monkeypatch):
    """On an accelerator the device plan reserves the code ring (one buffer per window block, at the largest coded
    block's bf16 size: codes are sized only once made); on the CPU, or without lossless, nothing."""
    pipe = flux_pipe()
    pipe.to(torch.bfloat16)
    backend = pipe.enable_layerwise_offload(device="cpu", compression="lossless")
    flat = [w for row in backend._state.weights for w in row]
    forced = [w.empty for w in flat]
    assert backend._code_ring_planned(backend._state, flat, forced) == 0  # the CPU decodes from the host buffers
    monkeypatch.setattr(backend, "device", torch.device("cuda"))
    largest = max(w.nbytes for w, f in zip(flat, forced) if not f)
    assert backend._code_ring_planned(backend._state, flat, forced) == 2 * largest
    monkeypatch.setattr(backend, "config", dataclasses.replace(backend.config, compression=None))
    assert backend._code_ring_planned(backend._state, flat, forced) == 0
    monkeypatch.undo()
    pipe.disable_omni_offload()


def test_a_block_gathered_where_it_is_coded_codes_to_the_same_bytes():
    """``current_flat(device)`` gathers a block's tensors straight into buffers on the coding device (an accelerator:
    no host copy first); on the CPU the coding device is the host (``None``) and both layouts are the same bytes."""
    from diffusers_omni.offload.coded_block import coding_device
    from diffusers_omni.offload.memory import PackedWeights

    block = torch.nn.Sequential(torch.nn.Linear(40, 24), torch.nn.LayerNorm(24)).eval()
    block[0].to(torch.bfloat16)
    weights = PackedWeights("block", block)
    assert coding_device(torch.device("cpu")) is None
    assert coding_device(torch.device("cuda", 1)) == torch.device("cuda", 1)
    host, there = weights.current_flat(), weights.current_flat(torch.device("cpu"))
    assert set(host) == {torch.bfloat16, torch.float32}
    assert all(torch.equal(host[d].view(torch.uint8), there[d].view(torch.uint8)) for d in host)
    coded = code_block(there, torch.device("cpu"), lambda n: torch.zeros(n, dtype=torch.uint8))  # padding zeroed
    assert torch.equal(coded.buffer, code_block(host, torch.device("cpu"),
                                                lambda n: torch.zeros(n, dtype=torch.uint8)).buffer)
    decoded = coded.decoded()
    assert all(torch.equal(decoded[d].view(torch.uint8), host[d].view(torch.uint8)) for d in host)
