"""Offload of quantized transformers on CPU: torchao int8/float8 weight-only, GGUF (Q8_0 + Q4_K, read back
through ``from_single_file``) and bitsandbytes NF4 (double quant) / int8 under every strategy, bitwise equal to the resident quantized model; packed bytes
streamed; the same weight objects after disable; unstreamable subclasses refused with nothing changed."""

from __future__ import annotations

import pytest
import torch

from diffusers_omni import OffloadConfig, apply_offload
from diffusers_omni.models.base import tail_attrs_for
from diffusers_omni.offload.hooks import hook_names
from diffusers_omni.offload.memory import ALIGN_BYTES, RESIDUE_BYTES, PackedWeights
from diffusers_omni.offload.tensors import TensorSet, UnsupportedTensorError, storage_nbytes, tensor_nbytes

import quant_helpers as qh
from dist_harness import describe, launch
from offload_helpers import flux_pipe, generate, pipeline_modules

STRATEGIES = ("model_level", "layerwise", "layerwise_budget")


def _blocks(model):
    if hasattr(model, "single_transformer_blocks"):
        return [(f"transformer_blocks.{i}", b) for i, b in enumerate(model.transformer_blocks)] + [
            (f"single_transformer_blocks.{i}", b) for i, b in enumerate(model.single_transformer_blocks)
        ]
    return [(f"blocks.{i}", b) for i, b in enumerate(model.blocks)]


def _hooks(model) -> dict[str, list[str]]:
    return {name: hook_names(m) for name, m in model.named_modules()}


def _logical_numel(weight) -> int:
    """Elements of the weight as the model sees it (GGUF and bitsandbytes 4-bit bytes hold more values)."""
    state = getattr(weight, "quant_state", None)
    return torch.Size(getattr(weight, "quant_shape", state.shape if state is not None else weight.shape)).numel()


def _config(strategy: str, model) -> OffloadConfig:
    if strategy != "layerwise_budget":
        return OffloadConfig(strategy, device="cpu")
    sizes = [PackedWeights(p, b, keep_residues=True).nbytes for p, b in _blocks(model)]
    # The output layers (norm_out, proj_out) stream with the last block.
    tail = [t for attr in tail_attrs_for(model) for t in list(getattr(model, attr).parameters())
            + list(getattr(model, attr).buffers())]
    sizes[-1] += sum(tensor_nbytes(t) for t in tail)
    block_ids = {id(t) for _, b in _blocks(model) for t in list(b.parameters()) + list(b.buffers())}
    block_ids |= {id(t) for t in tail}
    fixed = sum(tensor_nbytes(t) for t in list(model.parameters()) + list(model.buffers()) if id(t) not in block_ids)
    # Room for the two streaming slots and one more block: some blocks stay resident, the others stream. The slack
    # covers the layout's padding: on the CPU each tensor keeps its address residue (up to RESIDUE_BYTES more each).
    leaves = max(len(PackedWeights(p, b).slots) for p, b in _blocks(model)) + len(tail)
    slack = 4096 + 3 * RESIDUE_BYTES * leaves
    return OffloadConfig("layerwise", device="cpu", max_device_memory=fixed + 3 * max(sizes) + slack)


