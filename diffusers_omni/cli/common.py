"""Helpers shared by the CLI commands: argument types, tables, logging, platform overrides and pipeline loading."""

from __future__ import annotations

import argparse
import logging
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..attention.selector import environment_backend
from ..config.names import did_you_mean

TINY_MODELS = ("tiny-flux", "tiny-wan", "tiny-wan-i2v", "tiny-nextstep", "tiny-bagel", "tiny-soulx-singer")


# Repositories published without a model_index.json whose layout a pipeline class of this package reads itself:
# the ``model_type`` of their config.json -> (module, pipeline class).
PUBLISHED_LAYOUTS = {"nextstep": ("diffusers_omni.architectures.nextstep", "NextStep11Pipeline")}


def read_model_json(model: str, name: str) -> dict | None:
    """A JSON file of a local model folder or of a hub repository (that one file is downloaded); ``None`` when it
    cannot be read (offline, no such file or repository, unreadable JSON: the load reports it)."""
    import json

    root = Path(model).expanduser()
    try:
        if root.is_dir():
            return json.loads((root / name).read_text()) if (root / name).is_file() else None
        if model in TINY_MODELS or model.count("/") != 1:
            return None
        from huggingface_hub import hf_hub_download

        return json.loads(Path(hf_hub_download(model, name)).read_text())
    except Exception:
        return None


def published_layout_class(model: str) -> type | None:
    """The pipeline class that reads ``model`` as published (a local folder or hub id with no model_index.json whose
    config.json names a ``model_type`` of ``PUBLISHED_LAYOUTS``), else ``None``."""
    import importlib

    config = read_model_json(model, "config.json")
    entry = PUBLISHED_LAYOUTS.get(config.get("model_type")) if isinstance(config, dict) else None
    if entry is None or read_model_json(model, "model_index.json") is not None:
        return None
    return getattr(importlib.import_module(entry[0]), entry[1])


class UsageError(ValueError):
    """Invalid command-line input; the message names the flag and the value (exit status 2)."""


# Argument types: argparse turns ArgumentTypeError into "argument --steps: <message>" and exit status 2.

# Upper bounds of the counts (a run that could never finish, or whose schedule alone fills the memory, is refused
# by the parser): denoising steps (FLUX.1-dev runs 28, Wan 50), warm-up calls or runs, and timed repeats.
MAX_STEPS = 1000
MAX_WARMUP = 100
MAX_REPEATS = 1000


def bounded_int(low: int, high: int) -> Callable[[str], int]:
    """An argument type: an integer from ``low`` to ``high``; anything else is refused naming the range."""

    def parse(text: str) -> int:
        value = _int(text)
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be an integer from {low} to {high}, got {text!r}")
        return value

    parse.__name__ = f"integer from {low} to {high}"
    return parse


steps_int = bounded_int(1, MAX_STEPS)


def positive_int(text: str) -> int:
    value = _int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def non_negative_int(text: str) -> int:
    value = _int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer ≥ 0, got {text!r}")
    return value


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None


def finite_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number ≥ 0, got {text!r}")
    return value


def device_arg(text: str) -> str:
    """A torch device string that exists on this machine (``cuda``/``xpu``/``mps``/``npu`` without one, or an index
    past the device count, is refused here, not mid-run)."""
    import torch

    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a torch device; expected cpu, cuda, cuda:N or mps") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise argparse.ArgumentTypeError(
                f"{text!r}: CUDA is not available here (torch {torch.__version__}"
                f"{', built without CUDA' if torch.version.cuda is None else ', no GPU visible'}); use --device cpu"
            )
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise argparse.ArgumentTypeError(f"{text!r}: only {torch.cuda.device_count()} CUDA device(s) visible")
    elif device.type == "mps" and not torch.backends.mps.is_available():
        raise argparse.ArgumentTypeError(f"{text!r}: MPS is not available here; use --device cpu")
    elif device.type in ("xpu", "npu"):
        # torch.xpu ships with torch; torch.npu exists only once torch_npu is imported.
        backend = getattr(torch, device.type, None)
        name = device.type.upper()
        if backend is None or not backend.is_available():
            raise argparse.ArgumentTypeError(
                f"{text!r}: {name} is not available here (torch {torch.__version__}"
                f"{'' if backend is not None else f', no torch.{device.type} (torch_npu not imported)'}); "
                "use --device cpu")
        if device.index is not None and device.index >= backend.device_count():
            raise argparse.ArgumentTypeError(f"{text!r}: only {backend.device_count()} {name} device(s) visible")
    elif device.type != "cpu":
        raise argparse.ArgumentTypeError(f"{text!r}: device type {device.type!r} is not supported; use cpu, cuda or mps")
    return text


