"""``compression_cache_dir`` (#37 item 2): the lossless code written once per block, read back by later enables
after checking it against the model's weights, and read coded from disk by the blocks a host budget keeps off the
host — for a pipeline with no checkpoint files at all."""

from __future__ import annotations

import logging

import pytest
import torch

from diffusers_omni.config.offload import DistributedLayerwiseOffloadConfig, LayerwiseOffloadConfig
from diffusers_omni.offload import coded_cache
from diffusers_omni.offload.coded_cache import CodedCache
from diffusers_omni.offload.disk import CheckpointError
from diffusers_omni.offload.stores import CodedFileStore, LosslessStore
from offload_helpers import assert_same_snapshot, generate, pipeline_snapshot, wan22_pipe
from test_host_budget import COMPONENTS, _deep_flux, _host_bytes, _image, _state_dicts

pytestmark = pytest.mark.integration


def _bf16_flux():
    pipe = _deep_flux()
    pipe.to(torch.bfloat16)
    for module in pipe.components.values():
        if isinstance(module, torch.nn.Module):
            module.eval()
    return pipe


def _files(folder) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(folder.iterdir())}


def test_config_takes_a_folder_for_lossless_only_naming_the_field(tmp_path):
    config = LayerwiseOffloadConfig(device="cpu", compression="lossless", compression_cache_dir=tmp_path / "c")
    assert config.compression_cache_dir == str(tmp_path / "c")
    assert DistributedLayerwiseOffloadConfig(device="cpu", use_allgather=False, compression="lossless",
                                             compression_cache_dir=str(tmp_path)).compression_cache_dir
    with pytest.raises(ValueError, match=r"compression_cache_dir='.*' keeps the code of compression=\"lossless\", "
                                         r"but compression=None; allowed: compression=\"lossless\""):
        LayerwiseOffloadConfig(device="cpu", compression_cache_dir=tmp_path)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match=r"compression_cache_dir='.*file' is a file, not a folder"):
        LayerwiseOffloadConfig(device="cpu", compression="lossless", compression_cache_dir=tmp_path / "file")
    with pytest.raises(TypeError, match=r"compression_cache_dir must be a folder \(str or os.PathLike\) or None, got "
                                        r"int: 3"):
        LayerwiseOffloadConfig(device="cpu", compression="lossless", compression_cache_dir=3)
    with pytest.raises(ValueError, match="compression_cache_dir='' is empty"):
        LayerwiseOffloadConfig(device="cpu", compression="lossless", compression_cache_dir=" ")


def test_code_is_written_once_then_read_back_bitwise(tmp_path, monkeypatch):
    pipe = _bf16_flux()
    reference = _image(pipe)
    expected = _state_dicts(pipe)
    folder = tmp_path / "cache"
    backend = pipe.enable_layerwise_offload(device="cpu", compression="lossless", compression_cache_dir=folder)
    written = backend.stats.cache_counters
    coded_blocks = backend.stats.store_blocks["lossless"]
    assert written["cache blocks written"] == coded_blocks == len(list(folder.iterdir())) > 0
    assert written["cache blocks read"] == 0
    assert torch.equal(_image(pipe), reference)
    pipe.disable_omni_offload()
    files = _files(folder)

    # The next enable codes nothing: every block's code comes from its file.
    monkeypatch.setattr("diffusers_omni.offload.stores.lossless.code_block",
                        lambda *a, **k: pytest.fail("a cached block was coded again"))
    backend = pipe.enable_layerwise_offload(device="cpu", compression="lossless", compression_cache_dir=folder)
    counters = backend.stats.cache_counters
    assert counters["cache blocks read"] == coded_blocks and counters["cache blocks written"] == 0
    assert "compression_cache_dir" in str(pipe.omni_offload_report())
    for _ in range(2):
        assert torch.equal(_image(pipe), reference)
    actual = _state_dicts(pipe)
    assert all(torch.equal(actual[n][k], expected[n][k]) for n in COMPONENTS for k in expected[n])
    pipe.disable_omni_offload()
    assert _files(folder) == files  # nothing rewritten
    actual = _state_dicts(pipe)
    assert all(torch.equal(actual[n][k], expected[n][k]) for n in COMPONENTS for k in expected[n])
    assert torch.equal(_image(pipe), reference)


