"""Layerwise offload under a host-memory budget (``max_host_memory``, #29 item 2): streamed blocks that do not fit
keep no host copy and are read from their checkpoint's safetensors files at each load, through a staging ring and
one reader thread; everything that reads a host copy (state_dict, disable, rollback, the report) reads them too."""

from __future__ import annotations

import gc
import threading

import pytest
import torch
from diffusers import FluxTransformer2DModel

from diffusers_omni import LayerwiseOffloadConfig, apply_offload
from diffusers_omni.offload import disk, memory
from diffusers_omni.offload.host_plan import HostCandidate, plan_host_memory
from diffusers_omni.pipelines.flux import OmniFluxPipeline
from diffusers_omni.pipelines.wan import OmniWanPipeline

from offload_helpers import FakeCudaRuntime, assert_same_snapshot, flux_pipe, pipeline_snapshot, wan22_pipe

pytestmark = pytest.mark.integration

COMPONENTS = ("transformer", "text_encoder", "text_encoder_2", "vae")


def _deep_flux() -> OmniFluxPipeline:
    """The tiny FLUX pipeline with a 3 + 4 block transformer (room for blocks on disk and blocks in memory)."""
    pipe = flux_pipe()
    config = {**pipe.transformer.config, "num_layers": 3, "num_single_layers": 4}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        pipe.register_modules(transformer=FluxTransformer2DModel.from_config(config).eval())
    return pipe


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A saved deep FLUX pipeline: the transformer in several shards (an index), the encoders in single files."""
    folder = tmp_path_factory.mktemp("flux")
    _deep_flux().save_pretrained(folder, max_shard_size="300KB")
    assert (folder / "transformer" / "diffusion_pytorch_model.safetensors.index.json").is_file()
    return folder


def _load(folder, **kwargs) -> OmniFluxPipeline:
    pipe = OmniFluxPipeline.from_pretrained(folder, **kwargs)
    for module in pipe.components.values():
        if isinstance(module, torch.nn.Module):
            module.eval()
    return pipe


def _image(pipe) -> torch.Tensor:
    return pipe(prompt="a red fox in the snow", num_inference_steps=2, height=32, width=32,
                generator=torch.Generator().manual_seed(0), output_type="pt", max_sequence_length=32).images


def _host_bytes(pipe) -> int:
    """What layerwise offload keeps in host memory without a budget."""
    backend = pipe.enable_layerwise_offload(device="cpu")
    total = backend.stats.host_bytes
    pipe.disable_omni_offload()
    return total


def _state_dicts(pipe) -> dict[str, dict[str, torch.Tensor]]:
    return {name: {k: v.clone() for k, v in getattr(pipe, name).state_dict().items()} for name in COMPONENTS}


def _minimum(error: Exception) -> int:
    """The least ``max_host_memory`` a too-small budget's error names."""
    return int(str(error).split("at least ")[1].split(" ")[0])


def _readers(backend) -> threading.Thread:
    return backend._state.staging._thread


def _reader_threads() -> set[threading.Thread]:
    """Every disk reader thread of this process (other threads, tqdm's monitor say, may come and go)."""
    return {t for t in threading.enumerate() if t.name.startswith("diffusers-omni disk reader")}


def test_blocks_read_from_disk_bitwise_report_state_dict_and_disable(saved):
    pipe = _load(saved)
    reference = _image(pipe)
    expected = _state_dicts(pipe)
    budget = _host_bytes(pipe) * 3 // 4
    backend = pipe.enable_layerwise_offload(device="cpu", max_host_memory=budget)
    stats = backend.stats
    state = backend._state
    disk_paths = [b.weights.path for row in state.streamed for b in row if b is not None and b.store.name == "disk"]
    # Encoder blocks first, then DiT blocks; some DiT blocks keep their host copy.
    dit = [p for p in disk_paths if p.startswith("transformer.")]
    assert len(disk_paths) - len(dit) == 4 and 0 < len(dit) < 7
    assert stats.disk_blocks == len(disk_paths)
    assert stats.host_bytes + stats.staging_bytes <= budget
    reader = _readers(backend)
    assert reader.is_alive() and reader.daemon
    for _ in range(2):
        assert torch.equal(_image(pipe), reference)
    assert stats.disk_reads >= 2 * stats.disk_blocks and stats.disk_read_bytes >= 2 * stats.disk_bytes_per_pass
    assert stats.on_demand_loads == 0
    with torch.inference_mode():
        assert torch.equal(_image(pipe), reference)

    report = pipe.omni_offload_report()
    disk_bytes = sum(s.read_bytes for s in state.disk.values())
    assert sum(report[name].disk_bytes for name in COMPONENTS) == disk_bytes == stats.disk_bytes_per_pass
    assert report["transformer"].disk_bytes > 0 and report["vae"].disk_bytes == 0
    for name in COMPONENTS:  # one copy of each weight between calls: the non-block ones on the device
        entry = report[name]
        assert entry.device_bytes + entry.pageable_bytes + entry.disk_bytes == entry.weight_bytes
    assert any(note.startswith(f"disk: {stats.disk_blocks} streamed blocks have no host copy") for note in report.notes)
    assert "staging ring" in str(report)

    # state_dict() while enabled reads the disk-backed blocks from their files.
    for name, tensors in _state_dicts(pipe).items():
        assert tensors.keys() == expected[name].keys()
        assert all(torch.equal(tensors[k], expected[name][k]) for k in tensors), name
    assert torch.equal(_image(pipe), reference)

    pipe.disable_omni_offload()
    assert not reader.is_alive()
    for name in COMPONENTS:
        module = getattr(pipe, name)
        for key, tensor in module.state_dict(keep_vars=True).items():
            assert type(tensor) in (torch.Tensor, torch.nn.Parameter) and tensor.device.type == "cpu", key
            assert not tensor.is_pinned() and tensor.numel() == expected[name][key].numel(), key
            assert torch.equal(tensor, expected[name][key]), key
    assert torch.equal(_image(pipe), reference)


