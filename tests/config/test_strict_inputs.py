"""Hostile inputs to the typed configs (issue 13, items 6 and 7): each raises ValueError/TypeError naming the field
and the value, never another exception, never silently empty."""

import json

import pytest

from diffusers_omni import AttentionConfig, AttentionSpec, BlockSparseSpec, SkipSoftmaxSpec
from diffusers_omni.config.attention import MAX_LAYER_INDEX, MAX_ROLE_DEPTH, parse_layer_selector
from diffusers_omni.config.offload import MAX_BYTES, MAX_COUNT, OffloadConfig, OffloadPlan, parse_bytes


@pytest.mark.parametrize("per_role", [[], 0, "", (), 0.0, False])
def test_a_falsy_per_role_that_is_not_a_dict_is_refused(per_role):
    with pytest.raises(TypeError) as info:
        AttentionConfig.parse({"per_role": per_role})
    assert "per_role must be a dict" in str(info.value) and repr(per_role) in str(info.value)


def test_absent_or_null_per_role_is_empty():
    assert AttentionConfig.parse({"per_role": None}).per_role == {}
    assert AttentionConfig.parse('{"per_role": null}').per_role == {}
    assert AttentionConfig.parse({"default": "auto"}).per_role == {}


@pytest.mark.parametrize(
    "per_role",
    [
        {"a.b": "TORCH_SDPA", "a": {"b": "auto"}},
        {"a": {"b": "auto"}, "a.b": "TORCH_SDPA"},
        {"x": {"a.b": "auto", "a": {"b": "auto"}}},
    ],
)
def test_two_spellings_of_one_role_are_refused_naming_both(per_role):
    with pytest.raises(ValueError) as info:
        AttentionConfig.parse({"per_role": per_role})
    message = str(info.value)
    assert "both configure role" in message
    prefix = "['x']" if "x" in per_role else ""
    assert f"per_role{prefix}['a.b']" in message and f"per_role{prefix}['a']['b']" in message


@pytest.mark.parametrize("key", ["a..b", ".a", "a.", " ", "."])
def test_role_keys_with_an_empty_component_are_refused(key):
    with pytest.raises(ValueError, match="empty role component") as info:
        AttentionConfig.parse({"per_role": {key: "auto"}})
    assert repr(key) in str(info.value)


def test_skip_layers_with_a_huge_range_is_refused_without_expanding_it():
    # Before the fix this expanded a trillion indices and exhausted host memory.
    with pytest.raises(ValueError) as info:
        BlockSparseSpec(skip_layers="0-1000000000000")
    assert "block_sparse.skip_layers='0-1000000000000'" in str(info.value)
    assert f"<= {MAX_LAYER_INDEX}" in str(info.value)
    with pytest.raises(ValueError, match="out of range"):
        parse_layer_selector("3," + "9" * 5000)  # int() alone would refuse with its own digit-limit message
    with pytest.raises(ValueError, match="out of range"):
        parse_layer_selector([MAX_LAYER_INDEX + 1])
    assert parse_layer_selector(f"0-{MAX_LAYER_INDEX}")[-1] == MAX_LAYER_INDEX
    assert parse_layer_selector("007") == (7,)


@pytest.mark.parametrize("token", ["+3", "٣", "1_0", "-3", "1-", "1--3", "0x3"])
def test_skip_layer_items_are_plain_ascii_ints(token):
    with pytest.raises(ValueError) as info:
        parse_layer_selector(token)
    assert repr(token) in str(info.value)


@pytest.mark.parametrize(
    "build, field",
    [
        (lambda: SkipSoftmaxSpec(threshold=10**400), "skip_softmax.threshold"),
        (lambda: SkipSoftmaxSpec(threshold=-(10**400)), "skip_softmax.threshold"),
        (lambda: SkipSoftmaxSpec(target_sparsity=10**400), "skip_softmax.target_sparsity"),
        (lambda: SkipSoftmaxSpec(disabled_until_timestep=-(10**400)), "skip_softmax.disabled_until_timestep"),
        (lambda: BlockSparseSpec(sparsity=10**400), "block_sparse.sparsity"),
        (lambda: BlockSparseSpec(start_step=-(10**5000)), "block_sparse.start_step"),
        (lambda: AttentionSpec("TRTLLM_ATTN", quant={"dtype_qk": "int8", "q_block_size": 10**5000}), "q_block_size"),
        (lambda: OffloadConfig("layerwise", device="cpu", prefetch_depth=-(10**5000)), "prefetch_depth"),
        (lambda: OffloadConfig("layerwise", device="cpu", max_device_memory=-(10**400)), "max_device_memory"),
    ],
)
def test_huge_ints_raise_value_error_naming_the_field(build, field):
    # Before the fix: OverflowError (int too large to convert to float), or ValueError from repr() of the int.
    with pytest.raises(ValueError) as info:
        build()
    assert field in str(info.value), str(info.value)


