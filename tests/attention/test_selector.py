import logging

import pytest
import torch

import diffusers_omni
from diffusers_omni import AttentionConfig
from diffusers_omni.attention.backends.base import AttentionBackend, AttentionCall
from diffusers_omni.attention.platform import Platform, use_platform
from diffusers_omni.attention.routing import PLATFORM_ROUTES, ROUTE_CONDITIONS
from diffusers_omni.attention.registry import get_backend_class, register_backend, reset_backend
from diffusers_omni.attention.selector import ENV_BACKEND, BackendNotSupportedError, resolve

CPU = Platform(device_type="cpu", device_name="CPU")
HOPPER = Platform("cuda", "H200", (9, 0), 91900)
BLACKWELL_DC = Platform("cuda", "B200", (10, 0), 91000)
BLACKWELL_WS = Platform("cuda", "RTX PRO 6000", (12, 0), 91000)
AMPERE = Platform("cuda", "A100", (8, 0), 90100)


def cpu_call(**kw):
    return AttentionCall(device_type="cpu", dtype=torch.float32, head_dim=64, **kw)


def cuda_call(**kw):
    kw.setdefault("dtype", torch.bfloat16)
    kw.setdefault("head_dim", 128)
    return AttentionCall(device_type="cuda", **kw)


def test_resolution_order(monkeypatch):
    config = AttentionConfig.parse(
        {
            "default": "TORCH_SDPA",
            "per_role": {"flux.joint": "TORCH_SDPA", "cross": "auto"},
        }
    )
    assert resolve(config, "flux.joint", "self", cpu_call(), CPU).source == "per_role['flux.joint']"
    assert resolve(config, "wan.cross", "cross", cpu_call(), CPU).source == "per_role['cross'] auto → platform default (CPU)"
    assert resolve(config, "wan.self", "self", cpu_call(), CPU).source == "default"
    monkeypatch.setenv(ENV_BACKEND, "torch_sdpa")
    env_only = resolve(AttentionConfig(), "wan.self", "self", cpu_call(), CPU)
    assert (env_only.backend, env_only.source) == ("TORCH_SDPA", f"env {ENV_BACKEND}")
    # The config's default outranks the environment variable.
    assert resolve(config, "wan.self", "self", cpu_call(), CPU).source == "default"
    monkeypatch.delenv(ENV_BACKEND)
    platform = resolve(None, "wan.self", "self", cpu_call(), CPU)
    assert (platform.backend, platform.source, platform.spec) == ("TORCH_SDPA", "platform default (CPU)", None)


def test_env_var_invalid_value_names_the_variable(monkeypatch):
    monkeypatch.setenv(ENV_BACKEND, "FAST_ATTN")
    with pytest.raises(ValueError, match=f"environment variable {ENV_BACKEND}='FAST_ATTN'.*TORCH_SDPA"):
        resolve(None, "wan.self", "self", cpu_call(), CPU)


def test_explicit_backend_that_cannot_run_raises_with_reasons():
    with pytest.raises(BackendNotSupportedError) as info:
        resolve("CUDNN_ATTN", "flux.joint", "self", cpu_call(), CPU)
    message = str(info.value)
    assert "CUDNN_ATTN (from default)" in message and "'flux.joint'" in message
    assert "platform device is 'cpu'; CUDNN_ATTN requires one of ['cuda']" in message
    assert "dtype is float32; CUDNN_ATTN requires one of bfloat16, float16" in message


@pytest.mark.parametrize(
    "platform, call, expected",
    [
        (CPU, cpu_call(), "TORCH_SDPA"),
        (Platform("mps", "MPS"), AttentionCall("mps", torch.float16, 64), "TORCH_SDPA"),
        (HOPPER, cuda_call(), "TORCH_SDPA"),
        (HOPPER, cuda_call(has_mask=True), "TORCH_SDPA"),
        (HOPPER, cuda_call(has_mask=True, dtype=torch.float32), "TORCH_SDPA"),
        (AMPERE, cuda_call(), "TORCH_SDPA"),
        (BLACKWELL_DC, cuda_call(mask_free_path=True), "CUDNN_ATTN"),
        (BLACKWELL_WS, cuda_call(), "CUDNN_ATTN"),
        (Platform("cuda", "B200", (10, 0), 90100), cuda_call(), "TORCH_SDPA"),
    ],
)
def test_platform_defaults(platform, call, expected):
    assert resolve(None, "x.self", "self", call, platform).backend == expected