def test_budget_that_fits_reads_nothing_and_starts_no_thread(saved):
    pipe = _load(saved)
    threads = _reader_threads()
    backend = pipe.enable_layerwise_offload(device="cpu", max_host_memory=_host_bytes(pipe))
    assert backend.stats.disk_blocks == 0 and backend.stats.staging_bytes == 0
    assert backend._state.staging is None and backend._state.disk_reader is None
    assert backend._state.streamer.before_stack is None  # no reads to request: every block has a host copy
    assert backend.stats.store_blocks == {"pinned": backend.stats.streamed_blocks}
    assert _reader_threads() == threads
    pipe.disable_omni_offload()


def test_budget_too_small_states_the_minimum_which_then_works(saved):
    pipe = _load(saved)
    reference = _image(pipe)
    before = pipeline_snapshot(pipe)
    with pytest.raises(ValueError, match=r"max_host_memory=1 \(1 B\) is too small; allowed: at least (\d+) ") as info:
        pipe.enable_layerwise_offload(device="cpu", max_host_memory=1)
    message = str(info.value)
    assert "phase units" in message and "the staging ring, 3 ×" in message
    assert_same_snapshot(before, pipeline_snapshot(pipe))
    minimum = _minimum(info.value)
    backend = pipe.enable_layerwise_offload(device="cpu", max_host_memory=minimum)
    assert backend.stats.host_bytes + backend.stats.staging_bytes == minimum
    assert torch.equal(_image(pipe), reference)
    pipe.disable_omni_offload()
    assert torch.equal(_image(pipe), reference)


def test_a_pipeline_built_in_memory_is_refused_when_it_needs_disk_and_nothing_changes():
    pipe = _deep_flux()
    budget = _host_bytes(pipe) // 2
    before = pipeline_snapshot(pipe)
    threads = _reader_threads()
    with pytest.raises(ValueError, match="is too small") as info:
        pipe.enable_layerwise_offload(device="cpu", max_host_memory=budget)
    assert "not loaded from local safetensors files" in str(info.value)
    assert "'transformer'" in str(info.value) and "'text_encoder_2'" in str(info.value)
    assert_same_snapshot(before, pipeline_snapshot(pipe))
    assert _reader_threads() == threads


def test_weights_that_differ_from_their_files_are_refused(saved):
    pipe = _load(saved, dtype=torch.bfloat16)  # the files are float32
    budget = _host_bytes(pipe) * 3 // 4
    before = pipeline_snapshot(pipe)
    with pytest.raises(ValueError, match=r"max_host_memory: block 'text_encoder") as info:
        pipe.enable_layerwise_offload(device="cpu", max_host_memory=budget)
    message = str(info.value)
    assert "is torch.bfloat16 in the model but torch.float32 in" in message and "model.safetensors" in message
    assert "raise max_host_memory" in message and "save_pretrained" in message
    assert_same_snapshot(before, pipeline_snapshot(pipe))

    pipe = _load(saved)
    budget = _host_bytes(pipe) * 3 // 4
    backend = pipe.enable_layerwise_offload(device="cpu", max_host_memory=budget)
    path = next(s.label for s in backend._state.disk.values() if s.label.startswith("transformer."))
    pipe.disable_omni_offload()
    weight = next(p for p in pipe.transformer.get_submodule(path.removeprefix("transformer.")).parameters())
    weight.data[0] += 1  # as a fused LoRA would
    before = pipeline_snapshot(pipe)
    with pytest.raises(ValueError, match=f"block '{path}' of 'transformer': tensor .* holds other values than in "):
        pipe.enable_layerwise_offload(device="cpu", max_host_memory=budget)
    assert_same_snapshot(before, pipeline_snapshot(pipe))


def test_quantized_like_weights_keep_their_host_copy_and_the_error_says_so(saved):
    class Marked(torch.nn.Parameter):
        """A storage-carrying Parameter subclass, as GGUF's and bitsandbytes' weights are."""

    pipe = _load(saved)
    for block in pipe.transformer.transformer_blocks:
        linear = block.attn.to_q
        linear.weight = Marked(linear.weight.data.clone())  # a copy: not a view of the file any more
    with pytest.raises(ValueError, match="is too small") as info:
        pipe.enable_layerwise_offload(device="cpu", max_host_memory=1)
    assert ("3 blocks: its weights are Marked tensors (quantized weights are read from disk only while they are "
            "views of the file they were loaded from, as load_gguf_mmap loads a GGUF file and from_pretrained maps a "
            "torchao checkpoint; these are copies, so they keep their host copy)") in str(info.value)


def test_subclass_weights_that_are_views_of_their_file_are_read_back_from_it(saved):
    """from_pretrained maps safetensors files: a subclass made around the mapped bytes (no copy) is still a view of
    the file, so its block is read back from there (by address, not by name) like any other."""

    class Marked(torch.nn.Parameter):
        pass

    pipe = _load(saved)
    reference = _image(pipe)
    for block in pipe.transformer.transformer_blocks:
        linear = block.attn.to_q
        linear.weight = Marked(linear.weight.data)
    budget = _host_bytes(_load(saved)) * 3 // 4  # another pipeline: disabling leaves copies, not views of the file
    backend = pipe.enable_layerwise_offload(device="cpu", max_host_memory=budget)
    dit = [s for s in backend._state.disk.values() if s.label.startswith("transformer.transformer_blocks.")]
    assert dit and backend.stats.disk_blocks >= len(dit)
    for _ in range(2):
        assert torch.equal(_image(pipe), reference)
    pipe.disable_omni_offload()
    assert all(type(b.attn.to_q.weight) is Marked for b in pipe.transformer.transformer_blocks)
    assert torch.equal(_image(pipe), reference)


