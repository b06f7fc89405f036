"""Per-layer comparison of one transformer call under two configurations.

``capture_layers`` runs recorded inputs through a transformer under one ``AlignmentSide`` (an attention config,
stock Diffusers, a dtype, inference or training mode) and keeps every block's output plus the final output and
the kernel fingerprint. ``compare_layer_outputs`` reports, per block, the maximum absolute error, the maximum
relative error (normalised by the larger of the two sides' maximum magnitudes) and bitwise equality.
``check_alignment`` does both sides and the comparison in one call.

For lossy configurations (FP8, block-sparse) the report also gives the quality a user compares configs by: per
layer the relative error ``‖b − a‖ / ‖a‖`` (side ``a`` is the reference), and for the final output its PSNR in dB
(peak: the reference output's value range).
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from ..attention.registry import check_config
from ..config.attention import AttentionConfig
from ..installer import applied_attention_config, apply_attention, remove_attention
from ..models.base import blocks_attrs_for
from ..utils.modules import model_dtype
from ..utils.text import table
from .fingerprint import FingerprintComparison, compare_fingerprints, kernel_fingerprint
from .record import RecordedInputs, map_tensors

STOCK = "stock"
MODES = ("inference", "training")
OUTPUTS_FORMAT = "diffusers-omni.layer-outputs/1"
OUTPUT_LAYER = "output"


@dataclass(frozen=True)
class AlignmentSide:
    """One side of a comparison.

    Args:
        attention: anything ``AttentionConfig.parse`` accepts; ``"stock"`` for Diffusers' own processors (omni
            attention removed); ``None`` keeps whatever the model has installed now.
        dtype (`torch.dtype`, *optional*): run a copy of the model (and the floating inputs) in this dtype.
        mode (`str`, defaults to ``"inference"``): ``"inference"`` runs under ``torch.no_grad()``;
            ``"training"`` runs like a training step's forward: ``model.train()``, autograd on, floating inputs
            requiring grad (no backward is run).
        label (`str`, *optional*): a name for reports.
    """

    attention: Any = None
    dtype: torch.dtype | None = None
    mode: str = "inference"
    label: str = ""

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"AlignmentSide.mode={self.mode!r} is not allowed; allowed: {', '.join(MODES)}")
        if self.dtype is not None and not isinstance(self.dtype, torch.dtype):
            raise TypeError(f"AlignmentSide.dtype must be a torch.dtype or None, got {self.dtype!r}")
        attention = self.attention
        if isinstance(attention, str) and attention.strip().lower() in (STOCK, "diffusers"):
            object.__setattr__(self, "attention", STOCK)
        elif attention is not None:
            # Checked against the kernel families now (names, aliases, options), so a bad side fails here.
            object.__setattr__(self, "attention", check_config(AttentionConfig.parse(attention)))

    @classmethod
    def parse(cls, value: Any) -> "AlignmentSide":
        return value if isinstance(value, AlignmentSide) else cls(attention=value)

    def describe(self) -> dict[str, Any]:
        attention = self.attention
        if attention is not None and attention != STOCK:
            attention = attention.to_dict()
        return {
            "label": self.label,
            "attention": attention if attention is not None else "as installed",
            "dtype": str(self.dtype).replace("torch.", "") if self.dtype else None,
            "mode": self.mode,
        }


def _tensors(value: Any) -> tuple[torch.Tensor, ...]:
    found: list[torch.Tensor] = []
    map_tensors(value if not hasattr(value, "to_tuple") else value.to_tuple(), lambda t: found.append(t) or t)
    return tuple(found)


@dataclass
class LayerOutputs:
    """Every block's output tensors (in execution order), the final output, the fingerprint and the side."""

    layers: dict[str, tuple[torch.Tensor, ...]]
    fingerprint: dict[str, Any]
    side: dict[str, Any] = field(default_factory=dict)

    def save(self, path: str | Path) -> Path:
        """``torch.save`` the outputs with the fingerprint, for comparison with another machine's."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(
            {
                "format": OUTPUTS_FORMAT,
                "layers": {k: list(v) for k, v in self.layers.items()},
                "fingerprint": json.dumps(self.fingerprint, default=str),
                "side": json.dumps(self.side, default=str),
            },
            path,
        )
        return path

    @classmethod
    def load(cls, path: str | Path) -> "LayerOutputs":
        data = torch.load(path, map_location="cpu", weights_only=True)
        if not isinstance(data, dict) or data.get("format") != OUTPUTS_FORMAT:
            raise ValueError(f"{path} holds no diffusers-omni layer outputs (format {OUTPUTS_FORMAT!r})")
        layers = {k: tuple(v) for k, v in data["layers"].items()}
        return cls(layers, json.loads(data["fingerprint"]), json.loads(data["side"]))


def _block_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    blocks = []
    for attr in blocks_attrs_for(model):
        container = getattr(model, attr, None)
        if container is None:
            continue
        for index, block in enumerate(container):
            blocks.append((f"{attr}.{index}", block))
    if not blocks:
        raise ValueError(f"{type(model).__name__} declares no blocks (blocks_attrs_for returned nothing)")
    return blocks


def _model_device(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


@contextlib.contextmanager
def _attention_as(model: nn.Module, attention: Any):
    """Install ``attention`` on ``model`` for the duration, then put back what was there."""
    if attention is None:
        yield
        return
    previous = applied_attention_config(model)
    if attention == STOCK:
        remove_attention(model)
    else:
        apply_attention(model, attention)
    try:
        yield
    finally:
        if previous is not None:
            apply_attention(model, previous)
        else:
            remove_attention(model)


def capture_layers(model: nn.Module, inputs: RecordedInputs, side: Any = None) -> LayerOutputs:
    """Run ``inputs`` through ``model`` under ``side`` and keep each block's output (on the CPU).

    Args:
        model (`torch.nn.Module`): a supported transformer; its attention state is restored afterwards.
        inputs (`RecordedInputs`): from ``record_transformer_inputs`` or ``RecordedInputs.load``.
        side: an ``AlignmentSide`` or anything its ``attention`` accepts.

    Returns:
        ``LayerOutputs`` with one entry per block (``"transformer_blocks.0"``, ...) and ``"output"``.
    """
    side = AlignmentSide.parse(side)
    work = model
    if side.dtype is not None and side.dtype != model_dtype(model):
        work = copy.deepcopy(model).to(side.dtype)
    device = _model_device(work)
    run_inputs = inputs.to(device, side.dtype or None)
    layers: dict[str, tuple[torch.Tensor, ...]] = {}

    def keep(name):
        def hook(module, args, output):
            key = name if name not in layers else f"{name}#{sum(k.split('#')[0] == name for k in layers) + 1}"
            layers[key] = tuple(t.detach().to("cpu", copy=True) for t in _tensors(output))

        return hook

    training = side.mode == "training"
    was_training = work.training
    handles = [block.register_forward_hook(keep(name)) for name, block in _block_modules(work)]
    try:
        with _attention_as(work, side.attention):
            fingerprint = kernel_fingerprint(work)
            if training:
                work.train()
                # Fresh leaves: ``RecordedInputs.to`` may hand back the caller's own tensors.
                leaf = lambda t: t.detach().clone().requires_grad_() if t.is_floating_point() else t  # noqa: E731
                run_inputs = RecordedInputs(map_tensors(run_inputs.args, leaf), map_tensors(run_inputs.kwargs, leaf))
            grad = torch.enable_grad() if training else torch.no_grad()
            with grad:
                output = work(*run_inputs.args, **run_inputs.kwargs)
            layers[OUTPUT_LAYER] = tuple(t.detach().to("cpu", copy=True) for t in _tensors(output))
    finally:
        for handle in handles:
            handle.remove()
        work.train(was_training)
    return LayerOutputs(layers, fingerprint, side.describe())


@dataclass
class LayerComparison:
    layer: str
    shape: tuple[int, ...]
    dtype_a: str
    dtype_b: str
    max_abs: float
    max_rel: float
    bitwise_equal: bool
    rel_err: float = 0.0  # ‖b − a‖ / ‖a‖ over the layer's output tensors (side a is the reference)
    psnr_db: float = math.inf  # 10·log10(range(a)² / MSE); inf when equal

    def to_dict(self) -> dict[str, Any]:
        return {
            "layer": self.layer,
            "shape": list(self.shape),
            "dtype_a": self.dtype_a,
            "dtype_b": self.dtype_b,
            "max_abs": self.max_abs,
            "max_rel": self.max_rel,
            "rel_err": self.rel_err,
            "psnr_db": self.psnr_db,
            "bitwise_equal": self.bitwise_equal,
        }


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _compare(name: str, a: tuple[torch.Tensor, ...], b: tuple[torch.Tensor, ...]) -> LayerComparison:
    if len(a) != len(b) or any(x.shape != y.shape for x, y in zip(a, b)):
        raise ValueError(
            f"layer {name!r}: output shapes differ ({[tuple(x.shape) for x in a]} vs {[tuple(y.shape) for y in b]}); "
            "were both sides run on the same inputs?"
        )
    max_abs, peak, bitwise = 0.0, 0.0, True
    diff_sq, ref_sq, count, lo, hi = 0.0, 0.0, 0, math.inf, -math.inf
    for x, y in zip(a, b):
        bitwise = bitwise and x.dtype == y.dtype and torch.equal(x, y)
        x64, y64 = x.double(), y.double()
        if x64.numel():
            max_abs = max(max_abs, (x64 - y64).abs().max().item())
            peak = max(peak, x64.abs().max().item(), y64.abs().max().item())
            diff_sq += (x64 - y64).square().sum().item()
            ref_sq += x64.square().sum().item()
            count += x64.numel()
            lo, hi = min(lo, x64.min().item()), max(hi, x64.max().item())
    max_rel = max_abs / peak if peak > 0 else (0.0 if max_abs == 0 else float("inf"))
    rel_err = math.sqrt(diff_sq / ref_sq) if ref_sq > 0 else (0.0 if diff_sq == 0 else math.inf)
    mse = diff_sq / count if count else 0.0
    value_range = hi - lo if count else 0.0
    psnr = math.inf if mse == 0 else (10 * math.log10(value_range**2 / mse) if value_range > 0 else -math.inf)
    shape = tuple(a[-1].shape) if a else ()
    return LayerComparison(
        name,
        shape,
        ",".join(sorted({_dtype_name(t.dtype) for t in a})),
        ",".join(sorted({_dtype_name(t.dtype) for t in b})),
        max_abs,
        max_rel,
        bitwise,
        rel_err,
        psnr,
    )


@dataclass
class AlignmentReport:
    """Per-layer errors between side ``a`` and side ``b``, plus the fingerprint comparison."""

    layers: list[LayerComparison]
    fingerprints: FingerprintComparison
    side_a: dict[str, Any] = field(default_factory=dict)
    side_b: dict[str, Any] = field(default_factory=dict)
    atol: float | None = None

    @property
    def bitwise_equal(self) -> bool:
        return all(row.bitwise_equal for row in self.layers)

    @property
    def first_divergence(self) -> str | None:
        """The first layer (in execution order) whose outputs are not bitwise equal."""
        return next((row.layer for row in self.layers if not row.bitwise_equal), None)

    @property
    def output(self) -> LayerComparison | None:
        """The comparison of the final output (the last row)."""
        return next((row for row in self.layers if row.layer == OUTPUT_LAYER), None)

    @property
    def aligned(self) -> bool:
        """Bitwise equal everywhere, or (with ``atol``) every layer's max abs error within it."""
        if self.atol is None:
            return self.bitwise_equal
        return all(row.max_abs <= self.atol for row in self.layers)

    def to_dict(self) -> dict[str, Any]:
        return {
            "aligned": self.aligned,
            "bitwise_equal": self.bitwise_equal,
            "first_divergence": self.first_divergence,
            "output_rel_err": self.output.rel_err if self.output else None,
            "output_psnr_db": self.output.psnr_db if self.output else None,
            "atol": self.atol,
            "a": self.side_a,
            "b": self.side_b,
            "layers": [row.to_dict() for row in self.layers],
            "kernels": self.fingerprints.to_dict(),
        }

    def to_json(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=2, default=str) + "\n")
        return path

    def table(self) -> str:
        rows = [
            {
                "layer": row.layer,
                "max_abs": f"{row.max_abs:.3e}",
                "max_rel": f"{row.max_rel:.3e}",
                "rel_err": f"{row.rel_err:.3e}",
                "psnr_db": f"{row.psnr_db:.1f}",
                "bitwise": "yes" if row.bitwise_equal else "NO",
                "dtype a/b": row.dtype_a if row.dtype_a == row.dtype_b else f"{row.dtype_a}/{row.dtype_b}",
            }
            for row in self.layers
        ]
        lines = [table(rows, ["layer", "max_abs", "max_rel", "rel_err", "psnr_db", "bitwise", "dtype a/b"]), ""]
        lines.append(self.fingerprints.table())
        verdict = "bitwise equal" if self.bitwise_equal else f"first divergence at {self.first_divergence}"
        if self.atol is not None:
            verdict += f"; {'within' if self.aligned else 'NOT within'} atol={self.atol:g}"
        output = self.output
        if output is not None and not output.bitwise_equal:
            lines.append(f"\nfinal output vs side a: rel err {output.rel_err:.3e}, PSNR {output.psnr_db:.1f} dB")
        lines.append(f"\nresult: {verdict}")
        return "\n".join(lines)


