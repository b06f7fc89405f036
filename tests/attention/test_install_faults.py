"""Attention installation is all or nothing (issue 13, item 3): a failure at any stage and inner step of enabling
omni attention, on any DiT of a multi-DiT pipeline, leaves every model exactly as it was: the same processor
objects, hooks, module attributes and parameters."""

from __future__ import annotations

import collections
import dataclasses
import itertools

import pytest
import torch
import torch.nn as nn
from diffusers.models.attention_processor import AttnProcessor2_0

from diffusers_omni import apply_attention, remove_attention
from diffusers_omni import installer as install
from diffusers_omni.attention.backends.sdpa import TorchSDPABackend
from diffusers_omni.attention.processors import is_omni_processor
from diffusers_omni.attention.registry import register_backend, reset_backend
from diffusers_omni.attention.backends.trtllm.timestep_gate import timestep_state
from diffusers_omni.models import base as model_base
from diffusers_omni.pipelines.wan import OmniWanPipeline
from diffusers_omni.testing import tiny_wan_components


class Fault(RuntimeError):
    """The injected failure."""


def wan22_pipe() -> OmniWanPipeline:
    components = tiny_wan_components(seed=0)
    second = tiny_wan_components(seed=1)["transformer"]
    pipe = OmniWanPipeline(**{**components, "transformer_2": second}, boundary_ratio=0.5)
    for component in pipe.components.values():
        if isinstance(component, nn.Module):
            component.eval()
    return pipe


# -- exact model state ----------------------------------------------------------------------------------------------

_CONTAINERS = (dict, collections.OrderedDict, set, list)


def model_state(model: nn.Module) -> dict:
    """Every module's ``__dict__`` (objects, not copies) and one level of its containers (hook dicts, _modules,
    _parameters, ...), plus parameter storage pointers and values."""
    state = {}
    for name, module in model.named_modules(remove_duplicate=False):
        entries = {}
        for key, value in module.__dict__.items():
            if type(value) in _CONTAINERS:
                items = list(value.items()) if isinstance(value, dict) else list(value)
                entries[key] = (value, items)
            else:
                entries[key] = (value, None)
        state[name] = (module, entries)
    params = {name: (p, p.data_ptr(), p.device, p.dtype, p.detach().clone()) for name, p in model.named_parameters()}
    return {"modules": state, "params": params}


def assert_same_state(before: dict, after: dict, label: str = "") -> None:
    assert list(before["modules"]) == list(after["modules"]), label
    for name, (module, entries) in before["modules"].items():
        module_after, entries_after = after["modules"][name]
        assert module is module_after, (label, name)
        assert list(entries) == list(entries_after), (label, name, set(entries) ^ set(entries_after))
        for key, (value, items) in entries.items():
            value_after, items_after = entries_after[key]
            assert value is value_after, (label, name, key)
            if items is None:
                continue
            assert len(items) == len(items_after), (label, name, key)
            for a, b in zip(items, items_after):
                if isinstance(a, tuple):
                    assert a[0] == b[0] and a[1] is b[1], (label, name, key, a[0])
                else:
                    assert a is b or a == b, (label, name, key)
    assert before["params"].keys() == after["params"].keys()
    for name, (p, ptr, device, dtype, value) in before["params"].items():
        q = after["params"][name][0]
        assert q is p and q.data_ptr() == ptr and q.device == device and q.dtype == dtype, (label, name)
        assert torch.equal(q, value), (label, name)


def processors(model: nn.Module) -> dict:
    return {name: m.processor for name, m in model.named_modules() if hasattr(m, "processor")}


# -- fault injection ------------------------------------------------------------------------------------------------


class Injector:
    """Counts the calls reaching one inner step of installation; raises ``Fault`` at call ``fail_at`` (1-based),
    before or after letting the real step run."""

    def __init__(self) -> None:
        self.calls = 0
        self.fail_at: int | None = None
        self.after = False

    def wrap(self, real):
        def step(*args, **kwargs):
            self.calls += 1
            if self.fail_at == self.calls and not self.after:
                raise Fault(f"injected before call {self.calls}")
            result = real(*args, **kwargs)
            if self.fail_at == self.calls and self.after:
                raise Fault(f"injected after call {self.calls}")
            return result

        return step


class BindingBackend(TorchSDPABackend):
    """TORCH_SDPA with a ``bind_site`` that attaches model state (the timestep gate's forward pre-hook) and a
    per-site attribute, as TRTLLM_ATTN and RAINFUSION_ATTN do."""

    name = "BINDING_TEST"
    injector: Injector | None = None

    def bind_site(self, model, site, resolution):
        def bind(model, site, resolution):
            timestep_state(model, "wan")
            model.__dict__.setdefault("_binding_test_sites", []).append(site.name)
            return self

        return self.injector.wrap(bind)(model, site, resolution) if self.injector else bind(model, site, resolution)


