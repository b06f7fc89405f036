"""Build a Diffusers transformer whose weights are mmap views of its checkpoint (safetensors; GGUF with
``load_gguf_mmap`` at the end of this module).

Every rank of a distributed layerwise run maps the same files, so the checkpoint sits once in the OS page cache
instead of once per rank in anonymous memory; the AllGather backend then copies only the rank's 1/N slice of each
block into pinned memory and drops the views. Steps:

1. open every safetensors file with ``safetensors.safe_open`` (single file or the shards of a
   ``*.safetensors.index.json``) and check it against the model before anything is mapped: safetensors validates
   each header (offsets contiguous, non-overlapping and covering the file, sizes matching shapes), and names,
   shapes and dtype kinds are compared with the model built from ``config.json``. Anything wrong raises
   ``CheckpointError`` naming the file and tensor, and nothing is half-loaded;
2. build the model from its config with parameters on the meta device and buffers real
   (``accelerate.init_empty_weights(include_buffers=False)``), so non-persistent buffers such as RoPE frequency
   tables are computed exactly as a normal construction computes them;
3. take each tensor with ``safe_open(...).get_tensor``: on CPU, safetensors maps the file once (a private,
   copy-on-write ``mmap``: pages are shared through the page cache until written) and returns zero-copy views of
   that mapping, which ``load_state_dict(assign=True)`` assigns to the parameters and persistent buffers
   (``tests/offload/test_loading.py`` checks that every parameter lies in the file's mapping and that reading all
   weights adds no anonymous memory);
4. convert dtypes as ``from_pretrained`` does for the same file: with ``torch_dtype``, floating tensors become
   ``torch_dtype`` (``_keep_in_fp32_modules`` float32; ``float8_e4m3fn`` kept); without it, floating tensors take
   the dtype the model was built with. A tensor already in its target dtype stays a view; a converted one is a
   private host copy, so save the checkpoint in the dtype you run to keep host RSS at model ÷ N.
"""

from __future__ import annotations

import json
import logging
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from safetensors import SafetensorError, safe_open

from ..models.base import check_layer_counts

logger = logging.getLogger("diffusers_omni")

SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
for _name, _attr in (("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2")):
    if hasattr(torch, _attr):
        SAFETENSORS_DTYPES[_name] = getattr(torch, _attr)

for _name, _attr in (("U16", "uint16"), ("U32", "uint32"), ("U64", "uint64"), ("F8_E8M0", "float8_e8m0fnu")):
    if hasattr(torch, _attr):
        SAFETENSORS_DTYPES[_name] = getattr(torch, _attr)


class CheckpointError(ValueError):
    """A safetensors checkpoint that cannot be mapped (missing, truncated, corrupt, or not matching the model)."""


def read_safetensors_header(path: str | os.PathLike) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """``{name: (dtype, shape)}`` of one safetensors file, validated by ``safetensors.safe_open`` (no tensor data is
    read)."""
    path = Path(path)
    entries = {}
    try:
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():
                view = handle.get_slice(name)
                dtype_name, shape = view.get_dtype(), tuple(view.get_shape())
                if dtype_name not in SAFETENSORS_DTYPES:
                    raise CheckpointError(
                        f"{path}: tensor {name!r} has dtype {dtype_name}, which this torch build cannot hold"
                    )
                entries[name] = (SAFETENSORS_DTYPES[dtype_name], shape)
    except SafetensorError as error:
        raise CheckpointError(f"{path}: corrupt or truncated safetensors file ({error})") from error
    except OSError as error:
        raise CheckpointError(f"{path}: cannot read safetensors file ({error})") from error
    return entries


def mmap_safetensors(path: str | os.PathLike, names=None) -> dict[str, torch.Tensor]:
    """Tensors of one safetensors file (all, or ``names``) as zero-copy views of one private mapping of the file."""
    try:
        with safe_open(str(path), framework="pt") as handle:
            return {name: handle.get_tensor(name) for name in (handle.keys() if names is None else names)}
    except SafetensorError as error:
        raise CheckpointError(f"{path}: corrupt or truncated safetensors file ({error})") from error
    except OSError as error:
        raise CheckpointError(f"{path}: cannot read safetensors file ({error})") from error