@pytest.fixture(scope="module")
def gguf_folder(tmp_path_factory):
    return tmp_path_factory.mktemp("gguf")


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("model_name", qh.MODELS)
@pytest.mark.parametrize("fmt", qh.FORMATS)
def test_quantized_dit_streams_packed_bytes_bitwise_equal(fmt, model_name, strategy, gguf_folder):
    model = qh.quantized(model_name, fmt, gguf_folder / f"{model_name}-{strategy}")
    kinds = qh.weight_kinds(model)
    assert kinds == {"torchao-int8": {"Int8Tensor"}, "torchao-float8": {"Float8Tensor"}, "gguf": {"GGUFParameter"},
                     "bnb-nf4": {"Params4bit"}, "bnb-int8": {"Int8Params"}}[fmt]
    if fmt == "bnb-nf4":
        assert all(p.quant_state.nested and p.quant_type == "nf4" for p in model.parameters() if hasattr(p, "quant_state"))
    if fmt == "gguf":
        types = {p.quant_type.name for p in model.parameters() if hasattr(p, "quant_type")}
        assert types == {"Q8_0", "Q4_K"}
    reference = qh.run(model, model_name)
    linears = [n for n, _ in qh.quantized_linears(model) if n.startswith(("transformer_blocks.1", "blocks.1"))]
    marked = model.get_submodule(linears[0]).weight
    marked.marker = "kept"  # a user attribute on a quantized weight must survive
    before = qh.weights_state(model)
    packed_total = storage_nbytes(model)
    dequantized_total = sum(_logical_numel(p) * 4 for p in model.parameters())
    dequantized_blocks = sum(_logical_numel(p) * 4 for _, b in _blocks(model) for p in b.parameters())
    assert packed_total < 0.5 * dequantized_total

    backend = apply_offload(model, _config(strategy, model))
    seen, remove = qh.capture_during_forward(model, linears)
    outputs = qh.run(model, model_name)
    remove()
    assert all(torch.equal(a, b) for a, b in zip(reference, outputs)), "offload must be bitwise equal step after step"
    stats = backend.stats
    if strategy == "model_level":
        leaves = len(TensorSet(model).leaves)  # packed bytes (+ alignment of each leaf), not a dequantized copy
        assert packed_total <= stats.onloaded_bytes <= packed_total + ALIGN_BYTES * leaves
    else:
        assert stats.streamed_blocks > 0 and stats.on_demand_loads == 0
        if strategy == "layerwise_budget":
            assert stats.resident_blocks > 0
        assert stats.streamed_bytes_per_pass < 0.5 * dequantized_blocks
    for name, calls in seen.items():
        original, _, _, _, values = before[f"{name}.weight"]
        assert len(calls) == len(reference)
        for weight_id, cls, nbytes, marker in calls:
            assert cls is type(original) and nbytes == sum(v.numel() * v.element_size() for v in values)
            if name == linears[0]:
                assert marker == "kept"
            if fmt.startswith("torchao") and strategy != "layerwise_budget":
                assert weight_id != id(original), "a wrapper subclass computes on an object rebuilt around device views"
    backend.disable()
    qh.assert_same_weights(before, model)
    assert all(torch.equal(a, b) for a, b in zip(reference, qh.run(model, model_name)))


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_unstreamable_subclass_is_refused_by_name_with_nothing_changed(strategy):
    model = qh.quantized("flux", "torchao-int8")
    qh.make_opaque(model, "single_transformer_blocks.1.proj_out")
    before, hooks = qh.weights_state(model), _hooks(model)
    with pytest.raises(UnsupportedTensorError) as raised:
        apply_offload(model, _config(strategy if strategy != "layerwise_budget" else "layerwise", model))
    message = str(raised.value)
    assert "parameter 'weight' of module" in message and "single_transformer_blocks.1.proj_out" in message
    assert "quant_helpers.OpaqueTensor" in message and "__tensor_flatten__" in message
    assert "GGUFParameter" in message and "Float8Tensor" in message  # what is supported
    qh.assert_same_weights(before, model)
    assert _hooks(model) == hooks


@pytest.mark.parametrize("strategy", ["layerwise", "model_level"])
def test_bnb_4bit_weights_the_cpu_backend_would_repack_are_refused_with_nothing_changed(strategy):
    """bitsandbytes' CPU backend repacks a 4-bit layer (weight bytes and quant_state) on its first eval forward on a
    CPU with AVX512-BF16; offload would drop that and compute on stale bytes (it did, silently). Refused up front,
    naming the module; bitsandbytes' own flag stands in for the CPU feature, so this holds on any CPU."""
    model = qh.quantized("flux", "bnb-nf4")
    layers = [m for m in model.modules() if hasattr(m, "support_avx512bf16_for_cpu")]
    assert layers
    for layer in layers:
        layer.support_avx512bf16_for_cpu = True
    before, hooks = qh.weights_state(model), _hooks(model)
    with pytest.raises(UnsupportedTensorError, match=r"cannot offload parameter 'weight' of module '[\w.]+' to "
                                                     r"device='cpu': it is a bitsandbytes\.nn\.modules\.Params4bit "
                                                     r"that bitsandbytes' CPU backend repacks.*allowed: run one "
                                                     r"forward before enabling offload.*or offload to a GPU"):
        apply_offload(model, OffloadConfig(strategy, device="cpu"))
    qh.assert_same_weights(before, model)
    assert _hooks(model) == hooks


