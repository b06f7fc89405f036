import json
import math

import pytest

from diffusers_omni import AttentionConfig, AttentionSpec, AttnQuantSpec, BlockSparseSpec, SkipSoftmaxSpec
from diffusers_omni.attention.plan import AttentionPlan
from diffusers_omni.attention.registry import registered_backend_names
from diffusers_omni.config.attention import parse_layer_selector

VALID_SPECS = [
    {"backend": "TORCH_SDPA"},
    {"backend": "torch_sdpa"},
    {"backend": "auto"},
    {"backend": "AUTO"},
    {"backend": "TRTLLM_ATTN", "skip_softmax": {"target_sparsity": 0.5}},
    {"backend": "TRTLLM_ATTN", "skip_softmax": {"threshold": 0.0, "disabled_until_timestep": 1.0}},
    {"backend": "TRTLLM_ATTN", "skip_softmax": {"threshold": 3}},
    {"backend": "TRTLLM_ATTN", "quant": {"dtype_qk": "int8"}},
    {"backend": "TRTLLM_ATTN", "quant": {"dtype_qk": "fp8_e4m3", "q_block_size": 4, "k_block_size": 1}},
    {"backend": "FLASHINFER_ATTN", "quant": {"dtype_qk": "bfloat16", "dtype_vo": "fp8_e4m3"}},
    {"backend": "FLASHINFER_ATTN", "quant": {"dtype_vo": "float16"}},
    {"backend": "RAINFUSION_ATTN", "block_sparse": {}},
    {"backend": "RAINFUSION_ATTN", "block_sparse": {"sparsity": 0.0, "start_step": 3, "skip_layers": "0-3,38"}},
    {"backend": "RAINFUSION_ATTN", "block_sparse": {"sparsity": 1, "skip_layers": [5, 1]}},
    {"backend": "RAINFUSION_ATTN", "block_sparse": {"mass_threshold": 0.9, "start_step": 2}},
]


@pytest.mark.parametrize("value", VALID_SPECS)
def test_valid_specs(value):
    spec = AttentionSpec.parse(value)
    assert spec.backend == value["backend"].upper() or spec.backend == "auto"
    assert AttentionSpec.parse(spec.to_dict()) == spec