def _read_index(index: Path) -> dict[str, str]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (OSError, UnicodeDecodeError, ValueError, RecursionError, KeyError, TypeError) as error:
        raise CheckpointError(f"{index}: not a safetensors index ({error!r})") from error
    if not isinstance(weight_map, dict):
        raise CheckpointError(
            f"{index}: 'weight_map' must map tensor names to shard files, got {type(weight_map).__name__}"
        )
    for name, shard in weight_map.items():
        if not isinstance(shard, str) or not shard:
            raise CheckpointError(f"{index}: tensor {name!r} maps to {shard!r}, not a shard file name")
        if Path(shard).is_absolute() or ".." in Path(shard).parts or "\\" in shard:
            raise CheckpointError(
                f"{index}: tensor {name!r} maps to {shard!r}; shards must be files inside {index.parent}"
            )
    return weight_map


def checkpoint_files(directory: str | os.PathLike) -> list[Path]:
    """The safetensors files of a Diffusers model folder: the shards named by an index, else the single file."""
    return list(_checkpoint_layout(Path(directory))[0])


def _checkpoint_layout(directory: Path) -> tuple[list[Path], dict[str, str] | None, Path | None]:
    """``(files, weight_map or None, index path or None)``."""
    if directory.is_file():
        return [directory], None, None
    indexes = sorted(directory.glob("*.safetensors.index.json"))
    if len(indexes) > 1:
        raise CheckpointError(f"{directory}: several safetensors indexes {[i.name for i in indexes]}")
    if indexes:
        weight_map = _read_index(indexes[0])
        files = [directory / name for name in sorted(set(weight_map.values()))]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{indexes[0]} names shards that do not exist: {missing}")
        return files, weight_map, indexes[0]
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{directory}: no *.safetensors file or *.safetensors.index.json found")
    if len(files) > 1:
        raise CheckpointError(f"{directory}: several *.safetensors files {[f.name for f in files]} and no index")
    return files, None, None