def test_unstreamable_resident_weight_rolls_back_everything():
    """A refused weight outside the blocks (moved, not packed) is found after earlier moves: rollback undoes them."""
    model = qh.quantized("wan", "torchao-float8")
    qh.make_opaque(model, "proj_out")
    before, hooks = qh.weights_state(model), _hooks(model)
    for strategy in ("layerwise", "model_level"):
        with pytest.raises(UnsupportedTensorError, match="proj_out'.*OpaqueTensor"):
            apply_offload(model, OffloadConfig(strategy, device="cpu"))
        qh.assert_same_weights(before, model)
        assert _hooks(model) == hooks


def test_packed_layout_keeps_strides_and_shares_aliased_bytes():
    module = torch.nn.Linear(8, 4)
    module.weight = torch.nn.Parameter(torch.randn(8, 4).t())  # a transposed (column-major) weight
    module.register_buffer("alias", module.bias.data)  # the same bytes under another name
    tensors = TensorSet(module)
    assert len(tensors.leaves) == 2 and tensors.leaves[0].stride == (1, 4)
    assert {id(t) for t in tensors.leaves[1].targets} == {id(module.bias), id(module.alias)}
    x = torch.randn(3, 8)
    reference = module(x)
    backend = apply_offload(torch.nn.Sequential(module), OffloadConfig("model_level", device="cpu"))
    assert torch.equal(module(x), reference) and module.weight.stride() == (1, 4)
    assert module.alias.data_ptr() == module.bias.data_ptr()
    backend.disable()


@pytest.mark.parametrize("fmt", ["torchao-int8", "torchao-float8"])
def test_wrapper_built_once_then_rebound_and_released_between_uses(fmt):
    """Layerwise builds each torchao weight once for the device and afterwards only rebinds its inner tensors (a
    FLUX step binds ~500 of them): one object per weight for every step, the original object between uses, the
    kept one holding zero-element tensors; each block's device buffers are made once and their memory is
    allocated for every load and freed as soon as the block ends; nothing is kept after disable."""
    import weakref

    model = qh.quantized("flux", fmt)
    reference = qh.run(model, "flux")
    before = qh.weights_state(model)
    backend = apply_offload(model, OffloadConfig("layerwise", device="cpu"))
    state = backend._state
    streamed = {id(module): block for stack, row in zip(state.stacks, state.streamed)
                for (_, module), block in zip(stack.blocks, row) if block is not None}
    buffers: dict[int, weakref.ref] = {}
    loaded_bytes: list[tuple[int, int]] = []

    def keep_buffer_refs(module, args):
        block = streamed[id(module)]
        assert block.slot is not None, "prefetched before it runs"
        for b in block.buffers.values():
            buffers[id(b)] = weakref.ref(b)
            loaded_bytes.append((b.untyped_storage().nbytes(), b.numel() * b.element_size()))

    hooks = [m.register_forward_pre_hook(keep_buffer_refs) for _, m in _blocks(model) if id(m) in streamed]
    linears = [n for n, _ in qh.quantized_linears(model) if n.startswith(("transformer_blocks", "single_"))]
    seen, remove = qh.capture_during_forward(model, linears)
    outputs = qh.run(model, "flux")
    remove()
    for hook in hooks:
        hook.remove()
    assert all(torch.equal(a, b) for a, b in zip(reference, outputs))
    for name, calls in seen.items():
        ids = {weight_id for weight_id, *_ in calls}
        assert len(calls) == 3 and len(ids) == 1 and ids != {id(before[f"{name}.weight"][0])}, name
        assert model.get_submodule(name).weight is before[f"{name}.weight"][0], "between uses: the original object"
    wrappers = [w for row in state.weights for weights in row for w in weights.tensors.wrappers]
    assert len(wrappers) >= len(linears)
    assert all(w.reusable and w.rebuilt is not None for w in wrappers)
    assert all(held.numel() == 0 for w in wrappers for _, held in w.rebuilt.inner)
    assert len(buffers) == sum(len(b.weights.numel) for b in streamed.values()), "one buffer per dtype per block"
    assert len(loaded_bytes) == 3 * len(buffers) and all(held == size for held, size in loaded_bytes)
    # Freed when the block ended; only the next step's first blocks are loaded.
    held = [(blk.slot is not None, b.untyped_storage().nbytes(), b.numel() * b.element_size())
            for blk in streamed.values() for b in blk.buffers.values()]
    assert all(nbytes == (size if loaded else 0) for loaded, nbytes, size in held)
    assert any(not loaded for loaded, _, _ in held)
    backend.disable()
    assert all(w.rebuilt is None for w in wrappers)
    qh.assert_same_weights(before, model)
    state = streamed = None
    assert all(ref() is None for ref in buffers.values()), "nothing kept after disable"