def test_changed_weights_or_a_damaged_file_are_coded_again_and_replaced(tmp_path, caplog):
    pipe = _bf16_flux()
    folder = tmp_path / "cache"
    pipe.enable_layerwise_offload(device="cpu", compression="lossless", compression_cache_dir=folder)
    pipe.disable_omni_offload()
    names = sorted(p.name for p in folder.iterdir())

    # Another model's weights in one block (a fused LoRA, say): that block only is coded again, with a warning.
    with torch.no_grad():
        pipe.transformer.transformer_blocks[0].attn.to_q.weight.mul_(2)
    # A damaged byte in another block's file: refused by the coded bytes' digest.
    damaged = folder / "transformer.single_transformer_blocks.1.safetensors"
    data = bytearray(damaged.read_bytes())
    data[-100] ^= 0xFF
    damaged.write_bytes(bytes(data))
    reference = _image(pipe)
    with caplog.at_level(logging.WARNING, logger="diffusers_omni"):
        backend = pipe.enable_layerwise_offload(device="cpu", compression="lossless", compression_cache_dir=folder)
    warnings = [r.getMessage() for r in caplog.records if "compression_cache_dir" in r.getMessage()]
    assert len(warnings) == 2, warnings
    assert any("coded from other weights" in w and "transformer.transformer_blocks.0" in w for w in warnings)
    assert any("not the ones written" in w and "single_transformer_blocks.1" in w for w in warnings)
    counters = backend.stats.cache_counters
    assert counters["cache blocks written"] == 2 and counters["cache files replaced"] == 2
    assert sorted(p.name for p in folder.iterdir()) == names  # replaced in place: no second copy, no temporary
    assert torch.equal(_image(pipe), reference)
    pipe.disable_omni_offload()


def test_host_budget_reads_coded_blocks_from_the_cache_without_a_checkpoint(tmp_path):
    pipe = _bf16_flux()  # built in memory: no checkpoint files (without the cache, such a budget is refused)
    reference = _image(pipe)
    expected = _state_dicts(pipe)
    budget = _host_bytes(pipe) * 3 // 5
    with pytest.raises(ValueError, match="not loaded from local safetensors files") as refusal:
        pipe.enable_layerwise_offload(device="cpu", max_host_memory=budget, compression="lossless")
    assert 'or compression="lossless" with compression_cache_dir' in str(refusal.value)  # the way out
    backend = pipe.enable_layerwise_offload(device="cpu", max_host_memory=budget, compression="lossless",
                                            compression_cache_dir=tmp_path)
    stats, state = backend.stats, backend._state
    on_disk = [b for row in state.streamed for b in row if b is not None and isinstance(b.store, CodedFileStore)]
    assert len(on_disk) == stats.disk_blocks > 0
    logical = sum(b.weights.nbytes for b in on_disk)
    assert stats.disk_bytes_per_pass < 0.75 * logical  # read coded
    assert stats.host_bytes + stats.staging_bytes + stats.shared_bytes <= budget
    for _ in range(2):
        assert torch.equal(_image(pipe), reference)
    assert stats.disk_reads >= 2 * stats.disk_blocks and stats.on_demand_loads == 0
    report = str(pipe.omni_offload_report())
    assert "read from compression_cache_dir, coded" in report and "disk (lossless): " in report
    actual = _state_dicts(pipe)  # state_dict() decodes the disk-backed blocks' code
    assert all(torch.equal(actual[n][k], expected[n][k]) for n in COMPONENTS for k in expected[n])
    pipe.disable_omni_offload()
    actual = _state_dicts(pipe)
    for name in COMPONENTS:
        for key, tensor in getattr(pipe, name).state_dict(keep_vars=True).items():
            assert type(tensor) in (torch.Tensor, torch.nn.Parameter) and not tensor.is_pinned(), key
            assert torch.equal(tensor, expected[name][key]), key
    assert torch.equal(_image(pipe), reference)


