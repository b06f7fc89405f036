"""The offload belongs to the components (#28 items 2, 3, 5, 8): every route that would move, cast or hook a
component an enabled offload places is refused before anything changes, or works, whichever pipeline object it
starts from (the Diffusers pipeline given to ``omnify``, ``from_pipe``, a pipeline built from ``components``), and
any object sharing the components can find, adopt or disable the offload."""

from __future__ import annotations

import gc

import accelerate
import pytest
import torch
import torch.distributed as dist
from diffusers import AutoencoderKL, FluxPipeline
from diffusers.hooks import apply_group_offloading

import diffusers_omni
from diffusers_omni import OffloadConfig, apply_offload, disable_offload, omnify
from diffusers_omni.offload import OffloadActiveError, OffloadConflictError
from diffusers_omni.offload.hooks import hook_names
from diffusers_omni.pipelines.flux import OmniFluxPipeline
from diffusers_omni.testing.tiny import tiny_flux_components, tiny_flux_pipeline
from offload_helpers import assert_same_snapshot, bare_flux, pipeline_modules, snapshot

STRATEGIES = ["layerwise", "model_level"]
CPU = torch.device("cpu")


def generate(pipe, steps: int = 1, output_type: str = "latent") -> torch.Tensor:
    """A FLUX call (any FLUX pipeline object, Omni or not)."""
    return pipe(prompt="a red fox in the snow", num_inference_steps=steps, height=32, width=32,
                generator=torch.Generator().manual_seed(0), output_type=output_type, max_sequence_length=32)[0]


def _enable(pipe, strategy: str):
    return getattr(pipe, f"enable_{strategy}_offload")(device="cpu")


def _shared(strategy: str):
    """(the user's Diffusers pipeline, its Omni pipeline with offload on, the resident reference output)."""
    plain = tiny_flux_pipeline()
    omni = omnify(plain, "TORCH_SDPA")
    reference = generate(omni, steps=1)
    _enable(omni, strategy)
    return plain, omni, reference


def _state(pipe) -> dict:
    """Every component's tensors, hooks and ``__dict__`` (offload_helpers.snapshot) and the pipeline's ``__dict__``."""
    state = snapshot(*pipeline_modules(pipe))
    state["pipe#dict"] = {key: id(value) for key, value in pipe.__dict__.items()}
    return state


def _resident(dtype: torch.dtype | None = None, vae: AutoencoderKL | None = None) -> OmniFluxPipeline:
    pipe = omnify(tiny_flux_pipeline(), "TORCH_SDPA")
    if vae is not None:
        pipe.vae = vae
    return pipe if dtype is None else pipe.to(dtype)


def _decoded(pipe) -> torch.Tensor:
    """A decoded image (runs the VAE too)."""
    return generate(pipe, steps=1, output_type="pt")


def _other_vae() -> AutoencoderKL:
    return tiny_flux_components(seed=1)["vae"]


def _no_offload_left(pipe) -> bool:
    return not any(
        hook_names(m) or "_hf_hook" in m.__dict__ or "_omni_offload" in m.__dict__
        for module in pipeline_modules(pipe) for m in module.modules()
    )


# Item 2: a call through the original object is checked on every component first -------------------------------


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_cast_through_the_original_pipeline_works_bitwise(strategy):
    """Was: the text encoders were cast, the transformer refused, and the next call failed on a dtype mismatch."""
    plain, omni, _ = _shared(strategy)
    plain.to(torch.float64)
    assert all(m.dtype == torch.float64 for m in pipeline_modules(plain))
    assert omni.omni_offload_backend is not None and omni.omni_offload_backend.is_enabled()
    expected = generate(_resident(torch.float64), steps=1)
    assert torch.equal(generate(omni, steps=1), expected)
    assert torch.equal(generate(plain, steps=1), expected)  # the Diffusers object runs with the offload too


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_from_pipe_with_torch_dtype_shares_the_offload(strategy):
    """``FluxPipeline.from_pipe(omni, torch_dtype=...)`` casts the shared components: the host copies are re-packed,
    and both pipelines run bitwise equal to the resident cast pipeline."""
    _, omni, _ = _shared(strategy)
    other = FluxPipeline.from_pipe(omni, torch_dtype=torch.float64)
    expected = generate(FluxPipeline.from_pipe(_resident(), torch_dtype=torch.float64), steps=1)
    assert torch.equal(generate(other, steps=1), expected)
    assert torch.equal(generate(omni, steps=1), expected)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("move", ["to(meta)", "to(meta, float64)"])