def check_attention_environment() -> None:
    """Refuse an unknown ``DIFFUSION_ATTENTION_BACKEND`` or ``DIFFUSERS_ATTN_BACKEND`` in one line (exit status 2).

    Runs before any command imports Diffusers: Diffusers validates ``DIFFUSERS_ATTN_BACKEND`` when
    ``diffusers.models.attention_dispatch`` is imported and fails with a traceback from deep inside its import.
    """
    try:
        environment_backend()
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def check_writable(path: Path, flag: str = "--output") -> None:
    """Refuse an output path that cannot be written before any work is done (creates missing parent folders)."""
    import tempfile

    if path.is_dir():
        raise UsageError(f"{flag}={str(path)!r} is a directory; give a file name such as {str(path / 'omni.png')!r}")
    existing = next(p for p in (path.parent, *path.parent.parents) if p.exists())
    if not existing.is_dir():
        raise UsageError(f"{flag}={str(path)!r}: cannot write there ({existing} is a file, not a directory)")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path.parent):
            pass
    except OSError as exc:
        raise UsageError(f"{flag}={str(path)!r}: cannot write there ({exc.strerror or exc})") from None


def check_output(path: Path, overwrite: bool, flag: str = "--output") -> bool:
    """``check_writable``, and an existing file refused unless ``overwrite`` (``--overwrite``): nothing is replaced
    by surprise. Returns whether the run will replace a file."""
    check_writable(path, flag)
    if path.exists():
        if not overwrite:
            raise UsageError(f"{flag}={str(path)!r} exists; pass --overwrite to replace it, or give another {flag}")
        return True
    return False


def write_replacing(path: Path, write: Callable[[Path], None]) -> bool:
    """Write ``path`` through ``write(temporary path)`` (a file of the same suffix in the same folder) renamed over
    it: a reader of the old file keeps it whole and a failed write leaves the old file as it was. Returns whether a
    file was replaced."""
    import os
    import tempfile

    path.parent.mkdir(parents=True, exist_ok=True)
    replaced = path.exists()
    if replaced:
        mode = path.stat().st_mode & 0o7777
    else:
        umask = os.umask(0)
        os.umask(umask)
        mode = 0o666 & ~umask
    handle, name = tempfile.mkstemp(prefix=f".{path.stem}.", suffix=path.suffix, dir=path.parent)
    os.close(handle)
    temporary = Path(name)
    try:
        write(temporary)
        os.chmod(temporary, mode)
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    return replaced


# Pipelines of this package's own architectures (Diffusers cannot resolve them from a model_index.json), by the
# class name a saved directory records; the published layouts they also load are recognised by their files.
OWN_PIPELINES = {"BagelPipeline": "diffusers_omni.architectures.bagel"}
_PUBLISHED_LAYOUTS = {"BagelPipeline": ("llm_config.json", "ema.safetensors")}  # ByteDance-Seed/BAGEL-7B-MoT


def own_pipeline_class(model: str) -> type | None:
    """The pipeline class of this package that loads the local directory ``model`` (saved with
    ``save_pretrained``, or in a published layout it reads), else ``None``."""
    import importlib
    import json

    path = Path(model).expanduser()
    if not path.is_dir():
        return None
    name = None
    index = path / "model_index.json"
    if index.is_file():
        try:
            name = json.loads(index.read_text()).get("_class_name")
        except (OSError, ValueError):
            return None
    else:
        name = next((cls for cls, files in _PUBLISHED_LAYOUTS.items()
                     if all((path / file).is_file() for file in files)), None)
    if name not in OWN_PIPELINES:
        return None
    return getattr(importlib.import_module(OWN_PIPELINES[name]), name)