def load_transformer_mmap(
    model_cls: type,
    path: str | os.PathLike,
    subfolder: str | None = None,
    torch_dtype: torch.dtype | None = None,
) -> nn.Module:
    """A Diffusers model (``model_cls``, e.g. ``FluxTransformer2DModel``) built from the config in ``path`` (or
    ``path/subfolder``) with its weights as mmap views of the checkpoint's safetensors files.

    Args:
        model_cls: a Diffusers ``ModelMixin`` subclass.
        path: a local model folder (``save_pretrained`` output) or pipeline folder with ``subfolder``.
        subfolder: e.g. ``"transformer"`` inside a pipeline folder.
        torch_dtype: convert floating weights as ``from_pretrained(torch_dtype=...)`` does.

    The weights stay views of the files, so do not write into a file while a model loaded from it lives: a file
    rewritten in place (same inode: ``shutil.copyfile`` or ``open(path, "r+b")`` over it) changes the weights it
    has not copied. Each forward first checks the files (size and modification time, as ``max_host_memory``'s disk
    reads do) and raises ``CheckpointError`` naming the file if one was; load again after writing. To update a
    checkpoint under a running model, write the new file elsewhere and rename it over the old one
    (``os.replace``; safetensors' ``save_file`` does): the model keeps the old file's pages. Compiled graphs do
    not run the check.

    Example:
    ```py
    >>> transformer = load_transformer_mmap(FluxTransformer2DModel, "/models/flux-dev", "transformer", torch.bfloat16)
    >>> pipe = OmniFluxPipeline.from_pretrained("/models/flux-dev", transformer=transformer, torch_dtype=torch.bfloat16)
    >>> pipe.enable_distributed_layerwise_offload()
    ```
    """
    from accelerate import init_empty_weights

    directory = Path(path) / subfolder if subfolder else Path(path)
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: not a model folder (expected config.json and *.safetensors)")
    files, weight_map, index = _checkpoint_layout(directory)
    # 1. Every header, before building or mapping anything.
    where: dict[str, Path] = {}
    entries: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
    for file in files:
        for name, entry in read_safetensors_header(file).items():
            if name in where:
                raise CheckpointError(f"{directory}: tensor {name!r} is in both {where[name].name} and {file.name}")
            where[name], entries[name] = file, entry
    if weight_map is not None:
        wrong = [(n, shard) for n, shard in weight_map.items() if n in where and where[n].name != Path(shard).name]
        absent = [n for n in weight_map if n not in where]
        if wrong or absent:
            detail = [f"{n!r} is in {where[n].name}, not {shard}" for n, shard in wrong[:3]]
            detail += [f"{n!r} is in no shard" for n in absent[:3]]
            raise CheckpointError(f"{index}: the index does not match its shards: {'; '.join(detail)}")
    # 2. The model, on the meta device.
    model = _build_on_meta(model_cls, directory, init_empty_weights)
    expected = {name: tensor for name, tensor in model.state_dict().items()}
    missing = sorted(expected.keys() - entries.keys())
    if missing:
        raise CheckpointError(
            f"{directory}: checkpoint lacks {len(missing)} tensors of {model_cls.__name__} (e.g. {missing[:3]})"
        )
    unexpected = sorted(entries.keys() - expected.keys())
    if unexpected:
        logger.warning("%s: ignoring %d checkpoint tensors %s not in %s", directory, len(unexpected),
                       unexpected[:3], model_cls.__name__)
    for name, tensor in expected.items():
        dtype, shape = entries[name]
        if shape != tuple(tensor.shape):
            raise CheckpointError(
                f"{where[name]}: tensor {name!r} has shape {list(shape)}; {model_cls.__name__} built from "
                f"{directory / 'config.json'} expects {list(tensor.shape)}"
            )
        if dtype.is_floating_point != tensor.dtype.is_floating_point or (
            not dtype.is_floating_point and dtype != tensor.dtype
        ):
            raise CheckpointError(
                f"{where[name]}: tensor {name!r} is {dtype}; {model_cls.__name__} expects a "
                f"{'floating-point' if tensor.dtype.is_floating_point else str(tensor.dtype)} tensor"
            )
    # 3. Zero-copy views of each file's mapping, then 4. from_pretrained's dtype conversion.
    state: dict[str, torch.Tensor] = {}
    views: dict[Path, set[int]] = {}
    for file in files:
        names = [name for name in expected if where[name] == file]
        mapped = mmap_safetensors(file, names)
        views[file] = {t.untyped_storage().data_ptr() for t in mapped.values()}
        state.update(mapped)
    for name, tensor in expected.items():
        wanted = _target_dtype(model, name, state[name].dtype, torch_dtype, built=tensor.dtype)
        if wanted != state[name].dtype:
            state[name] = state[name].to(wanted)
    model.load_state_dict(state, strict=True, assign=True)
    meta = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if meta:
        raise CheckpointError(f"{directory}: tensors left unloaded on the meta device: {meta[:3]}")
    if torch_dtype is not None:
        _convert_buffers(model, torch_dtype)
    # Where the weights came from, as from_pretrained records it (layerwise offload's max_host_memory reads blocks
    # back from these files).
    model.register_to_config(_name_or_path=str(directory))
    watch_mapped_files(model, views, "load_transformer_mmap")
    return model.eval()


# --- A mapped checkpoint rewritten in place ------------------------------------------------------------------------

_MAPPED_FILES = "_omni_mapped_files"


@dataclass(frozen=True)
class MappedFile:
    """A checkpoint file some of a model's weights are views of: its identity and state when it was mapped, and
    the storages (host addresses) of the model's tensors that view it."""

    path: str
    inode: int
    size: int
    mtime_ns: int
    storages: frozenset[int]
    loader: str


