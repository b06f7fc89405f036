import pytest
import torch
from diffusers.models.transformers.transformer_flux import FluxAttnProcessor

from diffusers_omni import apply_attention, attention_report, remove_attention
from diffusers_omni.attention.processors import is_omni_processor
from diffusers_omni.attention.selector import BackendNotSupportedError
from diffusers_omni.installer import UnsupportedModelError
from diffusers_omni.testing import tiny_flux_components, tiny_flux_inputs


@pytest.fixture
def transformer():
    return tiny_flux_components()["transformer"]


def flux_inputs(batch=1, image_tokens=16, text_tokens=8):
    return tiny_flux_inputs(0, batch, image_tokens, text_tokens)


def attention_modules(model):
    return {name: m for name, m in model.named_modules() if hasattr(m, "processor")}


def test_apply_on_bare_transformer_routes_every_module(transformer):
    inputs = flux_inputs()
    with torch.no_grad():
        expected = transformer(**inputs).sample
    report = apply_attention(transformer, "TORCH_SDPA")
    modules = attention_modules(transformer)
    assert {entry["module"] for entry in report} == set(modules)
    assert all(is_omni_processor(m.processor) for m in modules.values())
    roles = {entry["module"]: entry["role"] for entry in report}
    assert roles["transformer_blocks.0.attn"] == "flux.joint"
    assert roles["single_transformer_blocks.0.attn"] == "flux.single"
    assert {e["category"] for e in report} == {"self"}
    with torch.no_grad():
        assert torch.equal(transformer(**inputs).sample, expected)
    assert attention_report(transformer) == report


def test_every_attention_call_goes_through_the_backend(transformer, monkeypatch):
    calls = []
    from diffusers_omni.attention.backends.sdpa import backend as sdpa

    original = sdpa.sdpa_bshd

    def spy(*args, **kwargs):
        calls.append(args[0].shape)
        return original(*args, **kwargs)

    monkeypatch.setattr(sdpa, "sdpa_bshd", spy)
    apply_attention(transformer, "TORCH_SDPA")
    with torch.no_grad():
        transformer(**flux_inputs())
    assert len(calls) == len(attention_modules(transformer))


def test_remove_restores_the_exact_processor_objects(transformer):
    before = {name: m.processor for name, m in attention_modules(transformer).items()}
    apply_attention(transformer, "TORCH_SDPA")
    apply_attention(transformer, None)  # re-applying keeps the Diffusers originals
    assert remove_attention(transformer) is True
    after = {name: m.processor for name, m in attention_modules(transformer).items()}
    assert all(after[name] is before[name] for name in before)
    assert all(isinstance(p, FluxAttnProcessor) for p in after.values())
    assert remove_attention(transformer) is False
    assert attention_report(transformer) == []


def test_failed_resolution_changes_nothing(transformer):
    before = {name: m.processor for name, m in attention_modules(transformer).items()}
    with pytest.raises(BackendNotSupportedError, match="CUDNN_ATTN"):
        apply_attention(transformer, {"per_role": {"flux.single": "CUDNN_ATTN"}})
    assert {name: m.processor for name, m in attention_modules(transformer).items()} == before
    assert attention_report(transformer) == []


def test_unsupported_model_names_supported_ones():
    with pytest.raises(UnsupportedModelError, match="Linear has no diffusers-omni attention declaration.*FluxTransformer2DModel"):
        apply_attention(torch.nn.Linear(2, 2))


def test_unknown_processor_is_refused_with_module_name(transformer):
    transformer.transformer_blocks[0].attn.set_processor(object())
    with pytest.raises(TypeError, match="'transformer_blocks.0.attn' uses processor object"):
        apply_attention(transformer)


def test_gradients_match_stock_diffusers(transformer):
    inputs = flux_inputs()
    stock_out = transformer(**inputs).sample
    stock_out.square().mean().backward()
    stock_grads = {n: p.grad.clone() for n, p in transformer.named_parameters() if p.grad is not None}
    transformer.zero_grad(set_to_none=True)
    apply_attention(transformer, "TORCH_SDPA")
    omni_out = transformer(**inputs).sample
    omni_out.square().mean().backward()
    assert torch.equal(stock_out, omni_out)
    for name, grad in stock_grads.items():
        assert torch.equal(grad, dict(transformer.named_parameters())[name].grad), name


def test_block_compiles_fullgraph(transformer):
    apply_attention(transformer, "TORCH_SDPA")
    block = transformer.single_transformer_blocks[0]
    generator = torch.Generator().manual_seed(1)
    hidden = torch.randn(1, 16, 32, generator=generator)
    text = torch.randn(1, 8, 32, generator=generator)
    temb = torch.randn(1, 32, generator=generator)
    rope = transformer.pos_embed(torch.zeros(24, 3))
    with torch.no_grad():
        eager = block(hidden, text, temb, image_rotary_emb=rope)
        torch._dynamo.reset()
        compiled = torch.compile(block, fullgraph=True, backend="eager")(hidden, text, temb, image_rotary_emb=rope)
    for a, b in zip(eager, compiled):
        assert torch.equal(a, b)