def test_wan22_experts_share_coded_buffers_at_the_least_budget(tmp_path):
    pipe = wan22_pipe()
    pipe.to(torch.bfloat16)
    reference = generate(pipe, steps=4)
    config = {"compression": "lossless", "compression_cache_dir": tmp_path}
    with pytest.raises(ValueError, match="is too small") as info:
        pipe.enable_layerwise_offload(device="cpu", max_host_memory=1, **config)
    least = int(str(info.value).split("at least ")[1].split(" ")[0])
    backend = pipe.enable_layerwise_offload(device="cpu", max_host_memory=least, **config)
    labels = [s.label for s in backend._state.disk.values()]
    assert any(label.startswith("transformer.") for label in labels)
    assert any(label.startswith("transformer_2.") for label in labels)
    assert all(s.coded is not None for s in backend._state.disk.values())
    for _ in range(2):
        assert torch.equal(generate(pipe, steps=4), reference)
    pipe.disable_omni_offload()
    assert torch.equal(generate(pipe, steps=4), reference)


def test_a_cache_file_changed_after_enabling_names_the_block(tmp_path):
    pipe = _bf16_flux()
    budget = _host_bytes(pipe) * 3 // 5
    backend = pipe.enable_layerwise_offload(device="cpu", max_host_memory=budget, compression="lossless",
                                            compression_cache_dir=tmp_path)
    source = next(iter(backend._state.disk.values()))
    path = backend._state.disk_reader.files[source.runs[0][0]]
    data = bytearray(path.read_bytes())
    data[source.runs[0][1]] ^= 0xFF  # the first coded byte: inside a checked window
    path.write_bytes(bytes(data))
    with pytest.raises(Exception) as info:
        _image(pipe)
    assert source.label in str(info.value) and "not the ones checked" in str(info.value)
    data[source.runs[0][1]] ^= 0xFF
    path.write_bytes(bytes(data))  # put back: the offload reads it again
    pipe.disable_omni_offload()


def test_a_failure_after_writing_the_cache_restores_the_pipeline_exactly(tmp_path, monkeypatch):
    pipe = _bf16_flux()
    reference = _image(pipe)
    before = pipeline_snapshot(pipe)
    take, calls = LosslessStore.take, []

    def failing_take(self, journal):
        calls.append(self.weights.path)
        if len(calls) == 3:
            raise RuntimeError("injected")
        take(self, journal)

    monkeypatch.setattr(LosslessStore, "take", failing_take)
    with pytest.raises(RuntimeError, match="injected"):
        pipe.enable_layerwise_offload(device="cpu", compression="lossless", compression_cache_dir=tmp_path)
    assert_same_snapshot(before, pipeline_snapshot(pipe))
    assert torch.equal(_image(pipe), reference)
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_digest_covers_every_byte_and_the_layout():
    pipe = _bf16_flux()
    backend = pipe.enable_layerwise_offload(device="cpu", compression="lossless")
    weights = backend._state.streamed[0][0].weights
    pipe.disable_omni_offload()
    first = coded_cache.weights_digest(weights)
    assert coded_cache.weights_digest(weights) == first
    tensor = weights.slots[-1].leaf.data()
    with torch.no_grad():
        flat = tensor.view(-1).view(torch.int16)
        flat[-1] ^= 1  # one bit of the last tensor
    assert coded_cache.weights_digest(weights) != first


