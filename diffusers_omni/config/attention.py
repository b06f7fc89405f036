"""Typed attention configuration: which backend serves which attention role.

Every spec validates its shape on construction: types, ranges, known keys, and option combinations that no backend
could accept. Invalid input raises ``ValueError`` (``TypeError`` for a value of the wrong type) naming the field,
the value found and what is allowed. ``AttentionConfig.parse`` is the single entry point that accepts user input in
any of its supported forms.

What depends on the backends (whether a name is registered, Diffusers' names as aliases, which backend accepts
which option and with which values) is not known here: each kernel family declares it in its package, and
``diffusers_omni.attention.plan.AttentionPlan.build`` checks a config against it (the installer builds that plan
once per enable call, so such errors reach the user on the same call).
"""

from __future__ import annotations

import json
import math
import re
import sys
from dataclasses import dataclass, field, fields
from typing import Any, Mapping

from ._values import check_int_range, keys_text, show

AUTO = "auto"

# Quantisation blocks are counted in tokens; no kernel takes blocks larger than this (each backend checks its own
# choices when the plan is built).
MAX_QUANT_BLOCK_SIZE = 65_536
# Layer indices above this are refused rather than expanded: no DiT comes near 10,000 blocks, and a selector such as
# "0-1000000000000" would otherwise be expanded into a tuple that exhausts host memory.
MAX_LAYER_INDEX = 9_999
# Nested ``per_role`` dicts flatten to dotted roles (``{"ltx2": {"video": {"self": ...}}}``); real roles have two or
# three components, and deeper nesting is refused before it can exhaust the interpreter's recursion limit.
MAX_ROLE_DEPTH = 8


def normalize_backend_name(value: Any, field_name: str = "backend") -> str:
    """The backend name in its canonical case: ``"auto"`` (any case) or upper case, surrounding spaces dropped.

    Whether the name is registered, or one of Diffusers' names (an alias), is checked when a plan is built from
    the config (``attention.registry.canonical_backend_name``); the spelling as typed is kept for its messages.
    """
    if not isinstance(value, str):
        raise TypeError(f"{field_name} must be a backend name (str), got {type(value).__name__}: {show(value)}")
    name = value.strip()
    if not name:
        raise ValueError(f"{field_name}={value!r} is empty; allowed: a backend name such as 'TORCH_SDPA', or "
                         f"{AUTO!r} for the platform default")
    if name.lower() == AUTO:
        return AUTO
    return name.upper()


def _check_type(owner: str, name: str, value: Any, types: tuple[type, ...], allowed: str) -> None:
    if isinstance(value, bool) and bool not in types:
        raise TypeError(f"{owner}.{name} must be {allowed}, got bool: {value!r}")
    if not isinstance(value, types):
        raise TypeError(f"{owner}.{name} must be {allowed}, got {type(value).__name__}: {show(value)}")


def _is_finite(value: int | float) -> bool:
    """Finite as the float the kernels receive. ``math.isfinite`` itself raises OverflowError for an int above
    ~1.8e308, so such ints are compared, not converted."""
    if isinstance(value, int):
        return abs(value) <= sys.float_info.max
    return math.isfinite(value)


def _check_unit_interval(owner: str, name: str, value: Any) -> None:
    _check_type(owner, name, value, (int, float), "a finite number in [0, 1]")
    if not _is_finite(value) or not 0 <= value <= 1:
        raise ValueError(f"{owner}.{name}={show(value)} is out of range; allowed: a finite number in [0, 1]")


def _check_choice(owner: str, name: str, value: Any, allowed: tuple, context: str = "") -> None:
    if value not in allowed:
        suffix = f" {context}" if context else ""
        raise ValueError(
            f"{owner}.{name}={show(value)} is not allowed{suffix}; allowed: {', '.join(map(repr, allowed))}"
        )