def test_refused_move_through_the_original_pipeline_changes_nothing(strategy, move):
    plain, omni, reference = _shared(strategy)
    before = _state(plain)
    with pytest.raises(OffloadActiveError, match=r"would change managed weights.*nothing was changed"):
        plain.to("meta") if move == "to(meta)" else plain.to("meta", torch.float64)
    assert_same_snapshot(before, _state(plain))
    assert torch.equal(generate(omni, steps=1), reference)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_refused_group_offload_through_the_original_pipeline_changes_nothing(strategy):
    """Was: group hooks stayed on the VAE and the encoders, and omni offload could not be enabled again."""
    plain, omni, reference = _shared(strategy)
    before = _state(plain)
    with pytest.raises(OffloadConflictError, match=r"group offload.*nothing was changed"):
        plain.enable_group_offload(onload_device=CPU, offload_type="leaf_level")
    assert_same_snapshot(before, _state(plain))
    assert torch.equal(generate(omni, steps=1), reference)
    omni.disable_omni_offload()
    _enable(omni, strategy)
    assert torch.equal(generate(omni, steps=1), reference)


# Item 3: foreign offloaders on every route ---------------------------------------------------------------------

FOREIGN = {
    "plain.enable_model_cpu_offload": lambda plain, omni: plain.enable_model_cpu_offload(device="cpu"),
    "plain.enable_sequential_cpu_offload": lambda plain, omni: plain.enable_sequential_cpu_offload(device="cpu"),
    "plain.remove_all_hooks": lambda plain, omni: plain.remove_all_hooks(),
    "accelerate.cpu_offload(transformer)": lambda plain, omni: accelerate.cpu_offload(omni.transformer, CPU),
    "accelerate.cpu_offload_with_hook(text_encoder)": lambda plain, omni: accelerate.cpu_offload_with_hook(
        omni.text_encoder, CPU),
    "apply_group_offloading(transformer, block_level)": lambda plain, omni: apply_group_offloading(
        omni.transformer, onload_device=CPU, offload_type="block_level", num_blocks_per_group=1),
    "apply_group_offloading(transformer, leaf_level)": lambda plain, omni: apply_group_offloading(
        omni.transformer, onload_device=CPU, offload_type="leaf_level"),
    "apply_group_offloading(text_encoder_2)": lambda plain, omni: apply_group_offloading(
        omni.text_encoder_2, onload_device=CPU, offload_type="leaf_level"),
    "vae.enable_group_offload": lambda plain, omni: omni.vae.enable_group_offload(
        onload_device=CPU, offload_type="leaf_level"),
}


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("route", list(FOREIGN))
def test_foreign_offloader_on_any_route_is_refused_before_anything_changes(strategy, route):
    """Was: accepted (under model-level, Accelerate then failed with ``'ExecutionDeviceHint' object has no
    attribute 'init_hook'`` after changing the module)."""
    plain, omni, reference = _shared(strategy)
    before = _state(plain)
    with pytest.raises(OffloadConflictError, match=r"diffusers-omni .* offload.*nothing was changed.*"
                                                   r"disable_omni_offload\(\) first"):
        FOREIGN[route](plain, omni)
    assert_same_snapshot(before, _state(plain))
    assert torch.equal(generate(omni, steps=1), reference)
    # The way out, from the object at hand: disable ours, then the other offloader runs.
    assert disable_offload(plain)
    assert _no_offload_left(plain)
    FOREIGN[route](plain, omni)