def test_processors_swapped_by_diffusers_are_replaced_again_on_the_next_call(transformer, caplog):
    inputs = flux_inputs()
    apply_attention(transformer, "TORCH_SDPA")
    with torch.no_grad():
        expected = transformer(**inputs).sample
    transformer.set_attn_processor(FluxAttnProcessor())  # what Diffusers' loaders do
    assert not is_omni_processor(transformer.transformer_blocks[0].attn.processor)
    with torch.no_grad(), caplog.at_level("INFO", logger="diffusers_omni.attention"):
        assert torch.equal(transformer(**inputs).sample, expected)
    assert all(is_omni_processor(m.processor) for m in attention_modules(transformer).values())
    assert "re-applying omni attention" in caplog.text
    remove_attention(transformer)
    assert all(isinstance(m.processor, FluxAttnProcessor) for m in attention_modules(transformer).values())


def test_a_swapped_processor_that_cannot_be_replaced_raises_on_the_next_call(transformer):
    apply_attention(transformer, "TORCH_SDPA")
    transformer.single_transformer_blocks[0].attn.set_processor(object())
    with pytest.raises(TypeError, match="'single_transformer_blocks.0.attn' uses processor object"):
        with torch.no_grad():
            transformer(**flux_inputs())


def test_all_true_masks_are_dropped_and_other_masks_reach_the_backend(transformer, monkeypatch):
    from diffusers_omni.attention.backends.sdpa import backend as sdpa

    seen = []
    original = sdpa.sdpa_bshd
    monkeypatch.setattr(sdpa, "sdpa_bshd", lambda *a, **k: seen.append(a[3]) or original(*a, **k))
    apply_attention(transformer, "TORCH_SDPA")
    inputs = flux_inputs()
    with torch.no_grad():
        no_mask = transformer(**inputs).sample
        full = torch.ones(1, 24, dtype=torch.bool)
        assert torch.equal(transformer(**inputs, joint_attention_kwargs={"attention_mask": full}).sample, no_mask)
        assert all(mask is None for mask in seen)
        partial = full.clone()
        partial[0, :4] = False
        seen.clear()
        masked = transformer(**inputs, joint_attention_kwargs={"attention_mask": partial}).sample
    assert all(mask is partial for mask in seen) and len(seen) == 2
    assert not torch.equal(masked, no_mask)


def test_a_mask_reaching_a_maskless_backend_raises(transformer):
    from diffusers_omni.attention.backends.base import AttentionBackend
    from diffusers_omni.attention.registry import register_backend, reset_backend

    class NoMask(AttentionBackend):
        name = "NOMASK_TEST"
        devices = frozenset({"cpu"})

        def __call__(self, q, k, v, attn_mask=None, *args):
            return q

    register_backend("NOMASK_TEST", NoMask)
    try:
        apply_attention(transformer, "NOMASK_TEST")
        partial = torch.ones(1, 24, dtype=torch.bool)
        partial[0, 0] = False
        with pytest.raises(ValueError, match="role 'flux.joint' received an attention mask.*NOMASK_TEST accepts none"):
            with torch.no_grad():
                transformer(**flux_inputs(), joint_attention_kwargs={"attention_mask": partial})
    finally:
        reset_backend("NOMASK_TEST")


def test_remove_attention_removes_hooks_that_backends_attached(transformer):
    from diffusers_omni.attention.backends.sdpa import TorchSDPABackend
    from diffusers_omni.attention.registry import register_backend, reset_backend
    from diffusers_omni.attention.backends.trtllm.timestep_gate import timestep_state

    class GatedBackend(TorchSDPABackend):
        name = "GATED_TEST"

        def bind_site(self, model, site, resolution):
            timestep_state(model, "flux")
            return self

    hooks_before = dict(transformer._forward_pre_hooks)
    register_backend("GATED_TEST", GatedBackend)
    try:
        apply_attention(transformer, "GATED_TEST")
        assert hasattr(transformer, "_omni_timestep_state")
        assert len(transformer._forward_pre_hooks) > len(hooks_before)
        with torch.no_grad():
            transformer(**flux_inputs())
        assert transformer._omni_timestep_state.t == 0.5  # FLUX passes t in [0, 1] already
        remove_attention(transformer)
    finally:
        reset_backend("GATED_TEST")
    assert not hasattr(transformer, "_omni_timestep_state")
    assert dict(transformer._forward_pre_hooks) == hooks_before
