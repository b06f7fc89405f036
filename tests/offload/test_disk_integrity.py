"""Checkpoint files changed under a host budget (#39 items 1 and 2): nothing is lost and nothing is silently wrong.

Blocks without a host copy are read from their files at every load. A file truncated after enabling fails the
call that reads it and refuses the disable (which would otherwise leave those blocks' tensors empty); putting the
file's bytes back makes every call exact again and lets the disable through. A same-size rewrite with the
modification time put back is caught by the checksum taken at enable, naming the block and the file.
"""

from __future__ import annotations

import os
import struct

import pytest
import torch
from diffusers import FluxTransformer2DModel

from diffusers_omni.offload import disk
from diffusers_omni.pipelines.flux import OmniFluxPipeline
from offload_helpers import flux_pipe

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folder = tmp_path_factory.mktemp("flux")
    pipe = flux_pipe()
    config = {**pipe.transformer.config, "num_layers": 3, "num_single_layers": 4}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        pipe.register_modules(transformer=FluxTransformer2DModel.from_config(config).eval())
    pipe.save_pretrained(folder, max_shard_size="300KB")
    return folder


def _load(folder) -> OmniFluxPipeline:
    pipe = OmniFluxPipeline.from_pretrained(folder)
    for module in pipe.components.values():
        if isinstance(module, torch.nn.Module):
            module.eval()
    return pipe


def _image(pipe) -> torch.Tensor:
    return pipe(prompt="a red fox in the snow", num_inference_steps=2, height=32, width=32,
                generator=torch.Generator().manual_seed(0), output_type="pt", max_sequence_length=32).images


def _enable(pipe):
    backend = pipe.enable_layerwise_offload(device="cpu")
    total = backend.stats.host_bytes
    pipe.disable_omni_offload()
    backend = pipe.enable_layerwise_offload(device="cpu", max_host_memory=total * 3 // 4)
    assert backend.stats.disk_blocks > 0
    return backend


def _a_transformer_file_read_from(backend):
    """A transformer shard that disk-backed blocks are read from."""
    state = backend._state
    files = state.disk_reader.files
    used = {files[f] for source in state.disk.values() if source.component == "transformer"
            for f, _, _ in source.runs}
    return sorted(used)[0]


def _no_empty_tensors(pipe) -> None:
    for name in ("transformer", "text_encoder", "text_encoder_2", "vae"):
        for key, tensor in getattr(pipe, name).state_dict().items():
            assert tensor.numel() > 0, (name, key)


def test_a_truncated_file_refuses_the_disable_and_putting_its_bytes_back_recovers_everything(saved, tmp_path):
    folder = tmp_path / "copy"
    import shutil

    shutil.copytree(saved, folder)
    pipe = _load(folder)
    reference = _image(pipe)
    backend = _enable(pipe)
    assert torch.equal(_image(pipe), reference)
    path = _a_transformer_file_read_from(backend)
    original = path.read_bytes()
    with open(path, "r+b") as handle:
        handle.truncate(len(original) // 2)
    with pytest.raises(disk.DiskReadError, match=path.name):
        _image(pipe)
    with pytest.raises(disk.DiskReadError, match=r"layerwise offload stays enabled: \d+ disk-backed blocks could not "
                                                 r"be read back .*put the files' original bytes back"):
        pipe.disable_omni_offload()
    assert pipe.omni_offload_backend is backend and backend.is_enabled()
    with pytest.raises(disk.DiskReadError):
        _image(pipe)  # still enabled, still consistent: the same error, not a crash on empty tensors
    # Following the advice: the file's exact bytes back (same inode, a new modification time).
    with open(path, "r+b") as handle:
        handle.write(original)
    for _ in range(2):
        assert torch.equal(_image(pipe), reference)
    pipe.disable_omni_offload()
    assert pipe.omni_offload_backend is None
    _no_empty_tensors(pipe)
    assert torch.equal(_image(pipe), reference)
    pipe.enable_layerwise_offload(device="cpu")  # enabling again works too
    assert torch.equal(_image(pipe), reference)
    pipe.disable_omni_offload()


def test_a_same_size_rewrite_with_its_mtime_put_back_is_refused_naming_block_and_file(saved, tmp_path):
    folder = tmp_path / "copy"
    import shutil

    shutil.copytree(saved, folder)
    pipe = _load(folder)
    reference = _image(pipe)
    backend = _enable(pipe)
    path = _a_transformer_file_read_from(backend)
    original = path.read_bytes()
    status = os.stat(path)
    header = 8 + struct.unpack("<Q", original[:8])[0]
    generator = torch.Generator().manual_seed(1)
    noise = torch.randint(0, 256, (len(original) - header,), dtype=torch.uint8, generator=generator).numpy().tobytes()
    with open(path, "r+b") as handle:  # same inode, same size
        handle.seek(header)
        handle.write(noise)
    os.utime(path, ns=(status.st_atime_ns, status.st_mtime_ns))
    after = os.stat(path)
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (status.st_ino, status.st_size, status.st_mtime_ns)
    with pytest.raises(disk.DiskReadError, match=rf"block 'transformer\.[\w.]+' of 'transformer': the bytes read "
                                                 rf"from .*{path.name} are not the ones checked when the offload was "
                                                 "enabled"):
        _image(pipe)
    with pytest.raises(disk.DiskReadError, match="stays enabled"):
        pipe.disable_omni_offload()
    with open(path, "r+b") as handle:
        handle.write(original)
    assert torch.equal(_image(pipe), reference)
    pipe.disable_omni_offload()
    _no_empty_tensors(pipe)
    assert torch.equal(_image(pipe), reference)


def test_sampled_windows_cover_every_tensor_start_and_end_and_a_window_every_64_kib():
    assert disk._windows(0) == []
    assert disk._windows(100) == [(0, 100)]
    windows = disk._windows(1 << 20)
    assert windows[0] == (0, 4096) and windows[-1] == ((1 << 20) - 4096, 4096)
    starts = [start for start, _ in windows]
    assert all(b - a <= 64 << 10 for a, b in zip(starts, starts[1:]))
    sampled = sum(size for _, size in windows)
    assert sampled <= (1 << 20) // 16 + 4096