# Item 5: an offload whose Omni pipeline is gone ---------------------------------------------------------------


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_orphaned_offload_is_adopted_or_disabled_from_the_original_pipeline(strategy):
    """Was: ``omnify(pipe).enable_*`` said "disable that offload first" and no object could disable it."""
    plain, omni, reference = _shared(strategy)
    del omni
    gc.collect()
    again = omnify(plain, "TORCH_SDPA")
    assert again.omni_offload_backend is not None  # found through the components
    backend = _enable(again, strategy)  # the same config adopts it
    assert backend is again.omni_offload_backend and backend.is_enabled()
    assert torch.equal(generate(again, steps=1), reference)
    other = "model_level" if strategy == "layerwise" else "layerwise"
    with pytest.raises(OffloadConflictError, match=rf"{strategy} offload is already enabled on this pipeline's "
                                                   r"components.*enabled on OmniFluxPipeline at 0x.*nothing was "
                                                   r"changed.*diffusers_omni.disable_offload\(pipe\)"):
        _enable(again, other)
    assert diffusers_omni.disable_offload(plain) == [backend]
    assert not backend.is_enabled() and _no_offload_left(plain)
    assert diffusers_omni.disable_offload(plain) == []  # nothing left: does nothing
    _enable(again, other)
    assert torch.equal(generate(again, steps=1), reference)
    again.disable_omni_offload()


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_disable_omni_offload_from_any_omni_pipeline_sharing_the_components(strategy):
    plain, omni, reference = _shared(strategy)
    backend = omni.omni_offload_backend
    OmniFluxPipeline(**plain.components).disable_omni_offload()
    assert not backend.is_enabled() and omni.omni_offload_backend is None and _no_offload_left(plain)
    assert torch.equal(generate(omni, steps=1), reference)


def test_disable_offload_on_a_bare_model_and_a_component():
    model = bare_flux()
    backend = apply_offload(model, OffloadConfig("layerwise", device="cpu"))
    assert disable_offload(model.transformer_blocks[0]) == []  # a module inside: not a component
    assert disable_offload(model) == [backend] and not backend.is_enabled()
    plain, omni, _ = _shared("model_level")
    backend = omni.omni_offload_backend
    assert disable_offload(plain.text_encoder) == [backend] and not backend.is_enabled()
    assert _no_offload_left(plain) and omni.omni_offload_backend is None
    with pytest.raises(TypeError, match=r"disable_offload: target must be a pipeline .* or a torch.nn.Module, got "
                                        r"str"):
        disable_offload("pipe")


