"""What an offloaded pipeline says when used the way offload cannot serve (#28 item 9): a failed enable's rollback
is logged as the rollback it is, a backward through streamed weights is refused by name, and pickling refuses
with the way out."""

from __future__ import annotations

import copy
import io
import logging
import pickle

import pytest
import torch
import torch.distributed as dist

from diffusers_omni import OffloadConfig, apply_offload
from diffusers_omni.offload import memory
from diffusers_omni.offload.hooks import InferenceOnlyError

from offload_helpers import (
    assert_same_snapshot,
    bare_flux,
    flux_inputs,
    flux_pipe,
    generate,
    pipeline_snapshot,
)


@pytest.fixture
def one_rank_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


# A host allocation failing while enabling ---------------------------------------------------------------------------


@pytest.mark.parametrize("strategy", ["layerwise", "model_level"])
@pytest.mark.parametrize("fail_at", [1, 2])
def test_host_allocation_failure_rolls_back_without_an_error_for_untouched_blocks(strategy, fail_at, monkeypatch,
                                                                                    caplog):
    """Before: the unit whose host allocation failed (its packing never started) was 'restored' too, which raised
    inside the rollback and logged an ERROR traceback ('rollback step ... failed'), suggesting corruption."""
    pipe = flux_pipe()
    before = pipeline_snapshot(pipe)
    packed: list[str] = []
    calls = {"allocate": 0}
    original_pack, original_allocate = memory.PackedWeights.pack, memory.HostMemory.allocate

    def pack(self, host_memory, release=None):
        packed.append(self.path)
        return original_pack(self, host_memory, release)

    def allocate(self, numel, dtype):
        calls["allocate"] += 1
        if calls["allocate"] == fail_at:
            raise MemoryError("host allocation failed (injected)")
        return original_allocate(self, numel, dtype)

    monkeypatch.setattr(memory.PackedWeights, "pack", pack)
    monkeypatch.setattr(memory.HostMemory, "allocate", allocate)
    with caplog.at_level(logging.INFO, logger="diffusers_omni"), pytest.raises(MemoryError):
        getattr(pipe, f"enable_{strategy}_offload")(device="cpu")
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
    rolled_back = [r.getMessage() for r in caplog.records if r.getMessage().startswith("offload: rolling back ")]
    # Every unit packed before the failing one is rolled back and says so; the failing one is left alone.
    assert len(rolled_back) == len(packed) - 1
    for path, message in zip(packed[:-1], reversed(rolled_back)):
        assert message.startswith(f"offload: rolling back {path}:"), message
    assert_same_snapshot(before, pipeline_snapshot(pipe))
    assert pipe.omni_offload_backend is None


# Backward through streamed weights ----------------------------------------------------------------------------------


def _enable(model, strategy: str):
    if strategy == "layerwise":
        return apply_offload(model, OffloadConfig("layerwise", device="cpu"))
    return apply_offload(model, OffloadConfig("distributed_layerwise", device="cpu",
                                              use_allgather=strategy == "distributed_allgather"))


@pytest.mark.parametrize("strategy", ["layerwise", "distributed_allgather", "distributed_no_allgather"])
def test_backward_through_streamed_weights_is_refused_by_name(strategy, request):
    """Before: RuntimeError 'setStorage: ... out of bounds for storage of size 0' (layerwise); AllGather slots are
    reused, so its gradients would be silently wrong."""
    if strategy.startswith("distributed"):
        request.getfixturevalue("one_rank_group")
    model = bare_flux()
    inputs = flux_inputs(0)
    with torch.no_grad():
        reference = model(**inputs)[0]
    backend = _enable(model, strategy)
    output = model(**inputs)[0]  # grad enabled: the forward itself still works and is bitwise equal
    assert torch.equal(output.detach(), reference) and output.requires_grad
    with pytest.raises(InferenceOnlyError) as info:
        output.sum().backward()
    message = str(info.value)
    assert "inference only" in message and "torch.no_grad()" in message and "backend.disable()" in message
    assert "FluxTransformer2DModel" in message
    # Gradients for the inputs only (weights frozen) need the weights too: refused the same way.
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    hidden = inputs["hidden_states"].clone().requires_grad_(True)
    with pytest.raises(InferenceOnlyError):
        model(**{**inputs, "hidden_states": hidden})[0].sum().backward()
    with torch.no_grad():  # nothing is left behind: the next calls are bitwise equal
        assert torch.equal(model(**inputs)[0], reference)
    backend.disable()
    resident = inputs["hidden_states"].clone().requires_grad_(True)
    model(**{**inputs, "hidden_states": resident})[0].sum().backward()  # resident again: backward works
    assert resident.grad is not None and hidden.grad is None


def test_pipeline_backward_error_names_the_pipeline_way_out():
    pipe = flux_pipe()
    pipe.enable_layerwise_offload(device="cpu")
    output = pipe.transformer(**flux_inputs(0))[0]
    with pytest.raises(InferenceOnlyError, match=r"backward through 'transformer'.*pipe\.disable_omni_offload\(\)"):
        output.sum().backward()
    assert generate(pipe, steps=1) is not None  # pipelines run under no_grad: unaffected
    pipe.disable_omni_offload()


def test_model_level_backward_still_works():
    """Model-level offload computes on whole, onloaded weights; the docs say only streamed weights cannot serve
    autograd."""
    model = bare_flux()
    inputs = flux_inputs(0)
    model(**inputs)[0].sum().backward()
    expected = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    backend = apply_offload(model, OffloadConfig("model_level", device="cpu"))
    model(**inputs)[0].sum().backward()
    assert all(torch.equal(p.grad, expected[name]) for name, p in model.named_parameters())
    backend.disable()


# Pickling -------------------------------------------------------------------------------------------------------------


def _pickle_attempts(obj):
    return {
        "pickle": lambda: pickle.dumps(obj),
        "torch.save": lambda: torch.save(obj, io.BytesIO()),
        "deepcopy": lambda: copy.deepcopy(obj),
    }


@pytest.mark.parametrize("strategy", ["layerwise", "model_level"])
def test_pickling_an_offloaded_pipeline_or_component_says_how(strategy):
    """Before: "Can't pickle local object 'LayerwiseOffloadBackend._state_dict_hooks.<locals>.put_back'" (or a
    guard's local function, or 'not the same object')."""
    pipe = flux_pipe()
    reference = generate(pipe, steps=1)
    getattr(pipe, f"enable_{strategy}_offload")(device="cpu")
    for name, obj in [("pipe", pipe), ("transformer", pipe.transformer), ("text_encoder", pipe.text_encoder),
                      ("vae", pipe.vae)]:
        for how, attempt in _pickle_attempts(obj).items():
            with pytest.raises(TypeError) as info:
                attempt()
            message = str(info.value)
            assert message.startswith("cannot pickle (or deep-copy) a model while diffusers-omni offload is enabled"), \
                (name, how, message)
            assert "disable_omni_offload()" in message
    assert torch.equal(generate(pipe, steps=1), reference)  # the refusals changed nothing
    pipe.disable_omni_offload()
    restored = pickle.loads(pickle.dumps(pipe.transformer))  # picklable again, with its weights
    assert all(torch.equal(a, b) for a, b in zip(restored.state_dict().values(), pipe.transformer.state_dict().values()))


def test_pickling_a_bare_offloaded_model_names_backend_disable():
    model = bare_flux()
    backend = apply_offload(model, OffloadConfig("layerwise", device="cpu"))
    with pytest.raises(TypeError, match=r"backend\.disable\(\)"):
        pickle.dumps(model)
    backend.disable()
    pickle.dumps(model)