def test_an_unwritable_folder_is_refused_naming_the_field(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(coded_cache.CacheError, match=r"compression_cache_dir='.*': cannot create the folder"):
        CodedCache(blocker / "sub")


def test_cli_compression_cache_dir_writes_the_same_image(tmp_path):
    from diffusers_omni.cli.main import main

    plain, cached = tmp_path / "plain.png", tmp_path / "cached.png"
    common = ["generate", "--model", "tiny-flux", "--dtype", "bfloat16", "--offload", "layerwise"]
    assert main([*common, "--output", str(plain)]) == 0
    flags = ["--compression", "lossless", "--compression-cache-dir", str(tmp_path / "cache"), "--overwrite"]
    for _ in range(2):  # written, then read
        assert main([*common, *flags, "--output", str(cached)]) == 0
        assert plain.read_bytes() == cached.read_bytes()
    assert any((tmp_path / "cache").iterdir())


def test_temporaries_of_unfinished_writes_are_removed_once_stale(tmp_path):
    import os
    import time

    stale = tmp_path / ".transformer.x.safetensors.abc.tmp"
    fresh = tmp_path / ".transformer.y.safetensors.def.tmp"
    for path in (stale, fresh):
        path.write_bytes(b"partial")
    old = time.time() - coded_cache.STALE_SECONDS - 60
    os.utime(stale, (old, old))
    CodedCache(tmp_path)
    assert not stale.exists() and fresh.exists()  # a write in progress elsewhere is left alone


def test_a_file_of_another_code_layout_is_coded_again(tmp_path, monkeypatch, caplog):
    pipe = _bf16_flux()
    pipe.enable_layerwise_offload(device="cpu", compression="lossless", compression_cache_dir=tmp_path)
    pipe.disable_omni_offload()
    monkeypatch.setattr(coded_cache, "CODE_LAYOUT", {**coded_cache.CODE_LAYOUT, "group": 4096})
    with caplog.at_level(logging.WARNING, logger="diffusers_omni"):
        backend = pipe.enable_layerwise_offload(device="cpu", compression="lossless", compression_cache_dir=tmp_path)
    assert backend.stats.cache_counters["cache blocks read"] == 0
    assert any("its code's layout is" in r.getMessage() for r in caplog.records)
    pipe.disable_omni_offload()


def _disk_paths(backend) -> set[str]:
    return {source.label for source in backend._state.disk.values()}


def test_host_budget_writes_only_the_blocks_it_reads_from_disk_then_reads_them_back(tmp_path, monkeypatch):
    pipe = _bf16_flux()
    reference = _image(pipe)
    budget = _host_bytes(pipe) * 3 // 5
    folder = tmp_path / "cache"
    config = {"device": "cpu", "max_host_memory": budget, "compression": "lossless", "compression_cache_dir": folder}
    backend = pipe.enable_layerwise_offload(**config)
    stats = backend.stats
    disk = _disk_paths(backend)
    kept = [b.weights.path for row in backend._state.streamed for b in row
            if b is not None and isinstance(b.store, LosslessStore)]
    assert disk and kept  # some blocks on disk, some coded in host memory
    # the folder holds the disk-backed blocks' code and nothing else: the others are coded into host memory only
    assert {p.name for p in folder.iterdir()} == {CodedCache(folder).path_of(path).name for path in disk}
    assert stats.cache_counters["cache blocks written"] == len(disk) and stats.cache_counters["cache blocks read"] == 0
    assert stats.host_bytes + stats.staging_bytes + stats.shared_bytes <= budget
    assert stats.cache_seconds["coding"] > 0 and stats.cache_seconds["writing"] > 0
    assert "compression_cache_dir: the enable's time on it: " in str(pipe.omni_offload_report())
    assert torch.equal(_image(pipe), reference)
    pipe.disable_omni_offload()
    files = _files(folder)

    # Again: the disk-backed blocks' code is read back (checked), not coded; nothing is written.
    coded = []
    code_block = coded_cache.code_block
    monkeypatch.setattr(coded_cache, "code_block", lambda *a, **k: coded.append(1) or code_block(*a, **k))
    backend = pipe.enable_layerwise_offload(**config)
    assert not coded and _disk_paths(backend) == disk
    assert backend.stats.cache_counters["cache blocks written"] == 0
    assert _files(folder) == files
    for _ in range(2):
        assert torch.equal(_image(pipe), reference)
    pipe.disable_omni_offload()

    # Without a budget every block is written; the files already there are read, not written again.
    backend = pipe.enable_layerwise_offload(device="cpu", compression="lossless", compression_cache_dir=folder)
    counters = backend.stats.cache_counters
    assert counters["cache blocks read"] == len(disk) and counters["cache blocks written"] == len(kept)
    pipe.disable_omni_offload()
    # A host-kept block whose file a no-budget enable wrote is read from it under the budget too.
    backend = pipe.enable_layerwise_offload(**config)
    counters = backend.stats.cache_counters
    assert counters["cache blocks read"] == len(kept) and counters["cache blocks written"] == 0
    assert torch.equal(_image(pipe), reference)
    pipe.disable_omni_offload()


def test_a_host_kept_blocks_stale_file_is_brought_up_to_date_warning_once(tmp_path, caplog):
    pipe = _bf16_flux()
    folder = tmp_path / "cache"
    pipe.enable_layerwise_offload(device="cpu", compression="lossless", compression_cache_dir=folder)
    pipe.disable_omni_offload()
    budget = _host_bytes(pipe) * 3 // 5
    config = {"device": "cpu", "max_host_memory": budget, "compression": "lossless", "compression_cache_dir": folder}
    backend = pipe.enable_layerwise_offload(**config)
    kept = next(b.weights.path for row in backend._state.streamed for b in row
                if b is not None and isinstance(b.store, LosslessStore))
    pipe.disable_omni_offload()
    module = pipe.transformer.get_submodule(kept.split(".", 1)[1])
    with torch.no_grad():
        next(p for p in module.parameters() if p.dtype == torch.bfloat16).mul_(2)
    reference = _image(pipe)
    with caplog.at_level(logging.WARNING, logger="diffusers_omni"):
        backend = pipe.enable_layerwise_offload(**config)
    warnings = [r.getMessage() for r in caplog.records if "compression_cache_dir" in r.getMessage()]
    assert len(warnings) == 1 and kept in warnings[0] and "coded from other weights" in warnings[0], warnings
    assert backend.stats.cache_counters["cache files replaced"] == 1  # the file says what the block now holds
    assert torch.equal(_image(pipe), reference)
    pipe.disable_omni_offload()
    backend = pipe.enable_layerwise_offload(**config)
    assert backend.stats.cache_counters["cache blocks written"] == 0
    pipe.disable_omni_offload()


def test_a_failed_write_stops_the_enable_leaving_whole_files_only(tmp_path, monkeypatch):
    pipe = _bf16_flux()
    reference = _image(pipe)
    before = pipeline_snapshot(pipe)
    budget = _host_bytes(pipe) * 3 // 5
    store, calls = CodedCache.store, []

    def failing_store(self, block, digest, coded):
        calls.append(block)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        return store(self, block, digest, coded)

    monkeypatch.setattr(CodedCache, "store", failing_store)
    folder = tmp_path / "cache"
    with pytest.raises(OSError, match="No space left"):
        pipe.enable_layerwise_offload(device="cpu", max_host_memory=budget, compression="lossless",
                                      compression_cache_dir=folder)
    assert_same_snapshot(before, pipeline_snapshot(pipe))
    assert torch.equal(_image(pipe), reference)
    assert [p.name for p in folder.iterdir()] == [CodedCache(folder).path_of(calls[0]).name]  # no temporary
    monkeypatch.setattr(CodedCache, "store", store)
    backend = pipe.enable_layerwise_offload(device="cpu", max_host_memory=budget, compression="lossless",
                                            compression_cache_dir=folder)
    assert backend.stats.cache_counters["cache blocks written"] == len(_disk_paths(backend)) - 1
    assert torch.equal(_image(pipe), reference)
    pipe.disable_omni_offload()