# Item 8: any pipeline object sharing the components runs with the offload; casting works ----------------------


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_pipeline_built_from_components_runs_and_adopts(strategy):
    """Was: it ran, but enabling offload on it was refused (``'transformer' already has diffusers-omni offload
    hooks … disable that offload first``), as in Diffusers' test_encode_prompt_works_in_isolation."""
    plain, omni, reference = _shared(strategy)
    backend = omni.omni_offload_backend
    second = OmniFluxPipeline(**omni.components)
    assert second.omni_offload_backend is backend
    assert torch.equal(generate(second, steps=1), reference)
    assert _enable(second, strategy) is backend  # adopted: nothing re-packed
    assert torch.equal(generate(second, steps=1), reference)
    assert torch.equal(generate(omni, steps=1), reference)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_pipeline_with_a_swapped_vae_re_plans_the_offload(strategy):
    """Diffusers' test_multi_vae: a pipeline from the same components with another VAE; enabling the same offload
    on it brings the new VAE under it."""
    vae = _other_vae()
    expected = _decoded(_resident(vae=_other_vae()))
    _, omni, _ = _shared(strategy)
    second = OmniFluxPipeline(**{**omni.components, "vae": vae})
    backend = _enable(second, strategy)
    assert backend.is_enabled() and any(module is vae for _, module, _ in backend.members())
    assert vae._hf_hook.execution_device == backend.execution_device
    assert torch.equal(_decoded(second), expected)
    assert torch.equal(generate(omni, steps=1), generate(_resident(), steps=1))  # shares the DiT and encoders


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_swapping_a_component_of_the_offloaded_pipeline_brings_it_under_the_offload(strategy):
    pipe = omnify(tiny_flux_pipeline(), "TORCH_SDPA")
    _enable(pipe, strategy)
    old, vae = pipe.vae, _other_vae()
    pipe.vae = vae
    backend = pipe.omni_offload_backend
    members = [module for _, module, _ in backend.members()]
    assert any(m is vae for m in members) and not any(m is old for m in members)
    assert "_hf_hook" not in old.__dict__ and "_omni_offload" not in old.__dict__
    assert torch.equal(_decoded(pipe), _decoded(_resident(vae=_other_vae())))
    # A wrapper around the same component (torch.compile) keeps the offload as it is.
    plain_transformer = pipe.transformer
    pipe.transformer = torch.compile(plain_transformer, backend="eager")
    assert pipe.omni_offload_backend is backend
    pipe.transformer = plain_transformer
    pipe.disable_omni_offload()


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("cast", ["pipe.to(float64)", "pipe.to(cpu, float64)", "pipe.to(dtype=bfloat16)"])
def test_casting_an_offloaded_pipeline_repacks_bitwise(strategy, cast):
    """Was refused (Diffusers' test_to_dtype, test_layerwise_casting_inference)."""
    dtype = torch.bfloat16 if "bfloat16" in cast else torch.float64
    casts = {
        "pipe.to(float64)": lambda pipe: pipe.to(torch.float64),
        "pipe.to(cpu, float64)": lambda pipe: pipe.to("cpu", torch.float64),
        "pipe.to(dtype=bfloat16)": lambda pipe: pipe.to(dtype=torch.bfloat16),
    }
    pipe = omnify(tiny_flux_pipeline(), "TORCH_SDPA")
    backend = _enable(pipe, strategy)
    assert casts[cast](pipe) is pipe
    assert pipe.omni_offload_backend is backend and backend.is_enabled()
    assert all(m.dtype == dtype for m in pipeline_modules(pipe))
    resident = casts[cast](_resident())
    for name in ("transformer", "text_encoder", "text_encoder_2", "vae"):
        ours, theirs = getattr(pipe, name).state_dict(), getattr(resident, name).state_dict()
        assert all(ours[k].dtype == theirs[k].dtype and torch.equal(ours[k], theirs[k]) for k in theirs), name
    if dtype == torch.float64:
        assert torch.equal(generate(pipe, steps=1), generate(resident, steps=1))
    pipe.disable_omni_offload()


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_casting_one_component_repacks_it(strategy):
    pipe = omnify(tiny_flux_pipeline(), "TORCH_SDPA")
    _enable(pipe, strategy)
    pipe.transformer.double()
    pipe.text_encoder.to(torch.float64)
    resident = _resident()
    resident.transformer.double()
    resident.text_encoder.to(torch.float64)
    for name in ("transformer", "text_encoder"):
        ours, theirs = getattr(pipe, name).state_dict(), getattr(resident, name).state_dict()
        assert all(ours[k].dtype == torch.float64 and torch.equal(ours[k], theirs[k]) for k in theirs), name
    # A move to the offload device changes nothing and is allowed on every component.
    pipe.transformer.to("cpu")
    pipe.vae.to("cpu")
    pipe.disable_omni_offload()


