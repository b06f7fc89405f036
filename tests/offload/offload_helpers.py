"""Shared builders and probes for the offload tests."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from diffusers import FluxTransformer2DModel, WanTransformer3DModel

from diffusers_omni.offload.hooks import hook_names
from diffusers_omni.pipelines.flux import OmniFluxPipeline
from diffusers_omni.pipelines.wan import OmniWanPipeline
from diffusers_omni.testing.tiny import tiny_flux_inputs, tiny_flux_pipeline, tiny_wan_components

FLUX_CALL = {"height": 32, "width": 32}
WAN_CALL = {"height": 32, "width": 32, "num_frames": 5}


def flux_pipe() -> OmniFluxPipeline:
    return tiny_flux_pipeline(pipeline_cls=OmniFluxPipeline)


def wan22_pipe() -> OmniWanPipeline:
    """Tiny Wan 2.2-style pipeline with two experts (high-noise ``transformer``, low-noise ``transformer_2``)."""
    components = tiny_wan_components(seed=0)
    second = tiny_wan_components(seed=1)["transformer"]
    return OmniWanPipeline(**{**components, "transformer_2": second}, boundary_ratio=0.5)


def generate(pipe: Any, steps: int = 3, **call: Any) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    kwargs = FLUX_CALL if isinstance(pipe, OmniFluxPipeline) else WAN_CALL
    output = pipe(
        prompt="a red fox in the snow",
        num_inference_steps=steps,
        generator=generator,
        output_type="latent",
        max_sequence_length=32,
        **{**kwargs, **call},
    )
    return output[0]


def bare_flux(num_layers: int = 3, num_single_layers: int = 4) -> FluxTransformer2DModel:
    torch.manual_seed(0)
    return FluxTransformer2DModel(
        patch_size=1,
        in_channels=16,
        num_layers=num_layers,
        num_single_layers=num_single_layers,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=32,
        pooled_projection_dim=32,
        guidance_embeds=True,
        axes_dims_rope=(4, 4, 8),
    ).eval()


def flux_inputs(seed: int = 0) -> dict[str, torch.Tensor]:
    return {**tiny_flux_inputs(seed), "return_dict": False}


def bare_wan() -> WanTransformer3DModel:
    return tiny_wan_components(seed=0)["transformer"]


def block_bytes(block: nn.Module) -> int:
    """Bytes materialised in a block's own parameters and buffers."""
    tensors = list(block.parameters()) + [b for b in block.buffers() if b is not None]
    return sum(t.numel() * t.element_size() for t in tensors)


def snapshot(*modules: nn.Module) -> dict[str, Any]:
    """Every tensor's id, device, dtype, values and ``requires_grad``, every hook name, and every module's
    ``__dict__`` (keys and the identity of each value: processors, hook registries, instance ``forward``...)."""
    state: dict[str, Any] = {}
    for index, module in enumerate(modules):
        for name, tensor in list(module.named_parameters()) + list(module.named_buffers()):
            state[f"{index}.{name}"] = (id(tensor), tensor.device, tensor.dtype, tensor.requires_grad,
                                        type(tensor), tensor.detach().clone())
        for name, sub in module.named_modules():
            state[f"{index}.{name}#hooks"] = hook_names(sub)
            state[f"{index}.{name}#registry"] = "_diffusers_hook" in sub.__dict__
            state[f"{index}.{name}#dict"] = {key: id(value) for key, value in sub.__dict__.items()}
    return state


def pipeline_snapshot(pipe: Any) -> dict[str, Any]:
    """``snapshot`` of every component plus the pipeline's and scheduler's own ``__dict__``."""
    state = snapshot(*pipeline_modules(pipe))
    state["pipe#dict"] = {key: id(value) for key, value in pipe.__dict__.items()}
    scheduler = getattr(pipe, "scheduler", None)
    if scheduler is not None:
        state["scheduler#dict"] = {key: id(value) for key, value in scheduler.__dict__.items()}
    return state


def assert_same_snapshot(before: dict[str, Any], after: dict[str, Any]) -> None:
    assert before.keys() == after.keys()
    for key, value in before.items():
        other = after[key]
        if isinstance(value, tuple) and value and isinstance(value[-1], torch.Tensor):
            assert value[:-1] == other[:-1], key
            if value[-1].device.type != "meta":  # meta tensors (Accelerate's sequential offload) have no values
                assert torch.equal(value[-1], other[-1]), key
        else:
            assert value == other, key


def mapped(ptr: int, nbytes: int) -> bool:
    """Whether ``[ptr, ptr + nbytes)`` lies inside one mapping of this process (``/proc/self/maps``)."""
    with open("/proc/self/maps") as handle:
        for line in handle:
            start, end = (int(x, 16) for x in line.split()[0].split("-"))
            if start <= ptr and ptr + nbytes <= end:
                return True
    return False