def test_platform_default_trace_lists_rejected_candidates():
    resolution = resolve(None, "flux.joint", "self", cuda_call(mask_free_path=True), BLACKWELL_DC)
    rejected = {c.backend: c.reasons for c in resolution.candidates if c.reasons}
    assert "TRTLLM_ATTN" in rejected and "package 'flashinfer' is not importable" in " ".join(rejected["TRTLLM_ATTN"])
    assert resolution.source == "platform default (Blackwell sm_100, cuDNN 91000)"
    assert resolution.to_dict()["rejected"][0]["backend"] == "TRTLLM_ATTN"
    # head_dim 64 fails TRTLLM's routing condition before the backend is even asked.
    small = resolve(None, "flux.joint", "self", cuda_call(mask_free_path=True, head_dim=64), BLACKWELL_DC)
    assert small.candidates[0].reasons == ("routing condition 'head_dim_128' does not hold",)


def test_routing_tables_name_registered_backends_and_known_conditions():
    for routes in PLATFORM_ROUTES.values():
        assert routes[-1].backend == "TORCH_SDPA"
        for route in routes:
            get_backend_class(route.backend)
            assert set(route.when) <= set(ROUTE_CONDITIONS)


class CpuOnlyBackend(AttentionBackend):
    name = "CPU_TEST_ATTN"
    devices = frozenset({"cpu"})
    dtypes = frozenset({torch.float32})
    max_head_dim = 64
    calls = 0

    def __call__(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        type(self).calls += 1
        return get_backend_class("TORCH_SDPA")(None)(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)


@pytest.fixture
def custom_backend():
    register_backend("cpu_test_attn", CpuOnlyBackend)
    yield CpuOnlyBackend
    reset_backend("CPU_TEST_ATTN")


def test_register_backend_at_runtime(custom_backend):
    resolution = resolve("CPU_TEST_ATTN", "flux.joint", "self", cpu_call(), CPU)
    assert resolution.backend == "CPU_TEST_ATTN"
    with pytest.raises(BackendNotSupportedError, match="head_dim is 128; CPU_TEST_ATTN requires head_dim <= 64"):
        resolve("CPU_TEST_ATTN", "flux.joint", "self", AttentionCall("cpu", torch.float32, 128), CPU)


def test_register_backend_replaces_and_reset_restores():
    register_backend("TORCH_SDPA", CpuOnlyBackend)
    try:
        assert get_backend_class("TORCH_SDPA") is CpuOnlyBackend
    finally:
        reset_backend("TORCH_SDPA")
    assert get_backend_class("TORCH_SDPA").__name__ == "TorchSDPABackend"


@pytest.mark.parametrize(
    "name, backend, error",
    [("", CpuOnlyBackend, ValueError), ("auto", CpuOnlyBackend, ValueError), ("X", object, TypeError), ("X", "no_colon", ValueError)],
)
def test_register_backend_validates(name, backend, error):
    with pytest.raises(error):
        register_backend(name, backend)


def test_each_role_logged_once(caplog):
    caplog.set_level(logging.INFO, logger="diffusers_omni.attention")
    for _ in range(3):
        resolve("TORCH_SDPA", "flux.joint", "self", cpu_call(), CPU)
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["attention role 'flux.joint' → TORCH_SDPA (default)"]


def test_resolution_is_cached():
    first = resolve("TORCH_SDPA", "flux.joint", "self", cpu_call(), CPU)
    assert resolve("TORCH_SDPA", "flux.joint", "self", cpu_call(), CPU) is first


def test_use_platform_scopes_the_override():
    with use_platform(HOPPER):
        assert diffusers_omni.current_platform() is HOPPER
    assert diffusers_omni.current_platform() is not HOPPER


def _available(monkeypatch, *names):
    from diffusers_omni.attention.selector import clear_resolution_cache

    for name in names:
        monkeypatch.setattr(get_backend_class(name), "not_supported_reasons", classmethod(lambda cls, call, platform: []))
    clear_resolution_cache()


def test_hopper_default_is_sdpa_and_shape_routed_where_the_table_ranks_others_first(monkeypatch):
    # Nothing installed: the committed table's FLASH_ATTN / FLASHINFER_ATTN classes cannot be used here.
    resolution = resolve(None, "flux.joint", "self", cuda_call(), HOPPER)
    assert (resolution.backend, resolution.shape_routed) == ("TORCH_SDPA", ())
    _available(monkeypatch, "FLASH_ATTN", "FLASHINFER_ATTN")
    unmasked = resolve(None, "flux.joint", "self", cuda_call(), HOPPER)
    assert (unmasked.backend, unmasked.shape_routed) == ("TORCH_SDPA", ("FLASH_ATTN",))
    assert "shape-routed to FLASH_ATTN" in unmasked.describe_backend()
    masked = resolve(None, "hunyuan.self", "self", cuda_call(has_mask=True), HOPPER)
    assert set(masked.shape_routed) == {"FLASH_ATTN", "FLASHINFER_ATTN"}
    assert resolve(None, "sdxl.self", "self", cuda_call(head_dim=64), HOPPER).shape_routed == ()  # SDPA wins at d64
    # Explicit selections are never rerouted.
    assert resolve("TORCH_SDPA", "flux.joint", "self", cuda_call(), HOPPER).shape_routed == ()
    assert resolve(None, "flux.joint", "self", cpu_call(), CPU).shape_routed == ()


def test_apply_attention_installs_a_shape_router_on_hopper(monkeypatch):
    from diffusers_omni import apply_attention
    from diffusers_omni.attention.routing import ShapeRouter
    from diffusers import FluxTransformer2DModel

    _available(monkeypatch, "FLASH_ATTN", "FLASHINFER_ATTN")
    model = FluxTransformer2DModel(
        in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=128, num_attention_heads=1,
        joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=(16, 56, 56),
    )
    with use_platform(HOPPER):
        monkeypatch.setattr("diffusers_omni.installer._call_device_type", lambda model, platform: "cuda")
        monkeypatch.setattr("diffusers_omni.installer.model_dtype", lambda model: torch.bfloat16)
        report = apply_attention(model)
    assert {entry["shape_routed"][0] for entry in report} == {"FLASH_ATTN"}
    processor = model.transformer_blocks[0].attn.processor
    router = next(iter(processor.attend.values())).backend
    assert isinstance(router, ShapeRouter) and list(router.candidates) == ["TORCH_SDPA", "FLASH_ATTN"]
    assert router.choose(4608, 4608, 128, False) == "FLASH_ATTN"
    router.candidates["FLASH_ATTN"].supports_backward = False  # as with fa3-fwd
    assert router.choose(4608, 4608, 128, False, needs_grad=True) == "TORCH_SDPA"
    assert router.choose(300, 77, 128, False) == "TORCH_SDPA"  # a class the table does not cover
    assert router.describe()["backend"] == "SHAPE_ROUTED(TORCH_SDPA|FLASH_ATTN)"


def test_routing_table_naming_an_unregistered_backend_is_skipped(monkeypatch):
    """A routing-table entry for a backend this build does not register is passed over, not a crash."""
    from diffusers_omni.attention import selector

    _available(monkeypatch, "FLASH_ATTN")
    table = {"tolerance": 0.03, "families": {"hopper": {
        "q1/kv1/d128/dense": {"ranking": ["GONE_ATTN", "FLASH_ATTN", "TORCH_SDPA"],
                              "worst_ratio": {"GONE_ATTN": 1.0, "FLASH_ATTN": 0.9, "TORCH_SDPA": 0.5}},
    }}}
    monkeypatch.setattr(selector, "active_table", lambda platform=None: table)
    resolution = resolve(None, "flux.joint", "self", cuda_call(), HOPPER)
    assert (resolution.backend, resolution.shape_routed) == ("TORCH_SDPA", ("FLASH_ATTN",))


def test_registering_a_backend_invalidates_cached_resolutions():
    """The selector's cache notices registry changes by itself (the registry does not call the selector)."""

    class First(AttentionBackend):
        name = "CACHE_TEST"
        devices = frozenset({"cpu"})

    class Second(AttentionBackend):
        name = "CACHE_TEST"
        devices = frozenset({"cuda"})

    register_backend("CACHE_TEST", First)
    try:
        assert resolve("CACHE_TEST", "flux.joint", "self", cpu_call(), CPU).backend == "CACHE_TEST"
        register_backend("CACHE_TEST", Second)
        with pytest.raises(BackendNotSupportedError, match="CACHE_TEST"):
            resolve("CACHE_TEST", "flux.joint", "self", cpu_call(), CPU)
    finally:
        reset_backend("CACHE_TEST")