def test_ints_within_float_range_stay_accepted():
    assert SkipSoftmaxSpec(threshold=10**300).threshold == 10**300
    assert SkipSoftmaxSpec(target_sparsity=1).target_sparsity == 1


@pytest.mark.parametrize(
    "value, fragment",
    [
        ("1" + "0" * 400 + "GB", "out of range"),
        ("1" * 5000, "out of range"),
        ("1e3GB", "not a byte size"),
        (".", "not a byte size"),
        ("GB", "not a byte size"),
        ("1.5 GiB", None),
    ],
)
def test_byte_sizes_never_overflow(value, fragment):
    if fragment is None:
        assert parse_bytes(value, "max_device_memory") == 3 * 2**29
        return
    with pytest.raises(ValueError) as info:
        parse_bytes(value, "max_device_memory")
    assert "max_device_memory=" in str(info.value) and fragment in str(info.value)


def test_byte_sizes_are_exact():
    assert parse_bytes("0.1KB", "x") == 100
    assert parse_bytes("12GiB", "x") == 12 * 2**30
    assert parse_bytes("999.999999999999999999TB", "x") == 999_999_999_999_999  # 30 fraction digits kept exactly
    assert parse_bytes("1024TiB", "x") == MAX_BYTES == 2**50  # the bound itself is allowed


# #28 item 6: every budget and size is bounded where it is parsed ---------------------------------------------------


@pytest.mark.parametrize(
    "value, shown_as",
    [
        (10**400, "<int of about 400 digits>"),
        (10**5000, "<int of about 5000 digits>"),  # repr() of the config raised ValueError for it
        (MAX_BYTES + 1, str(MAX_BYTES + 1)),
        (2**63, str(2**63)),  # past int64: OverflowError converting to a C integer
        ("1025TiB", "'1025TiB'"),
        ("999999999999999999999TB", "'999999999999999999999TB'"),
        ("1" + "0" * 400 + "GB", "'" + "1" + "0" * 36 + "..."),
    ],
    ids=["10**400", "10**5000", "MAX_BYTES+1", "2**63", "1025TiB", "1e21TB", "1e400GB"],
)
def test_byte_budgets_above_the_maximum_are_refused_naming_field_value_and_range(value, shown_as):
    # Before the fix: accepted (10**400 bytes), failing later with OverflowError (or in repr(config)).
    with pytest.raises(ValueError) as info:
        OffloadConfig("layerwise", device="cpu", max_device_memory=value)
    message = str(info.value)
    assert message.startswith(f"max_device_memory={shown_as}"), message
    assert f"allowed: 0 to {MAX_BYTES} bytes (= 1 PiB" in message, message
    assert len(message) < 400, "a huge value is abbreviated, never printed in full"


@pytest.mark.parametrize("value", ["1e400GiB", "inf", "nan GB", float("inf"), float("nan"), 1e9])
def test_float_budgets_are_refused_naming_the_field(value):
    with pytest.raises((TypeError, ValueError)) as info:
        OffloadConfig("layerwise", device="cpu", max_device_memory=value)
    assert str(info.value).startswith("max_device_memory"), str(info.value)


@pytest.mark.parametrize(
    "options, field",
    [
        ({"strategy": "layerwise", "prefetch_depth": 10**400}, "prefetch_depth"),
        ({"strategy": "layerwise", "prefetch_depth": MAX_COUNT + 1}, "prefetch_depth"),
        ({"strategy": "distributed_layerwise", "use_allgather": False, "resident_layers": 10**5000},
         "resident_layers"),
        ({"strategy": "distributed_layerwise", "use_allgather": False, "tensor_parallel_size": 2**63},
         "tensor_parallel_size"),
    ],
    ids=["prefetch_depth=10**400", "prefetch_depth=MAX_COUNT+1", "resident_layers=10**5000", "tensor_parallel=2**63"],
)
def test_counts_above_the_maximum_are_refused_naming_field_and_range(options, field):
    with pytest.raises(ValueError) as info:
        OffloadConfig(device="cpu", **options)
    message = str(info.value)
    assert message.startswith(f"{field}=") and f"allowed: 1 to {MAX_COUNT}" in message or \
        f"allowed: 0 to {MAX_COUNT}" in message, message
    assert len(message) < 400


