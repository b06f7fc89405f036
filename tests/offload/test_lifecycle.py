"""Enable is all-or-nothing, conflicts with other offloaders are refused, model-level keeps DiTs and encoders apart."""

from __future__ import annotations

import accelerate.hooks
import pytest
import torch
from diffusers.hooks import apply_group_offloading

from diffusers_omni import OffloadConfig, apply_offload
from diffusers_omni.offload.discovery import OffloadConflictError
from diffusers_omni.offload.layerwise import LayerwiseOffloadBackend
from diffusers_omni.offload.model_level import ModelLevelOffloadBackend
from offload_helpers import (
    assert_same_snapshot,
    bare_flux,
    flux_pipe,
    generate,
    pipeline_modules,
    snapshot,
    step_names,
    wan22_pipe,
)


class InjectedFailure(Exception):
    pass


def _fail_after(backend_cls, stage, monkeypatch):
    original = getattr(backend_cls, stage)

    def failing(self, state, journal):
        original(self, state, journal)
        raise InjectedFailure(stage)

    monkeypatch.setattr(backend_cls, stage, failing)


@pytest.mark.parametrize("stage", step_names(LayerwiseOffloadBackend))
def test_layerwise_failure_at_each_stage_leaves_pipeline_untouched(stage, monkeypatch):
    pipe = flux_pipe()
    reference = generate(pipe, steps=2)
    before = snapshot(*pipeline_modules(pipe))
    _fail_after(LayerwiseOffloadBackend, stage, monkeypatch)
    with pytest.raises(InjectedFailure):
        pipe.enable_layerwise_offload(device="cpu")
    assert_same_snapshot(before, snapshot(*pipeline_modules(pipe)))
    assert pipe.omni_offload_backend is None
    monkeypatch.undo()
    assert torch.equal(generate(pipe, steps=2), reference)
    pipe.enable_layerwise_offload(device="cpu")  # a later enable works
    pipe.disable_omni_offload()


@pytest.mark.parametrize("stage", step_names(ModelLevelOffloadBackend))
def test_model_level_failure_at_each_stage_leaves_pipeline_untouched(stage, monkeypatch):
    pipe = flux_pipe()
    before = snapshot(*pipeline_modules(pipe))
    _fail_after(ModelLevelOffloadBackend, stage, monkeypatch)
    with pytest.raises(InjectedFailure):
        pipe.enable_model_level_offload(device="cpu")
    assert_same_snapshot(before, snapshot(*pipeline_modules(pipe)))


def test_bare_model_failure_leaves_model_untouched(monkeypatch):
    model = bare_flux()
    before = snapshot(model)
    _fail_after(LayerwiseOffloadBackend, "_install_hooks", monkeypatch)
    with pytest.raises(InjectedFailure):
        apply_offload(model, OffloadConfig("layerwise", device="cpu"))
    assert_same_snapshot(before, snapshot(model))


def test_disable_removes_only_own_hooks():
    pipe = flux_pipe()
    pipe.transformer.enable_cache  # noqa: B018 - the cache API exists on the model
    from diffusers import FirstBlockCacheConfig

    pipe.transformer.enable_cache(FirstBlockCacheConfig(threshold=0.0))
    with_cache = snapshot(pipe.transformer)
    pipe.enable_layerwise_offload(device="cpu")
    generate(pipe, steps=2)
    pipe.disable_omni_offload()
    after = snapshot(pipe.transformer)
    hooks = {k: v for k, v in with_cache.items() if k.endswith("#hooks")}
    assert hooks == {k: v for k, v in after.items() if k.endswith("#hooks")}
    assert any(v for v in hooks.values())  # the cache hooks are still there