def watch_mapped_files(model: nn.Module, views: dict[Path, set[int]], loader: str) -> None:
    """Record the files ``loader`` mapped (with the storage addresses of the views it took of each) on ``model``
    and check them before each forward (``check_mapped_files``). A private mapping shows the file's current bytes
    in every page not yet copied, so a file rewritten in place (same inode: ``shutil.copyfile`` or
    ``open(path, "r+b")`` over it) changes the loaded weights, or crashes the process with SIGBUS when it
    shrank."""
    records = []
    for file, storages in views.items():
        status = os.stat(file)
        records.append(MappedFile(str(file), status.st_ino, status.st_size, status.st_mtime_ns, frozenset(storages),
                                  loader))
    model.__dict__[_MAPPED_FILES] = tuple(records)
    if not getattr(model, "_omni_mapped_files_hooked", False):
        model.register_forward_pre_hook(_check_mapped_files_hook)
        model.__dict__["_omni_mapped_files_hooked"] = True


def _tensors(model: nn.Module) -> list[torch.Tensor]:
    return [t for t in list(model.parameters()) + list(model.buffers()) if t is not None]


def _check_mapped_files_hook(model: nn.Module, args: Any) -> None:
    if torch.compiler.is_compiling():  # compiled graphs cannot stat files; eager forwards check
        return
    check_mapped_files(model)


def check_mapped_files(model: nn.Module) -> None:
    """Raise ``CheckpointError`` when a file ``model``'s weights are still views of was rewritten in place since it
    was mapped (same inode, another size or modification time). A file replaced by a rename or deleted leaves the
    mapping on the old file (the weights unchanged); a model whose weights were copied (``deepcopy``, ``.to()``,
    an offload's host copies) no longer depends on the file."""
    for record in model.__dict__.get(_MAPPED_FILES, ()):
        try:
            status = os.stat(record.path)
        except OSError:
            continue
        if status.st_ino != record.inode or (status.st_size, status.st_mtime_ns) == (record.size, record.mtime_ns):
            continue
        if not any(t.device.type == "cpu" and t.untyped_storage().data_ptr() in record.storages
                   for t in _tensors(model)):
            continue
        raise CheckpointError(
            f"{record.path} was rewritten in place since {record.loader} mapped it ({record.size} → "
            f"{status.st_size} bytes, modified again): {type(model).__name__}'s weights are views of that file's "
            f"pages, so they may now hold the new bytes (or crash the process if the file shrank); refused. "
            f"Allowed: {record.loader} again after writing; to update a checkpoint under a running model, write the "
            "new file elsewhere and rename it over the old one (os.replace; safetensors' save_file does), which "
            "leaves this model on the old file's pages"
        )


def _build_on_meta(model_cls: type, directory: Path, init_empty_weights) -> nn.Module:
    """``model_cls`` from ``directory/config.json`` with parameters on the meta device; a missing, unreadable or
    invalid config raises ``CheckpointError``."""
    if not (isinstance(model_cls, type) and hasattr(model_cls, "load_config") and hasattr(model_cls, "from_config")):
        raise TypeError(f"model_cls must be a Diffusers ModelMixin subclass, got {model_cls!r}")
    config_path = directory / "config.json"
    try:
        config = model_cls.load_config(directory)
    except Exception as error:  # Diffusers raises EnvironmentError/ValueError/... for a missing or bad file
        raise CheckpointError(f"{config_path}: cannot read the model config ({error})") from error
    try:
        check_layer_counts(config, model_cls.__name__)
    except ValueError as error:
        raise CheckpointError(f"{config_path}: {error}") from None
    try:
        with init_empty_weights(include_buffers=False):
            return model_cls.from_config(config)
    except Exception as error:  # a config whose values the model's constructor refuses
        raise CheckpointError(
            f"{config_path}: does not build a {model_cls.__name__} ({type(error).__name__}: {error})"
        ) from error