def test_the_largest_allowed_values_make_a_printable_config():
    config = OffloadConfig("layerwise", device="cpu", max_device_memory=MAX_BYTES, prefetch_depth=MAX_COUNT)
    assert str(MAX_BYTES) in repr(config)
    distributed = OffloadConfig("distributed_layerwise", device="cpu", use_allgather=False,
                                resident_layers=MAX_COUNT, tensor_parallel_size=MAX_COUNT)
    assert str(MAX_COUNT) in repr(distributed)


@pytest.mark.parametrize(
    "value",
    [
        {"backend": "TORCH_SDPA", 1: 2, "zz": 3},
        {"default": "auto", 1: 2, "x": 3},
        {"per_role": {"cross": {"quant": {}, 1: 2}}},
        {"per_role": {"cross": {1: 2, "x": 3}}},
        {"backend": "TRTLLM_ATTN", "skip_softmax": {1: 2, "x": 3}},
    ],
)
def test_mixed_type_keys_are_reported_not_sorted_into_a_type_error(value):
    # Before the fix: TypeError "'<' not supported between instances of 'str' and 'int'".
    with pytest.raises((ValueError, TypeError)) as info:
        AttentionConfig.parse(value)
    assert "'<' not supported" not in str(info.value)
    assert "1" in str(info.value)


def test_deep_nesting_raises_value_error_not_recursion_error():
    nested = "auto"
    for _ in range(1000):
        nested = {"a": nested}
    with pytest.raises(ValueError, match=f"deeper than {MAX_ROLE_DEPTH}"):
        AttentionConfig.parse({"per_role": nested})
    text = '{"per_role": ' + '{"a": ' * 100000 + '"auto"' + "}" * 100001
    with pytest.raises(ValueError, match="not valid JSON"):
        AttentionConfig.parse(text)
    with pytest.raises(TypeError, match="quant.dtype_qk must be"):
        AttentionSpec.parse({"backend": "TRTLLM_ATTN", "quant": {"dtype_qk": nested}})


def test_a_json_number_beyond_ints_digit_limit_is_invalid_json():
    with pytest.raises(ValueError, match="not valid JSON"):
        AttentionConfig.parse('{"backend": "TRTLLM_ATTN", "skip_softmax": {"threshold": ' + "9" * 5000 + "}}")


@pytest.mark.parametrize(
    "build, fragments",
    [
        (lambda: parse_layer_selector(3.5), ["block_sparse.skip_layers", "float", "3.5"]),
        (lambda: AttentionSpec.parse(3.5), ["spec", "float", "3.5"]),
        (lambda: AttentionConfig.parse(3.5), ["attention config", "float", "3.5"]),
        (lambda: AttentionConfig.parse({"per_role": {7: "auto"}}), ["per_role", "int", "7"]),
        (lambda: OffloadConfig("layerwise", device="cpu", prefetch_depth="2"), ["prefetch_depth", "str", "'2'"]),
        (lambda: OffloadConfig("layerwise", device="cpu", show_progress="yes"), ["show_progress", "str", "'yes'"]),
        (lambda: OffloadConfig("distributed_layerwise", device="cpu", hsdp=1), ["hsdp", "int", "1"]),
        (lambda: OffloadConfig("layerwise", device="cpu", plan={"blocks": {}}), ["plan", "dict", "'blocks'"]),
        (lambda: OffloadPlan(blocks=[("transformer", ["blocks"])]), ["OffloadPlan.blocks", "list", "'transformer'"]),
        (lambda: OffloadPlan(blocks={3: ["blocks"]}), ["OffloadPlan.blocks", "int", "3"]),
        (lambda: OffloadPlan(resident=[None]), ["OffloadPlan.resident", "NoneType", "None"]),
        (lambda: OffloadConfig({"layerwise": 1}, device="cpu"), ["strategy", "dict", "'layerwise'"]),
    ],
)
def test_type_errors_give_type_and_value(build, fragments):
    with pytest.raises(TypeError) as info:
        build()
    for fragment in fragments:
        assert fragment in str(info.value), (fragment, str(info.value))


def test_messages_for_huge_or_deep_values_stay_short():
    nested = 1
    for _ in range(1000):
        nested = [nested]
    with pytest.raises(TypeError) as info:
        OffloadConfig("layerwise", device="cpu", prefetch_depth=nested)
    assert len(str(info.value)) < 300
    with pytest.raises(TypeError) as info:
        AttentionSpec.parse({"backend": "TRTLLM_ATTN", "quant": {"dtype_qk": list(range(100000))}})
    assert len(str(info.value)) < 300 and "quant.dtype_qk" in str(info.value)
    assert json.dumps(AttentionConfig.parse({"per_role": {"a": {"b": "auto"}}}).to_dict())