# (spec dict, exception type, fragments the message must contain)
INVALID_SPECS = [
    ({"backend": "NOPE"}, ValueError, ["backend='NOPE'", "TORCH_SDPA", "auto"]),
    ({"backend": 3}, TypeError, ["backend", "int"]),
    ({"backend": "TORCH_SDPA", "skip_softmax": {"threshold": 1.0}}, ValueError, ["skip_softmax", "TORCH_SDPA", "TRTLLM_ATTN"]),
    ({"backend": "TORCH_SDPA", "quant": {"dtype_qk": "int8"}}, ValueError, ["quant", "TORCH_SDPA"]),
    ({"backend": "TORCH_SDPA", "block_sparse": {}}, ValueError, ["block_sparse", "RAINFUSION_ATTN"]),
    ({"backend": "TRTLLM_ATTN", "quant": {"dtype_qk": "bfloat16"}}, ValueError, ["dtype_qk='bfloat16'", "int8", "fp8_e4m3"]),
    ({"backend": "TRTLLM_ATTN", "quant": {"dtype_qk": "int8", "dtype_vo": "fp8_e4m3"}}, ValueError, ["dtype_vo", "TRTLLM_ATTN"]),
    ({"backend": "TRTLLM_ATTN", "quant": {"dtype_qk": "int8", "q_block_size": 8}}, ValueError, ["q_block_size=8", "1, 4, 16"]),
    ({"backend": "TRTLLM_ATTN", "quant": {"dtype_qk": "int8", "k_block_size": 2}}, ValueError, ["k_block_size=2"]),
    ({"backend": "TRTLLM_ATTN", "quant": {}}, ValueError, ["dtype_qk", "required"]),
    ({"backend": "FLASHINFER_ATTN", "quant": {"dtype_qk": "int8"}}, ValueError, ["dtype_qk='int8'", "float16", "bfloat16"]),
    ({"backend": "FLASHINFER_ATTN", "quant": {"dtype_vo": "int8"}}, ValueError, ["dtype_vo='int8'", "fp8_e4m3"]),
    ({"backend": "FLASHINFER_ATTN", "quant": {}}, ValueError, ["dtype_qk", "dtype_vo"]),
    ({"backend": "FLASHINFER_ATTN", "quant": {"dtype_qk": "bfloat16", "q_block_size": 0}}, ValueError, ["q_block_size=0", "positive"]),
    ({"backend": "FLASHINFER_ATTN", "quant": {"dtype_qk": 16}}, TypeError, ["dtype_qk", "int"]),
    ({"backend": "TRTLLM_ATTN", "skip_softmax": {"target_sparsity": 1.5}}, ValueError, ["target_sparsity=1.5", "[0, 1]"]),
    ({"backend": "TRTLLM_ATTN", "skip_softmax": {"target_sparsity": -0.1}}, ValueError, ["target_sparsity=-0.1"]),
    ({"backend": "TRTLLM_ATTN", "skip_softmax": {"target_sparsity": math.nan}}, ValueError, ["target_sparsity=nan", "finite"]),
    ({"backend": "TRTLLM_ATTN", "skip_softmax": {"threshold": math.inf}}, ValueError, ["threshold=inf", ">= 0"]),
    ({"backend": "TRTLLM_ATTN", "skip_softmax": {"threshold": -1}}, ValueError, ["threshold=-1", ">= 0"]),
    ({"backend": "TRTLLM_ATTN", "skip_softmax": {"target_sparsity": 0.5, "threshold": 1}}, ValueError, ["mutually exclusive"]),
    ({"backend": "TRTLLM_ATTN", "skip_softmax": {"disabled_until_timestep": 2}}, ValueError, ["disabled_until_timestep=2"]),
    ({"backend": "TRTLLM_ATTN", "skip_softmax": {"threshold": "1"}}, TypeError, ["threshold", "str"]),
    ({"backend": "TRTLLM_ATTN", "skip_softmax": {"target_sparsity": True}}, TypeError, ["target_sparsity", "bool"]),
    ({"backend": "TRTLLM_ATTN", "skip_softmax": {"bogus": 1}}, ValueError, ["unknown key", "bogus", "target_sparsity"]),
    ({"backend": "RAINFUSION_ATTN", "block_sparse": {"sparsity": 1.01}}, ValueError, ["sparsity=1.01"]),
    ({"backend": "RAINFUSION_ATTN", "block_sparse": {"mass_threshold": 1.0}}, ValueError,
     ["block_sparse.mass_threshold=1.0", "out of range", "(0, 1)"]),
    ({"backend": "RAINFUSION_ATTN", "block_sparse": {"mass_threshold": 0}}, ValueError, ["mass_threshold=0", "(0, 1)"]),
    ({"backend": "RAINFUSION_ATTN", "block_sparse": {"mass_threshold": "0.9"}}, TypeError,
     ["block_sparse.mass_threshold", "str", "'0.9'"]),
    ({"backend": "RAINFUSION_ATTN", "block_sparse": {"mass_threshold": 0.9, "sparsity": 0.5}}, ValueError,
     ["sparsity=0.5", "mass_threshold=0.9", "mutually exclusive"]),
    ({"backend": "RAINFUSION_ATTN", "block_sparse": {"start_step": -1}}, ValueError, ["start_step=-1", ">= 0"]),
    ({"backend": "RAINFUSION_ATTN", "block_sparse": {"start_step": 1.5}}, TypeError, ["start_step", "float"]),
    ({"backend": "RAINFUSION_ATTN", "block_sparse": {"skip_layers": "3-1"}}, ValueError, ["ascending"]),
    ({"backend": "RAINFUSION_ATTN", "block_sparse": {"skip_layers": "a"}}, ValueError, ["'a'"]),
    ({"backend": "RAINFUSION_ATTN", "block_sparse": {"skip_layers": "1,,2"}}, ValueError, ["empty item"]),
    ({"backend": "RAINFUSION_ATTN", "block_sparse": {"skip_layers": [-1]}}, ValueError, [">= 0"]),
    ({"backend": "RAINFUSION_ATTN", "block_sparse": {"skip_layers": [1.0]}}, TypeError, ["ints"]),
    ({"backend": "RAINFUSION_ATTN", "block_sparse": {"skip_layers": 3}}, TypeError, ["selector"]),
    ({"backend": "TORCH_SDPA", "extra": 1}, ValueError, ["unknown key", "extra"]),
    ({"backend": "auto", "quant": {"dtype_qk": "int8"}}, ValueError, ["quant", "'auto'"]),
]