def test_model_level_under_inference_mode_keeps_normal_wrapper_objects():
    """Model-level onloads inside the DiT's forward, here under ``inference_mode``: the objects kept for the next
    onload are normal tensors (a parameter must never be an inference tensor), reused across onloads."""
    model = qh.quantized("flux", "torchao-int8")
    with torch.inference_mode():
        reference = qh.run(model, "flux")
    backend = apply_offload(model, OffloadConfig("model_level", device="cpu"))
    linear = next(n for n, _ in qh.quantized_linears(model) if n.startswith("transformer_blocks.1"))
    seen, remove = qh.capture_during_forward(model, [linear])
    with torch.inference_mode():
        outputs = qh.run(model, "flux")
    remove()
    assert all(torch.equal(a, b) for a, b in zip(reference, outputs))
    wrappers = backend._state.exclusives[0].weights.tensors.wrappers
    assert wrappers and all(w.rebuilt is not None and not torch.is_inference(w.rebuilt.tensor) for w in wrappers)
    assert len({weight_id for weight_id, *_ in seen[linear]}) == 1
    backend.disable()
    assert all(w.rebuilt is None for w in wrappers)


def test_wrapper_that_copies_its_inner_tensors_is_rebuilt_on_every_bind():
    """A subclass whose ``__tensor_unflatten__`` does not keep the tensors it is given cannot be moved by rebinding
    them: it is rebuilt on every bind (still computing on the current views); one that keeps them is reused."""
    from torch.testing._internal.two_tensor import TwoTensor

    class CopyingTwoTensor(TwoTensor):
        @staticmethod
        def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
            return CopyingTwoTensor(inner["a"].clone(), inner["b"].clone(), outer_size, outer_stride)

    for cls, reused in ((TwoTensor, True), (CopyingTwoTensor, False)):
        module = torch.nn.Module()
        module.w = torch.nn.Parameter(cls(torch.zeros(4), torch.zeros(4)), requires_grad=False)
        original = module.w
        tensors = TensorSet(module)
        built = []
        for value in (1.0, 2.0):
            views = [torch.full((4,), value), torch.full((4,), value + 10)]
            tensors.bind(views)
            built.append(module.w)
            assert type(module.w) is cls and module.w is not original
            assert torch.equal(module.w.a, views[0]) and torch.equal(module.w.b, views[1])
        assert (built[0] is built[1]) is reused and tensors.wrappers[0].reusable is reused
        tensors.park([torch.empty(0), torch.empty(0)])
        assert module.w is original


def test_pipeline_quantization_config_just_works(tmp_path):
    from diffusers import PipelineQuantizationConfig, TorchAoConfig
    from torchao.quantization import Float8WeightOnlyConfig, Int8WeightOnlyConfig
    from transformers import TorchAoConfig as TransformersTorchAoConfig

    from diffusers_omni.pipelines.flux import OmniFluxPipeline

    flux_pipe().save_pretrained(tmp_path)
    config = PipelineQuantizationConfig(quant_mapping={
        "transformer": TorchAoConfig(Int8WeightOnlyConfig()),
        "text_encoder_2": TransformersTorchAoConfig(Float8WeightOnlyConfig()),
    })
    pipe = OmniFluxPipeline.from_pretrained(tmp_path, quantization_config=config)
    for module in pipeline_modules(pipe):
        module.eval()
    assert qh.weight_kinds(pipe.transformer) == {"Int8Tensor"}
    assert qh.weight_kinds(pipe.text_encoder_2) == {"Float8Tensor"}
    reference = generate(pipe, steps=2)
    before = {name: qh.weights_state(m) for name, m in pipe.components.items() if isinstance(m, torch.nn.Module)}
    for enable in (pipe.enable_layerwise_offload, pipe.enable_model_level_offload):
        enable(device="cpu")
        assert torch.equal(generate(pipe, steps=2), reference)
        pipe.disable_omni_offload()
        for name, state in before.items():
            qh.assert_same_weights(state, getattr(pipe, name))


