"""``load_gguf_mmap`` on malformed GGUF files (issue 39 item 3): truncated or hostile headers, tensors whose
type × shape does not fit their bytes, tensors sharing bytes. Each is a ``CheckpointError`` naming the file (and
the tensor or field), raised before gguf's reader or Diffusers sees the file, instead of an ``IndexError`` from
gguf's reader or a model that loads and computes NaN or wrong values.

The hostile files are byte surgery on a file the ``gguf`` package wrote (``write_gguf_checkpoint``), done through
gguf's own reader opened read-write, whose fields are views of the file."""

from __future__ import annotations

import os

import gguf
import numpy as np
import pytest
import torch

import quant_helpers as qh
from diffusers_omni.offload.loading import CheckpointError, load_gguf_mmap, read_gguf_table
from diffusers_omni.testing.quantized import write_gguf_checkpoint


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """A tiny Flux transformer written as GGUF (linear weights Q4_K where their rows allow it, else Q8_0)."""
    folder = tmp_path_factory.mktemp("gguf")
    plain = qh.unquantized("flux")
    plain.save_config(folder)
    chosen = write_gguf_checkpoint(plain, folder / "flux.gguf", prefer="Q4_K")
    return type(plain), folder, chosen


@pytest.fixture
def gguf_file(written, tmp_path):
    """A fresh copy of the written file, and the config folder."""
    _, folder, _ = written
    copy = tmp_path / "copy.gguf"
    copy.write_bytes((folder / "flux.gguf").read_bytes())
    return copy, folder


def edit(path, change):
    """Apply ``change(reader)`` to the file through gguf's reader opened read-write (its fields map the file)."""
    reader = gguf.GGUFReader(str(path), "r+")
    change(reader)
    reader.data.flush()
    del reader


def info(reader, index):
    """Tensor ``index``'s info parts: name length, name, dimension count, dimensions, type, offset."""
    return reader.tensors[index].field.parts


def load(model_cls, path, folder):
    return load_gguf_mmap(model_cls, path, folder, compute_dtype=torch.float32, torch_dtype=torch.float32)


def in_data_order(reader):
    return sorted(range(len(reader.tensors)), key=lambda i: reader.tensors[i].data_offset)


def test_the_written_file_loads_and_its_table_matches_ggufs_reader(written, gguf_file):
    model_cls, _, chosen = written
    path, folder = gguf_file
    table = read_gguf_table(path)
    reader = gguf.GGUFReader(str(path))
    assert [(e.name, e.type, e.data_start, e.nbytes) for e in table.tensors] == [
        (t.name, t.tensor_type, t.data_offset, t.n_bytes) for t in reader.tensors]
    assert {"Q4_K", "Q8_0"} <= set(chosen.values())  # both block sizes are exercised below
    model = load(model_cls, path, folder).eval()
    with torch.no_grad():
        assert all(torch.isfinite(out).all() for out in qh.run(model, "flux", seeds=(0,)))


def _set_count(field):
    def change(reader):
        reader.fields[field].parts[0][0] = 2**62
    return change


def _truncate(size_of):
    def change(path):
        size = size_of(gguf.GGUFReader(str(path)))
        with open(path, "r+b") as handle:
            handle.truncate(size)
    return change


def _surgery(change):
    return lambda path: edit(path, change)


def _second_info_start(reader):
    return reader.tensors[1].field.offset


def _last_info_start(reader):
    return reader.tensors[-1].field.offset