def _target_dtype(
    model: nn.Module, name: str, dtype: torch.dtype, torch_dtype: torch.dtype | None, built: torch.dtype | None = None
) -> torch.dtype:
    """The dtype ``from_pretrained`` gives tensor ``name`` of a checkpoint holding it as ``dtype``
    (``diffusers.models.model_loading_utils.load_model_dict_into_meta``): with ``torch_dtype``, floating tensors
    other than ``float8_e4m3fn`` become ``torch_dtype`` (float32 in ``_keep_in_fp32_modules``); without it, they take
    the dtype the model was built with (``built``)."""
    if not dtype.is_floating_point:
        return dtype
    if torch_dtype is None:
        return built if built is not None and built.is_floating_point else dtype
    if dtype == getattr(torch, "float8_e4m3fn", None):
        return dtype
    keep = getattr(model, "_keep_in_fp32_modules", None) or []
    if any(re.search(rf"(^|\.){re.escape(k)}(\.|$)", name) for k in keep):
        return torch.float32
    return torch_dtype


def _convert_buffers(model: nn.Module, torch_dtype: torch.dtype) -> None:
    """Non-persistent floating buffers follow ``torch_dtype`` as ``from_pretrained``'s ``model.to(dtype)`` does."""
    persistent = set(model.state_dict().keys())
    for name, buffer in list(model.named_buffers()):
        if name in persistent or buffer is None or not buffer.dtype.is_floating_point:
            continue
        wanted = _target_dtype(model, name, buffer.dtype, torch_dtype)
        if buffer.dtype != wanted:
            buffer.data = buffer.data.to(wanted)


def load_gguf_mmap(
    model_cls: type,
    path: str | os.PathLike,
    config: str | os.PathLike,
    compute_dtype: torch.dtype = torch.bfloat16,
    torch_dtype: torch.dtype | None = None,
    **kwargs,
) -> nn.Module:
    """A Diffusers model (``model_cls``) from a GGUF file whose weights are views of the file's mapping.

    ``model_cls.from_single_file(path, quantization_config=GGUFQuantizationConfig(...))`` copies every tensor of the
    file into private memory while it reads it. This maps the file instead (``gguf.GGUFReader``, private
    copy-on-write mapping) and hands Diffusers those views as a state dict, so ``from_single_file`` converts names
    and splits fused tensors without copying the quantized bytes: the weights stay views of the file, and under
    ``max_host_memory`` their blocks are read back from it. Tensors that Diffusers converts (a float32 norm loaded
    with ``torch_dtype=torch.bfloat16``) are private copies. ``config`` is the model's config folder (or a hub
    name, as ``from_single_file`` takes it); other keyword arguments go to ``from_single_file``.

    Before gguf's reader maps the file, its header and tensor-info table are checked (``read_gguf_table``): a
    truncated or corrupt file, a tensor whose type × shape does not match the bytes it points at (a relabelled
    type, a changed shape), or two tensors sharing bytes is a ``CheckpointError`` naming the file and the tensor.
    As with ``load_transformer_mmap``, a file rewritten in place after loading is refused at the next forward.

    Example:
    ```py
    >>> transformer = load_gguf_mmap(FluxTransformer2DModel, "/models/flux1-dev-Q4_K_S.gguf",
    ...                              config="/models/flux-dev", subfolder="transformer", torch_dtype=torch.bfloat16)
    ```
    """
    import warnings

    import gguf
    from diffusers import GGUFQuantizationConfig
    from diffusers.quantizers.gguf.utils import GGUFParameter

    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: no such GGUF file")
    read_gguf_table(path)  # every length, type, size and range checked before gguf's reader maps the file
    try:
        reader = gguf.GGUFReader(str(path), "c")
    except Exception as error:  # what the checks above did not foresee: still a CheckpointError naming the file
        raise CheckpointError(f"{path}: not a readable GGUF file ({type(error).__name__}: {error})") from error
    plain = (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16)
    state_dict: dict[str, torch.Tensor] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch.from_numpy of a mapping: shared, as intended
        for tensor in reader.tensors:
            data = torch.from_numpy(tensor.data)
            state_dict[tensor.name] = (data if tensor.tensor_type in plain
                                       else GGUFParameter(data, quant_type=tensor.tensor_type))
    views = {path: {t.untyped_storage().data_ptr() for t in state_dict.values()}}
    model = model_cls.from_single_file(
        state_dict, config=str(config), torch_dtype=torch_dtype,
        quantization_config=GGUFQuantizationConfig(compute_dtype=compute_dtype), **kwargs,
    )
    watch_mapped_files(model, views, "load_gguf_mmap")
    return model