def test_group_offloading_conflict_names_the_module():
    pipe = flux_pipe()
    apply_group_offloading(pipe.transformer, onload_device=torch.device("cpu"), offload_type="block_level",
                           num_blocks_per_group=1)
    before = snapshot(pipe.text_encoder)
    with pytest.raises(OffloadConflictError, match=r"'transformer.*group offloading.*enable_group_offload"):
        pipe.enable_layerwise_offload(device="cpu")
    with pytest.raises(OffloadConflictError, match="'transformer"):
        pipe.enable_model_level_offload(device="cpu")
    assert_same_snapshot(before, snapshot(pipe.text_encoder))


def test_accelerate_hook_conflict_names_the_module():
    pipe = flux_pipe()
    accelerate.hooks.add_hook_to_module(pipe.text_encoder_2, accelerate.hooks.AlignDevicesHook(execution_device="cpu"))
    with pytest.raises(OffloadConflictError, match=r"'text_encoder_2' has an Accelerate hook.*remove_all_hooks"):
        pipe.enable_model_level_offload(device="cpu")


def test_second_enable_is_refused_until_disabled():
    pipe = flux_pipe()
    pipe.enable_layerwise_offload(device="cpu")
    with pytest.raises(RuntimeError, match="layerwise offload is already enabled"):
        pipe.enable_model_level_offload(device="cpu")
    pipe.disable_omni_offload()
    pipe.disable_omni_offload()
    pipe.enable_model_level_offload(device="cpu")
    pipe.disable_omni_offload()


def test_bare_model_twice_is_a_conflict():
    model = bare_flux()
    backend = apply_offload(model, OffloadConfig("layerwise", device="cpu"))
    with pytest.raises(OffloadConflictError, match="already has diffusers-omni offload hooks"):
        apply_offload(model, OffloadConfig("layerwise", device="cpu"))
    backend.disable()


def _record_residency(pipe, backend):
    """(component, onloaded components) for every DiT/encoder forward, taken while the forward runs."""
    seen: list[tuple[str, tuple[str, ...]]] = []
    for name in ("transformer", "transformer_2", "text_encoder", "text_encoder_2"):
        module = getattr(pipe, name, None)
        if module is not None:
            module.register_forward_hook(lambda m, a, o, name=name: seen.append((name, backend.onloaded())))
    return seen


@pytest.mark.parametrize("make_pipe", [flux_pipe, wan22_pipe], ids=["flux", "wan22"])
def test_model_level_mutual_exclusion_and_bitwise(make_pipe):
    pipe = make_pipe()
    steps = 4
    reference = generate(pipe, steps=steps)
    backend = pipe.enable_model_level_offload(device="cpu")
    seen = _record_residency(pipe, backend)
    with torch.inference_mode():
        assert torch.equal(generate(pipe, steps=steps), reference)
    assert torch.equal(generate(pipe, steps=steps), reference)
    dits = {"transformer", "transformer_2"}
    assert {name for name, _ in seen} >= {"transformer", "text_encoder"}
    for name, onloaded in seen:
        assert name in onloaded
        if name in dits:
            assert set(onloaded) == {name}, (name, onloaded)
        else:
            assert not set(onloaded) & dits, (name, onloaded)
    # The VAE stays resident; host copies are packed once, not per swap.
    host_ptrs = {k: v.data_ptr() for k, v in backend._state.exclusives[0].weights.host.items()}
    generate(pipe, steps=2)
    assert host_ptrs == {k: v.data_ptr() for k, v in backend._state.exclusives[0].weights.host.items()}
    pipe.disable_omni_offload()
    pipe.to("cpu")
    assert torch.equal(generate(pipe, steps=steps), reference)


def test_model_level_use_context_manager():
    pipe = flux_pipe()
    backend = pipe.enable_model_level_offload(device="cpu")
    generate(pipe, steps=1)
    assert backend.onloaded() == ("transformer",)
    with pipe.omni_onload("text_encoder") as encoder:
        assert encoder is pipe.text_encoder
        assert backend.onloaded() == ("text_encoder",)
    with pipe.omni_onload("vae") as vae:
        assert vae is pipe.vae
    with pytest.raises(ValueError, match="not a component"):
        with pipe.omni_onload("scheduler"):
            pass
    pipe.disable_omni_offload()