@dataclass(frozen=True)
class AttnQuantSpec:
    """Quantised attention inputs, read by ``TRTLLM_ATTN`` (SAGE quantisation), ``FLASHINFER_ATTN`` (QK16/V8) and
    ``FLASH_ATTN`` (FP8 e4m3 Q, K and V on Hopper FlashAttention-3: an extension of the contract, which defines
    ``quant`` for FlashInfer and TRTLLM only). Which values each backend accepts is checked by its family when the
    plan is built (``attention/backends/<family>/``).

    Args:
        dtype_qk (`str`, *optional*): dtype of Q and K.
        dtype_vo (`str`, *optional*): dtype of V (FlashInfer; FLASH_ATTN requires ``"fp8_e4m3"`` for both).
        q_block_size (`int`, defaults to 1): quantisation block along the query sequence (TRTLLM: 1, 4 or 16).
        k_block_size (`int`, defaults to 16): quantisation block along the key sequence (TRTLLM: 1, 4 or 16).
    """

    dtype_qk: str | None = None
    dtype_vo: str | None = None
    q_block_size: int = 1
    k_block_size: int = 16

    def __post_init__(self) -> None:
        for name in ("dtype_qk", "dtype_vo"):
            value = getattr(self, name)
            if value is not None:
                _check_type("quant", name, value, (str,), "a dtype name (str) or None")
        for name in ("q_block_size", "k_block_size"):
            value = getattr(self, name)
            _check_type("quant", name, value, (int,), "a positive int")
            if value <= 0:
                raise ValueError(f"quant.{name}={show(value)} must be a positive int")
            check_int_range(value, f"quant.{name}", 1, MAX_QUANT_BLOCK_SIZE, "tokens")


@dataclass(frozen=True)
class SkipSoftmaxSpec:
    """Skip-Softmax sparse attention for ``TRTLLM_ATTN``.

    Args:
        target_sparsity (`float`, *optional*): operating point in [0, 1] on a calibrated curve.
        threshold (`float`, *optional*): direct threshold >= 0; exclusive with ``target_sparsity``.
        disabled_until_timestep (`float`, defaults to 0.0): normalised timestep in [0, 1]; steps with
            ``t > disabled_until_timestep`` stay dense.
    """

    target_sparsity: float | None = None
    threshold: float | None = None
    disabled_until_timestep: float = 0.0

    def __post_init__(self) -> None:
        if self.target_sparsity is not None:
            _check_unit_interval("skip_softmax", "target_sparsity", self.target_sparsity)
        if self.threshold is not None:
            _check_type("skip_softmax", "threshold", self.threshold, (int, float), "a finite number >= 0")
            if not _is_finite(self.threshold) or self.threshold < 0:
                raise ValueError(
                    f"skip_softmax.threshold={show(self.threshold)} is out of range; allowed: a finite number >= 0"
                )
        if self.target_sparsity is not None and self.threshold is not None:
            raise ValueError(
                f"skip_softmax.target_sparsity={show(self.target_sparsity)} and skip_softmax.threshold="
                f"{show(self.threshold)} are mutually exclusive; set one of them"
            )
        _check_unit_interval("skip_softmax", "disabled_until_timestep", self.disabled_until_timestep)


_LAYER_ITEM = re.compile(r"^\s*([0-9]+)\s*(?:-\s*([0-9]+)\s*)?$", re.ASCII)
_LAYER_ALLOWED = f"layer indices >= 0 and <= {MAX_LAYER_INDEX}, as a string like '0-3,38' or a list of ints"