# --- GGUF: the header and tensor-info table, checked before gguf's reader sees the file -------------------------

_GGUF_HEADER = 24  # magic, version (uint32), tensor count, key/value count (uint64)
_GGUF_MAX_DIMS = 4  # GGML_MAX_DIMS
_GGUF_MIN_INFO = 24  # a tensor info: name length (8), dimension count (4), type (4), offset (8)
_GGUF_MIN_KV = 13  # a key/value: key length (8), value type (4), a one-byte value
_GGUF_ARRAY_DEPTH = 8  # nested arrays deeper than this are refused (GGUF files use at most one level)
# GGUF value types: struct code of the scalars; 8 is a string, 9 an array.
_GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_GGUF_STRING, _GGUF_ARRAY, _GGUF_UINT32 = 8, 9, 4


@dataclass(frozen=True)
class GGUFTensorInfo:
    """One tensor of a GGUF file: ``dims`` in GGUF order (row length first), ``data_start`` the absolute byte
    offset of its data, ``nbytes`` what its type × shape requires."""

    name: str
    type: Any  # gguf.GGMLQuantizationType
    dims: tuple[int, ...]
    data_start: int
    nbytes: int

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape as torch orders it (row length last)."""
        return tuple(reversed(self.dims))

    def describe(self) -> str:
        return (f"tensor {self.name!r} ({self.type.name}, shape {list(self.shape)}, {self.nbytes} bytes at "
                f"{self.data_start}..{self.data_start + self.nbytes})")


@dataclass(frozen=True)
class GGUFTable:
    version: int
    alignment: int
    data_offset: int
    tensors: list[GGUFTensorInfo]


class _GGUFCursor:
    """Bounds-checked reads of a GGUF header from a read-only mapping; every failure names the file and the item
    being read."""

    def __init__(self, path: Path, data: Any, size: int, endian: str) -> None:
        self.path, self.data, self.size, self.endian, self.offset = path, data, size, endian, 0

    def fail(self, where: str, detail: str) -> CheckpointError:
        return CheckpointError(f"{self.path}: not a readable GGUF file: {where}: {detail}")

    def need(self, nbytes: int, where: str, what: str) -> None:
        if self.offset + nbytes > self.size:
            raise self.fail(where, f"the file ends at byte {self.size}, inside {what} (needs {nbytes} bytes at byte "
                                   f"{self.offset})")

    def scalar(self, code: str, where: str, what: str) -> Any:
        size = struct.calcsize(code)
        self.need(size, where, what)
        (value,) = struct.unpack_from(self.endian + code, self.data, self.offset)
        self.offset += size
        return value

    def string(self, where: str, what: str) -> str:
        length = self.scalar("Q", where, f"the {what} length")
        if length > self.size - self.offset:
            raise self.fail(where, f"{what} length {length} runs past the end of the file (at byte {self.offset}, "
                                   f"{self.size - self.offset} bytes left)")
        raw = bytes(self.data[self.offset:self.offset + length])
        self.offset += length
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as error:
            raise self.fail(where, f"the {what} is not UTF-8 ({error})") from None

    def skip_value(self, value_type: int, where: str, depth: int = 0) -> Any:
        """Read (scalars) or skip (strings, arrays) one value of GGUF value type ``value_type``."""
        if value_type in _GGUF_SCALARS:
            return self.scalar(_GGUF_SCALARS[value_type], where, "its value")
        if value_type == _GGUF_STRING:
            return self.string(where, "string")
        if value_type != _GGUF_ARRAY:
            raise self.fail(where, f"value type {value_type} is not a GGUF value type (allowed: 0-12)")
        if depth >= _GGUF_ARRAY_DEPTH:
            raise self.fail(where, f"arrays nested more than {_GGUF_ARRAY_DEPTH} deep")
        item_type = self.scalar("I", where, "the array's item type")
        count = self.scalar("Q", where, "the array's length")
        if item_type in _GGUF_SCALARS:
            nbytes = count * struct.calcsize(_GGUF_SCALARS[item_type])
            if nbytes > self.size - self.offset:
                raise self.fail(where, f"array of {count} items runs past the end of the file")
            self.offset += nbytes
            return None
        if item_type not in (_GGUF_STRING, _GGUF_ARRAY):
            raise self.fail(where, f"array item type {item_type} is not a GGUF value type (allowed: 0-12)")
        if count * 8 > self.size - self.offset:  # each string or array item takes at least 8 bytes
            raise self.fail(where, f"array of {count} items runs past the end of the file")
        for _ in range(count):
            self.skip_value(item_type, where, depth + 1)
        return None


def read_gguf_table(path: str | os.PathLike) -> GGUFTable:
    """The header and tensor-info table of a GGUF file, checked before anything reads its tensors: every length and
    count fits in the file, at most 4 dimensions, known GGML types, rows a whole number of quantization blocks,
    each tensor's bytes (its type × shape) inside the data section, aligned, and no two tensors sharing bytes nor
    bytes between them that no tensor accounts for (what a type or shape changed after writing leaves). Anything
    else raises ``CheckpointError`` naming the file and the tensor or key."""
    import mmap

    import gguf

    path = Path(path)
    try:
        size = path.stat().st_size
        if size < _GGUF_HEADER:
            raise CheckpointError(f"{path}: not a readable GGUF file: {size} bytes, shorter than the "
                                  f"{_GGUF_HEADER}-byte GGUF header")
        with open(path, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return _parse_gguf_table(path, data, size, gguf)
    except OSError as error:
        raise CheckpointError(f"{path}: cannot read GGUF file ({error})") from error


def _parse_gguf_table(path: Path, data: Any, size: int, gguf: Any) -> GGUFTable:
    if bytes(data[:4]) != b"GGUF":
        raise CheckpointError(f"{path}: not a readable GGUF file: magic {bytes(data[:4])!r}, not b'GGUF'")
    endian = "<"
    (version,) = struct.unpack_from("<I", data, 4)
    if version & 0xFFFF == 0:  # written on a machine of the other byte order (as gguf's reader detects it)
        endian = ">"
        (version,) = struct.unpack_from(">I", data, 4)
    cursor = _GGUFCursor(path, data, size, endian)
    cursor.offset = 8
    if version not in (2, 3):
        raise cursor.fail("header", f"version {version}; GGUF versions 2 and 3 are read")
    tensor_count = cursor.scalar("Q", "header", "the tensor count")
    kv_count = cursor.scalar("Q", "header", "the key/value count")
    left = size - cursor.offset
    if kv_count > left // _GGUF_MIN_KV:
        raise cursor.fail("header", f"key/value count {kv_count}: at most {left // _GGUF_MIN_KV} fit in the "
                                    f"{left} bytes after the header (a truncated file or a corrupt count)")
    if tensor_count > left // _GGUF_MIN_INFO:
        raise cursor.fail("header", f"tensor count {tensor_count}: at most {left // _GGUF_MIN_INFO} tensor infos "
                                    f"fit in the {left} bytes after the header (a truncated file or a corrupt count)")
    alignment = gguf.GGUF_DEFAULT_ALIGNMENT
    keys: set[str] = set()
    for index in range(kv_count):
        where = f"key/value {index}"
        key = cursor.string(where, "key")
        where = f"key/value {index} ({key!r})"
        if key in keys:
            raise cursor.fail(where, "the key appears twice")
        keys.add(key)
        value_type = cursor.scalar("I", where, "its value type")
        value = cursor.skip_value(value_type, where)
        if key == "general.alignment":
            if value_type != _GGUF_UINT32 or not value or value & (value - 1):
                raise cursor.fail(where, f"general.alignment is {value!r} (value type {value_type}); allowed: a "
                                         "non-zero power of two stored as uint32")
            alignment = value
    infos: list[tuple[str, int, tuple[int, ...], int]] = []
    names: set[str] = set()
    for index in range(tensor_count):
        where = f"tensor info {index}"
        name = cursor.string(where, "name")
        where = f"tensor info {index} ({name!r})"
        if name in names:
            raise CheckpointError(f"{path}: tensor {name!r} appears twice in the tensor infos")
        names.add(name)
        n_dims = cursor.scalar("I", where, "its dimension count")
        if n_dims > _GGUF_MAX_DIMS:
            raise cursor.fail(where, f"{n_dims} dimensions; allowed: at most {_GGUF_MAX_DIMS}")
        dims = tuple(cursor.scalar("Q", where, "its dimensions") for _ in range(n_dims))
        raw_type = cursor.scalar("I", where, "its type")
        offset = cursor.scalar("Q", where, "its data offset")
        infos.append((name, raw_type, dims, offset))
    data_offset = cursor.offset + (-cursor.offset % alignment)
    tensors = []
    for name, raw_type, dims, offset in infos:
        try:
            ggml_type = gguf.GGMLQuantizationType(raw_type)
            block, type_size = gguf.GGML_QUANT_SIZES[ggml_type]
        except (ValueError, KeyError):
            raise CheckpointError(f"{path}: tensor {name!r} has type {raw_type}, which is no GGML type the installed "
                                  f"gguf package {getattr(gguf, '__version__', '')} knows") from None
        row = dims[0] if dims else 1
        if row % block:
            raise CheckpointError(
                f"{path}: tensor {name!r} is {ggml_type.name} with shape {list(reversed(dims))}: its rows of {row} "
                f"elements are not a multiple of {block}, the {ggml_type.name} block size")
        if offset % alignment:
            raise CheckpointError(f"{path}: tensor {name!r} has data offset {offset}, not a multiple of the "
                                  f"alignment {alignment}")
        elements = 1
        for dim in dims:
            elements *= dim
        info = GGUFTensorInfo(name, ggml_type, dims, data_offset + offset, elements // block * type_size)
        if info.data_start + info.nbytes > size:
            raise CheckpointError(f"{path}: {info.describe()} runs past the end of the file: the file ends at byte "
                                  f"{size} (data section from byte {data_offset})")
        tensors.append(info)
    _check_gguf_ranges(path, tensors, data_offset, alignment, size)
    return GGUFTable(version, alignment, data_offset, tensors)


def _check_gguf_ranges(path: Path, tensors: list[GGUFTensorInfo], data_offset: int, alignment: int,
                       size: int) -> None:
    """Tensors' byte ranges do not overlap, and the data section holds nothing else but alignment padding."""
    placed = sorted((t for t in tensors if t.nbytes), key=lambda t: (t.data_start, t.nbytes))
    cause = "a type or shape does not match the bytes written"
    position, previous = data_offset, None
    for tensor in placed:
        if previous is not None and tensor.data_start < previous.data_start + previous.nbytes:
            raise CheckpointError(f"{path}: {previous.describe()} overlaps {tensor.describe()}: {cause}, or two "
                                  "tensors point at the same bytes")
        if tensor.data_start - position >= alignment:
            after = f"after {previous.describe()}" if previous is not None else "at the start of the data section"
            raise CheckpointError(
                f"{path}: bytes {position}..{tensor.data_start} {after} and before {tensor.describe()} belong to no "
                f"tensor (no tensor accounts for them): {cause}")
        end = tensor.data_start + tensor.nbytes
        position, previous = end + (-end % alignment), tensor
    if previous is not None and size - position >= alignment:
        raise CheckpointError(
            f"{path}: bytes {position}..{size} after {previous.describe()}, the last tensor, belong to no tensor (no "
            f"tensor accounts for them): {cause}")
