"""#13 item 1: a registration lives exactly as long as its host buffer, whatever ends it: ``disable()``, garbage
collection of a model dropped without ``disable()``, or interpreter exit.

On CPU the CUDA runtime is replaced by ``FakeCudaRuntime``, which fails where ``cudaHostRegister`` /
``cudaHostUnregister`` fail (overlapping or unknown registrations) and also when a range is unregistered after its
memory was unmapped. The real runtime runs the same sequence on the H200 (benchmarks/offload_lifecycle_bench.py).
"""

from __future__ import annotations

import gc
import subprocess
import sys
import textwrap
import weakref
from pathlib import Path

import pytest
import torch

from diffusers_omni import OffloadConfig, apply_offload
from diffusers_omni.offload import memory
from offload_helpers import FakeCudaRuntime, bare_flux, flux_inputs, flux_pipe, generate

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


@pytest.fixture
def fake_cuda(monkeypatch):
    runtime = FakeCudaRuntime()
    monkeypatch.setattr(memory, "host_pinner", lambda device: runtime)
    return runtime


def _registers(runtime: FakeCudaRuntime) -> int:
    return sum(1 for call, _ in runtime.calls if call == "register")


def _unregisters(runtime: FakeCudaRuntime) -> int:
    return sum(1 for call, _ in runtime.calls if call == "unregister")


@pytest.mark.parametrize("strategy", ["layerwise", "model_level"])
def test_dropped_without_disable_then_a_second_model(strategy, fake_cuda):
    """The H200 sequence: offload a pipeline, drop it without disable() (``del pipe`` in a notebook), collect,
    offload a second one in the same process."""
    pipe = flux_pipe()
    getattr(pipe, f"enable_{strategy}_offload")(device="cpu", pin_memory=True)
    assert pipe.omni_offload_backend._state.host_memory.mode == "registered"
    generate(pipe, steps=1)
    assert fake_cuda.registered and memory.registered_host_bytes() == fake_cuda.registered_bytes
    alive = weakref.ref(pipe.transformer)
    del pipe
    gc.collect()
    assert alive() is None  # nothing keeps the dropped model alive
    assert fake_cuda.registered == {}  # unregistered before the pages were unmapped (the fake checks)
    assert memory.registered_host_bytes() == 0
    assert _registers(fake_cuda) == _unregisters(fake_cuda) > 0

    second = flux_pipe()
    reference = generate(second, steps=1)
    getattr(second, f"enable_{strategy}_offload")(device="cpu", pin_memory=True)
    assert torch.equal(generate(second, steps=1), reference)
    second.disable_omni_offload()
    assert fake_cuda.registered == {}


def test_disable_unregisters_once_and_tensors_stay_valid(fake_cuda):
    model = bare_flux()
    with torch.no_grad():
        reference = model(**flux_inputs())[0]
    backend = apply_offload(model, OffloadConfig("layerwise", device="cpu", pin_memory=True))
    registered = dict(fake_cuda.registered)
    assert registered and memory.registered_host_bytes() == sum(registered.values())
    backend.disable()
    assert fake_cuda.registered == {} and memory.registered_host_bytes() == 0
    # The weights now live in the (unregistered) pages as ordinary tensors.
    with torch.no_grad():
        assert torch.equal(model(**flux_inputs())[0], reference)
    unregisters = _unregisters(fake_cuda)
    del model, backend
    gc.collect()
    assert _unregisters(fake_cuda) == unregisters  # the pages' death does not unregister twice


def test_a_view_keeps_the_registration_alive(fake_cuda):
    """Registration ends with the storage, not with the tensor that allocated it."""
    runtime = fake_cuda
    host = memory.HostMemory(torch.device("cpu"), pin_memory=True)
    assert host.mode == "registered"
    buffer = host.allocate(3000, torch.bfloat16)
    assert buffer.data_ptr() % 4096 == 0
    buffer.fill_(1)
    host.pin(buffer)
    view = buffer[100:200].view(10, 10)
    del buffer, host
    gc.collect()
    assert len(runtime.registered) == 1
    assert view.sum().item() == 100
    del view
    assert runtime.registered == {} and _unregisters(runtime) == 1


def test_interpreter_exit_unregisters_what_is_still_alive(tmp_path):
    log = tmp_path / "calls.log"
    script = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {str(HERE)!r})
        import torch
        from diffusers_omni.offload import memory
        from offload_helpers import FakeCudaRuntime, flux_pipe
        runtime = FakeCudaRuntime(log={str(log)!r})
        memory.host_pinner = lambda device: runtime
        pipe = flux_pipe()
        pipe.enable_layerwise_offload(device="cpu", pin_memory=True)
        assert runtime.registered
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    calls = [line.split() for line in log.read_text().splitlines()]
    registered = {ptr for call, ptr in calls if call == "register"}
    unregistered = [ptr for call, ptr in calls if call == "unregister"]
    assert registered and sorted(unregistered) == sorted(registered)
    assert "failed" not in proc.stderr


@pytest.mark.parametrize("strategy", ["layerwise", "model_level"])
def test_delete_and_rebuild_cycles(strategy, fake_cuda):
    """Ten cycles of build, offload, generate, drop without disable: no registration, pipeline or host page
    outlives its cycle, and host RSS stays flat."""

    def rss() -> int:
        with open("/proc/self/statm") as handle:
            return int(handle.read().split()[1]) * 4096

    growth = []
    for cycle in range(10):
        pipe = flux_pipe()
        getattr(pipe, f"enable_{strategy}_offload")(device="cpu", pin_memory=True)
        generate(pipe, steps=1)
        pages = [weakref.ref(p) for p in pipe.omni_offload_backend._state.host_memory._pages.values()]
        assert pages
        if cycle % 2:
            pipe.disable_omni_offload()
        del pipe
        gc.collect()
        assert all(page() is None for page in pages)
        assert fake_cuda.registered == {} and memory.registered_host_bytes() == 0
        growth.append(rss())
    assert _registers(fake_cuda) == _unregisters(fake_cuda) >= 10
    assert growth[-1] - growth[2] < 16 * 2**20, [g // 2**20 for g in growth]