def test_gguf_transformer_in_a_pipeline(tmp_path):
    pipe = flux_pipe()
    gguf = qh.quantized("flux", "gguf", tmp_path)
    config = {**pipe.transformer.config}
    assert gguf.config.in_channels == config["in_channels"] and gguf.config.joint_attention_dim == 32
    pipe.register_modules(transformer=gguf)
    reference = generate(pipe, steps=2)
    pipe.enable_layerwise_offload(device="cpu")
    assert torch.equal(generate(pipe, steps=2), reference)
    pipe.disable_omni_offload()
    pipe.enable_model_level_offload(device="cpu")
    assert torch.equal(generate(pipe, steps=2), reference)
    pipe.disable_omni_offload()


@pytest.fixture(scope="module")
def quantized_lora_dir(tmp_path_factory):
    """A FLUX LoRA (attention projections) for the tiny transformer ``quant_helpers`` quantizes."""
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    from diffusers_omni.pipelines.flux import OmniFluxPipeline

    directory = tmp_path_factory.mktemp("quantized_lora")
    source = qh.unquantized("flux")
    torch.manual_seed(1)
    source.add_adapter(LoraConfig(r=4, lora_alpha=4, init_lora_weights=False,
                                  target_modules=["to_q", "to_k", "to_v", "to_out.0"]))
    OmniFluxPipeline.save_lora_weights(directory, transformer_lora_layers=get_peft_model_state_dict(source))
    return directory


@pytest.mark.parametrize("strategy", ["layerwise", "model_level"])
# bitsandbytes 4-bit is left to the H200 check (benchmarks/quant_offload_check.py, LoRA scenarios): its CPU backend
# repacks the weights on the first forward and undoes that in state_dict(), which LoRA loading calls.
@pytest.mark.parametrize("fmt", ["gguf", "torchao-int8", "torchao-float8", "bnb-int8"])
def test_lora_on_a_quantized_transformer_with_offload_on(fmt, strategy, quantized_lora_dir, tmp_path):
    """GGUF / torchao / bitsandbytes DiT + LoRA, the common way to run a fine-tune on a small GPU: loading and
    unloading the LoRA while offload is on gives the resident quantized pipeline's images."""

    def pipe_with_quantized_transformer():
        pipe = flux_pipe()
        pipe.register_modules(transformer=qh.quantized("flux", fmt, tmp_path))
        return pipe

    resident = pipe_with_quantized_transformer()
    base = generate(resident, steps=2)
    resident.load_lora_weights(quantized_lora_dir)
    with_lora = generate(resident, steps=2)
    assert not torch.equal(with_lora, base)

    pipe = pipe_with_quantized_transformer()
    getattr(pipe, f"enable_{strategy}_offload")(device="cpu")
    backend = pipe.omni_offload_backend
    before = qh.weight_kinds(pipe.transformer)
    pipe.load_lora_weights(quantized_lora_dir)
    assert pipe.omni_offload_backend is backend and qh.weight_kinds(pipe.transformer) == before
    assert torch.equal(generate(pipe, steps=2), with_lora)
    pipe.unload_lora_weights()
    assert torch.equal(generate(pipe, steps=2), base)
    pipe.disable_omni_offload()
    assert torch.equal(generate(pipe, steps=2), base)