def parse_layer_selector(value: Any, field_name: str = "block_sparse.skip_layers") -> tuple[int, ...]:
    """Parse ``"0-3,38"`` or a list of ints into a sorted tuple of layer indices (each at most
    ``MAX_LAYER_INDEX``)."""
    if isinstance(value, str):
        bounds: list[tuple[int, int]] = []
        for part in value.split(","):
            token = part.strip()
            if not token:
                raise ValueError(f"{field_name}={show(value)} has an empty item; allowed: {_LAYER_ALLOWED}")
            match = _LAYER_ITEM.match(token)
            if match is None:
                raise ValueError(
                    f"{field_name}={show(value)}: {show(token)} is not an int >= 0 or an ascending range 'a-b'; "
                    f"allowed: {_LAYER_ALLOWED}"
                )
            # Compared as digit strings first: int() refuses more than 4300 digits with its own ValueError.
            lo_text, hi_text = (text.lstrip("0") or "0" if text is not None else None for text in match.groups())
            if len(lo_text) > 6 or (hi_text is not None and len(hi_text) > 6):
                raise ValueError(f"{field_name}={show(value)}: {show(token)} is out of range; allowed: {_LAYER_ALLOWED}")
            lo = int(lo_text)
            hi = int(hi_text) if hi_text is not None else lo
            if hi < lo:
                raise ValueError(f"{field_name}={show(value)}: range {token!r} must be ascending")
            if hi > MAX_LAYER_INDEX:
                raise ValueError(f"{field_name}={show(value)}: {token!r} is out of range; allowed: {_LAYER_ALLOWED}")
            bounds.append((lo, hi))
        # Bounded above, so expanding is at most MAX_LAYER_INDEX + 1 indices.
        return tuple(sorted({i for lo, hi in bounds for i in range(lo, hi + 1)}))
    if isinstance(value, (list, tuple)):
        for item in value:
            if isinstance(item, bool) or not isinstance(item, int):
                raise TypeError(
                    f"{field_name} items must be ints >= 0, got {type(item).__name__}: {show(item)} in {show(value)}"
                )
            if not 0 <= item <= MAX_LAYER_INDEX:
                raise ValueError(
                    f"{field_name} item {show(item)} is out of range; allowed: ints >= 0 and <= {MAX_LAYER_INDEX} "
                    f"(in {show(value)})"
                )
        return tuple(sorted(set(value)))
    raise TypeError(
        f"{field_name} must be a selector string like '0-3,38' or a list of ints, got {type(value).__name__}: "
        f"{show(value)}"
    )


@dataclass(frozen=True)
class BlockSparseSpec:
    """Block-sparse attention (``RAINFUSION_ATTN``).

    Each query block keeps some of the key blocks, chosen one of two ways (set at most one of ``sparsity`` and
    ``mass_threshold``):

    Args:
        sparsity (`float`, defaults to 0.8): fraction of blocks skipped, in [0, 1]: each query block keeps a fixed
            number of key blocks, ``round((1 - sparsity) · blocks)`` (top-k by pooled score; on CUDA a partial tail
            block counts as one of them, and is always kept). The default when ``mass_threshold`` is not set.
        start_step (`int`, defaults to 0): denoising steps before sparsity starts.
        skip_layers (`str` or `list[int]`, *optional*): layers that stay dense, e.g. ``"0-3,38"``.
        mass_threshold (`float`, *optional*): cumulative-mass selection instead of a fixed count, in (0, 1): each
            query block needs the smallest set of key blocks whose share of the softmax of its pooled scores reaches
            this value (at least its forced blocks); a call keeps, for every query block, its top blocks of one
            count, the largest needed count rounded up to a bucket (a superset of each needed set). CUDA path only;
            an extension of the contract.
    """

    sparsity: float | None = None
    start_step: int = 0
    skip_layers: tuple[int, ...] | None = None
    mass_threshold: float | None = None

    def __post_init__(self) -> None:
        if self.mass_threshold is not None:
            _check_type("block_sparse", "mass_threshold", self.mass_threshold, (int, float),
                        "a finite number in (0, 1)")
            if not _is_finite(self.mass_threshold) or not 0 < self.mass_threshold < 1:
                raise ValueError(
                    f"block_sparse.mass_threshold={show(self.mass_threshold)} is out of range; allowed: a finite "
                    "number in (0, 1) (the share of each query block's pooled attention mass its kept key blocks "
                    "must reach; 1 would keep every block)"
                )
            if self.sparsity is not None:
                raise ValueError(
                    f"block_sparse.sparsity={show(self.sparsity)} and block_sparse.mass_threshold="
                    f"{show(self.mass_threshold)} are mutually exclusive; set one of them (sparsity: a fixed number "
                    "of key blocks per query block, mass_threshold: as many as reach that share of the pooled "
                    "attention mass)"
                )
        else:
            if self.sparsity is None:
                object.__setattr__(self, "sparsity", 0.8)
            _check_unit_interval("block_sparse", "sparsity", self.sparsity)
        _check_type("block_sparse", "start_step", self.start_step, (int,), "an int >= 0")
        if self.start_step < 0:
            raise ValueError(f"block_sparse.start_step={show(self.start_step)} must be an int >= 0")
        if self.skip_layers is not None:
            object.__setattr__(self, "skip_layers", parse_layer_selector(self.skip_layers))

    @property
    def selection(self) -> str:
        """``"mass"`` (cumulative-mass threshold) or ``"topk"`` (a fixed kept count from ``sparsity``)."""
        return "mass" if self.mass_threshold is not None else "topk"

    def describe(self) -> str:
        """``sparsity 0.8`` or ``mass threshold 0.9``, for reports."""
        if self.mass_threshold is not None:
            return f"mass threshold {self.mass_threshold}"
        return f"sparsity {self.sparsity}"