def check_model(model: str, flag: str = "--model") -> None:
    """A tiny model name, a Diffusers pipeline directory, or something that looks like a hub id."""
    if model in TINY_MODELS:
        return
    path = Path(model).expanduser()
    if path.is_dir():
        if (not (path / "model_index.json").is_file() and published_layout_class(model) is None
                and own_pipeline_class(model) is None):
            raise UsageError(
                f"{flag}={model!r} is a directory without model_index.json; expected a pipeline saved with "
                "save_pretrained (or a hub snapshot), a hub id, or one of " + ", ".join(TINY_MODELS)
            )
        return
    hub_like = model.count("/") == 1 and not model.startswith(("/", ".", "~"))
    hint = "" if hub_like else did_you_mean(model, TINY_MODELS, prefix=" (did you mean ", suffix="?)")
    looks_local = model.startswith(("/", ".", "~")) or path.exists() or model.count("/") > 1
    if hint or looks_local:
        raise UsageError(
            f"{flag}={model!r} is not a model directory{hint}; expected a local pipeline directory, a hub id such "
            f"as 'black-forest-labs/FLUX.1-dev', or one of {', '.join(TINY_MODELS)}"
        )
    if not hub_like:
        raise UsageError(f"{flag}={model!r} is neither a local directory nor a hub id (hub ids are 'owner/name', "
                         f"e.g. 'black-forest-labs/FLUX.1-dev'), nor one of {', '.join(TINY_MODELS)}")
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(model)
    except HFValidationError as exc:
        raise UsageError(f"{flag}={model!r} is not a valid hub id ({exc})") from None


# How long the hub may take to say whether a model exists before it counts as unreachable.
HUB_PROBE_TIMEOUT_S = 3.0
_hub_answers: dict[str, str] = {}


def check_hub_model(model: str, flag: str = "--model") -> None:
    """For a hub id (``check_model`` passed, no local directory): within seconds, whether the hub has it, without
    Diffusers' download retries. ``UsageError`` (exit 2) when the hub answers that there is no such model;
    ``OSError`` (exit 1) when the hub cannot be reached, or offline (``HF_HUB_OFFLINE=1``), and no copy is in the
    local cache. With a cached copy and no hub, the rest of the run is switched to the cache (offline mode) with one
    warning, so that no download is attempted (and retried) later."""
    if model in TINY_MODELS or Path(model).expanduser().is_dir() or model in _hub_answers:
        return
    from huggingface_hub import HfApi, constants, try_to_load_from_cache
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    cached = isinstance(try_to_load_from_cache(model, "model_index.json"), str)
    if constants.is_offline_mode():
        if not cached:
            raise OSError(f"{flag}={model!r}: offline (HF_HUB_OFFLINE=1) and not in the local cache "
                          f"({constants.HF_HUB_CACHE}); unset HF_HUB_OFFLINE to download it, or give a local "
                          "pipeline directory")
        _hub_answers[model] = "cached"
        return
    endpoint = constants.ENDPOINT
    try:
        HfApi(endpoint=endpoint).model_info(model, timeout=HUB_PROBE_TIMEOUT_S)
    except GatedRepoError:
        pass  # it exists; the download says what access it needs
    except RepositoryNotFoundError:
        raise UsageError(f"{flag}={model!r}: no such model on the hub ({endpoint}), or a private one this machine "
                         "is not logged in for (`hf auth login`)") from None
    except Exception as exc:  # no network, DNS, proxy, timeout, the hub failing: it cannot say
        reason = " ".join(str(exc).split()) or type(exc).__name__
        if not cached:
            raise OSError(f"{flag}={model!r}: cannot reach the hub ({endpoint}: {reason}) and it is not in the local "
                          "cache; check the network (or HF_ENDPOINT, a proxy), or give a local pipeline "
                          "directory") from None
        constants.HF_HUB_OFFLINE = True  # read at each request: every later download reads the cache, no retries
        import sys

        print(f"diffusers-omni: warning: cannot reach the hub ({endpoint}: {reason}); using the cached copy of "
              f"{model} (as with HF_HUB_OFFLINE=1)", file=sys.stderr)
        _hub_answers[model] = "cached"
        return
    _hub_answers[model] = "hub"