STEPS = ("resolve", "backend", "bind_site", "make_processor", "set_processor", "register_hook", "report")


@pytest.fixture
def binding_backend():
    register_backend("BINDING_TEST", BindingBackend)
    yield
    BindingBackend.injector = None
    reset_backend("BINDING_TEST")


def inject(step: str, injector: Injector, monkeypatch, pipe) -> None:
    """Route the real ``step`` of installation through ``injector``."""
    if step == "resolve":
        monkeypatch.setattr(install, "resolve_role", injector.wrap(install.resolve_role))
    elif step == "backend":
        monkeypatch.setattr(install, "get_backend_class", lambda name: injector.wrap(install_get(name)))
    elif step == "bind_site":
        BindingBackend.injector = injector
    elif step == "make_processor":
        declaration = model_base.declaration_for(pipe.transformer)
        faulty = dataclasses.replace(declaration, make_processor=injector.wrap(declaration.make_processor))
        for class_name in declaration.class_names:
            monkeypatch.setitem(model_base._DECLARATIONS, class_name, faulty)
    elif step == "set_processor":
        cls = type(pipe.transformer.blocks[0].attn1)
        monkeypatch.setattr(cls, "set_processor", injector.wrap(cls.set_processor))
    elif step == "register_hook":
        cls = type(pipe.transformer)
        monkeypatch.setattr(cls, "register_forward_pre_hook", injector.wrap(nn.Module.register_forward_pre_hook))
    elif step == "report":
        monkeypatch.setattr(install, "_report_entry", injector.wrap(install._report_entry))


install_get = install.get_backend_class
CONFIGS = {
    "plain": {"default": "BINDING_TEST"},
    "per_role": {"default": "TORCH_SDPA", "per_role": {"cross": "BINDING_TEST", "wan.self": "auto"}},
}


@pytest.mark.parametrize("previous", [None, {"default": "TORCH_SDPA"}], ids=["fresh", "re-enable"])
@pytest.mark.parametrize("step", STEPS)
@pytest.mark.parametrize("after", [False, True], ids=["before", "after"])
def test_a_fault_at_every_step_of_every_dit_leaves_both_dits_exactly_as_they_were(
    step, after, previous, binding_backend, monkeypatch
):
    pipe = wan22_pipe()
    models = (pipe.transformer, pipe.transformer_2)
    if previous is not None:
        pipe.enable_omni_attention(previous)
    config = CONFIGS["plain"]
    counter = Injector()
    with monkeypatch.context() as patch:
        inject(step, counter, patch, pipe)
        pipe.enable_omni_attention(config)  # a clean run: how many calls reach this step
        BindingBackend.injector = None
    assert counter.calls >= 2, (step, counter.calls)
    # Both DiTs were installed by the clean run; go back to the state before it (disable also drops bound state).
    pipe.disable_omni_attention()
    if previous is not None:
        pipe.enable_omni_attention(previous)
    for fail_at in range(1, counter.calls + 1):
        before = [model_state(m) for m in models]
        injector = Injector()
        injector.fail_at, injector.after = fail_at, after
        with monkeypatch.context() as patch:
            inject(step, injector, patch, pipe)
            with pytest.raises(Fault):
                pipe.enable_omni_attention(config)
            BindingBackend.injector = None
        for model, state in zip(models, before):
            assert_same_state(state, model_state(model), f"{step} {'after' if after else 'before'} call {fail_at}")
        assert install.is_attention_applied(models[0]) == (previous is not None)
    # Nothing was left half-done: enabling now works and removal restores Diffusers' processors.
    pipe.enable_omni_attention(config)
    assert all(is_omni_processor(p) for m in models for p in processors(m).values())
    pipe.disable_omni_attention()
    assert not any(is_omni_processor(p) for m in models for p in processors(m).values())


def test_per_role_configs_fail_cleanly_too(binding_backend, monkeypatch):
    pipe = wan22_pipe()
    models = (pipe.transformer, pipe.transformer_2)
    counter = Injector()
    with monkeypatch.context() as patch:
        inject("bind_site", counter, patch, pipe)
        pipe.enable_omni_attention(CONFIGS["per_role"])
        BindingBackend.injector = None
    pipe.disable_omni_attention()
    assert counter.calls == 2 * len(models[0].blocks)  # the cross role of every block of both DiTs
    for fail_at in range(1, counter.calls + 1):
        before = [model_state(m) for m in models]
        injector = Injector()
        injector.fail_at, injector.after = fail_at, True
        with monkeypatch.context() as patch:
            inject("bind_site", injector, patch, pipe)
            with pytest.raises(Fault):
                pipe.enable_omni_attention(CONFIGS["per_role"])
            BindingBackend.injector = None
        for model, state in zip(models, before):
            assert_same_state(state, model_state(model), f"bind_site {fail_at}")