HOSTILE = {
    # (surgery on the file, fragments of the error besides the file name)
    "cut at 24 bytes": (_truncate(lambda r: 24), ["key/value count 1", "0 bytes after the header"]),
    "cut at 10 bytes": (_truncate(lambda r: 10), ["10 bytes", "24-byte GGUF header"]),
    "cut inside the tensor infos": (_truncate(lambda r: _last_info_start(r) + 5),
                                    ["tensor info", "the file ends at byte", "inside the name length"]),
    "cut at the second tensor info": (_truncate(lambda r: _second_info_start(r)),
                                      ["tensor count", "tensor infos fit in the"]),
    "cut inside the data": (_truncate(lambda r: r.tensors[-1].data_offset + 3),
                            ["ends at byte", "data section"]),
    "tensor count 2**62": (_surgery(_set_count("GGUF.tensor_count")),
                           ["tensor count 4611686018427387904", "at most"]),
    "kv count 2**62": (_surgery(_set_count("GGUF.kv_count")), ["key/value count 4611686018427387904", "at most"]),
    "name length 2**62": (_surgery(lambda r: info(r, 0)[0].__setitem__(0, 2**62)),
                          ["tensor info 0", "name length 4611686018427387904"]),
    "key length 2**62": (_surgery(lambda r: r.fields["general.architecture"].parts[0].__setitem__(0, 2**62)),
                         ["key/value 0", "length 4611686018427387904"]),
    "1000 dimensions": (_surgery(lambda r: info(r, 1)[2].__setitem__(0, 1000)),
                        ["tensor info 1", "1000 dimensions", "at most 4"]),
    "unknown type": (_surgery(lambda r: info(r, 0)[4].__setitem__(0, 9999)), ["has type 9999"]),
    "unknown value type": (_surgery(lambda r: r.fields["general.architecture"].parts[2].__setitem__(0, 77)),
                           ["general.architecture", "value type 77"]),
    "bad alignment": (None, ["general.alignment", "power of two"]),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_truncated_or_hostile_headers_are_checkpoint_errors_naming_the_file(written, gguf_file, case):
    # Before the fix: IndexError (or ValueError, OverflowError, MemoryError) from gguf's reader, naming no file.
    model_cls, _, _ = written
    path, folder = gguf_file
    surgery, fragments = HOSTILE[case]
    if surgery is None:  # an alignment of 3, written by gguf's own writer
        writer = gguf.GGUFWriter(str(path), arch="diffusers-omni-test")
        writer.add_uint32("general.alignment", 3)
        writer.add_tensor("w", np.ones((4, 4), dtype=np.float32))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    else:
        surgery(path)
    with pytest.raises(CheckpointError) as caught:
        load(model_cls, path, folder)
    message = str(caught.value)
    assert str(path) in message
    for fragment in fragments:
        assert fragment in message, message


def _tensor_named(reader, quant):
    """Index of a tensor of type ``quant`` that is not the last one in the data section."""
    order = in_data_order(reader)
    return next(i for i in order[:-1] if reader.tensors[i].tensor_type == gguf.GGMLQuantizationType[quant])


def test_a_q4_k_tensor_relabelled_q8_0_is_a_checkpoint_error_naming_it(written, gguf_file):
    # Before the fix: it loaded, reading Q8_0 blocks over its own and the next tensor's bytes; the model gave NaN.
    model_cls, _, _ = written
    path, folder = gguf_file
    reader = gguf.GGUFReader(str(path))
    index = _tensor_named(reader, "Q4_K")
    name = reader.tensors[index].name
    del reader
    edit(path, lambda r: info(r, index)[4].__setitem__(0, int(gguf.GGMLQuantizationType.Q8_0)))
    with pytest.raises(CheckpointError) as caught:
        load(model_cls, path, folder)
    message = str(caught.value)
    assert str(path) in message and repr(name) in message and "Q8_0" in message and "overlaps" in message, message


def test_a_q8_0_tensor_relabelled_q4_0_is_a_checkpoint_error_naming_it(written, gguf_file):
    # A smaller type leaves bytes no tensor accounts for: before the fix it loaded with wrong values.
    model_cls, _, _ = written
    path, folder = gguf_file
    reader = gguf.GGUFReader(str(path))
    index = _tensor_named(reader, "Q8_0")
    name = reader.tensors[index].name
    del reader
    edit(path, lambda r: info(r, index)[4].__setitem__(0, int(gguf.GGMLQuantizationType.Q4_0)))
    with pytest.raises(CheckpointError) as caught:
        load(model_cls, path, folder)
    message = str(caught.value)
    assert str(path) in message and repr(name) in message and "no tensor accounts for" in message, message


def test_a_row_length_not_a_multiple_of_the_block_is_a_checkpoint_error(written, gguf_file):
    model_cls, _, _ = written
    path, folder = gguf_file
    reader = gguf.GGUFReader(str(path))
    index = _tensor_named(reader, "Q8_0")
    name = reader.tensors[index].name
    del reader

    def change(r):
        dims = info(r, index)[3]
        dims[0], dims[1] = dims[0] * 2 - 1, 1  # fewer bytes than now, and a row that is no whole number of blocks

    edit(path, change)
    with pytest.raises(CheckpointError) as caught:
        load(model_cls, path, folder)
    message = str(caught.value)
    assert repr(name) in message and "multiple of 32" in message, message


def test_a_tensor_pointing_at_another_tensors_bytes_is_a_checkpoint_error(written, gguf_file):
    # Before the fix: it loaded, the second weight a copy of the first's bytes (wrong values, no error).
    model_cls, _, _ = written
    path, folder = gguf_file
    reader = gguf.GGUFReader(str(path))
    order = in_data_order(reader)
    first, second = (next(i for i in order if reader.tensors[i].tensor_type == gguf.GGMLQuantizationType.Q8_0),
                     None)
    second = next(i for i in order if i != first and reader.tensors[i].tensor_type == reader.tensors[first].tensor_type
                  and reader.tensors[i].n_bytes == reader.tensors[first].n_bytes)
    names = reader.tensors[first].name, reader.tensors[second].name
    del reader
    edit(path, lambda r: info(r, second)[5].__setitem__(0, int(info(r, first)[5][0])))
    with pytest.raises(CheckpointError) as caught:
        load(model_cls, path, folder)
    message = str(caught.value)
    assert str(path) in message and all(repr(n) in message for n in names) and "overlaps" in message, message


def test_a_tensor_past_the_end_or_misaligned_is_a_checkpoint_error(written, gguf_file, tmp_path):
    model_cls, _, _ = written
    path, folder = gguf_file
    other = tmp_path / "other.gguf"
    other.write_bytes(path.read_bytes())
    edit(path, lambda r: info(r, 0)[5].__setitem__(0, os.path.getsize(path)))
    with pytest.raises(CheckpointError, match=r"past the end of the file") as caught:
        load(model_cls, path, folder)
    assert str(path) in str(caught.value)
    edit(other, lambda r: info(r, 0)[5].__setitem__(0, int(info(r, 0)[5][0]) + 1))
    with pytest.raises(CheckpointError, match=r"not a multiple of the alignment 32"):
        load(model_cls, other, folder)


def test_duplicate_tensor_names_are_a_checkpoint_error(written, gguf_file):
    model_cls, _, _ = written
    path, folder = gguf_file
    reader = gguf.GGUFReader(str(path))
    a, b = next((i, j) for i in range(len(reader.tensors)) for j in range(i + 1, len(reader.tensors))
                if len(reader.tensors[i].name) == len(reader.tensors[j].name))
    name = reader.tensors[a].name
    del reader
    edit(path, lambda r: info(r, b)[1].__setitem__(slice(None), np.frombuffer(name.encode(), dtype=np.uint8)))
    with pytest.raises(CheckpointError, match=rf"tensor {name!r} appears twice"):
        load(model_cls, path, folder)


def test_a_gguf_file_written_over_after_loading_is_refused_at_the_next_forward(written, gguf_file):
    """Issue 39 item 4, for ``load_gguf_mmap``: the quantized weights are views of the file's mapping; bytes written
    into the file afterwards (same inode) would change them silently."""
    import time

    model_cls, _, _ = written
    path, folder = gguf_file
    model = load(model_cls, path, folder).eval()
    table = read_gguf_table(path)
    target = next(t for t in table.tensors if t.type == gguf.GGMLQuantizationType.Q8_0)
    time.sleep(0.05)  # a file system's timestamps can be coarse
    with open(path, "r+b") as handle:
        handle.seek(target.data_start + 2)  # past the first block's scale: its int8 weights
        handle.write(bytes(range(16)))
    with pytest.raises(CheckpointError, match=r"rewritten in place since load_gguf_mmap mapped it") as caught:
        qh.run(model, "flux", seeds=(0,))
    assert str(path) in str(caught.value)