_SUB_SPECS = {"quant": AttnQuantSpec, "skip_softmax": SkipSoftmaxSpec, "block_sparse": BlockSparseSpec}
# The backend options of a spec, in the order their backend checks run.
OPTION_FIELDS = ("skip_softmax", "quant", "block_sparse")


def _from_mapping(cls: type, value: Any, where: str) -> Any:
    if value is None or isinstance(value, cls):
        return value
    if not isinstance(value, Mapping):
        raise TypeError(f"{where} must be a {cls.__name__} or a dict, got {type(value).__name__}: {show(value)}")
    allowed = [f.name for f in fields(cls) if f.init]
    unknown = [key for key in value if key not in allowed]
    if unknown:
        raise ValueError(f"{where} has unknown key(s) {keys_text(unknown)}; allowed: {allowed}")
    return cls(**value)


@dataclass(frozen=True)
class AttentionSpec:
    """One backend choice plus the typed options only that backend reads.

    The spec is checked for shape here; the backend name (ours, or one of Diffusers' names), and whether that
    backend reads the options given and accepts their values, are checked when a plan is built from it
    (``AttentionPlan.build``: ``apply_attention`` and ``enable_omni_attention`` do, once per call).

    Args:
        backend (`str`): a backend name such as ``"TORCH_SDPA"`` (any case) or ``"auto"`` for the platform default.
        quant (`AttnQuantSpec`, *optional*): quantised inputs (TRTLLM_ATTN, FLASHINFER_ATTN, FLASH_ATTN FP8).
        skip_softmax (`SkipSoftmaxSpec`, *optional*): Skip-Softmax sparsity (TRTLLM_ATTN).
        block_sparse (`BlockSparseSpec`, *optional*): block-sparse attention (RAINFUSION_ATTN).
    """

    backend: str
    quant: AttnQuantSpec | None = None
    skip_softmax: SkipSoftmaxSpec | None = None
    block_sparse: BlockSparseSpec | None = None
    # The name as the user typed it (for messages once the plan checks it); not part of the value.
    spelling: Any = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "spelling", self.backend.strip() if isinstance(self.backend, str) else self.backend)
        object.__setattr__(self, "backend", normalize_backend_name(self.backend))
        for name, cls in _SUB_SPECS.items():
            object.__setattr__(self, name, _from_mapping(cls, getattr(self, name), name))
        if self.is_auto:
            # The platform default is chosen per call site; no option can be checked against a backend yet.
            for name in OPTION_FIELDS:
                if getattr(self, name) is not None:
                    raise ValueError(
                        f"{name} is not allowed with backend={AUTO!r} (the platform default takes no options); "
                        "allowed: name the backend that reads it"
                    )

    @property
    def is_auto(self) -> bool:
        return self.backend == AUTO

    @classmethod
    def parse(cls, value: Any, where: str = "spec") -> "AttentionSpec":
        if isinstance(value, AttentionSpec):
            return value
        if isinstance(value, str):
            return cls(backend=value)
        if isinstance(value, Mapping):
            if "backend" not in value:
                raise ValueError(f"{where} needs a 'backend' key; got keys {keys_text(value)}")
            allowed = [f.name for f in fields(cls) if f.init]
            unknown = [key for key in value if key not in allowed]
            if unknown:
                raise ValueError(f"{where} has unknown key(s) {keys_text(unknown)}; allowed: {allowed}")
            return cls(**value)
        raise TypeError(
            f"{where} must be an AttentionSpec, a backend name or a dict, got {type(value).__name__}: {show(value)}"
        )

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"backend": self.backend}
        for name in _SUB_SPECS:
            sub = getattr(self, name)
            if sub is not None:
                out[name] = {f.name: getattr(sub, f.name) for f in fields(sub)}
        return out


