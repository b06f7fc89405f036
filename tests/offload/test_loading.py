"""``load_transformer_mmap`` (issue 13 item 8, issue 16): dtypes as ``from_pretrained`` gives them, every broken
checkpoint a ``CheckpointError`` naming the file and tensor, and weights that are views of the file's mapping."""

from __future__ import annotations

import json
import os
import shutil
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file

from diffusers_omni.offload.loading import CheckpointError, load_transformer_mmap, mmap_safetensors

from offload_helpers import bare_wan, file_mappings, mapped_file

FILE = "diffusion_pytorch_model.safetensors"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    model = bare_wan()
    folder = tmp_path_factory.mktemp("wan")
    model.save_pretrained(folder)
    return type(model), folder


@pytest.fixture
def folder(saved, tmp_path):
    copy = tmp_path / "model"
    shutil.copytree(saved[1], copy)
    return copy


def rewrite(folder, change):
    """Rewrite the checkpoint with ``change(state_dict)`` applied (a valid safetensors file)."""
    state = load_file(folder / FILE)
    change(state)
    save_file(state, folder / FILE, metadata={"format": "pt"})


def write_raw(path, header: dict, data: bytes) -> None:
    """A safetensors file with a hand-written header (what safetensors' writer would refuse to produce)."""
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


def params(model):
    return dict(list(model.named_parameters()) + list(model.named_buffers()))


def assert_same_as_from_pretrained(cls, folder, torch_dtype):
    reference = cls.from_pretrained(folder, torch_dtype=torch_dtype)
    loaded = load_transformer_mmap(cls, folder, torch_dtype=torch_dtype)
    ref, got = params(reference), params(loaded)
    assert ref.keys() == got.keys()
    for name in ref:
        assert ref[name].dtype == got[name].dtype and torch.equal(ref[name], got[name]), name
    return loaded


@pytest.mark.parametrize("torch_dtype", [None, torch.bfloat16, torch.float16])
def test_a_tensor_of_another_dtype_is_cast_as_from_pretrained_casts_it(saved, folder, torch_dtype):
    # Before the fix (torch_dtype=None): the bf16 tensor stayed bf16 in a float32 model, which failed at its first
    # forward with a dtype mismatch.
    cls, _ = saved
    rewrite(folder, lambda s: s.update({k: s[k].to(torch.bfloat16) for k in list(s)[::3]}))
    loaded = assert_same_as_from_pretrained(cls, folder, torch_dtype)
    floating = {p.dtype for p in loaded.parameters() if p.is_floating_point()}
    assert floating <= {torch_dtype or torch.float32, torch.float32}
    inputs = {
        "hidden_states": torch.randn(1, loaded.config.in_channels, 1, 4, 4),
        "timestep": torch.tensor([500]),
        "encoder_hidden_states": torch.randn(1, 8, loaded.config.text_dim),
    }
    inputs = {k: v.to(torch_dtype) if v.is_floating_point() and torch_dtype else v for k, v in inputs.items()}
    with torch.no_grad():
        assert torch.isfinite(loaded(**inputs, return_dict=False)[0].float()).all()


def test_views_of_the_file_without_anonymous_copies(saved):
    cls, folder = saved
    model = load_transformer_mmap(cls, folder)
    mappings = file_mappings()
    assert {mapped_file(p, mappings) for p in model.parameters()} == {str(folder / FILE)}


def test_reading_every_mapped_tensor_adds_no_anonymous_memory(tmp_path):
    # safe_open's CPU tensors are views of one private file mapping: reading them grows file-backed RSS (shared
    # through the page cache), not anonymous RSS.
    path = tmp_path / "big.safetensors"
    save_file({f"t{i}": torch.full((1024, 1024), float(i)) for i in range(32)}, path)  # 128 MiB

    def rss(kind):
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) * 1024 for line in status if line.startswith(kind))

    anon = rss("RssAnon:")
    tensors = mmap_safetensors(path)
    total = sum(float(t[::64, ::64].sum()) + float(t[-1, -1]) for t in tensors.values())
    assert sum(float(t.sum()) for t in tensors.values()) == 1024 * 1024 * sum(range(32))
    assert total > 0
    assert rss("RssAnon:") - anon < 16 * 2**20
    mappings = file_mappings()
    assert {mapped_file(t, mappings) for t in tensors.values()} == {str(path)}


