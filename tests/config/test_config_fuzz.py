"""Property-based fuzz of the typed configs (issue 13). The oracle is the documented rules:

- a valid config parses, and round-trips through ``to_dict`` and JSON to an equal config;
- an invalid one raises ``ValueError`` or ``TypeError`` whose message names the field and shows the value;
- no input, however hostile (huge ints, deep nesting, mixed-type keys, garbage), raises any other exception.

CI runs a derandomized few thousand examples in seconds; ``pytest -m slow`` runs many more, randomized.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import string
import sys

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from diffusers_omni import AttentionConfig, AttentionSpec
from diffusers_omni.attention.plan import AttentionPlan
from diffusers_omni.attention.registry import registered_backend_names
from diffusers_omni.config.attention import MAX_LAYER_INDEX, MAX_ROLE_DEPTH

BACKEND_NAMES = registered_backend_names()
from diffusers_omni.config.offload import MAX_BYTES, MAX_COUNT, OffloadConfig, OffloadPlan, OffloadStrategy

_COMMON = dict(deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
CI = settings(max_examples=300, derandomize=True, **_COMMON)
SLOW = settings(max_examples=5000, **_COMMON)


def fuzz(*strategies):
    """``body`` as two tests: a derandomized CI run and a randomized ``slow`` run with many more examples."""

    def make(body):
        return CI(given(*strategies)(body)), pytest.mark.slow(SLOW(given(*strategies)(body)))

    return make


# -- values ---------------------------------------------------------------------------------------------------------

unit = st.one_of(st.floats(0, 1), st.sampled_from([0, 1]))
finite_nonneg = st.one_of(st.floats(0, sys.float_info.max), st.integers(0, 10**300))
block = st.sampled_from([1, 4, 16])
layer = st.integers(0, MAX_LAYER_INDEX)
# Role names that are also spec keys would make a nested dict read as a spec; the docs reserve them.
role_part = st.text(string.ascii_lowercase + string.digits + "_", min_size=1, max_size=8).filter(
    lambda t: t not in ("backend", "quant", "skip_softmax", "block_sparse")
)
role_key = st.lists(role_part, min_size=1, max_size=3).map(".".join)


@st.composite
def layer_selectors(draw):
    if draw(st.booleans()):
        return draw(st.lists(layer, max_size=6))
    items = []
    for _ in range(draw(st.integers(1, 4))):
        lo = draw(st.integers(0, 200))
        items.append(str(lo) if draw(st.booleans()) else f"{lo}-{lo + draw(st.integers(0, 50))}")
    return ",".join(items)


def case_variants(name):
    return st.sampled_from([name, name.lower(), name.title(), f" {name} "])


@st.composite
def valid_specs(draw):
    kind = draw(st.sampled_from(["plain", "auto", "trtllm", "flashinfer", "rainfusion"]))
    if kind == "plain":
        return draw(st.sampled_from(BACKEND_NAMES).flatmap(case_variants))
    if kind == "auto":
        return {"backend": draw(st.sampled_from(["auto", "AUTO", "Auto"]))}
    spec: dict = {}
    if kind == "trtllm":
        spec["backend"] = "TRTLLM_ATTN"
        if draw(st.booleans()):
            spec["quant"] = {"dtype_qk": draw(st.sampled_from(["int8", "fp8_e4m3"])), "q_block_size": draw(block),
                             "k_block_size": draw(block)}
        skip = {}
        which = draw(st.sampled_from(["none", "target", "threshold"]))
        if which == "target":
            skip["target_sparsity"] = draw(unit)
        elif which == "threshold":
            skip["threshold"] = draw(finite_nonneg)
        if draw(st.booleans()):
            skip["disabled_until_timestep"] = draw(unit)
        if skip or draw(st.booleans()):
            spec["skip_softmax"] = skip
    elif kind == "flashinfer":
        spec["backend"] = "FLASHINFER_ATTN"
        quant = {}
        if draw(st.booleans()):
            quant["dtype_qk"] = draw(st.sampled_from(["float16", "bfloat16"]))
        if not quant or draw(st.booleans()):
            quant["dtype_vo"] = draw(st.sampled_from(["float16", "bfloat16", "fp8_e4m3"]))
        spec["quant"] = quant
    else:
        spec["backend"] = "RAINFUSION_ATTN"
        sparse = {}
        if draw(st.booleans()):
            sparse["sparsity"] = draw(unit)
        elif draw(st.booleans()):
            sparse["mass_threshold"] = draw(unit.filter(lambda x: 0 < x < 1))
        if draw(st.booleans()):
            sparse["start_step"] = draw(st.integers(0, 10**30))
        if draw(st.booleans()):
            sparse["skip_layers"] = draw(layer_selectors())
        spec["block_sparse"] = sparse
    return spec


@st.composite
def valid_configs(draw):
    """``(config dict, expected dotted per_role keys)``."""
    config: dict = {}
    if draw(st.booleans()):
        config["default"] = draw(valid_specs())
    roles = draw(st.lists(role_key, max_size=5, unique=True))
    # No role may be a prefix component path of another (that would be nesting into a spec).
    roles = [r for r in roles if not any(o != r and (o.startswith(r + ".") or r.startswith(o + ".")) for o in roles)]
    per_role: dict = {}
    for role in roles:
        spec = draw(valid_specs())
        head, _, tail = role.partition(".")
        if tail and draw(st.booleans()):
            per_role.setdefault(head, {})[tail] = spec  # the nested spelling of the same role
        else:
            per_role[role] = spec
    if per_role or draw(st.booleans()):
        config["per_role"] = per_role
    if draw(st.booleans()):
        config["deterministic"] = draw(st.sampled_from([True, False, None]))
    return config, set(roles)


# -- oracle ---------------------------------------------------------------------------------------------------------


NO_VALUE = object()  # the mistake is structural: the message need not show a value


def shown(value) -> str | None:
    """What the message must contain to show ``value``: its repr when short (long values are abbreviated)."""
    if value is NO_VALUE:
        return None
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() * 0.30103 > 40:
        return "digits"
    text = repr(value)
    return text if len(text) <= 60 else None


def assert_refused(build, field: str, value) -> None:
    with pytest.raises((ValueError, TypeError)) as info:
        build()
    message = str(info.value)
    assert field in message, (field, message)
    fragment = shown(value)
    if fragment is not None:
        assert fragment in message, (fragment, message)


# -- attention config -----------------------------------------------------------------------------------------------


def _valid_round_trip(case):
    config, roles = case
    parsed = AttentionConfig.parse(config)
    assert set(parsed.per_role) == roles
    assert AttentionConfig.parse(parsed.to_dict()) == parsed
    assert AttentionConfig.parse(json.dumps(parsed.to_dict())) == parsed
    assert AttentionConfig.parse(json.dumps(config)) == parsed
    for spec in [parsed.default, *parsed.per_role.values()]:
        if spec is not None:
            assert spec.backend == "auto" or spec.backend in BACKEND_NAMES
            assert AttentionSpec.parse(spec.to_dict()) == spec


test_valid_attention_configs_round_trip, test_valid_attention_configs_round_trip_slow = fuzz(valid_configs())(_valid_round_trip)

# (field named in the message, path to the value inside a spec dict, values that break it)
_BAD_NUMBERS = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True).filter(lambda x: not (0 <= x <= 1)),
    st.integers().filter(lambda x: not 0 <= x <= 1),
    st.sampled_from([10**400, -(10**400), 10**5000, math.inf, math.nan]),
)
_NOT_NUMBERS = st.one_of(st.text(max_size=5), st.booleans(), st.none(), st.lists(st.integers(), max_size=2))
_MUTATIONS = [
    ("skip_softmax.target_sparsity", {"backend": "TRTLLM_ATTN", "skip_softmax": {}}, ("skip_softmax", "target_sparsity"),
     st.one_of(_BAD_NUMBERS, _NOT_NUMBERS.filter(lambda v: v is not None))),
    ("skip_softmax.threshold", {"backend": "TRTLLM_ATTN", "skip_softmax": {}}, ("skip_softmax", "threshold"),
     st.one_of(st.floats(max_value=-1e-300), st.integers(max_value=-1), st.sampled_from([math.inf, math.nan, 10**400]),
               _NOT_NUMBERS.filter(lambda v: v is not None))),
    ("skip_softmax.disabled_until_timestep", {"backend": "TRTLLM_ATTN", "skip_softmax": {}},
     ("skip_softmax", "disabled_until_timestep"), st.one_of(_BAD_NUMBERS, _NOT_NUMBERS)),
    ("quant.q_block_size", {"backend": "TRTLLM_ATTN", "quant": {"dtype_qk": "int8"}}, ("quant", "q_block_size"),
     st.one_of(st.integers().filter(lambda x: x not in (1, 4, 16)), st.floats(), _NOT_NUMBERS)),
    ("quant.dtype_qk", {"backend": "TRTLLM_ATTN", "quant": {}}, ("quant", "dtype_qk"),
     st.one_of(st.text(max_size=8).filter(lambda v: v not in ("int8", "fp8_e4m3")), st.integers(), st.booleans())),
    ("quant.dtype_vo", {"backend": "FLASHINFER_ATTN", "quant": {"dtype_qk": "float16"}}, ("quant", "dtype_vo"),
     st.one_of(st.text(max_size=8).filter(lambda v: v not in ("float16", "bfloat16", "fp8_e4m3")), st.integers())),
    ("block_sparse.sparsity", {"backend": "RAINFUSION_ATTN", "block_sparse": {}}, ("block_sparse", "sparsity"),
     st.one_of(_BAD_NUMBERS, _NOT_NUMBERS.filter(lambda v: v is not None))),
    ("block_sparse.mass_threshold", {"backend": "RAINFUSION_ATTN", "block_sparse": {}},
     ("block_sparse", "mass_threshold"),
     st.one_of(_BAD_NUMBERS, st.sampled_from([0, 0.0, 1, 1.0, 1.5]), _NOT_NUMBERS.filter(lambda v: v is not None))),
    ("block_sparse.start_step", {"backend": "RAINFUSION_ATTN", "block_sparse": {}}, ("block_sparse", "start_step"),
     st.one_of(st.integers(max_value=-1), st.floats(), st.sampled_from([-(10**5000)]), _NOT_NUMBERS)),
    ("block_sparse.skip_layers", {"backend": "RAINFUSION_ATTN", "block_sparse": {}}, ("block_sparse", "skip_layers"),
     st.one_of(
         st.text(max_size=12).filter(lambda t: not _valid_selector(t)),
         st.sampled_from(["0-1000000000000", "5-3", "1,,2", "-1", f"0-{MAX_LAYER_INDEX + 1}", "9" * 5000]),
         st.lists(st.one_of(st.integers(max_value=-1), st.integers(min_value=MAX_LAYER_INDEX + 1)), min_size=1,
                  max_size=3),
         st.lists(st.one_of(st.floats(), st.text(max_size=3), st.booleans()), min_size=1, max_size=3),
         st.integers(), st.floats(),
     )),
    ("backend", {}, ("backend",),
     st.one_of(st.integers(), st.floats(), st.none(), st.booleans(), st.lists(st.text(max_size=3), max_size=2),
               st.text(string.ascii_letters, min_size=1, max_size=8).map(lambda t: "NOT_A_BACKEND_" + t))),
]


def _valid_selector(text: str) -> bool:
    """The documented grammar: comma-separated ASCII ints or ascending ranges ``a-b``, each at most the bound."""
    for item in text.split(","):
        match = re.fullmatch(r"\s*([0-9]+)\s*(?:-\s*([0-9]+)\s*)?", item, re.ASCII)
        if match is None:
            return False
        lo, hi = int(match.group(1)), int(match.group(2) or match.group(1))
        if not lo <= hi <= MAX_LAYER_INDEX:
            return False
    return True


@st.composite
def mutated_specs(draw):
    field, base, path, values = draw(st.sampled_from(_MUTATIONS))
    value = draw(values)
    spec = json.loads(json.dumps(base))
    target = spec
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    where = draw(st.sampled_from(["default", "per_role", "bare"]))
    config = {"default": spec} if where == "default" else {"per_role": {"r.x": spec}} if where == "per_role" else spec
    return field, value, config


def _invalid_spec_refused(case):
    field, value, config = case
    # Shape errors are raised by the parse; names and per-backend options when the plan is built from it.
    assert_refused(lambda: AttentionPlan.build(AttentionConfig.parse(config)), field, value)


test_invalid_specs_name_field_and_value, test_invalid_specs_name_field_and_value_slow = fuzz(mutated_specs())(_invalid_spec_refused)


@st.composite
def invalid_config_shapes(draw):
    """Structural mistakes: ``(field, value, config)``."""
    kind = draw(st.sampled_from(["per_role_type", "key_type", "empty_part", "two_spellings", "too_deep",
                                 "deterministic", "unknown_key", "no_backend"]))
    if kind == "per_role_type":
        value = draw(st.one_of(st.sampled_from([[], 0, "", (), False, 0.0]), st.integers(), st.text(max_size=4),
                               st.lists(st.integers(), max_size=2)))
        return "per_role", value, {"per_role": value}
    if kind == "key_type":
        key = draw(st.one_of(st.integers(), st.floats(allow_nan=False), st.booleans(), st.none(), st.just("")))
        return "per_role", key, {"per_role": {key: "auto", "cross": "auto"}}
    if kind == "empty_part":
        key = draw(st.sampled_from(["a..b", ".a", "a.", " ", ". ", "a. .b"]))
        return "per_role", key, {"per_role": {key: "auto"}}
    if kind == "two_spellings":
        head, tail = draw(role_part), draw(role_part)
        return f"per_role['{head}.{tail}']", f"{head}.{tail}", {
            "per_role": {f"{head}.{tail}": "auto", head: {tail: "TORCH_SDPA"}}}
    if kind == "too_deep":
        depth = draw(st.integers(MAX_ROLE_DEPTH + 1, 1500))
        nested = "auto"
        for _ in range(depth):
            nested = {"a": nested}
        return "per_role", NO_VALUE, {"per_role": nested}
    if kind == "deterministic":
        value = draw(st.one_of(st.integers(), st.text(max_size=4), st.floats()))
        return "deterministic", value, {"deterministic": value}
    if kind == "unknown_key":
        extra = draw(st.one_of(st.integers(), st.text(max_size=6).filter(
            lambda t: t not in ("default", "per_role", "deterministic", "backend"))))
        return "unknown key", extra, {"default": "auto", extra: 1}
    keys = draw(st.sampled_from([{"quant": {}}, {"skip_softmax": {}}, {"block_sparse": {}}]))
    return "needs a 'backend' key", NO_VALUE, {"per_role": {"cross": keys}}


def _invalid_shape_refused(case):
    field, value, config = case
    assert_refused(lambda: AttentionConfig.parse(config), field, value)


test_invalid_config_shapes_name_field_and_value, test_invalid_config_shapes_name_field_and_value_slow = fuzz(invalid_config_shapes())(_invalid_shape_refused)

# Arbitrary JSON-like input, hostile scalars included: parses (and round-trips) or raises ValueError/TypeError.
_SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=10),
    st.sampled_from(["auto", "TORCH_SDPA", "TRTLLM_ATTN", "RAINFUSION_ATTN", "0-3,38", "0-1000000000000", 10**400,
                     "cross", "flux.joint", "backend", "quant", "skip_softmax", "block_sparse", "per_role"]),
)
_KEYS = st.one_of(st.sampled_from(["default", "per_role", "deterministic", "backend", "quant", "skip_softmax",
                                   "block_sparse", "threshold", "target_sparsity", "sparsity", "skip_layers",
                                   "dtype_qk", "dtype_vo", "q_block_size", "cross", "a.b", "a"]),
                  st.text(max_size=4), st.integers(-3, 3))
garbage = st.recursive(_SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                         st.dictionaries(_KEYS, inner, max_size=5)), max_leaves=25)


def _garbage_never_crashes(value):
    for form in (value, _json_or_none(value)):
        if form is None:
            continue
        try:
            parsed = AttentionConfig.parse(form)
        except (ValueError, TypeError) as error:
            assert str(error)
            continue
        assert AttentionConfig.parse(parsed.to_dict()) == parsed


def _json_or_none(value):
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return None


test_arbitrary_input_raises_only_value_or_type_errors, test_arbitrary_input_raises_only_value_or_type_errors_slow = (
    fuzz(garbage)(_garbage_never_crashes)
)


# -- offload config -------------------------------------------------------------------------------------------------

_STRATEGY_SPELLINGS = {
    OffloadStrategy.NONE: ["none", "NONE", "None"],
    OffloadStrategy.MODEL_LEVEL: ["model_level", "model-level", "MODEL_LEVEL", "Model-Level"],
    OffloadStrategy.LAYERWISE: ["layerwise", "LAYERWISE", "Layerwise"],
    OffloadStrategy.DISTRIBUTED_LAYERWISE: ["distributed_layerwise", "distributed-layerwise"],
}


@st.composite
def valid_offload(draw):
    strategy = draw(st.sampled_from(list(OffloadStrategy)))
    spelled = draw(st.one_of(st.sampled_from(_STRATEGY_SPELLINGS[strategy]), st.just(strategy)))
    requested = [spelled]
    if strategy is not OffloadStrategy.DISTRIBUTED_LAYERWISE and draw(st.booleans()):
        lower = [s for s in OffloadStrategy if list(OffloadStrategy).index(s) < list(OffloadStrategy).index(strategy)]
        requested += draw(st.lists(st.sampled_from(lower), max_size=2)) if lower else []
    kwargs = {
        "strategy": requested if len(requested) > 1 or draw(st.booleans()) else spelled,
        "device": draw(st.sampled_from(["cpu", "cuda", "cuda:1", torch.device("cpu"), "CPU".lower()])),
        "pin_memory": draw(st.booleans()),
        "show_progress": draw(st.sampled_from([None, True, False])),
    }
    if strategy is OffloadStrategy.LAYERWISE:
        if draw(st.booleans()):
            kwargs["max_device_memory"] = draw(st.one_of(
                st.integers(0, MAX_BYTES),
                st.tuples(st.integers(0, 1024), st.sampled_from(["", "b", "KB", "MiB", "gib", "GB", "TiB"]))
                .map(lambda t: f"{t[0]}{t[1]}"),
                st.tuples(st.integers(0, 999), st.integers(0, 999), st.sampled_from(["GiB", "MB"]))
                .map(lambda t: f"{t[0]}.{t[1]} {t[2]}"),
            ))
        kwargs["prefetch_depth"] = draw(st.integers(1, MAX_COUNT))
    if strategy is OffloadStrategy.DISTRIBUTED_LAYERWISE:
        allgather = draw(st.booleans())
        kwargs["use_allgather"] = allgather
        if not allgather:
            kwargs["resident_layers"] = draw(st.integers(0, 100))
            kwargs["tensor_parallel_size"] = draw(st.integers(1, 8))
            kwargs["hsdp"] = draw(st.booleans())
            kwargs["prefetch_depth"] = draw(st.integers(1, 4))
    if draw(st.booleans()):
        kwargs["plan"] = OffloadPlan(
            blocks={"transformer": draw(st.lists(role_part, max_size=2))},
            resident=draw(st.lists(role_key, max_size=2)),
        )
    return strategy, kwargs


def _valid_offload(case):
    strategy, kwargs = case
    config = OffloadConfig(**kwargs)
    assert config.strategy is strategy and config.requested[0] is strategy
    assert isinstance(config.device, torch.device)
    # Each strategy's config holds only its own fields: rebuild from those.
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.init}
    rebuilt = OffloadConfig(strategy=config.requested, **fields)
    assert rebuilt == config


test_valid_offload_configs_normalise_stably, test_valid_offload_configs_normalise_stably_slow = fuzz(valid_offload())(_valid_offload)

_NON_BOOL = st.one_of(st.integers(), st.text(max_size=4), st.none(), st.floats())
_OFFLOAD_MUTATIONS = [
    ("strategy", "layerwise", st.one_of(st.integers(), st.floats(), st.none(), st.dictionaries(st.text(max_size=3),
                                                                                               st.integers(), max_size=2),
                                          st.text(max_size=8).filter(lambda t: t.strip().lower().replace("-", "_")
                                                                     not in {s.value for s in OffloadStrategy}))),
    ("device", "layerwise", st.one_of(st.integers(), st.none(), st.floats(),
                                      st.sampled_from(["", "cuda:-1", "gpu", "cuda:0 ", "meta", "cuda:1.5",
                                                       "cuda:99999999999999999999"]))),
    ("pin_memory", "layerwise", _NON_BOOL.filter(lambda v: v is not None)),
    ("max_device_memory", "layerwise", st.one_of(
        st.integers(max_value=-1), st.integers(min_value=MAX_BYTES + 1), st.floats(), st.booleans(),
        st.sampled_from(["1e3GB", "12 parsecs", ".", "GB", "-5GB", "1" + "0" * 400 + "GB", "9" * 5000, "∞GB"]),
        st.text(max_size=6).filter(lambda t: not re.search("[0-9]", t)))),
    ("prefetch_depth", "layerwise", st.one_of(st.integers(max_value=0), st.integers(min_value=MAX_COUNT + 1),
                                              st.floats(), st.booleans(), st.text(max_size=3),
                                              st.sampled_from([-(10**5000), 10**5000]))),
    ("show_progress", "layerwise", _NON_BOOL.filter(lambda v: v is not None)),
    ("plan", "layerwise", st.one_of(st.integers(), st.text(max_size=3), st.dictionaries(st.text(max_size=3),
                                                                                         st.integers(), max_size=2))),
    ("use_allgather", "distributed_layerwise", _NON_BOOL),
    ("hsdp", "distributed_layerwise", _NON_BOOL),
    ("resident_layers", "distributed_layerwise", st.one_of(st.integers(max_value=-1), st.integers(min_value=MAX_COUNT + 1),
                                                          st.floats(), st.text(max_size=3))),
    ("tensor_parallel_size", "distributed_layerwise", st.one_of(st.integers(max_value=0),
                                                               st.integers(min_value=MAX_COUNT + 1), st.floats(),
                                                               st.text(max_size=3))),
    ("max_device_memory", "model_level", st.integers(0, 10**12)),  # valid bytes, wrong strategy
    ("resident_layers", "layerwise", st.integers(1, 10)),  # distributed-only option
]


@st.composite
def mutated_offload(draw):
    field, strategy, values = draw(st.sampled_from(_OFFLOAD_MUTATIONS))
    value = draw(values)
    kwargs = {"strategy": strategy, "device": "cpu"}
    if strategy == "distributed_layerwise" and field in ("resident_layers", "tensor_parallel_size", "hsdp"):
        kwargs["use_allgather"] = False
    kwargs[field] = value
    return field, value, kwargs


def _invalid_offload(case):
    field, value, kwargs = case
    assert_refused(lambda: OffloadConfig(**kwargs), field, value)


test_invalid_offload_configs_name_field_and_value, test_invalid_offload_configs_name_field_and_value_slow = fuzz(mutated_offload())(_invalid_offload)


def _plan_garbage(blocks, extra, resident):
    try:
        OffloadPlan(blocks=blocks, extra_streamed=extra, resident=resident)
    except (ValueError, TypeError) as error:
        assert "OffloadPlan." in str(error)


test_offload_plan_garbage, test_offload_plan_garbage_slow = fuzz(garbage, garbage, garbage)(_plan_garbage)