@pytest.mark.parametrize("world", [1, 2])
def test_distributed_layerwise_quantized(world, tmp_path):
    results = launch(qh.distributed_parity, world, str(tmp_path), deadline=300)
    for rank, result in enumerate(results):
        assert result["ok"], describe(rank, result)
        value = result["value"]
        for key, r in value.items():
            if key.startswith("refusal"):
                continue
            assert r["equal"] and r["equal_after"] and r["same_weights"], (rank, key, r)
            assert r["on_demand"] == 0, (rank, key, r)
            if key.endswith("/True"):  # AllGather: each rank holds 1/N of the packed bytes
                assert r["host_bytes"] * world - r["streamed"] < world * 512 * 16, (rank, key, r)
        assert value["refusal_unchanged"]
        expected = "UnsupportedTensorError" if rank == world - 1 else "rank 1 could not enable"
        assert value["refusal"] is not None and expected in value["refusal"], value["refusal"]
        assert "OpaqueTensor" in value["refusal"]


def _state(model) -> dict:
    return {k: (type(v), v.dequantize() if hasattr(v, "dequantize") else v.clone()) for k, v in model.state_dict().items()}


@pytest.mark.parametrize("fmt", qh.FORMATS)
def test_state_dict_under_layerwise_reads_quantized_host_copies(fmt, gguf_folder):
    """save_pretrained / state_dict() while layerwise offload is on: streamed quantized blocks are read from their
    host copies (wrapper subclasses rebuilt around them, bitsandbytes' quant_state included), then left as they were."""
    model = qh.quantized("flux", fmt, gguf_folder / f"state-{fmt}")
    for layer in model.modules():  # no CPU repacking of bnb 4-bit weights (refused under offload, tested above)
        if hasattr(layer, "support_avx512bf16_for_cpu"):
            layer.support_avx512bf16_for_cpu = False
    before = _state(model)
    backend = apply_offload(model, OffloadConfig("layerwise", device="cpu"))
    try:
        during = _state(model)
        assert during.keys() == before.keys()
        for key, (kind, value) in before.items():
            assert during[key][0] is kind, key
            assert torch.equal(during[key][1], value), key
        assert _state(model).keys() == before.keys()  # a second call finds the blocks parked again
    finally:
        backend.disable()


def _weight_signature(weight) -> tuple:
    """What can select a different dispatch path for a torchao weight: its class, autograd/inference flags, its
    non-tensor attributes (kernel preference, mm config, block size...) and its inner tensors' classes and flags."""
    names, _ = weight.__tensor_flatten__()
    attrs = tuple(sorted((k, repr(v)) for k, v in vars(weight).items() if not isinstance(v, torch.Tensor)))
    inner = tuple(
        (n, type(t), t.dtype, tuple(t.shape), t.is_contiguous(), t.requires_grad, torch.is_inference(t))
        for n in names for t in [getattr(weight, n)]
    )
    return (type(weight), weight.requires_grad, torch.is_inference(weight), weight.is_leaf, attrs, inner)


@pytest.mark.parametrize("fmt", ["torchao-float8", "torchao-int8"])
def test_layerwise_inference_mode_forward_sees_weights_like_the_resident_ones(fmt):
    """During an offloaded ``inference_mode`` forward every quantized linear sees a weight with the same class,
    flags, extra attributes and inner-tensor flags as the resident model's (the kept, rebound object included), so
    torchao's dispatch takes the same path; the same torchao functions run as many times as resident."""
    import cProfile
    import pstats

    model = qh.quantized("flux", fmt)
    linears = [m for _, m in qh.quantized_linears(model)]
    seen: dict[int, list] = {}
    hooks = [m.register_forward_pre_hook(lambda mod, _a: seen.setdefault(id(mod), []).append(
        _weight_signature(mod.weight))) for m in linears]

    def torchao_calls() -> dict:
        profile = cProfile.Profile()
        with torch.inference_mode():
            profile.runcall(qh.run, model, "flux", (0,))
        stats = pstats.Stats(profile).stats
        return {key: value[0] for key, value in stats.items() if "torchao" in key[0]}

    resident_calls = torchao_calls()
    resident = {k: v[0] for k, v in seen.items()}
    seen.clear()
    backend = apply_offload(model, OffloadConfig("layerwise", device="cpu"))
    torchao_calls()  # first bind builds the kept objects
    seen.clear()
    offloaded_calls = torchao_calls()
    for h in hooks:
        h.remove()
    backend.disable()
    assert seen.keys() == resident.keys()
    for key, signatures in seen.items():
        assert all(s == resident[key] for s in signatures), (signatures[0], resident[key])
    assert offloaded_calls == resident_calls