# The compute capabilities of NVIDIA GPUs (CUDA's sm_XY architectures, Maxwell to Blackwell) that --platform simulates.
KNOWN_SM = ("sm_50", "sm_52", "sm_53", "sm_60", "sm_61", "sm_62", "sm_70", "sm_72", "sm_75", "sm_80", "sm_86",
            "sm_87", "sm_89", "sm_90", "sm_100", "sm_101", "sm_103", "sm_110", "sm_120", "sm_121")


def parse_platform(text: str | None):
    """``--platform`` values: ``cpu``, ``mps``, or ``sm_XY[,cudnn=N]`` (e.g. ``sm_90,cudnn=91900``) for a compute
    capability of ``KNOWN_SM``."""
    from ..attention.platform import Platform

    if text is None:
        return None
    head, *options = [part.strip() for part in text.split(",")]
    if head in ("cpu", "mps"):
        return Platform(device_type=head, device_name=head.upper())
    if not (head.startswith("sm_") and head[3:].isdigit() and len(head) >= 5):
        raise UsageError(f"--platform={text!r}: expected cpu, mps or sm_XY[,cudnn=N] (e.g. sm_90,cudnn=91900)")
    if head not in KNOWN_SM:
        raise UsageError(f"--platform={text!r}: {head} is no NVIDIA GPU's compute capability; allowed: cpu, mps, "
                         f"{', '.join(KNOWN_SM)}")
    digits = head[3:]
    capability = (int(digits[:-1]), int(digits[-1]))
    cudnn = 91900
    for option in options:
        key, _, value = option.partition("=")
        if key != "cudnn" or not value.isdigit():
            raise UsageError(f"--platform option {option!r} is not allowed; allowed: cudnn=N")
        cudnn = int(value)
    return Platform(device_type="cuda", device_name=f"simulated {head}", compute_capability=capability, cudnn_version=cudnn)