@pytest.fixture
def one_rank_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_distributed_cast_is_refused_on_every_component_before_anything_changes(one_rank_group):
    """Distributed offload cannot suspend on one rank: every component it places refuses a cast, so a pipeline-wide
    cast from a Diffusers object (its loop casts one component after another) changes nothing either."""
    plain = tiny_flux_pipeline()
    omni = omnify(plain, "TORCH_SDPA")
    reference = generate(omni, steps=1)
    omni.enable_distributed_layerwise_offload(device="cpu", use_allgather=False)
    before = _state(plain)
    for cast in (lambda: plain.to(torch.float64), lambda: omni.to(torch.float64), lambda: plain.vae.double()):
        with pytest.raises(OffloadActiveError, match=r"would change managed weights.*collective.*nothing was "
                                                     r"changed.*on every rank"):
            cast()
        assert_same_snapshot(before, _state(plain))
    assert torch.equal(generate(omni, steps=1), reference)
    omni.disable_omni_offload()


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_faster_cache_added_after_enable_runs_bitwise(strategy):
    """Diffusers' FasterCache state tests fail under layerwise only on their count of hook registries (the offload's
    block hooks share them, docs/user_guide/interop.md); the cache itself, added after the offload, works."""
    from diffusers import FasterCacheConfig

    def cached(pipe):
        pipe.transformer.enable_cache(FasterCacheConfig(
            spatial_attention_block_skip_range=2, spatial_attention_timestep_skip_range=(-1, 999),
            current_timestep_callback=lambda: pipe.current_timestep, attention_weight_callback=lambda _: 0.5,
            is_guidance_distilled=True, tensor_format="BFCHW"))
        return pipe

    reference = generate(cached(_resident()), steps=3)
    pipe = omnify(tiny_flux_pipeline(), "TORCH_SDPA")
    _enable(pipe, strategy)
    assert torch.equal(generate(cached(pipe), steps=3), reference)
    pipe.disable_omni_offload()


@pytest.fixture(scope="module")
def lora_dir(tmp_path_factory):
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    directory = tmp_path_factory.mktemp("lora")
    source = tiny_flux_pipeline()
    torch.manual_seed(1)
    source.transformer.add_adapter(LoraConfig(r=4, lora_alpha=4, init_lora_weights=False,
                                              target_modules=["to_q", "to_k", "to_v", "to_out.0"]))
    FluxPipeline.save_lora_weights(directory, transformer_lora_layers=get_peft_model_state_dict(source.transformer))
    return directory


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_lora_through_another_omni_pipeline_suspends_the_offload(strategy, lora_dir):
    """Diffusers' LoRA loops reach into the components directly (``unfuse_lora`` unmerges each layer itself; FLUX's
    ``load_lora_weights`` reads weight shapes first): on an Omni pipeline sharing the components they run with the
    offload suspended, as on the pipeline that enabled it. Was: wrong output after ``unfuse_lora`` (model-level),
    ``ValueError: not enough values to unpack`` (layerwise)."""
    resident = _resident()
    outputs = []
    for step in ("load_lora_weights", "fuse_lora", "unfuse_lora", "unload_lora_weights"):
        getattr(resident, step)(lora_dir) if step == "load_lora_weights" else getattr(resident, step)()
        outputs.append(generate(resident, steps=2))
    _, omni, _ = _shared(strategy)
    backend = omni.omni_offload_backend
    second = OmniFluxPipeline(**omni.components)
    for step, expected in zip(("load_lora_weights", "fuse_lora", "unfuse_lora", "unload_lora_weights"), outputs):
        getattr(second, step)(lora_dir) if step == "load_lora_weights" else getattr(second, step)()
        assert backend.is_enabled() and second.omni_offload_backend is backend, step
        assert torch.equal(generate(second, steps=2), expected), step
    omni.disable_omni_offload()


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_another_omni_pipeline_refuses_foreign_offloaders_before_its_loop(strategy):
    _, omni, reference = _shared(strategy)
    second = OmniFluxPipeline(**omni.components)
    before = _state(second)
    for call in (lambda: second.enable_group_offload(onload_device=CPU, offload_type="leaf_level"),
                 lambda: second.enable_model_cpu_offload(device="cpu")):
        with pytest.raises(OffloadConflictError, match=r"^pipe\.enable_.*cannot run while diffusers-omni .* offload "
                                                       r"is enabled.*nothing was changed"):
            call()
        assert_same_snapshot(before, _state(second))
    assert torch.equal(generate(second, steps=1), reference)