@pytest.mark.parametrize("value, error, fragments", INVALID_SPECS)
def test_invalid_specs(value, error, fragments):
    # Shape errors are raised by the spec itself; names and per-backend options when the plan is built from it.
    with pytest.raises(error) as info:
        AttentionPlan.build(AttentionSpec.parse(value))
    for fragment in fragments:
        assert fragment in str(info.value), (fragment, str(info.value))


def test_every_backend_name_is_accepted():
    for name in registered_backend_names():
        assert AttentionSpec(backend=name).backend == name


def test_parse_forms_agree():
    seed_form = {"default": {"backend": "TORCH_SDPA"}, "per_role": {"cross": {"backend": "auto"}}}
    expected = AttentionConfig(default=AttentionSpec("TORCH_SDPA"), per_role={"cross": AttentionSpec("auto")})
    assert AttentionConfig.parse(seed_form) == expected
    assert AttentionConfig.parse(json.dumps(seed_form)) == expected
    assert AttentionConfig.parse(expected) is expected
    assert AttentionConfig.parse("TORCH_SDPA") == AttentionConfig(default=AttentionSpec("TORCH_SDPA"))
    assert AttentionConfig.parse({"backend": "TORCH_SDPA"}) == AttentionConfig(default=AttentionSpec("TORCH_SDPA"))
    assert AttentionConfig.parse(None) == AttentionConfig()
    assert AttentionConfig.parse({"per_role": {"cross": "TORCH_SDPA"}}).per_role["cross"].backend == "TORCH_SDPA"


def test_nested_roles_flatten_to_dotted_roles():
    config = AttentionConfig.parse(
        {"per_role": {"ltx2": {"audio_to_video": {"backend": "TORCH_SDPA"}, "video": {"self": "auto"}}, "cross": "auto"}}
    )
    assert set(config.per_role) == {"ltx2.audio_to_video", "ltx2.video.self", "cross"}
    assert config.per_role["ltx2.audio_to_video"].backend == "TORCH_SDPA"


@pytest.mark.parametrize(
    "value, error, fragment",
    [
        ("{not json", ValueError, "not valid JSON"),
        ({"defaults": {}}, ValueError, "unknown key(s) ['defaults']"),
        ({"per_role": ["x"]}, TypeError, "per_role must be a dict"),
        ({"per_role": {"cross": {"quant": {}}}}, ValueError, "needs a 'backend' key"),
        ({"per_role": {"cross": 3}}, TypeError, "per_role['cross']"),
        ({"default": 3}, TypeError, "default"),
        (3.5, TypeError, "float"),
        ("", ValueError, "backend=''"),
    ],
)
def test_invalid_configs(value, error, fragment):
    with pytest.raises(error) as info:
        AttentionConfig.parse(value)
    assert fragment in str(info.value)


def test_typed_specs_are_frozen_and_hashable():
    spec = AttentionSpec("RAINFUSION_ATTN", block_sparse=BlockSparseSpec(skip_layers="0-2"))
    assert spec.block_sparse.skip_layers == (0, 1, 2)
    assert hash(spec) == hash(AttentionSpec.parse(spec.to_dict()))
    with pytest.raises(AttributeError):
        spec.backend = "TORCH_SDPA"


def test_direct_construction_validates():
    with pytest.raises(ValueError, match="target_sparsity"):
        SkipSoftmaxSpec(target_sparsity=2.0)
    with pytest.raises(ValueError, match="quant is not allowed"):
        AttentionPlan.build(AttentionSpec("TORCH_SDPA", quant=AttnQuantSpec(dtype_qk="int8")))


def test_layer_selector():
    assert parse_layer_selector("0-3,38") == (0, 1, 2, 3, 38)
    assert parse_layer_selector(" 5 , 2-3") == (2, 3, 5)
    assert parse_layer_selector([3, 1, 3]) == (1, 3)


def test_block_sparse_selection_rule():
    assert BlockSparseSpec().sparsity == 0.8 and BlockSparseSpec().selection == "topk"
    assert BlockSparseSpec() == BlockSparseSpec(sparsity=0.8)
    mass = BlockSparseSpec(mass_threshold=0.9)
    assert mass.sparsity is None and mass.selection == "mass" and mass.describe() == "mass threshold 0.9"
    spec = AttentionSpec("RAINFUSION_ATTN", block_sparse=mass)
    assert AttentionSpec.parse(spec.to_dict()) == spec