def _looks_like_spec(value: Mapping) -> bool:
    return "backend" in value


def _spelling(path: tuple[str, ...]) -> str:
    return "per_role" + "".join(f"[{key!r}]" for key in path)


def _flatten_roles(per_role: Mapping) -> dict[str, AttentionSpec]:
    """Flatten nested role dicts to dotted roles; refuse two spellings of one role and malformed keys.

    Iterative (an explicit stack), so hostile nesting raises ``ValueError`` at ``MAX_ROLE_DEPTH`` instead of
    ``RecursionError``.
    """
    out: dict[str, AttentionSpec] = {}
    spelled: dict[str, str] = {}
    stack: list[tuple[tuple[str, ...], Mapping]] = [((), per_role)]
    while stack:
        path, mapping = stack.pop()
        nested = []
        for key, item in mapping.items():
            if not isinstance(key, str) or not key:
                raise TypeError(
                    f"{_spelling(path)} keys must be non-empty role names (str), got {type(key).__name__}: "
                    f"{show(key)}"
                )
            if any(not part.strip() for part in key.split(".")):
                raise ValueError(
                    f"{_spelling(path)} key {key!r} has an empty role component; allowed: a role such as "
                    "'flux.joint' or a category such as 'cross'"
                )
            where = path + (key,)
            role = ".".join(where)
            if len(role.split(".")) > MAX_ROLE_DEPTH:
                raise ValueError(
                    f"{_spelling(where[:MAX_ROLE_DEPTH])}... nests deeper than {MAX_ROLE_DEPTH} role components; "
                    "allowed: a role such as 'flux.joint' (or nested {'flux': {'joint': ...}})"
                )
            if isinstance(item, Mapping) and not _looks_like_spec(item):
                spec_keys = [k for k in item if k in _SUB_SPECS]
                if spec_keys or not item:
                    raise ValueError(
                        f"per_role[{role!r}] needs a 'backend' key; got keys {keys_text(item)} (nested dicts without "
                        "'backend' are read as dotted roles)"
                    )
                nested.append((where, item))
                continue
            if role in spelled:
                raise ValueError(
                    f"{spelled[role]} and {_spelling(where)} both configure role {role!r}; keep one of them"
                )
            spelled[role] = _spelling(where)
            out[role] = AttentionSpec.parse(item, where=f"per_role[{role!r}]")
        stack.extend(reversed(nested))
    return out