class FakeCudaRuntime:
    """The CUDA runtime's host registration, on CPU, for checking our lifecycle logic (the real runtime is
    exercised on the H200 by benchmarks/offload_lifecycle_bench.py).

    Tracks registered ranges and fails exactly where ``cudaHostRegister`` / ``cudaHostUnregister`` fail: a range
    overlapping a registered one (``cudaErrorHostMemoryAlreadyRegistered``), unregistering a pointer that is not
    the start of a registration (``cudaErrorHostMemoryNotRegistered``). Every call is logged.
    """

    def __init__(self, log: str | None = None) -> None:
        self.registered: dict[int, int] = {}
        self.calls: list[tuple[str, int]] = []
        self.synchronized = 0
        self.log = log  # a file every call is appended to (for checks after the process exits)

    def _record(self, call: str, ptr: int) -> None:
        self.calls.append((call, ptr))
        if self.log is not None:
            with open(self.log, "a") as handle:
                handle.write(f"{call} {ptr}\n")

    def register(self, ptr: int, nbytes: int) -> None:
        self._record("register", ptr)
        if not mapped(ptr, nbytes):
            raise RuntimeError("cudaHostRegister failed: cudaErrorInvalidValue (range not mapped)")
        for start, size in self.registered.items():
            if start < ptr + nbytes and ptr < start + size:
                raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed: cudaErrorHostMemoryAlreadyRegistered")
        self.registered[ptr] = nbytes

    def unregister(self, ptr: int) -> None:
        self._record("unregister", ptr)
        if ptr not in self.registered:
            raise RuntimeError("cudaHostUnregister failed: cudaErrorHostMemoryNotRegistered")
        if not mapped(ptr, self.registered[ptr]):
            # The real runtime's page-locked range would now be unmapped memory.
            raise RuntimeError("cudaHostUnregister after the memory was freed")
        del self.registered[ptr]

    def synchronize(self) -> None:
        self.synchronized += 1

    @property
    def registered_bytes(self) -> int:
        return sum(self.registered.values())


class InjectedFailure(Exception):
    pass


class CallCounter:
    """Wraps ``owner.name`` (a function, method or class) to count calls and raise ``InjectedFailure`` on call
    number ``fail_at`` (1-based; ``None`` only counts), before the call runs or, with ``after=True``, once it has
    returned. Install with ``install(monkeypatch)``."""

    def __init__(self, owner: Any, name: str, fail_at: int | None = None, after: bool = False) -> None:
        self.original = inspect.getattr_static(owner, name) if isinstance(owner, type) else getattr(owner, name)
        self.fail_at = fail_at
        self.after = after
        self.count = 0
        self.owner = owner
        self.name = name

    def install(self, monkeypatch: Any) -> "CallCounter":
        original = self.original
        counter = self

        if isinstance(original, staticmethod):
            function = original.__func__
        else:
            function = original

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            counter.count += 1
            failing = counter.count == counter.fail_at
            if failing and not counter.after:
                raise InjectedFailure(f"before {counter.name} call {counter.count}")
            result = function(*args, **kwargs)
            if failing:
                raise InjectedFailure(f"after {counter.name} call {counter.count}")
            return result

        monkeypatch.setattr(self.owner, self.name, staticmethod(wrapper) if isinstance(original, staticmethod)
                            else wrapper)
        return self


def pipeline_modules(pipe: Any) -> list[nn.Module]:
    return [m for m in pipe.components.values() if isinstance(m, nn.Module)]


def file_mappings() -> list[tuple[int, int, str]]:
    """``(start, end, path)`` of every file-backed mapping of this process (Linux ``/proc/self/maps``)."""
    mappings = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].startswith("/"):
                start, end = (int(x, 16) for x in fields[0].split("-"))
                mappings.append((start, end, fields[5].strip()))
    return mappings


def mapped_file(tensor: torch.Tensor, mappings=None) -> str | None:
    """The file whose mapping holds ``tensor``'s bytes (a zero-copy view of it), or ``None`` (anonymous memory)."""
    begin = tensor.data_ptr()
    end = begin + tensor.numel() * tensor.element_size()
    for start, stop, path in mappings if mappings is not None else file_mappings():
        if start <= begin and end <= stop:
            return path
    return None


def step_names(backend_cls: type) -> list[str]:
    """The method names of a backend class's enable steps, in order (``_enable_steps`` only looks its bound
    methods up, so an instance made without ``__init__`` answers)."""
    return [step.__name__ for step in backend_cls._enable_steps(object.__new__(backend_cls))]


def run_interpreted(test_file: str) -> None:
    """Run ``test_file``'s tests named ``*interpreted*`` in a child with ``TRITON_INTERPRET=1`` (Triton reads it when
    first imported, so a Triton kernel then runs on CPU tensors) and assert they all ran and passed."""
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                          test_file, "-k", "interpreted"], cwd=root, env=env, capture_output=True, text=True,
                         timeout=900)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and "skipped" not in run.stdout.splitlines()[-1], run.stdout[-2000:]
