"""Diffusers features with omni offload on (#13 items 4, 5, 11; #18 items 1, 4, 5): each works (bitwise equal to
the same feature on the resident pipeline) or is refused before anything changes, with a message naming the
feature and the order that works. The table in docs/user_guide/offload.md lists the same cases."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.distributed as dist
from diffusers import FluxTransformer2DModel
from diffusers.models.transformers.transformer_flux import FluxTransformerBlock
from peft import LoraConfig
from peft.utils import get_peft_model_state_dict
from safetensors.torch import load_file
from transformers import CLIPTextModel

from diffusers_omni import OffloadConfig, apply_offload
from diffusers_omni.offload import OffloadActiveError, OffloadConflictError
from diffusers_omni.pipelines.flux import OmniFluxPipeline
from offload_helpers import (
    assert_same_snapshot,
    bare_flux,
    flux_inputs,
    flux_pipe,
    generate,
    pipeline_modules,
    pipeline_snapshot,
    snapshot,
)

STRATEGIES = ["layerwise", "model_level"]


def _enable(pipe, strategy: str):
    if strategy.startswith("distributed"):
        return pipe.enable_distributed_layerwise_offload(device="cpu", use_allgather=strategy == "distributed_allgather")
    return getattr(pipe, f"enable_{strategy}_offload")(device="cpu")


@pytest.fixture
def one_rank_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _dicts(pipe) -> dict:
    return {k: v for k, v in pipeline_snapshot(pipe).items() if k.endswith("#dict")}


# #13 item 5: exact restoration -------------------------------------------------------------------------------


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_disable_restores_every_module_dict_exactly(strategy):
    pipe = flux_pipe()
    generate(pipe, steps=1)  # a call sets pipeline attributes of its own
    before = pipeline_snapshot(pipe)
    _enable(pipe, strategy)
    generate(pipe, steps=1)
    pipe.disable_omni_offload()
    after = pipeline_snapshot(pipe)
    for key in before:
        if key == "pipe#dict":  # a call replaces per-call attributes (_joint_attention_kwargs...)
            assert before[key].keys() == after[key].keys()
        elif (key.endswith("#dict") or key.endswith("#hooks")) and not key.startswith("scheduler"):
            assert before[key] == after[key], key
    # No instance ``forward`` is left behind (it was a reference cycle module → bound method → module).
    for module in pipeline_modules(pipe):
        assert not any("forward" in m.__dict__ for m in module.modules())


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_bare_model_is_freed_by_reference_counting_after_disable(strategy):
    model = bare_flux()
    backend = apply_offload(model, OffloadConfig(strategy, device="cpu"))
    with torch.no_grad():
        model(**flux_inputs())
    backend.disable()
    del backend
    alive = weakref.ref(model)
    gc.disable()
    try:
        del model
        assert alive() is None  # no cycle (instance ``forward``, hook ↔ function reference) keeps it alive
    finally:
        gc.enable()


# #13 item 4: Diffusers' offloaders refused in both orders ----------------------------------------------------

DIFFUSERS_OFFLOADERS = {
    "enable_model_cpu_offload": lambda pipe: pipe.enable_model_cpu_offload(device="cpu"),
    "enable_sequential_cpu_offload": lambda pipe: pipe.enable_sequential_cpu_offload(device="cpu"),
    "enable_group_offload": lambda pipe: pipe.enable_group_offload(
        onload_device=torch.device("cpu"), offload_type="leaf_level"),
    "transformer.enable_group_offload": lambda pipe: pipe.transformer.enable_group_offload(
        onload_device=torch.device("cpu"), offload_type="leaf_level"),
}


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("offloader", list(DIFFUSERS_OFFLOADERS))
def test_diffusers_offload_after_omni_offload_is_refused(strategy, offloader):
    pipe = flux_pipe()
    reference = generate(pipe, steps=1)
    backend = _enable(pipe, strategy)
    before = pipeline_snapshot(pipe)
    name = offloader.split(".")[-1]
    with pytest.raises(OffloadConflictError, match=rf"{name}.*cannot run while diffusers-omni .* offload is "
                                                   r"enabled.*nothing was changed.*disable_omni_offload\(\) first"):
        DIFFUSERS_OFFLOADERS[offloader](pipe)
    assert_same_snapshot(before, pipeline_snapshot(pipe))
    assert pipe.omni_offload_backend is backend
    assert torch.equal(generate(pipe, steps=1), reference)
    # The way out works: disable ours, then Diffusers' runs.
    pipe.disable_omni_offload()
    DIFFUSERS_OFFLOADERS[offloader](pipe)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("offloader", list(DIFFUSERS_OFFLOADERS))
def test_omni_offload_after_diffusers_offload_is_refused(strategy, offloader):
    pipe = flux_pipe()
    DIFFUSERS_OFFLOADERS[offloader](pipe)
    before = pipeline_snapshot(pipe)
    with pytest.raises(OffloadConflictError, match=r"cannot enable diffusers-omni .* offload; another offloader is "
                                                   r"active:\n  'transformer.*(enable_model_cpu_offload|enable_group_"
                                                   r"offload)"):
        _enable(pipe, strategy)
    assert_same_snapshot(before, pipeline_snapshot(pipe))
    assert pipe.omni_offload_backend is None


def test_model_level_tells_diffusers_where_parked_components_run():
    """Diffusers 0.42 places inputs with ``get_module_execution_device`` (FLUX's CLIP prompt path among ~30): an
    offloader's onload device if it finds one, else the module's weights' device, which for a component model-level
    offload parks on the host says ``cpu`` (on the H200 the CLIP ids went to the host: ``index is on cpu``). Each
    parked component answers with the offload device while enabled; nothing is left after disable; the hint is
    not mistaken for an Accelerate hook (re-enable works, Diffusers sees no CPU offload of its own)."""
    from diffusers.utils.torch_utils import get_module_execution_device

    from diffusers_omni.offload.hooks import ExecutionDeviceHint

    pipe = flux_pipe()
    reference = generate(pipe, steps=1)
    components = ("transformer", "text_encoder", "text_encoder_2")
    for _ in range(2):
        backend = pipe.enable_model_level_offload(device="cpu")
        for name in components:
            module = getattr(pipe, name)
            assert isinstance(module._hf_hook, ExecutionDeviceHint)
            assert module._hf_hook.execution_device == backend.execution_device
            assert get_module_execution_device(module) == backend.execution_device
        # #28: every component the offload places carries the hint (the VAE, resident, says the same device).
        assert get_module_execution_device(pipe.vae) == backend.execution_device
        assert torch.equal(generate(pipe, steps=1), reference)
        pipe.disable_omni_offload()
        assert not any(hasattr(getattr(pipe, name), "_hf_hook") for name in components)
    layerwise = pipe.enable_layerwise_offload(device="cpu")  # the hints say the device the components are on
    assert all(getattr(pipe, name)._hf_hook.execution_device == layerwise.execution_device for name in components)
    pipe.disable_omni_offload()


# #13 item 11 / #18 item 5: dtype and device moves --------------------------------------------------------------


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("move", ["pipe.to(meta)", "pipe.to(meta, float64)", "transformer.to(meta)",
                                  "vae.to(meta)", "text_encoder.to(meta)"])
def test_device_move_while_offloaded_is_refused(strategy, move):
    """Device moves away from the offload device are refused on every component the offload places (#28: casts
    work instead, tests/offload/test_guards_components.py)."""
    pipe = flux_pipe()
    reference = generate(pipe, steps=1)
    _enable(pipe, strategy)
    moves = {
        "pipe.to(meta)": lambda: pipe.to("meta"),  # any device other than where offload placed the weights
        "pipe.to(meta, float64)": lambda: pipe.to("meta", torch.float64),
        "transformer.to(meta)": lambda: pipe.transformer.to("meta"),
        "vae.to(meta)": lambda: pipe.vae.to("meta"),
        "text_encoder.to(meta)": lambda: pipe.text_encoder.to("meta"),
    }
    before = pipeline_snapshot(pipe)
    with pytest.raises(OffloadActiveError, match=r"while .* offload is enabled would change managed weights "
                                                 r"\(.*→.*\).*nothing was changed.*disable_omni_offload\(\), "
                                                 r"then .*, then enable the offload again"):
        moves[move]()
    assert_same_snapshot(before, pipeline_snapshot(pipe))
    assert torch.equal(generate(pipe, steps=1), reference)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_moves_that_change_nothing_are_allowed_and_disable_to_enable_works(strategy):
    pipe = flux_pipe()
    reference = generate(pipe, steps=1)
    _enable(pipe, strategy)
    pipe.to("cpu")
    pipe.to(torch.float32)
    pipe.transformer.float()
    assert torch.equal(generate(pipe, steps=1), reference)
    # The documented order: disable, .to(dtype), enable — equal to .to(dtype) then enable.
    pipe.disable_omni_offload()
    pipe.to(torch.float64)
    _enable(pipe, strategy)
    moved = generate(pipe, steps=1)
    plain = flux_pipe().to(torch.float64)
    _enable(plain, strategy)
    assert moved.dtype == torch.float64 and torch.equal(moved, generate(plain, steps=1))


# #13 item 11: torch.compile --------------------------------------------------------------------------------


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_compile_fullgraph_is_refused_clearly_and_graph_breaks_work(strategy):
    torch._dynamo.reset()
    model = bare_flux()
    with torch.no_grad():
        reference = model(**flux_inputs())[0]
    backend = apply_offload(model, OffloadConfig(strategy, device="cpu"))
    with pytest.raises(Exception, match=r"offload hooks rebind weights between blocks.*fullgraph=True.*"
                                        r"compile_repeated_blocks\(fullgraph=False\)"):
        with torch.no_grad():
            torch.compile(model, fullgraph=True, backend="eager")(**flux_inputs())
    torch._dynamo.reset()
    with torch.no_grad():
        assert torch.equal(torch.compile(model, backend="eager")(**flux_inputs())[0], reference)
    torch._dynamo.reset()
    model.compile_repeated_blocks(backend="eager")  # regional compile
    with torch.no_grad():
        assert torch.equal(model(**flux_inputs())[0], reference)
    backend.disable()
    torch._dynamo.reset()


# #18 item 1: saving ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("strategy", STRATEGIES + ["distributed_no_allgather"])
def test_save_pretrained_writes_the_real_weights(strategy, tmp_path, request):
    if strategy.startswith("distributed"):
        request.getfixturevalue("one_rank_group")
    pipe = flux_pipe()
    expected = {name: t.clone() for name, t in pipe.transformer.state_dict().items()}
    expected_encoder = {name: t.clone() for name, t in pipe.text_encoder.state_dict().items()}
    reference = generate(pipe, steps=1)
    _enable(pipe, strategy)
    generate(pipe, steps=1)
    pipe.save_pretrained(tmp_path / "pipe")
    pipe.transformer.save_pretrained(tmp_path / "transformer")
    assert torch.equal(generate(pipe, steps=1), reference)
    for directory in (tmp_path / "pipe" / "transformer", tmp_path / "transformer"):
        loaded = FluxTransformer2DModel.from_pretrained(directory)  # plain Diffusers
        state = loaded.state_dict()
        assert state.keys() == expected.keys()
        assert all(torch.equal(state[k], expected[k]) for k in expected), directory
    encoder = CLIPTextModel.from_pretrained(tmp_path / "pipe" / "text_encoder").state_dict()
    assert all(torch.equal(encoder[k], expected_encoder[k]) for k in expected_encoder)
    # Exactly what was read: no empty tensor in any file.
    for path in (tmp_path / "pipe").rglob("*.safetensors"):
        assert all(t.numel() > 0 for t in load_file(path).values()), path


def test_save_under_allgather_offload_is_refused_before_writing(tmp_path, one_rank_group):
    pipe = flux_pipe()
    pipe.enable_distributed_layerwise_offload(device="cpu")
    for save in (lambda: pipe.save_pretrained(tmp_path / "pipe"),
                 lambda: pipe.transformer.save_pretrained(tmp_path / "transformer")):
        with pytest.raises(OffloadActiveError, match=r"save_pretrained.*1/N shard.*nothing was written.*"
                                                     r"disable_omni_offload\(\) on every rank"):
            save()
    with pytest.raises(OffloadActiveError, match="state_dict"):
        pipe.transformer.state_dict()
    assert not any(tmp_path.iterdir())
    pipe.disable_omni_offload()
    pipe.save_pretrained(tmp_path / "pipe")  # the way out
    assert (tmp_path / "pipe" / "transformer").is_dir()


# #18 item 4: LoRA, fused QKV, layerwise casting ----------------------------------------------------------------


@pytest.fixture(scope="module")
def lora_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("lora")
    source = flux_pipe()
    torch.manual_seed(1)
    source.transformer.add_adapter(LoraConfig(r=4, lora_alpha=4, init_lora_weights=False,
                                              target_modules=["to_q", "to_k", "to_v", "to_out.0"]))
    OmniFluxPipeline.save_lora_weights(directory, transformer_lora_layers=get_peft_model_state_dict(source.transformer))
    return directory


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_lora_load_fuse_unfuse_unload_with_offload_on(strategy, lora_dir):
    resident = flux_pipe()
    base = generate(resident, steps=2)
    resident.load_lora_weights(lora_dir)
    with_lora = generate(resident, steps=2)
    resident.fuse_lora()
    fused = generate(resident, steps=2)
    resident.unfuse_lora()
    unfused = generate(resident, steps=2)
    resident.unload_lora_weights()
    unloaded = generate(resident, steps=2)  # unfusing subtracts the delta again: not bitwise the base weights
    assert not torch.equal(with_lora, base)

    pipe = flux_pipe()
    backend = _enable(pipe, strategy)
    pipe.load_lora_weights(lora_dir)
    assert pipe.omni_offload_backend is backend  # suspended and enabled again, same backend
    assert torch.equal(generate(pipe, steps=2), with_lora)
    pipe.set_adapters(["default_0"], [0.5])  # scales only: works without suspending
    pipe.set_adapters(["default_0"], [1.0])
    assert torch.equal(generate(pipe, steps=2), with_lora)
    pipe.fuse_lora()
    assert torch.equal(generate(pipe, steps=2), fused)
    pipe.unfuse_lora()
    assert torch.equal(generate(pipe, steps=2), unfused)
    pipe.unload_lora_weights()
    assert torch.equal(generate(pipe, steps=2), unloaded)
    assert pipe.omni_offload_backend is backend
    pipe.disable_omni_offload()
    assert torch.equal(generate(pipe, steps=2), unloaded)
    # Loading then unloading without fusing gives the base weights back exactly.
    _enable(pipe := flux_pipe(), strategy)
    pipe.load_lora_weights(lora_dir)
    pipe.unload_lora_weights()
    assert torch.equal(generate(pipe, steps=2), base)


def test_lora_under_distributed_offload_is_refused(lora_dir, one_rank_group):
    pipe = flux_pipe()
    pipe.enable_distributed_layerwise_offload(device="cpu")
    before = pipeline_snapshot(pipe)
    with pytest.raises(OffloadActiveError, match=r"load_lora_weights.*changes weights.*collective.*nothing was "
                                                 r"changed.*disable_omni_offload\(\) on every rank, then "
                                                 r"pipe.load_lora_weights"):
        pipe.load_lora_weights(lora_dir)
    assert_same_snapshot(before, pipeline_snapshot(pipe))


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_fuse_qkv_projections_with_offload_on(strategy):
    resident = flux_pipe()
    resident.transformer.fuse_qkv_projections()
    fused = generate(resident, steps=2)
    pipe = flux_pipe()
    _enable(pipe, strategy)
    pipe.transformer.fuse_qkv_projections()
    assert torch.equal(generate(pipe, steps=2), fused)
    assert any(hasattr(m, "to_qkv") for m in pipe.transformer.modules())
    pipe.transformer.unfuse_qkv_projections()
    pipe.disable_omni_offload()


@pytest.mark.parametrize("strategy,order", [(s, o) for s in STRATEGIES for o in ("casting_first", "offload_first")]
                         + [(s, "casting_first") for s in ("distributed_no_allgather", "distributed_allgather")])
def test_layerwise_casting_with_offload(strategy, order, request):
    if strategy.startswith("distributed"):
        request.getfixturevalue("one_rank_group")  # world size 1 over gloo
    storage = torch.float8_e4m3fn
    resident = flux_pipe()
    resident.transformer.enable_layerwise_casting(storage_dtype=storage, compute_dtype=torch.float32)
    reference = generate(resident, steps=2)
    pipe = flux_pipe()
    if order == "casting_first":
        pipe.transformer.enable_layerwise_casting(storage_dtype=storage, compute_dtype=torch.float32)
        _enable(pipe, strategy)
    else:
        _enable(pipe, strategy)
        pipe.transformer.enable_layerwise_casting(storage_dtype=storage, compute_dtype=torch.float32)
    assert torch.equal(generate(pipe, steps=2), reference)
    if not strategy.startswith("distributed"):
        block = next(m for m in pipe.transformer.modules() if isinstance(m, FluxTransformerBlock))
        stored = block.ff.net[2].weight
        assert stored.dtype == storage  # between calls the weight is the float8 copy (or its empty placeholder)
    pipe.disable_omni_offload()
    assert torch.equal(generate(pipe, steps=2), reference)


def test_guards_leave_diffusers_signatures_intact():
    pipe = flux_pipe()
    import inspect

    expected = {name: inspect.signature(getattr(pipe, name)) for name in ("load_lora_weights", "to", "fuse_lora")}
    pipe.enable_layerwise_offload(device="cpu")
    assert {name: inspect.signature(getattr(pipe, name)) for name in expected} == expected
    pipe.disable_omni_offload()
    assert snapshot(pipe.transformer).keys()


@pytest.mark.parametrize("use_allgather", [True, False], ids=["allgather", "no_allgather"])
def test_distributed_lora_loaded_before_enable_and_set_adapters(use_allgather, lora_dir, one_rank_group):
    resident = flux_pipe()
    resident.load_lora_weights(lora_dir)
    full = generate(resident, steps=2)
    resident.set_adapters(["default_0"], [0.5])
    half = generate(resident, steps=2)
    pipe = flux_pipe()
    pipe.load_lora_weights(lora_dir)
    pipe.enable_distributed_layerwise_offload(device="cpu", use_allgather=use_allgather)
    assert torch.equal(generate(pipe, steps=2), full)
    pipe.set_adapters(["default_0"], [0.5])
    assert torch.equal(generate(pipe, steps=2), half)
    before = pipeline_snapshot(pipe)
    with pytest.raises(OffloadActiveError, match=r"pipe.to\(torch.float64\) while distributed_layerwise offload is "
                                                 r"enabled.*on every rank"):
        pipe.to(torch.float64)
    assert_same_snapshot(before, pipeline_snapshot(pipe))
    pipe.disable_omni_offload()


@pytest.mark.parametrize("strategy", STRATEGIES + ["distributed_no_allgather", "distributed_allgather"])
def test_cache_hooks_with_offload(strategy, request):
    from diffusers import FirstBlockCacheConfig

    if strategy.startswith("distributed"):
        request.getfixturevalue("one_rank_group")  # world size 1 over gloo

    resident = flux_pipe()
    resident.transformer.enable_cache(FirstBlockCacheConfig(threshold=0.2))
    reference = generate(resident, steps=4)
    pipe = flux_pipe()
    pipe.transformer.enable_cache(FirstBlockCacheConfig(threshold=0.2))
    _enable(pipe, strategy)
    assert torch.equal(generate(pipe, steps=4), reference)
    pipe.disable_omni_offload()
    assert torch.equal(generate(pipe, steps=4), reference)


# #18: the distributed layerwise column (world size 1 over gloo, both modes) ------------------------------------

DISTRIBUTED = ["distributed_no_allgather", "distributed_allgather"]


@pytest.mark.parametrize("strategy", DISTRIBUTED)
def test_distributed_compile_with_graph_breaks_and_regional(strategy, one_rank_group):
    torch._dynamo.reset()
    reference = generate(flux_pipe(), steps=2)
    pipe = flux_pipe()
    _enable(pipe, strategy)
    compiled = torch.compile(pipe.transformer, backend="eager")
    plain = pipe.transformer
    pipe.transformer = compiled
    assert torch.equal(generate(pipe, steps=2), reference)
    pipe.transformer = plain
    torch._dynamo.reset()
    pipe.transformer.compile_repeated_blocks(backend="eager")
    assert torch.equal(generate(pipe, steps=2), reference)
    pipe.disable_omni_offload()
    torch._dynamo.reset()