@dataclass(frozen=True)
class AttentionConfig:
    """Per-role attention backend configuration.

    Resolution for an attention call with ``role`` and ``category``: ``per_role[role]`` → ``per_role[category]``
    → ``default`` → ``DIFFUSION_ATTENTION_BACKEND`` → platform default.

    Args:
        default (`AttentionSpec`, *optional*): the spec for every role without an override.
        per_role (`dict[str, AttentionSpec]`): overrides keyed by role (``"flux.joint"``) or category (``"cross"``).
        deterministic (`bool`, *optional*): ``True`` asks every role for a kernel whose output (and gradients) are
            bitwise identical run to run on the same inputs; a backend that cannot promise it is refused at enable
            time with its reasons, and the platform default skips it. ``False`` turns the request off even when the
            environment variable ``DIFFUSERS_OMNI_DETERMINISTIC`` is set; ``None`` (default) defers to that
            variable. See ``docs/user_guide/alignment.md``.

    Example:
    ```py
    >>> AttentionConfig.parse('{"default": {"backend": "TORCH_SDPA"}, "per_role": {"cross": "auto"}}')
    ```
    """

    default: AttentionSpec | None = None
    per_role: Mapping[str, AttentionSpec] = field(default_factory=dict)
    deterministic: bool | None = None

    def __post_init__(self) -> None:
        if self.deterministic is not None and not isinstance(self.deterministic, bool):
            raise TypeError(
                f"deterministic must be True, False or None, got {type(self.deterministic).__name__}: "
                f"{show(self.deterministic)}"
            )
        if self.default is not None:
            object.__setattr__(self, "default", AttentionSpec.parse(self.default, where="default"))
        per_role = {} if self.per_role is None else self.per_role
        if not isinstance(per_role, Mapping):
            raise TypeError(
                f"per_role must be a dict of role -> spec, got {type(per_role).__name__}: {show(per_role)}"
            )
        object.__setattr__(self, "per_role", _flatten_roles(per_role))

    @classmethod
    def parse(cls, value: Any) -> "AttentionConfig":
        """Build a config from an ``AttentionConfig``, a backend name, a dict, a JSON string, or ``None``.

        A dict (or JSON object) is either ``{"default": ..., "per_role": ...}`` or a single spec
        (``{"backend": ...}``), which becomes the default. Nested role dicts flatten to dotted roles.
        """
        if value is None:
            return cls()
        if isinstance(value, AttentionConfig):
            return value
        if isinstance(value, AttentionSpec):
            return cls(default=value)
        if isinstance(value, str):
            text = value.strip()
            if text.startswith("{"):
                try:
                    decoded = json.loads(text)
                except json.JSONDecodeError as exc:
                    raise ValueError(
                        f"attention config is not valid JSON ({exc.msg} at char {exc.pos}): {show(value)}"
                    ) from None
                except (ValueError, RecursionError) as exc:  # e.g. a 5000-digit number, or nesting ~1000 deep
                    reason = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)
                    raise ValueError(f"attention config is not valid JSON ({reason}): {show(value)}") from None
                return cls.parse(decoded)
            return cls(default=AttentionSpec(backend=text))
        if isinstance(value, Mapping):
            if _looks_like_spec(value):
                return cls(default=AttentionSpec.parse(value, where="default"))
            unknown = [key for key in value if key not in ("default", "per_role", "deterministic")]
            if unknown:
                raise ValueError(
                    f"attention config has unknown key(s) {keys_text(unknown)}; allowed: ['default', 'per_role', "
                    "'deterministic']"
                )
            # A falsy per_role that is not a dict ([], 0, "") is refused by the constructor, not read as empty.
            return cls(
                default=value.get("default"),
                per_role=value.get("per_role"),
                deterministic=value.get("deterministic"),
            )
        raise TypeError(
            "attention config must be an AttentionConfig, an AttentionSpec, a backend name, a dict or a JSON "
            f"string, got {type(value).__name__}: {show(value)}"
        )

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "default": self.default.to_dict() if self.default else None,
            "per_role": {role: spec.to_dict() for role, spec in self.per_role.items()},
        }
        if self.deterministic is not None:
            out["deterministic"] = self.deterministic
        return out