_HANDLER_NAME = "diffusers-omni-cli"


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is at each record (not the stream of the first call: ``main`` may run
    several times in one process, each with its own stderr)."""

    def __init__(self) -> None:
        super().__init__()

    @property
    def stream(self):
        import sys

        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


def configure_logging(verbose: int | bool = 0, rank: int = 0) -> None:
    """Diffusers-style logging for the CLI: our warnings by default, ``-v`` INFO, ``-vv`` DEBUG (Diffusers' too).

    Only the ``diffusers_omni`` logger gets a handler; the root logger is left alone. Ranks other than 0 of a
    distributed run show errors only.
    """
    level = logging.WARNING if not verbose else (logging.INFO if int(verbose) == 1 else logging.DEBUG)
    if rank != 0:
        level = logging.ERROR
    logger = logging.getLogger("diffusers_omni")
    if not any(getattr(h, "name", None) == _HANDLER_NAME for h in logger.handlers):
        handler = _StderrHandler()
        handler.set_name(_HANDLER_NAME)
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        logger.addHandler(handler)
    logger.setLevel(level)
    if int(verbose) >= 2:
        from diffusers.utils import logging as diffusers_logging

        diffusers_logging.set_verbosity_debug()


def load_pipeline(model: str, dtype: Any = None, mmap: bool = False, transformer_gguf: str | None = None):
    """A tiny local pipeline by name, or any supported Diffusers pipeline through ``from_pretrained``.

    With ``mmap``, every DiT the pipeline declares is loaded with ``load_transformer_mmap`` (weights stay views of
    the safetensors files, shared through the page cache, so ranks of a distributed run do not each hold a copy).
    With ``transformer_gguf``, the pipeline's ``transformer`` comes from that GGUF file through ``load_gguf_mmap``
    (quantized weights that stay views of the file, computing in ``dtype``; a host budget reads its blocks back
    from it) and every other component from ``model``.
    """
    from ..utils.quiet import quiet_torchvision_fallback

    with quiet_torchvision_fallback():  # the tiny pipelines' module imports Diffusers' models (quantizer notices)
        from .. import testing

    check_model(model)
    if transformer_gguf is not None:
        if model in TINY_MODELS:
            raise UsageError(f"--transformer-gguf needs a model directory or hub id (the transformer's config and "
                             f"the other components); got {model!r} (built in memory, no files)")
        if mmap:
            raise UsageError("--transformer-gguf and --mmap both load the transformer; give one of them")
        with quiet_torchvision_fallback():
            return _load_with_gguf_transformer(model, dtype, transformer_gguf)
    if mmap:
        if model in TINY_MODELS:
            raise UsageError(f"--mmap needs a model directory or hub id; got {model!r} (built in memory, no files)")
        with quiet_torchvision_fallback():
            return _load_with_mmap_dits(model, dtype)

    if model in TINY_MODELS:
        pipe = _tiny_pipeline(model, testing)
        return pipe if dtype is None else pipe.to(dtype)  # built in float32: --dtype casts it, as torch_dtype would
    from diffusers import DiffusionPipeline

    kwargs = {"torch_dtype": dtype} if dtype is not None else {}
    own = published_layout_class(model) or own_pipeline_class(model)
    with quiet_torchvision_fallback():
        if own is not None:
            return own.from_pretrained(model, **kwargs)
        return DiffusionPipeline.from_pretrained(model, **kwargs)


def _tiny_pipeline(model: str, testing: Any):
    """The tiny pipeline named ``model`` (random weights, built in memory, float32)."""
    if model == "tiny-flux":
        return testing.tiny_flux_pipeline()
    if model == "tiny-wan":
        return testing.tiny_wan_pipeline()
    if model == "tiny-wan-i2v":
        return testing.tiny_wan_i2v_pipeline()
    if model == "tiny-nextstep":
        from ..testing.tiny_nextstep import tiny_nextstep_pipeline

        return tiny_nextstep_pipeline()
    if model == "tiny-bagel":
        from ..testing.tiny_bagel import tiny_bagel_pipeline

        return tiny_bagel_pipeline()
    if model == "tiny-soulx-singer":
        from ..testing.tiny_soulx_singer import tiny_soulx_singer_pipeline

        return tiny_soulx_singer_pipeline()
    raise UsageError(f"no tiny pipeline named {model!r}")


def _pipeline_folder(model: str) -> tuple[Path, dict, Callable[[str], type | None]]:
    """The local folder of ``model`` (downloaded with Diffusers' own filtering when it is a hub id), its
    ``model_index.json``, and the class of a component by path (``None``: the pipeline has none)."""
    import importlib

    from diffusers import DiffusionPipeline

    root = Path(model)
    if not root.is_dir():
        # Diffusers' own filtering (the pipeline's component folders, safetensors over .bin, no single-file
        # checkpoints), as from_pretrained downloads; a bare snapshot_download would fetch the whole repository.
        root = Path(DiffusionPipeline.download(model))
    index = DiffusionPipeline.load_config(root)

    def component_class(path: str) -> type | None:
        entry = index.get(path)
        if not isinstance(entry, (list, tuple)) or entry[1] is None:
            return None
        library, class_name = entry
        return getattr(importlib.import_module(library), class_name)

    return root, index, component_class


def _load_with_mmap_dits(model: str, dtype: Any):
    import diffusers
    from diffusers import DiffusionPipeline

    from ..offload.loading import load_transformer_mmap
    from ..pipelines.registry import omni_pipeline_class

    root, index, component_class = _pipeline_folder(model)
    pipeline_cls = getattr(diffusers, index["_class_name"])
    components = {}
    for path in omni_pipeline_class(pipeline_cls)._dit_modules:
        model_cls = component_class(path)
        if model_cls is not None:
            components[path] = load_transformer_mmap(model_cls, root, subfolder=path, torch_dtype=dtype)
    kwargs = {"torch_dtype": dtype} if dtype is not None else {}
    return DiffusionPipeline.from_pretrained(root, **components, **kwargs)


def _load_with_gguf_transformer(model: str, dtype: Any, gguf_file: str):
    import torch
    from diffusers import DiffusionPipeline

    from ..offload.loading import load_gguf_mmap

    root, _, component_class = _pipeline_folder(model)
    model_cls = component_class("transformer")
    if model_cls is None:
        raise UsageError(f"--transformer-gguf: {model!r} has no transformer component to load from {gguf_file}")
    transformer = load_gguf_mmap(model_cls, gguf_file, config=root, subfolder="transformer",
                                 compute_dtype=dtype or torch.float32, torch_dtype=dtype)
    kwargs = {"torch_dtype": dtype} if dtype is not None else {}
    return DiffusionPipeline.from_pretrained(root, transformer=transformer, **kwargs)