@pytest.mark.parametrize(
    "change, fragments",
    [
        (lambda s: s.update({"proj_out.bias": torch.zeros(3)}), ["'proj_out.bias'", "shape [3]", "expects"]),
        (lambda s: s.update({"proj_out.bias": s["proj_out.bias"].to(torch.int32)}), ["'proj_out.bias'", "int32"]),
        (lambda s: s.update({"proj_out.bias": s["proj_out.bias"].bool()}), ["'proj_out.bias'", "torch.bool"]),
        (lambda s: s.pop("proj_out.bias"), ["lacks 1 tensors", "proj_out.bias"]),
    ],
)
def test_tensors_not_matching_the_model_are_checkpoint_errors(saved, folder, change, fragments):
    cls, _ = saved
    rewrite(folder, change)
    with pytest.raises(CheckpointError) as info:
        load_transformer_mmap(cls, folder)
    for fragment in fragments:
        assert fragment in str(info.value), str(info.value)


@pytest.mark.parametrize(
    "header, data, fragment",
    [
        ({"a": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, bytes(8), "-2"),
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
          "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, bytes(12), "invalid offset for tensor `b`"),
        ({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, bytes(8), "invalid shape"),
        ({"a": {"dtype": "F32", "shape": [2**62, 4], "data_offsets": [0, 8]}}, bytes(8), "overflow"),
        ({"a": {"dtype": "X32", "shape": [2], "data_offsets": [0, 8]}}, bytes(8), "X32"),
        ([1, 2], b"", "invalid"),
    ],
)
def test_corrupt_headers_are_checkpoint_errors_naming_the_file(folder, header, data, fragment):
    write_raw(folder / FILE, header, data)
    with pytest.raises(CheckpointError) as info:
        load_transformer_mmap(type(bare_wan()), folder)
    assert str(folder / FILE) in str(info.value) and fragment in str(info.value)


@pytest.mark.parametrize(
    "config, fragment",
    [
        ("{not json", "cannot read the model config"),
        (None, "cannot read the model config"),
        ('{"num_layers": "two", "_class_name": "WanTransformer3DModel"}', "does not build a WanTransformer3DModel"),
        ('{"num_attention_heads": -2, "_class_name": "WanTransformer3DModel"}', "does not build"),
    ],
)
def test_a_bad_config_is_a_checkpoint_error(saved, folder, config, fragment):
    cls, _ = saved
    if config is None:
        (folder / "config.json").unlink()
    else:
        (folder / "config.json").write_text(config)
    with pytest.raises(CheckpointError) as info:
        load_transformer_mmap(cls, folder)
    assert "config.json" in str(info.value) and fragment in str(info.value)


@pytest.fixture
def sharded(saved, tmp_path):
    cls, _ = saved
    folder = tmp_path / "sharded"
    bare_wan().save_pretrained(folder, max_shard_size="30KB")
    index = next(folder.glob("*.index.json"))
    assert len(list(folder.glob("*.safetensors"))) > 1
    return cls, folder, index


@pytest.mark.parametrize(
    "edit, fragment",
    [
        (lambda i: "{not json", "not a safetensors index"),
        (lambda i: json.dumps({"metadata": {}}), "not a safetensors index"),
        (lambda i: json.dumps({"weight_map": ["a"]}), "'weight_map' must map"),
        (lambda i: json.dumps({"weight_map": {"x": 3}}), "maps to 3"),
        (lambda i: json.dumps({"weight_map": {**i["weight_map"], "x": "../outside.safetensors"}}), "inside"),
        (lambda i: json.dumps({"weight_map": {**i["weight_map"], "x": "/etc/passwd"}}), "inside"),
        (lambda i: json.dumps({"weight_map": {**i["weight_map"], "x": "missing.safetensors"}}), "do not exist"),
        (lambda i: json.dumps({"weight_map": {**i["weight_map"], "not.a.tensor": next(iter(i["weight_map"].values()))}}),
         "'not.a.tensor' is in no shard"),
        (lambda i: json.dumps({"weight_map": {k: sorted(set(i["weight_map"].values()))[0] for k in i["weight_map"]}}),
         "the index does not match its shards"),
        (lambda i: "[" * 100000, "not a safetensors index"),
    ],
)
def test_a_malformed_index_is_a_checkpoint_error(sharded, edit, fragment):
    cls, folder, index = sharded
    index.write_text(edit(json.loads(index.read_text())))
    with pytest.raises(CheckpointError) as info:
        load_transformer_mmap(cls, folder)
    assert fragment in str(info.value), str(info.value)


def test_a_tensor_in_two_shards_is_a_checkpoint_error(sharded):
    cls, folder, index = sharded
    shards = sorted(folder.glob("*.safetensors"))
    first = load_file(shards[0])
    second = load_file(shards[1])
    name = next(iter(first))
    second[name] = first[name]
    save_file(second, shards[1], metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=rf"'{name}' is in both"):
        load_transformer_mmap(cls, folder)


def test_sharded_checkpoints_load_as_from_pretrained_does(sharded):
    cls, folder, _ = sharded
    assert_same_as_from_pretrained(cls, folder, torch.bfloat16)


def test_load_gguf_mmap_refuses_a_missing_or_unreadable_file(tmp_path):
    from diffusers import FluxTransformer2DModel

    from diffusers_omni.offload.loading import load_gguf_mmap

    with pytest.raises(CheckpointError, match=r"nothing\.gguf: no such GGUF file"):
        load_gguf_mmap(FluxTransformer2DModel, tmp_path / "nothing.gguf", tmp_path)
    (tmp_path / "bad.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(CheckpointError, match=r"bad\.gguf: not a readable GGUF file"):
        load_gguf_mmap(FluxTransformer2DModel, tmp_path / "bad.gguf", tmp_path)


# Issue 39 item 4: a checkpoint rewritten in place after load_transformer_mmap ------------------------------------


def _wan_inputs(model):
    generator = torch.Generator().manual_seed(0)
    return {
        "hidden_states": torch.randn(1, model.config.in_channels, 1, 4, 4, generator=generator),
        "timestep": torch.tensor([500]),
        "encoder_hidden_states": torch.randn(1, 8, model.config.text_dim, generator=generator),
        "return_dict": False,
    }


def _rewrite_later(path, change):
    """Write the checkpoint again with ``change`` applied, at a later modification time than the load's."""
    import time

    state = {k: v.clone() for k, v in load_file(path).items()}
    change(state)
    time.sleep(0.05)  # a file system's timestamps can be coarse
    return state


def test_a_checkpoint_rewritten_in_place_after_loading_is_refused_at_the_next_forward(saved, folder):
    """The weights are views of a (private) mapping of the file, whose untouched pages show what the file holds
    now: before the fix, saving over the file changed the loaded weights silently (the next forward gave other
    values; a shorter file would crash the process with SIGBUS)."""
    cls, _ = saved
    model = load_transformer_mmap(cls, folder)
    with torch.no_grad():
        reference = model(**_wan_inputs(model))[0]
    name = next(n for n, p in model.named_parameters() if p.dim() == 2)
    state = _rewrite_later(folder / FILE, lambda s: s.update({name: s[name] + 1}))
    save_file(state, folder.parent / "other.safetensors", metadata={"format": "pt"})
    inode = os.stat(folder / FILE).st_ino
    shutil.copyfile(folder.parent / "other.safetensors", folder / FILE)  # truncates and rewrites the same file
    assert os.stat(folder / FILE).st_ino == inode
    assert torch.equal(dict(model.named_parameters())[name], state[name])  # the loaded weight did change
    with pytest.raises(CheckpointError) as caught:
        with torch.no_grad():
            model(**_wan_inputs(model))
    message = str(caught.value)
    assert str(folder / FILE) in message and "rewritten in place" in message and "load_transformer_mmap" in message
    assert "rename" in message  # the way to update a checkpoint under a running model
    # A copy of the weights does not depend on the file: it runs (with the weights it copied).
    copied = load_transformer_mmap(cls, folder)
    import copy as copy_module

    detached = copy_module.deepcopy(copied)
    _rewrite_later(folder / FILE, lambda s: None)
    shutil.copyfile(folder.parent / "other.safetensors", folder / FILE)
    with torch.no_grad():
        assert torch.isfinite(detached(**_wan_inputs(detached))[0]).all()
    assert reference.shape == detached(**_wan_inputs(detached))[0].shape


def test_a_checkpoint_replaced_by_rename_leaves_the_loaded_model_running_unchanged(saved, folder):
    """The safe way to update a checkpoint under a running model: write a new file and rename it over the old one;
    the mapping keeps the old file's pages, so nothing changes and nothing is refused."""
    cls, _ = saved
    model = load_transformer_mmap(cls, folder)
    with torch.no_grad():
        reference = model(**_wan_inputs(model))[0]
    state = _rewrite_later(folder / FILE, lambda s: s.update({k: s[k] + 1 for k in list(s)[:5]}))
    save_file(state, folder / "new.safetensors.tmp", metadata={"format": "pt"})
    os.replace(folder / "new.safetensors.tmp", folder / FILE)
    with torch.no_grad():
        assert torch.equal(model(**_wan_inputs(model))[0], reference)