def test_reader_thread_stops_on_disable_and_when_the_pipeline_is_collected(saved, monkeypatch):
    runtime = FakeCudaRuntime()  # registered host memory, so the staging ring's pinning is checked too
    monkeypatch.setattr(memory, "host_pinner", lambda device: runtime)
    pipe = _load(saved)
    budget = _host_bytes(pipe) * 3 // 4
    backend = pipe.enable_layerwise_offload(device="cpu", max_host_memory=budget)
    staging = backend._state.staging
    assert {slot.address for slot in staging.slots} <= set(runtime.registered)
    reader = _readers(backend)
    pipe.disable_omni_offload()
    assert not reader.is_alive() and runtime.registered == {}

    backend = pipe.enable_layerwise_offload(device="cpu", max_host_memory=budget)
    _image(pipe)
    reader = _readers(backend)
    assert reader.is_alive() and runtime.registered
    del pipe, backend, staging
    gc.collect()
    reader.join(timeout=10)
    assert not reader.is_alive() and runtime.registered == {}


def test_a_failing_read_names_the_block_and_leaves_no_hung_thread(saved, monkeypatch):
    pipe = _load(saved)
    reference = _image(pipe)
    budget = _host_bytes(pipe) * 3 // 4
    backend = pipe.enable_layerwise_offload(device="cpu", max_host_memory=budget)
    reader = _readers(backend)
    original = disk.read_pieces

    def failing(*args, **kwargs):
        raise OSError(5, "Input/output error (injected)")

    monkeypatch.setattr(disk, "read_pieces", failing)
    with pytest.raises(disk.DiskReadError, match=r"reading block '[\w.]+' of '\w+' from [\w.-]+safetensors.* failed "
                                                 r"\(OSError: \[Errno 5\] Input/output error \(injected\)\)"):
        _image(pipe)
    assert reader.is_alive()  # waiting for the next request, not stuck
    monkeypatch.setattr(disk, "read_pieces", original)
    assert torch.equal(_image(pipe), reference)  # the next call reads again
    pipe.disable_omni_offload()
    assert not reader.is_alive()
    assert torch.equal(_image(pipe), reference)

    # A read failing while enabling (the first blocks load at the end of enable) rolls everything back.
    before = pipeline_snapshot(pipe)
    threads = _reader_threads()
    monkeypatch.setattr(disk, "read_pieces", failing)
    monkeypatch.setattr(disk, "verify_block", lambda source, reader, views=None: source.drop_tensors())
    monkeypatch.setattr("diffusers_omni.offload.stores.file.verify_block", disk.verify_block)
    with pytest.raises(disk.DiskReadError, match="reading block 'transformer"):
        pipe.enable_layerwise_offload(device="cpu", max_host_memory=budget)
    assert_same_snapshot(before, pipeline_snapshot(pipe))
    assert _reader_threads() == threads