def compare_layer_outputs(a: LayerOutputs, b: LayerOutputs, *, atol: float | None = None) -> AlignmentReport:
    """Compare two captures layer by layer (layers only one side has raise: the models differ)."""
    if list(a.layers) != list(b.layers):
        only_a = sorted(set(a.layers) - set(b.layers))
        only_b = sorted(set(b.layers) - set(a.layers))
        raise ValueError(f"the two captures have different layers (only in a: {only_a}; only in b: {only_b})")
    rows = [_compare(name, a.layers[name], b.layers[name]) for name in a.layers]
    return AlignmentReport(rows, compare_fingerprints(a.fingerprint, b.fingerprint), a.side, b.side, atol)


def check_alignment(
    model: nn.Module, inputs: RecordedInputs, a: Any = None, b: Any = None, *, atol: float | None = None
) -> AlignmentReport:
    """Run the same recorded inputs through ``model`` under sides ``a`` and ``b`` and compare every block.

    Args:
        model (`torch.nn.Module`): a supported transformer (e.g. ``pipe.transformer``); left as it was found.
        inputs (`RecordedInputs`): the call to replay.
        a: an ``AlignmentSide``, an attention config, or ``"stock"`` (Diffusers' own processors).
        b: the side compared with ``a``, given the same way.
        atol (`float`, *optional*): tolerance for ``report.aligned``; ``None`` requires bitwise equality.

    Example:
    ```py
    >>> report = check_alignment(pipe.transformer, inputs, a={"default": "TORCH_SDPA"}, b="stock")
    >>> print(report.table())
    ```
    """
    return compare_layer_outputs(capture_layers(model, inputs, a), capture_layers(model, inputs, b), atol=atol)