def test_second_dit_with_a_processor_the_first_lacks_leaves_both_untouched():
    # Before the fix: the first DiT was installed, then make_processor refused the second (half-enabled).
    pipe = wan22_pipe()
    pipe.transformer_2.blocks[-1].attn1.set_processor(AttnProcessor2_0())
    before = [model_state(m) for m in (pipe.transformer, pipe.transformer_2)]
    last = len(pipe.transformer_2.blocks) - 1
    with pytest.raises(TypeError, match=rf"'blocks\.{last}\.attn1' uses processor AttnProcessor2_0"):
        pipe.enable_omni_attention("TORCH_SDPA")
    assert_same_state(before[0], model_state(pipe.transformer), "first DiT")
    assert_same_state(before[1], model_state(pipe.transformer_2), "second DiT")
    assert pipe.omni_attention_report() == []


def test_set_processor_failing_partway_leaves_no_orphaned_omni_processor(monkeypatch):
    # Before the fix: the processors set before the failure stayed, with no state, so remove_attention() returned
    # False and could not take them off.
    pipe = wan22_pipe()
    model = pipe.transformer
    original = processors(model)
    before = model_state(model)
    injector = Injector()
    injector.fail_at, injector.after = len(original), True  # the last processor is set, then the step fails
    cls = type(model.blocks[0].attn1)
    monkeypatch.setattr(cls, "set_processor", injector.wrap(cls.set_processor))
    with pytest.raises(Fault):
        apply_attention(model, "TORCH_SDPA")
    monkeypatch.undo()
    assert not any(is_omni_processor(p) for p in processors(model).values())
    assert all(processors(model)[name] is p for name, p in original.items())
    assert_same_state(before, model_state(model))
    assert remove_attention(model) is False


def test_keyboard_interrupt_during_install_rolls_back(monkeypatch):
    pipe = wan22_pipe()
    before = [model_state(m) for m in (pipe.transformer, pipe.transformer_2)]
    calls = itertools.count(1)
    real = nn.Module.register_forward_pre_hook

    def interrupted(self, *args, **kwargs):
        handle = real(self, *args, **kwargs)
        if next(calls) == 2:
            raise KeyboardInterrupt
        return handle

    monkeypatch.setattr(type(pipe.transformer), "register_forward_pre_hook", interrupted)
    with pytest.raises(KeyboardInterrupt):
        pipe.enable_omni_attention("TORCH_SDPA")
    assert_same_state(before[0], model_state(pipe.transformer))
    assert_same_state(before[1], model_state(pipe.transformer_2))


def test_removal_failing_on_the_second_dit_keeps_both_enabled(monkeypatch):
    pipe = wan22_pipe()
    pipe.enable_omni_attention("TORCH_SDPA")
    report = pipe.omni_attention_report()
    before = [model_state(m) for m in (pipe.transformer, pipe.transformer_2)]
    injector = Injector()
    injector.fail_at, injector.after = len(processors(pipe.transformer)) + 1, True
    cls = type(pipe.transformer.blocks[0].attn1)
    monkeypatch.setattr(cls, "set_processor", injector.wrap(cls.set_processor))
    with pytest.raises(Fault):
        pipe.disable_omni_attention()
    monkeypatch.undo()
    assert_same_state(before[0], model_state(pipe.transformer))
    assert_same_state(before[1], model_state(pipe.transformer_2))
    assert pipe.omni_attention_report() == report
    pipe.disable_omni_attention()
    assert pipe.omni_attention_report() == []


def test_the_state_oracle_sees_a_leftover_change():
    # The fault tests are only as good as model_state: it must notice what a half-done install leaves.
    pipe = wan22_pipe()
    model = pipe.transformer
    before = model_state(model)
    handle = model.register_forward_pre_hook(lambda module, args: None)
    with pytest.raises(AssertionError):
        assert_same_state(before, model_state(model))
    handle.remove()
    assert_same_state(before, model_state(model))
    model.blocks[0].attn1.set_processor(AttnProcessor2_0())
    with pytest.raises(AssertionError):
        assert_same_state(before, model_state(model))