def test_bare_model_loaded_from_its_folder(saved):
    model = FluxTransformer2DModel.from_pretrained(saved / "transformer").eval()
    from offload_helpers import flux_inputs

    with torch.no_grad():
        reference = model(**flux_inputs())[0]
    host = apply_offload(model, LayerwiseOffloadConfig(device="cpu"))
    total = host.stats.host_bytes
    host.disable()
    backend = apply_offload(model, LayerwiseOffloadConfig(device="cpu", max_host_memory=total * 3 // 4))
    assert backend.stats.disk_blocks > 0
    with torch.no_grad():
        for _ in range(2):
            assert torch.equal(model(**flux_inputs())[0], reference)
    backend.disable()
    with torch.no_grad():
        assert torch.equal(model(**flux_inputs())[0], reference)


def test_wan22_both_experts_read_blocks_from_disk(tmp_path):
    wan22_pipe().save_pretrained(tmp_path)
    pipe = OmniWanPipeline.from_pretrained(tmp_path)
    for module in pipe.components.values():
        if isinstance(module, torch.nn.Module):
            module.eval()
    call = {"prompt": "a red fox", "num_inference_steps": 4, "height": 32, "width": 32, "num_frames": 5,
            "output_type": "pt", "max_sequence_length": 32}
    reference = pipe(**call, generator=torch.Generator().manual_seed(0)).frames
    with pytest.raises(ValueError, match="is too small") as info:
        pipe.enable_layerwise_offload(device="cpu", max_host_memory=1)
    budget = _minimum(info.value)  # every block on disk
    backend = pipe.enable_layerwise_offload(device="cpu", max_host_memory=budget)
    labels = [s.label for s in backend._state.disk.values()]
    assert any(label.startswith("transformer.") for label in labels)
    assert any(label.startswith("transformer_2.") for label in labels)
    for _ in range(2):
        assert torch.equal(pipe(**call, generator=torch.Generator().manual_seed(0)).frames, reference)
    assert backend.stats.disk_reads > 0
    pipe.disable_omni_offload()
    assert torch.equal(pipe(**call, generator=torch.Generator().manual_seed(0)).frames, reference)


def test_plan_takes_encoder_blocks_first_then_spreads_dit_blocks_over_the_stacks():
    encoder = [HostCandidate(f"e{i}", f"e{i}", 10, 0, True) for i in range(2)]
    first = [HostCandidate(f"a{i}", f"a{i}", 10, 1, False) for i in range(8)]
    second = [HostCandidate(f"b{i}", f"b{i}", 10, 2, False) for i in range(4)]
    quantized = HostCandidate("q", "q", 10, 1, False, reason="quantized")
    candidates = encoder + first + second + [quantized]

    def chosen(budget: int) -> list[str]:
        return [c.key for c in plan_host_memory(candidates, {"phase units": 5}, budget, 3).disk]

    # Host copies: 5 + 15 × 10 = 155. A ring of three 10-byte buffers only pays off from four blocks on disk.
    assert chosen(155) == []
    assert chosen(154) == ["e0", "e1", "a4", "b2"]  # two DiT blocks shared by the stacks' sizes (8 and 4)
    assert chosen(75) == ["e0", "e1", "a0", "a2", "a3", "a4", "a6", "a7", "b0", "b2", "b3"]  # 9 of 12, spread
    with pytest.raises(ValueError, match=r"max_host_memory=10 \(10 B\) is too small; allowed: at least 45 \(45 B\) = "
                                         r"phase units 5 B \+ 1 streamed blocks that keep their host copy 10 B \+ the "
                                         r"staging ring, 3 × 10 B \(the largest of the 14 blocks read from disk\)\. "
                                         r"Blocks that cannot be read from disk keep their host copy: 1 block: "
                                         r"quantized$"):
        plan_host_memory(candidates, {"phase units": 5}, 10, 3)


def test_a_transformer_loaded_as_mmap_views_reads_its_blocks_from_its_files(saved):
    """The low-RAM way to load a big DiT (``load_transformer_mmap``: weights are views of the checkpoint, no
    anonymous copy) records its folder as from_pretrained does, so a host budget can send its blocks to disk."""
    import re

    from diffusers_omni.offload.loading import load_transformer_mmap

    reference = _image(_load(saved))
    pipe = _load(saved)
    pipe.transformer = load_transformer_mmap(FluxTransformer2DModel, saved, subfolder="transformer").eval()
    assert pipe.transformer.config._name_or_path == str(saved / "transformer")
    with pytest.raises(ValueError, match="max_host_memory=1 ") as error:
        pipe.enable_layerwise_offload(device="cpu", max_host_memory=1)
    least = int(re.search(r"at least (\d+)", str(error.value)).group(1))
    backend = pipe.enable_layerwise_offload(device="cpu", max_host_memory=least)
    report = pipe.omni_offload_report()
    assert report["transformer"].bytes["disk"] > 0 and report["transformer"].pageable_bytes == 0
    for _ in range(2):
        assert torch.equal(_image(pipe), reference)
    assert backend.stats.disk_reads > 0
    pipe.disable_omni_offload()
    assert torch.equal(_image(pipe), reference)


def _spy_verify(monkeypatch) -> list[tuple[str, int]]:
    """``(component, bytes compared)`` for every block ``verify_block`` checks."""
    from diffusers_omni.offload.stores import file as file_store

    compared = []
    original = file_store.verify_block

    def spy(source, reader, views=None):
        compared.append((source.component, original(source, reader, views)))
        return compared[-1][1]

    monkeypatch.setattr(file_store, "verify_block", spy)
    return compared


def _least_host_budget(pipe) -> int:
    import re

    with pytest.raises(ValueError, match="max_host_memory=1 ") as error:
        pipe.enable_layerwise_offload(device="cpu", max_host_memory=1)
    return int(re.search(r"at least (\d+)", str(error.value)).group(1))


def test_mmap_views_of_the_files_are_not_read_to_be_checked(saved, monkeypatch):
    # A tensor that is an untouched view of the very bytes it would be compared with is those bytes.
    from diffusers_omni.offload.loading import load_transformer_mmap

    compared = _spy_verify(monkeypatch)
    pipe = _load(saved)
    reference = _image(pipe)
    with torch.no_grad():
        for parameter in pipe.transformer.parameters():  # private copies: each one is compared
            parameter.data = parameter.data.clone()
    pipe.enable_layerwise_offload(device="cpu", max_host_memory=_least_host_budget(pipe))
    mine = [nbytes for component, nbytes in compared if component == "transformer"]
    assert mine and all(nbytes > 0 for nbytes in mine)
    pipe.disable_omni_offload()
    compared.clear()
    pipe = _load(saved)
    pipe.transformer = load_transformer_mmap(FluxTransformer2DModel, saved, subfolder="transformer").eval()
    backend = pipe.enable_layerwise_offload(device="cpu", max_host_memory=_least_host_budget(pipe))
    mine = [nbytes for component, nbytes in compared if component == "transformer"]
    assert backend.stats.disk_blocks > 0 and mine and all(nbytes == 0 for nbytes in mine)
    assert torch.equal(_image(pipe), reference)
    pipe.disable_omni_offload()


def test_mmap_views_changed_in_place_are_compared_and_refused(saved):
    # Writing into a private mapping copies the page: the mapping holds anonymous pages, so its tensors are no longer
    # taken for the file's bytes and the comparison finds the change.
    from diffusers_omni.offload.loading import CheckpointError, load_transformer_mmap

    pipe = _load(saved)
    pipe.transformer = load_transformer_mmap(FluxTransformer2DModel, saved, subfolder="transformer").eval()
    budget = _least_host_budget(pipe)
    with torch.no_grad():
        for block in [*pipe.transformer.transformer_blocks, *pipe.transformer.single_transformer_blocks]:
            next(block.parameters()).view(-1)[0] += 1
    before = pipeline_snapshot(pipe)
    with pytest.raises(CheckpointError, match="holds other values than in"):
        pipe.enable_layerwise_offload(device="cpu", max_host_memory=budget)
    assert_same_snapshot(before, pipeline_snapshot(pipe))


def _rss_peak_while(action, field: str = "VmRSS") -> tuple[int, int]:
    """``(RSS before, peak RSS while action runs)`` in bytes, sampled from ``/proc/self/status``'s ``field`` every
    2 ms."""
    def rss() -> int:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(f"{field}:"):
                    return int(line.split()[1]) * 1024
        raise AssertionError(f"no {field} in /proc/self/status")

    peak, done = [0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], rss())
            done.wait(0.002)

    gc.collect()
    before = rss()
    thread = threading.Thread(target=sample)
    thread.start()
    try:
        action()
    finally:
        done.set()
        thread.join()
    return before, max(peak[0], rss())


def test_enabling_an_mmap_loaded_model_does_not_hold_its_file_pages(tmp_path):
    # Packing copies a block from the file's pages and then gives those pages back; the blocks read from disk are
    # not read to be checked. So enabling holds about the host copies, not the copies plus the whole file.
    from diffusers_omni.offload.loading import load_transformer_mmap

    config = dict(num_layers=2, num_single_layers=6, attention_head_dim=64, num_attention_heads=12,
                  joint_attention_dim=256, pooled_projection_dim=64, in_channels=16)
    torch.manual_seed(0)
    FluxTransformer2DModel(**config).to(torch.bfloat16).save_pretrained(tmp_path / "transformer")
    pipe = flux_pipe()
    pipe.transformer = load_transformer_mmap(FluxTransformer2DModel, tmp_path, subfolder="transformer",
                                             torch_dtype=torch.bfloat16).eval()
    model_bytes = sum(p.numel() * p.element_size() for p in pipe.transformer.parameters())
    assert model_bytes > 150 << 20
    budget = _least_host_budget(pipe)
    backends = []
    before, peak = _rss_peak_while(
        lambda: backends.append(pipe.enable_layerwise_offload(device="cpu", max_host_memory=budget)))
    backend = backends[0]
    disk_bytes = backend.stats.disk_bytes_per_pass
    assert disk_bytes > model_bytes // 3
    # Without giving pages back the peak would reach the host copies plus the whole model's file pages.
    assert peak - before < budget + model_bytes // 8, (peak - before, budget, model_bytes)
    pipe.disable_omni_offload()


def test_a_failed_enable_after_file_pages_were_given_back_leaves_the_model_exactly_as_it_was(saved, monkeypatch):
    # Packing gave the transformer's mmap pages back before the VAE's pack failed: the rollback puts the mapped
    # tensors back, and their pages read from the file again, the same bytes.
    from diffusers_omni.offload.loading import load_transformer_mmap
    from diffusers_omni.offload.memory import PackedWeights

    pipe = _load(saved)
    pipe.transformer = load_transformer_mmap(FluxTransformer2DModel, saved, subfolder="transformer").eval()
    reference = _image(pipe)
    before = pipeline_snapshot(pipe)
    released = []
    original_release = disk.FileViews.release

    def spy(self, tensors):
        released.append(original_release(self, tensors))
        return released[-1]

    original_pack = PackedWeights.pack

    def pack(self, host_memory, release=None):
        if self.path == "vae":
            raise MemoryError("no host memory for the VAE (injected)")
        return original_pack(self, host_memory, release)

    monkeypatch.setattr(disk.FileViews, "release", spy)
    monkeypatch.setattr(PackedWeights, "pack", pack)
    with pytest.raises(MemoryError, match="injected"):
        pipe.enable_layerwise_offload(device="cpu")
    assert sum(released) > 0  # pages of the mapped transformer were given back before the failure
    assert_same_snapshot(before, pipeline_snapshot(pipe))
    assert torch.equal(_image(pipe), reference)


def test_plan_shares_buffers_between_alternating_dits_after_the_encoders_and_before_reading_every_load():
    encoder = [HostCandidate(f"e{i}", f"e{i}", 10, 0, True) for i in range(4)]
    high = [HostCandidate(f"a{i}", f"a{i}", 20, 1, False, group=0, position=i) for i in range(4)]
    low = [HostCandidate(f"b{i}", f"b{i}", 20, 2, False, group=0, position=i) for i in range(4)]
    candidates = encoder + high + low

    def plan(budget: int):
        found = plan_host_memory(candidates, {"phase units": 5}, budget, 2)
        return [c.key for c in found.disk], [[c.key for c in group] for group in found.shared]

    # Host copies: 5 + 4 × 10 + 8 × 20 = 205. The encoders go to disk first (ring of 2 × 10): 5 + 20 + 160 = 185.
    assert plan(205) == ([], [])
    assert plan(185) == (["e0", "e1", "e2", "e3"], [])
    # Then positions of the two experts share one buffer each, evenly spread: each frees 20 bytes.
    assert plan(165) == (["e0", "e1", "e2", "e3"], [["a2", "b2"]])
    assert plan(105) == (["e0", "e1", "e2", "e3"], [["a0", "b0"], ["a1", "b1"], ["a2", "b2"], ["a3", "b3"]])
    # Below that, shared positions are read at every load (both blocks; the ring grows to the largest, 20).
    assert plan(104) == (["e0", "e1", "e2", "e3", "a1", "b1", "a3", "b3"], [["a0", "b0"], ["a2", "b2"]])
    with pytest.raises(ValueError, match=r"at least 45 \(45 B\) = phase units 5 B \+ the staging ring, 2 × 20 B"):
        plan(44)


def _saved_wan22(folder) -> OmniWanPipeline:
    wan22_pipe().save_pretrained(folder)
    pipe = OmniWanPipeline.from_pretrained(folder)
    for module in pipe.components.values():
        if isinstance(module, torch.nn.Module):
            module.eval()
    pipe.register_to_config(boundary_ratio=0.8)  # of 4 steps (999, 900, 750, 500): two per expert
    return pipe


WAN_CALL = {"prompt": "a red fox", "num_inference_steps": 4, "height": 32, "width": 32, "num_frames": 5,
            "output_type": "pt", "max_sequence_length": 32}


def _wan_budgets(pipe) -> tuple[int, int, int]:
    """(host bytes without a budget, the encoders' streamed block bytes and the bytes of a ring of their largest,
    the low-noise expert's streamed block bytes)."""
    from diffusers_omni.offload.discovery import ENCODER

    backend = pipe.enable_layerwise_offload(device="cpu")
    state = backend._state
    encoder = [w.nbytes for row, kinds, resident in zip(state.weights, state.kinds, state.resident)
               if kinds == ENCODER for w, r in zip(row, resident) if not r and not w.empty]
    low = sum(b.weights.nbytes for stack, row in zip(state.stacks, state.streamed) if stack.owner is pipe.transformer_2
              for b in row if b is not None)
    total = backend.stats.host_bytes
    pipe.disable_omni_offload()
    ring = min(4, len(encoder)) * max(encoder)  # prefetch_depth 2 + 2 buffers
    return total, sum(encoder) - ring, low


def test_wan22_experts_share_host_buffers_read_once_per_switch_of_expert(tmp_path):
    pipe = _saved_wan22(tmp_path)
    reference = pipe(**WAN_CALL, generator=torch.Generator().manual_seed(0)).frames
    total, encoder_saved, low = _wan_budgets(pipe)
    budget = total - encoder_saved - low  # every encoder block on disk, every expert position shared
    backend = pipe.enable_layerwise_offload(device="cpu", max_host_memory=budget)
    stats, state = backend.stats, backend._state
    positions = sum(1 for b in state.streamed[[s.owner for s in state.stacks].index(pipe.transformer)] if b)
    assert stats.shared_buffers == positions and stats.shared_blocks == 2 * positions
    assert {s.component for s in state.disk.values() if s.home is None} == {"text_encoder"}
    assert stats.host_bytes + stats.staging_bytes + stats.shared_bytes <= budget

    order: list[str] = []
    for name in ("transformer", "transformer_2"):
        getattr(pipe, name).register_forward_pre_hook(lambda *_, n=name: order.append(n))
    for _ in range(2):
        assert torch.equal(pipe(**WAN_CALL, generator=torch.Generator().manual_seed(0)).frames, reference)
    runs = 1 + sum(1 for a, b in zip(order, order[1:]) if a != b)  # stretches of one expert
    assert set(order) == {"transformer", "transformer_2"} and runs == 4  # high, low; high, low
    # A block is read into its shared buffer at the first forward of each stretch; every other load finds it there.
    assert stats.shared_hits == positions * (len(order) - runs)
    report = pipe.omni_offload_report()
    assert any(note.startswith(f"shared: {2 * positions} blocks of the alternating DiTs share {positions} buffers")
               for note in report.notes)
    pipe.disable_omni_offload()
    assert torch.equal(pipe(**WAN_CALL, generator=torch.Generator().manual_seed(0)).frames, reference)


def test_wan22_experts_called_in_turn_read_their_blocks_back_each_time_and_stay_exact(tmp_path):
    """The declaration says the experts alternate by step; calling them in turn (not how the pipeline runs them)
    only costs reads: every output is the model's own."""
    pipe = _saved_wan22(tmp_path)
    captured = {}

    def capture(module, args, kwargs):
        captured.setdefault("call", (args, kwargs))

    handle = pipe.transformer.register_forward_pre_hook(capture, with_kwargs=True)
    pipe(**WAN_CALL, generator=torch.Generator().manual_seed(0))
    handle.remove()
    args, kwargs = captured["call"]
    with torch.no_grad():
        expected = {name: getattr(pipe, name)(*args, **kwargs)[0] for name in ("transformer", "transformer_2")}
    total, encoder_saved, low = _wan_budgets(pipe)
    backend = pipe.enable_layerwise_offload(device="cpu", max_host_memory=total - encoder_saved - low)
    assert backend.stats.shared_buffers > 0
    reads = []
    with torch.no_grad():
        for name in ("transformer", "transformer_2") * 3:
            assert torch.equal(getattr(pipe, name)(*args, **kwargs)[0], expected[name]), name
            reads.append(backend.stats.disk_reads)
    # Enabling loaded each expert's first blocks; from then on each call reads its blocks back into the buffers.
    assert all(later > earlier for earlier, later in zip(reads[1:], reads[2:]))
    pipe.disable_omni_offload()


def test_alternating_dits_must_be_declared_dits():
    from diffusers_omni.offload.discovery import discover_components

    pipe = wan22_pipe()
    assert [c.path for c in discover_components(pipe).alternating] == ["transformer", "transformer_2"]

    class Wrong(OmniWanPipeline):
        _alternating_dits = ("transformer", "unet")

    pipe.__class__ = Wrong
    with pytest.raises(ValueError, match=r"Wrong\._alternating_dits names \['unet'\], which are not among its "
                                         r"_dit_modules \['transformer', 'transformer_2'\]"):
        discover_components(pipe)


def test_torchao_checkpoint_loaded_by_from_pretrained_reads_its_quantized_blocks_back_from_the_bin(tmp_path):
    """Diffusers saves torchao weights pickled (``diffusion_pytorch_model.bin``) and ``from_pretrained`` loads them
    with ``torch.load(mmap=True)``: the quantized weights' inner tensors are views of the file, so under a host
    budget their blocks are read back from it at their packed size, bitwise."""
    import quant_helpers as qh
    from diffusers import TorchAoConfig
    from torchao.quantization import Int8WeightOnlyConfig

    config = TorchAoConfig(Int8WeightOnlyConfig())
    plain = tmp_path / "plain"
    qh.unquantized("flux").save_pretrained(plain)
    FluxTransformer2DModel.from_pretrained(plain, quantization_config=config).save_pretrained(
        tmp_path / "quantized", safe_serialization=False)
    assert (tmp_path / "quantized" / "diffusion_pytorch_model.bin").is_file()

    def load():  # the folder's config names its quantization
        return FluxTransformer2DModel.from_pretrained(tmp_path / "quantized", use_safetensors=False).eval()

    model = load()
    kinds = {type(m.weight).__name__ for _, m in qh.quantized_linears(model)}
    assert kinds == {"Int8Tensor"}
    reference = qh.run(model, "flux")
    with pytest.raises(ValueError, match="is too small") as info:
        apply_offload(load(), LayerwiseOffloadConfig(device="cpu", max_host_memory=1))
    assert "tensor subclasses" not in str(info.value)  # no block has to keep its host copy
    backend = apply_offload(model, LayerwiseOffloadConfig(device="cpu", max_host_memory=_minimum(info.value)))
    quantized_on_disk = [s for s in backend._state.disk.values()
                         if any(p.name.endswith(("qdata", "scale")) for p in s.pieces)]
    assert quantized_on_disk and all(p.length for s in quantized_on_disk for p in s.pieces)
    assert {backend._state.disk_reader.files[p.file].name for s in quantized_on_disk for p in s.pieces} == {
        "diffusion_pytorch_model.bin"}
    for _ in range(2):
        assert all(torch.equal(a, b) for a, b in zip(qh.run(model, "flux"), reference))
    assert backend.stats.disk_reads > 0
    backend.disable()
    assert {type(m.weight).__name__ for _, m in qh.quantized_linears(model)} == kinds
    assert all(torch.equal(a, b) for a, b in zip(qh.run(model, "flux"), reference))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gguf_loaded_with_load_gguf_mmap_reads_its_quantized_blocks_back_from_the_gguf_file(tmp_path, dtype):
    """``from_single_file`` copies a GGUF file's tensors; ``load_gguf_mmap`` keeps them views of the file, so under
    a host budget the quantized blocks are read back from the ``.gguf`` at their packed size. In bfloat16 the
    file's float32 norms and biases are converted while loading (copies): each block keeps those on the host."""
    import quant_helpers as qh
    from diffusers_omni.offload.loading import load_gguf_mmap
    from diffusers_omni.testing.quantized import write_gguf_checkpoint

    plain = qh.unquantized("flux")
    plain.save_config(tmp_path)
    write_gguf_checkpoint(plain, tmp_path / "flux.gguf", prefer="Q4_K")

    def load():
        return load_gguf_mmap(type(plain), tmp_path / "flux.gguf", tmp_path, compute_dtype=dtype,
                              torch_dtype=dtype).eval()

    model = load()
    assert {type(m.weight).__name__ for _, m in qh.quantized_linears(model)} == {"GGUFParameter"}
    inputs = [{k: v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
               for k, v in qh.inputs("flux", seed).items()} for seed in (0, 1)]
    with torch.no_grad():
        reference = [model(**i)[0] for i in inputs]
    with pytest.raises(ValueError, match="is too small") as info:
        apply_offload(load(), LayerwiseOffloadConfig(device="cpu", max_host_memory=1))
    assert "Blocks that cannot be read from disk" not in str(info.value)  # every block can
    backend = apply_offload(model, LayerwiseOffloadConfig(device="cpu", max_host_memory=_minimum(info.value)))
    sources = list(backend._state.disk.values())
    assert sources and {backend._state.disk_reader.files[p.file].name for s in sources for p in s.pieces} == {
        "flux.gguf"}
    kept = sum(s.kept_bytes for s in sources)
    assert (kept > 0) == (dtype == torch.bfloat16)
    assert all(s.kept_bytes * 4 < s.read_bytes for s in sources)  # the quantized bytes come from the file
    with torch.no_grad():
        for _ in range(2):
            assert all(torch.equal(model(**i)[0], r) for i, r in zip(inputs, reference))
    assert backend.stats.disk_reads > 0
    backend.disable()
    assert {type(m.weight).__name__ for _, m in qh.quantized_linears(model)} == {"GGUFParameter"}
    with torch.no_grad():
        assert all(torch.equal(model(**i)[0], r) for i, r in zip(inputs, reference))


def test_wan22_shared_buffers_are_pinned_with_the_rest_read_state_dict_from_files_and_survive_a_failed_read(
        tmp_path, monkeypatch):
    """Shared buffers are registered with the offload's other host memory and unregistered on disable;
    ``state_dict()`` reads their blocks from the files; a read that fails into a shared buffer names the block and
    the next call, once the disk is back, is exact again."""
    runtime = FakeCudaRuntime()
    monkeypatch.setattr(memory, "host_pinner", lambda device: runtime)
    pipe = _saved_wan22(tmp_path)
    reference = pipe(**WAN_CALL, generator=torch.Generator().manual_seed(0)).frames
    expected = {k: v.clone() for k, v in pipe.transformer_2.state_dict().items()}
    total, encoder_saved, low = _wan_budgets(pipe)
    backend = pipe.enable_layerwise_offload(device="cpu", max_host_memory=total - encoder_saved - low)
    homes = backend._state.staging.homes
    assert homes and {home.address for home in homes} <= set(runtime.registered)
    tensors = pipe.transformer_2.state_dict()
    assert tensors.keys() == expected.keys() and all(torch.equal(tensors[k], expected[k]) for k in tensors)

    original = disk.read_pieces
    reader = backend._state.disk_reader
    experts = {fd for fd, file in zip(reader.fds, reader.files) if file.parent.name.startswith("transformer")}

    def failing(fd, *args, **kwargs):  # the experts' files fail; the text encoder's read as before
        if fd in experts:
            raise OSError(5, "Input/output error (injected)")
        return original(fd, *args, **kwargs)

    monkeypatch.setattr(disk, "read_pieces", failing)
    with pytest.raises(disk.DiskReadError, match=r"reading block 'transformer(_2)?\.blocks\.\d+' of "
                                                 r"'transformer(_2)?' from .* failed"):
        pipe(**WAN_CALL, generator=torch.Generator().manual_seed(0))
    monkeypatch.setattr(disk, "read_pieces", original)
    for _ in range(2):
        assert torch.equal(pipe(**WAN_CALL, generator=torch.Generator().manual_seed(0)).frames, reference)
    pipe.disable_omni_offload()
    assert runtime.registered == {}
    assert torch.equal(pipe(**WAN_CALL, generator=torch.Generator().manual_seed(0)).frames, reference)


def test_a_larger_host_budget_never_plans_more_disk_traffic():
    """Across budgets, the plan's reads per call never grow with the budget: an encoder block read once per call,
    a shared position twice (once per switch of expert), a block read at every load once per forward (ten here)."""
    encoder = [HostCandidate(f"e{i}", f"e{i}", 7, 0, True) for i in range(6)]
    high = [HostCandidate(f"a{i}", f"a{i}", 20 + i % 3, 1, False, group=0, position=i) for i in range(9)]
    low = [HostCandidate(f"b{i}", f"b{i}", 20 + i % 2, 2, False, group=0, position=i) for i in range(9)]
    lone = [HostCandidate(f"c{i}", f"c{i}", 12, 3, False) for i in range(5)]
    stuck = [HostCandidate("q", "q", 9, 1, False, reason="quantized", group=0, position=9)]
    candidates = encoder + high + low + lone + stuck
    fixed = {"phase units": 11}

    def reads(budget: int) -> int | None:
        try:
            plan = plan_host_memory(candidates, fixed, budget, 3)
        except ValueError:
            return None
        on_disk = {c.key for c in plan.disk}
        return (sum(1 for k in on_disk if k.startswith("e")) + 2 * len(plan.shared)
                + 10 * sum(1 for k in on_disk if not k.startswith("e")))

    everything = 11 + sum(c.nbytes for c in candidates)
    costs = [reads(b) for b in range(0, everything + 2)]
    feasible = [c for c in costs if c is not None]
    assert costs[-1] == 0 and feasible[0] > 0
    assert all(later <= earlier for earlier, later in zip(feasible, feasible[1:]))
    assert all(c is not None for c in costs[costs.index(feasible[0]):])  # once it fits, every larger budget fits
    plans = [plan_host_memory(candidates, fixed, b, 3) for b, c in enumerate(costs) if c is not None]
    assert any(p.shared and not any(c.key[0] in "abc" for c in p.disk) for p in plans)  # shared, DiTs not on disk
    assert any(p.shared and any(c.key[0] in "ab" for c in p.disk) for p in plans)  # some positions read every load
    assert all("q" not in {c.key for c in p.blocks} for p in plans)  # a block that must keep its copy keeps it


def _file_of(address: int) -> str | None:
    """The file mapped at ``address`` in this process (``/proc/self/maps``), ``None`` for anonymous memory."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            start, end = (int(x, 16) for x in fields[0].split("-"))
            if start <= address < end:
                return fields[5] if len(fields) > 5 else None
    return None


def _anon_peak_while(action) -> int:
    """The most the anonymous RSS grew over its value before ``action`` while it ran."""
    before, peak = _rss_peak_while(action, "RssAnon")
    return peak - before


def test_disable_gives_disk_blocks_back_as_views_of_their_files_not_as_ram(tmp_path):
    """Under a host budget the model is larger than what RAM holds for it: ``state_dict()`` shows, and disable gives,
    the blocks read from disk back as private mappings of their checkpoint files (found on the CPU machine in a real memory cgroup, where
    reading every block back into RAM on disable had the process killed). The bytes are the model's, exactly."""
    from diffusers_omni.offload.loading import load_transformer_mmap

    config = dict(num_layers=2, num_single_layers=6, attention_head_dim=64, num_attention_heads=12,
                  joint_attention_dim=32, pooled_projection_dim=32, in_channels=16, axes_dims_rope=[16, 24, 24])
    torch.manual_seed(0)
    FluxTransformer2DModel(**config).save_pretrained(tmp_path / "transformer")
    pipe = flux_pipe()
    pipe.transformer = load_transformer_mmap(FluxTransformer2DModel, tmp_path, subfolder="transformer",
                                             torch_dtype=torch.float32).eval()
    expected = {k: v.clone() for k, v in pipe.transformer.state_dict().items()}
    reference = _image(pipe)
    model_bytes = sum(v.numel() * v.element_size() for v in expected.values())
    backend = pipe.enable_layerwise_offload(device="cpu", max_host_memory=_least_host_budget(pipe))
    disk = [b for row in backend._state.streamed for b in row if b is not None and b.store.name == "disk"
            and b.weights.path.startswith("transformer.")]
    disk_bytes = sum(b.weights.nbytes for b in disk)
    assert disk_bytes > model_bytes // 2
    assert torch.equal(_image(pipe), reference)
    shown: dict[str, torch.Tensor] = {}
    grown = _anon_peak_while(lambda: shown.update(pipe.transformer.state_dict()))  # while enabled: file views too
    assert grown < disk_bytes // 4, (grown, disk_bytes)
    assert shown.keys() == expected.keys() and all(torch.equal(shown[k], expected[k]) for k in expected)
    disk_keys = [k for k in shown if any(k.startswith(b.weights.path.split(".", 1)[1] + ".") for b in disk)]
    assert disk_keys and all(str(_file_of(shown[k].data_ptr())).endswith(".safetensors") for k in disk_keys)
    shown.clear()  # the file views go before disable
    grown = _anon_peak_while(pipe.disable_omni_offload)
    assert grown < disk_bytes // 4, (grown, disk_bytes)
    files = {str(p) for p in (tmp_path / "transformer").glob("*.safetensors")}
    for block in disk:
        for leaf in block.weights.tensors.leaves:
            data = leaf.data()
            assert data.numel() == 0 or _file_of(data.data_ptr()) in files, leaf.name
    actual = pipe.transformer.state_dict()
    assert actual.keys() == expected.keys() and all(torch.equal(actual[k], expected[k]) for k in expected)
    assert torch.equal(_image(pipe), reference)
    with torch.no_grad():  # private mappings: writing to the model never writes its file
        next(pipe.transformer.single_transformer_blocks[-1].parameters()).add_(1)
    reloaded = load_transformer_mmap(FluxTransformer2DModel, tmp_path, subfolder="transformer",
                                     torch_dtype=torch.float32)
    assert all(torch.equal(reloaded.state_dict()[k], expected[k]) for k in expected)
