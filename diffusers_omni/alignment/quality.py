"""Quality of a candidate attention configuration against a reference one, on a whole pipeline run.

``compare_pipelines`` runs a pipeline twice with the same seed and call arguments, once under a reference attention
configuration (default ``"native"``: ``TORCH_SDPA``, exact) and once under a candidate (FP8 ``FLASH_ATTN``,
``RAINFUSION_ATTN``, ``SAGE_ATTN``, ...), and reports:

* the final images (or video frames) side by side with their amplified absolute difference;
* PSNR and SSIM of the candidate's images/frames against the reference's (values in [0, 1], data range 1);
* per attention module (and role), the relative error ``‖c − r‖ / ‖r‖`` of the candidate's attention output
  against the reference's, in the **first transformer call** of each run (the first denoising step; with
  classifier-free guidance its first, conditional, pass). Two numbers per module:

  - ``rel_err`` (propagated): the two runs' outputs of that module; the candidate's input already carries the
    error of every module before it;
  - ``local_rel_err``: the candidate's output against the reference processor run on the *same* inputs (the
    candidate's), i.e. the error this module's kernel adds by itself.

* the wall time of each run (including any kernel compilation on first use unless ``warmup_runs`` > 0).

``compare_transformer_call`` does the per-layer part (plus the transformer's output error) for one transformer
forward on given inputs, for models too large to run a whole pipeline twice.

See ``docs/user_guide/quality.md``.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from ..installer import apply_attention_all, applied_attention_config, attention_report, remove_attention_all
from ..models.base import declaration_for
from ..utils.text import table
from .compare import STOCK, AlignmentSide
from .record import RecordedInputs, map_tensors

DEFAULT_REFERENCE = "native"
DEFAULT_DIFF_GAIN = 10.0
GRID_FRAMES = 4
SSIM_WINDOW = 11
SSIM_SIGMA = 1.5
_RESERVED_CALL_KWARGS = ("generator", "output_type", "return_dict")
_SEPARATOR = 2  # white pixels between the panels of the side-by-side image
_MIN_PANEL = 192  # the labelled image enlarges smaller panels to at least this many pixels wide
_LABEL_FONT = 14  # pixels


# Image metrics ----------------------------------------------------------------------------------------------------


def _as_float64(x: Any) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x.detach().to("cpu", torch.float64)
    return torch.as_tensor(np.asarray(x), dtype=torch.float64)


def _check_pair(reference: torch.Tensor, candidate: torch.Tensor, what: str) -> None:
    if reference.shape != candidate.shape:
        raise ValueError(f"{what}: shapes differ ({tuple(reference.shape)} vs {tuple(candidate.shape)})")
    if reference.numel() == 0:
        raise ValueError(f"{what}: empty images")


def psnr(reference: Any, candidate: Any, data_range: float = 1.0) -> float:
    """Peak signal-to-noise ratio in dB: ``10·log10(data_range² / MSE)`` over every pixel, channel and frame.

    ``math.inf`` when the two are equal. Arrays or tensors of any (equal) shape; images from a pipeline's
    ``output_type="np"`` are in [0, 1] (``data_range=1``).
    """
    ref, cand = _as_float64(reference), _as_float64(candidate)
    _check_pair(ref, cand, "psnr")
    if not (isinstance(data_range, (int, float)) and data_range > 0 and math.isfinite(data_range)):
        raise ValueError(f"psnr data_range={data_range!r} must be a finite number > 0")
    mse = (ref - cand).square().mean().item()
    return math.inf if mse == 0 else 10.0 * math.log10(data_range**2 / mse)


def _gaussian_window(size: int, sigma: float) -> torch.Tensor:
    x = torch.arange(size, dtype=torch.float64) - (size - 1) / 2
    g = torch.exp(-(x**2) / (2 * sigma**2))
    return g / g.sum()


def _nchw(x: torch.Tensor) -> torch.Tensor:
    """``[H, W]`` → ``[1, 1, H, W]``; ``[..., H, W, C]`` (channels last, as pipelines return) → ``[N, C, H, W]``."""
    if x.ndim == 2:
        return x[None, None]
    if x.ndim < 2:
        raise ValueError(f"ssim needs images of shape [H, W] or [..., H, W, C]; got shape {tuple(x.shape)}")
    return x.reshape(-1, *x.shape[-3:]).permute(0, 3, 1, 2)


def ssim_per_image(reference: Any, candidate: Any, data_range: float = 1.0) -> list[float]:
    """SSIM of each image of a ``[..., H, W, C]`` stack (e.g. each frame of a video), see ``ssim``."""
    ref, cand = _as_float64(reference), _as_float64(candidate)
    _check_pair(ref, cand, "ssim")
    if not (isinstance(data_range, (int, float)) and data_range > 0 and math.isfinite(data_range)):
        raise ValueError(f"ssim data_range={data_range!r} must be a finite number > 0")
    x, y = _nchw(ref), _nchw(cand)
    height, width = x.shape[-2:]
    if height < SSIM_WINDOW or width < SSIM_WINDOW:
        raise ValueError(f"ssim needs images of at least {SSIM_WINDOW}×{SSIM_WINDOW} pixels (its Gaussian window); "
                         f"got {height}×{width}")
    channels = x.shape[1]
    g = _gaussian_window(SSIM_WINDOW, SSIM_SIGMA)
    kernel = (g[:, None] * g[None, :]).expand(channels, 1, SSIM_WINDOW, SSIM_WINDOW).contiguous()

    def filt(t: torch.Tensor) -> torch.Tensor:  # Gaussian-weighted local mean, valid positions only
        return F.conv2d(t, kernel, groups=channels)

    c1, c2 = (0.01 * data_range) ** 2, (0.03 * data_range) ** 2
    mu_x, mu_y = filt(x), filt(y)
    var_x = filt(x * x) - mu_x * mu_x
    var_y = filt(y * y) - mu_y * mu_y
    cov = filt(x * y) - mu_x * mu_y
    s = ((2 * mu_x * mu_y + c1) * (2 * cov + c2)) / ((mu_x * mu_x + mu_y * mu_y + c1) * (var_x + var_y + c2))
    per_image = s.mean(dim=(1, 2, 3))
    equal = (x == y).flatten(1).all(dim=1)
    return [1.0 if same else value for same, value in zip(equal.tolist(), per_image.tolist())]


def ssim(reference: Any, candidate: Any, data_range: float = 1.0) -> float:
    """Structural similarity (Wang et al. 2004): an 11×11 Gaussian window (σ = 1.5), K1 = 0.01, K2 = 0.03,
    population (co)variances, the mean over every valid window position, channel and image.

    Images are ``[H, W]`` or channels-last ``[..., H, W, C]`` (a batch of images, or video frames). Equals
    scikit-image's ``structural_similarity(a, b, gaussian_weights=True, sigma=1.5, use_sample_covariance=False,
    data_range=1, channel_axis=-1)`` per image; 1.0 for identical images.
    """
    values = ssim_per_image(reference, candidate, data_range)
    return float(sum(values) / len(values))


# Per-layer attention capture ----------------------------------------------------------------------------------------


def pipeline_dits(pipe: Any) -> dict[str, nn.Module]:
    """The pipeline's components that diffusers-omni drives attention on (``transformer``, ``transformer_2``...)."""
    components = getattr(pipe, "components", None)
    if not isinstance(components, dict):
        raise TypeError(f"{type(pipe).__name__} is not a Diffusers pipeline (it has no components dict)")
    dits = {name: module for name, module in components.items()
            if isinstance(module, nn.Module) and declaration_for(module) is not None}
    if not dits:
        raise ValueError(f"{type(pipe).__name__} has no transformer with a diffusers-omni attention declaration "
                         f"(components: {', '.join(components) or 'none'})")
    return dits


@dataclass
class AttentionLayerError:
    """One attention module's output in the first transformer call: candidate against reference.

    ``rel_err`` compares the two runs (errors of earlier layers included); ``local_rel_err`` compares the candidate
    with the reference processor on the candidate's own inputs (this module's kernel alone; ``None`` when not
    measured).
    """

    module: str
    roles: tuple[str, ...]
    shape: tuple[int, ...]
    rel_err: float
    max_abs: float
    local_rel_err: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"module": self.module, "roles": list(self.roles), "shape": list(self.shape), "rel_err": self.rel_err,
                "max_abs": self.max_abs, "local_rel_err": self.local_rel_err}


class _Errors:
    """Running ‖c − r‖², ‖r‖² and max |c − r| over a module's output tensors (float64 accumulation)."""

    def __init__(self) -> None:
        self.diff_sq = 0.0
        self.ref_sq = 0.0
        self.max_abs = 0.0

    def add(self, reference: tuple[torch.Tensor, ...], candidate: tuple[torch.Tensor, ...], where: str) -> None:
        if len(reference) != len(candidate) or any(r.shape != c.shape for r, c in zip(reference, candidate)):
            raise ValueError(f"{where}: output shapes differ between the runs ({[tuple(t.shape) for t in reference]} "
                             f"vs {[tuple(t.shape) for t in candidate]}); were both run on the same call?")
        for r, c in zip(reference, candidate):
            r = r.to(c.device)
            diff = c.float() - r.float()
            self.diff_sq += diff.square().sum(dtype=torch.float64).item()
            self.ref_sq += r.float().square().sum(dtype=torch.float64).item()
            if diff.numel():
                self.max_abs = max(self.max_abs, diff.abs().max().item())

    @property
    def rel_err(self) -> float:
        if self.ref_sq > 0:
            return math.sqrt(self.diff_sq / self.ref_sq)
        return 0.0 if self.diff_sq == 0 else math.inf


def _tensors(value: Any) -> tuple[torch.Tensor, ...]:
    """Every tensor of a module's output (tuples, dicts, ``BaseOutput``), in order."""
    found: list[torch.Tensor] = []
    map_tensors(value.to_tuple() if hasattr(value, "to_tuple") else value, lambda t: found.append(t) or t)
    return tuple(found)


def _sites(dits: dict[str, nn.Module]) -> dict[str, tuple[nn.Module, tuple[str, ...]]]:
    sites = {}
    for dit_name, model in dits.items():
        declaration = declaration_for(model)
        for site in declaration.find_sites(model):
            sites[f"{dit_name}.{site.name}"] = (site.module, tuple(role.role for role in site.roles))
    return sites


class _FirstCallRecorder:
    """Hooks the attention modules of ``dits`` during the ``call_index``-th forward of ``dits[primary]``.

    ``reference=None``: keep each module's output (on ``store_device``). Otherwise compare each output with the
    reference's (and, with ``local_processors``, with the reference processor rerun on the same inputs) as it is
    produced, keeping only the error sums.
    """

    def __init__(self, dits: dict[str, nn.Module], primary: str, *, store_device: Any = "cpu",
                 reference: "_FirstCallRecorder | None" = None,
                 local_processors: dict[str, Any] | None = None, call_index: int = 0) -> None:
        self.dits, self.primary, self.store_device = dits, primary, store_device
        self.reference, self.local_processors, self.call_index = reference, local_processors, call_index
        self.sites = _sites(dits)
        self.outputs: dict[str, tuple[torch.Tensor, ...]] = {}
        self.inputs: RecordedInputs | None = None
        self.errors: dict[str, _Errors] = {}
        self.local: dict[str, _Errors] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.calls = 0
        self._active = False
        self._rerunning = False
        self._handles: list[Any] = []

    def processors(self) -> dict[str, Any]:
        return {name: module.processor for name, (module, _) in self.sites.items()}

    def __enter__(self) -> "_FirstCallRecorder":
        model = self.dits[self.primary]

        def pre(module, args, kwargs):
            self._active = self.calls == self.call_index
            self.calls += 1
            if self._active:
                keep = lambda t: t.detach().to(self.store_device, copy=True)  # noqa: E731
                self.inputs = RecordedInputs(map_tensors(tuple(args), keep), map_tensors(dict(kwargs), keep))

        def post(module, args, kwargs, output):
            self._active = False

        self._handles.append(model.register_forward_pre_hook(pre, with_kwargs=True))
        self._handles.append(model.register_forward_hook(post, with_kwargs=True))
        for name, (module, _) in self.sites.items():
            self._handles.append(module.register_forward_hook(self._hook(name), with_kwargs=True))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _hook(self, name: str):
        def hook(module, args, kwargs, output):
            if not self._active or self._rerunning:
                return None
            out = _tensors(output)
            key = name if name not in self.shapes else f"{name}#{sum(k.split('#')[0] == name for k in self.shapes) + 1}"
            self.shapes[key] = tuple(out[0].shape) if out else ()
            if self.reference is None:
                self.outputs[key] = tuple(t.detach().to(self.store_device, copy=True) for t in out)
                return None
            if key not in self.reference.outputs:
                raise ValueError(f"attention module {key!r} ran in the candidate's first transformer call but not in "
                                 "the reference's; were both run on the same call?")
            self.errors.setdefault(key, _Errors()).add(self.reference.outputs[key], out, key)
            if self.local_processors is not None and name in self.local_processors:
                self.local.setdefault(key, _Errors()).add(self._rerun(module, name, args, kwargs), out, key)
            return None

        return hook

    def _rerun(self, module: nn.Module, name: str, args, kwargs) -> tuple[torch.Tensor, ...]:
        """The reference processor on this call's inputs (the module's own forward, processor swapped)."""
        candidate = module.processor
        self._rerunning = True
        module.processor = self.local_processors[name]
        try:
            with torch.no_grad():
                return tuple(t.detach() for t in _tensors(module(*args, **kwargs)))
        finally:
            module.processor = candidate
            self._rerunning = False

    def layer_errors(self) -> list[AttentionLayerError]:
        missing = [key for key in self.reference.outputs if key not in self.errors]
        if missing:
            raise ValueError(f"attention module(s) {missing[:4]} ran in the reference's first transformer call but "
                             "not in the candidate's")
        rows = []
        for key, errors in self.errors.items():
            roles = self.sites[key.split("#")[0]][1]
            local = self.local.get(key)
            rows.append(AttentionLayerError(key, roles, self.shapes[key], errors.rel_err, errors.max_abs,
                                            local.rel_err if local is not None else None))
        return rows


def _inputs_equal(a: RecordedInputs | None, b: RecordedInputs | None) -> bool:
    if a is None or b is None:
        return False
    left, right = [], []
    map_tensors((a.args, a.kwargs), lambda t: left.append(t) or t)
    map_tensors((b.args, b.kwargs), lambda t: right.append(t) or t)
    return len(left) == len(right) and all(x.shape == y.shape and torch.equal(x.cpu(), y.cpu())
                                           for x, y in zip(left, right))


def _side(value: Any, what: str) -> Any:
    """``"stock"`` or a parsed ``AttentionConfig``."""
    if value is None:
        raise ValueError(f"{what}=None: give an attention config (a backend name, a dict or JSON) or 'stock'")
    if isinstance(value, AlignmentSide):
        if value.dtype is not None or value.mode != "inference" or value.attention is None:
            raise ValueError(f"{what}={value!r}: only an attention config is compared here (no dtype, inference "
                             "mode, attention not None)")
        return value.attention
    return AlignmentSide(attention=value).attention


def _describe(attention: Any) -> Any:
    return STOCK if attention == STOCK else attention.to_dict()


@contextlib.contextmanager
def _attention_on(dits: dict[str, nn.Module], attention: Any):
    """Install ``attention`` on every DiT (or remove omni attention for ``"stock"``), then restore what was there."""
    models = list(dits.values())
    previous = [applied_attention_config(model) for model in models]
    if attention == STOCK:
        remove_attention_all(models)
    else:
        apply_attention_all(models, attention)
    try:
        yield
    finally:
        remove_attention_all(models)
        for model, config in zip(models, previous):
            if config is not None:
                apply_attention_all([model], config, check_roles=False)


def check_attention(pipe: Any, attention: Any) -> None:
    """Enable ``attention`` on the pipeline's DiTs and put back what was there, running nothing: raises what enabling
    it would raise (an unknown backend, one that cannot run a role here, a ``per_role`` key matching no role)."""
    with _attention_on(pipeline_dits(pipe), _side(attention, "attention")):
        pass


def _backends(dits: dict[str, nn.Module]) -> list[dict[str, Any]]:
    """Per role: the backend it runs and whether it is lossy (``stock`` when omni attention is off)."""
    rows: dict[str, dict[str, Any]] = {}
    for model in dits.values():
        for entry in attention_report(model):
            rows.setdefault(entry["role"], {"role": entry["role"], "backend": entry["backend"],
                                            "lossy": bool(entry.get("lossy")), "modules": 0})
            rows[entry["role"]]["modules"] += 1
    return list(rows.values()) or [{"role": "all", "backend": STOCK, "lossy": False, "modules": None}]


def _sync(models) -> None:
    for model in models:
        for p in model.parameters():
            if p.device.type == "cuda":
                torch.cuda.synchronize(p.device)
            return


def _primary(dits: dict[str, nn.Module]) -> str:
    return "transformer" if "transformer" in dits else next(iter(dits))


def summarize_layers(layers: list[AttentionLayerError]) -> dict[str, Any]:
    """Max and mean of the per-module errors, overall and per role (JSON-ready)."""

    def stats(rows: list[AttentionLayerError]) -> dict[str, Any]:
        rel = [row.rel_err for row in rows]
        local = [row.local_rel_err for row in rows if row.local_rel_err is not None]
        worst = max(rows, key=lambda row: row.rel_err) if rows else None
        return {
            "modules": len(rows),
            "rel_err_max": max(rel) if rel else None,
            "rel_err_mean": sum(rel) / len(rel) if rel else None,
            "local_rel_err_max": max(local) if local else None,
            "local_rel_err_mean": sum(local) / len(local) if local else None,
            "max_abs": max((row.max_abs for row in rows), default=None),
            "worst_module": worst.module if worst else None,
        }

    roles: dict[str, list[AttentionLayerError]] = {}
    for row in layers:
        roles.setdefault("+".join(row.roles), []).append(row)
    return {**stats(layers), "per_role": {role: stats(rows) for role, rows in roles.items()}}


# Pipelines ----------------------------------------------------------------------------------------------------------


def _to_uint8(x: np.ndarray) -> np.ndarray:
    return (np.clip(x, 0.0, 1.0) * 255.0 + 0.5).astype(np.uint8)


def _panel_row(images: list[np.ndarray]) -> np.ndarray:
    height = images[0].shape[0]
    gap = np.full((height, _SEPARATOR, 3), 255, dtype=np.uint8)
    parts = []
    for index, image in enumerate(images):
        if index:
            parts.append(gap)
        parts.append(image)
    return np.concatenate(parts, axis=1)


def _rgb(x: np.ndarray) -> np.ndarray:
    if x.ndim == 2:
        x = x[..., None]
    return np.repeat(x, 3, axis=-1) if x.shape[-1] == 1 else x[..., :3]


@dataclass
class QualityReport:
    """What ``compare_pipelines`` measured. ``reference_output`` / ``candidate_output`` are the pipeline outputs
    (``[B, H, W, C]`` images or ``[B, F, H, W, C]`` frames, floats in [0, 1])."""

    kind: str
    reference: dict[str, Any]
    candidate: dict[str, Any]
    psnr_db: float
    ssim: float
    layers: list[AttentionLayerError]
    wall_s: dict[str, float]
    first_call_inputs_equal: bool
    reference_output: np.ndarray = field(repr=False)
    candidate_output: np.ndarray = field(repr=False)
    # ``None``: the gain that shows the largest difference white (``gain``).
    diff_gain: float | None = DEFAULT_DIFF_GAIN
    call: dict[str, Any] = field(default_factory=dict)
    per_frame: dict[str, list[float]] = field(default_factory=dict)
    attention_step: str = "first transformer call (denoising step 0; its conditional pass under CFG)"

    @property
    def max_abs_diff(self) -> float:
        return float(np.abs(self.candidate_output.astype(np.float64) - self.reference_output).max())

    def frame_indices(self, count: int = GRID_FRAMES) -> list[int]:
        """The frames the grid shows: ``count`` evenly spaced, first and last included."""
        if self.kind != "video":
            return [0]
        frames = self.reference_output.shape[1]
        if frames <= count:
            return list(range(frames))
        return sorted({round(i * (frames - 1) / (count - 1)) for i in range(count)})

    def side_by_side(self, frames: int = GRID_FRAMES):
        """A PIL image. Images: reference | candidate | |candidate − reference| × ``diff_gain`` (clipped). Video:
        a grid, one column per shown frame (``frame_indices``), rows reference, candidate, amplified difference.
        Panels are separated by white lines of 2 pixels; the first image of the batch is shown."""
        from PIL import Image

        ref = self.reference_output[0].astype(np.float64)
        cand = self.candidate_output[0].astype(np.float64)
        diff = np.abs(cand - ref) * self.gain
        if self.kind == "image":
            return Image.fromarray(_panel_row([_to_uint8(_rgb(x)) for x in (ref, cand, diff)]))
        shown = self.frame_indices(frames)
        rows = [_panel_row([_to_uint8(_rgb(x[i])) for i in shown]) for x in (ref, cand, diff)]
        gap = np.full((_SEPARATOR, rows[0].shape[1], 3), 255, dtype=np.uint8)
        return Image.fromarray(np.concatenate([rows[0], gap, rows[1], gap, rows[2]], axis=0))

    @property
    def gain(self) -> float:
        """The difference panel's gain: ``diff_gain``, or when it is ``None`` the one that shows the largest
        difference white (1 when the outputs are identical), at most 10^6."""
        if self.diff_gain is not None:
            return float(self.diff_gain)
        largest = self.max_abs_diff
        return 1.0 if largest == 0 else float(min(1.0 / largest, 1e6))

    def annotated(self, frames: int = GRID_FRAMES):
        """``side_by_side`` with labels: a PIL image and what it shows. Small outputs are enlarged (nearest
        neighbour, by a whole factor) to panels of at least ``_MIN_PANEL`` pixels so that the labels fit; above
        each panel (images) or left of each row (videos): ``reference``, ``candidate`` and ``|difference| xG``
        (``|candidate − reference|`` times the gain ``gain``; ``difference: identical`` when there is none); under
        the panels PSNR, SSIM and the largest difference. The dict: ``labels``, ``footer``, ``diff_gain``,
        ``panel_scale``, ``panel_px`` (a panel's width), ``gap_px``, ``header_px`` (the band above the panels),
        ``label_px`` (the column left of them)."""
        from PIL import Image, ImageDraw, ImageFont

        base = self.side_by_side(frames)
        width = self.reference_output.shape[-2]
        scale = max(1, math.ceil(_MIN_PANEL / width))
        if scale > 1:
            base = base.resize((base.width * scale, base.height * scale), Image.NEAREST)
        identical = self.max_abs_diff == 0
        gain = self.gain
        # ASCII only: the default font has no minus sign or multiplication sign.
        labels = ["reference", "candidate", "difference: identical" if identical else f"|difference| x{gain:.3g}"]
        footer = f"PSNR {self.psnr_db:.2f} dB, SSIM {self.ssim:.4f}, max |diff| {self.max_abs_diff:.3g}"
        if self.kind == "video":
            footer += f"; frames {', '.join(str(i) for i in self.frame_indices(frames))}"
        font = ImageFont.load_default(size=_LABEL_FONT)
        line = _LABEL_FONT + 8
        text_width = max(int(font.getlength(text)) for text in [*labels, footer]) + 8
        panel, gap = width * scale, _SEPARATOR * scale
        if self.kind == "image":
            header, left = line, 0
            canvas_width = max(base.width, text_width, 2 * (panel + gap) + int(font.getlength(labels[2])) + 4)
        else:
            header, left = 0, max(int(font.getlength(text)) for text in labels) + 12
            canvas_width = max(base.width + left, text_width)
        canvas = Image.new("RGB", (canvas_width, header + base.height + line), "white")
        canvas.paste(base, (left, header))
        draw = ImageDraw.Draw(canvas)
        if self.kind == "image":
            for index, text in enumerate(labels):
                x = index * (panel + gap)
                draw.text((x + 2, 3), text, fill="black", font=font)
        else:
            row = base.height // 3
            for index, text in enumerate(labels):
                draw.text((4, index * row + row // 2 - _LABEL_FONT // 2), text, fill="black", font=font)
        draw.text((4, header + base.height + 3), footer, fill="black", font=font)
        return canvas, {"labels": labels, "footer": footer, "diff_gain": gain, "panel_scale": scale,
                        "panel_px": panel, "gap_px": gap, "header_px": header, "label_px": left}

    def save_image(self, path: str | Path) -> Path:
        """Write ``annotated()``'s image to ``path``."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        self.annotated()[0].save(path)
        return path

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "psnr_db": self.psnr_db,
            "ssim": self.ssim,
            "max_abs_diff": self.max_abs_diff,
            "per_frame": self.per_frame,
            "shown_frames": self.frame_indices() if self.kind == "video" else None,
            "output_shape": list(self.reference_output.shape),
            "diff_gain": self.gain,
            "wall_s": self.wall_s,
            "reference": self.reference,
            "candidate": self.candidate,
            "call": self.call,
            "attention_step": self.attention_step,
            "first_call_inputs_equal": self.first_call_inputs_equal,
            "attention": summarize_layers(self.layers),
            "layers": [row.to_dict() for row in self.layers],
        }

    def to_json(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=2, default=str) + "\n")
        return path

    def table(self) -> str:
        summary = summarize_layers(self.layers)
        rows = [{"role": role, "modules": s["modules"], "rel_err max": f"{s['rel_err_max']:.2e}",
                 "rel_err mean": f"{s['rel_err_mean']:.2e}",
                 "local max": "—" if s["local_rel_err_max"] is None else f"{s['local_rel_err_max']:.2e}",
                 "worst module": s["worst_module"]}
                for role, s in summary["per_role"].items()]
        lines = [table(rows, ["role", "modules", "rel_err max", "rel_err mean", "local max", "worst module"])]
        what = "frames" if self.kind == "video" else "image"
        lines.append("\nattention error in the first transformer call (step 0): rel_err = ‖c − r‖ / ‖r‖ of\n"
                     "each module's output, errors of earlier layers included; local = the module's kernel alone")
        lines.append(f"{what}: PSNR {self.psnr_db:.2f} dB, SSIM {self.ssim:.4f}, max |diff| {self.max_abs_diff:.3g}")
        lines.append(f"wall time: reference {self.wall_s['reference']:.2f} s, "
                     f"candidate {self.wall_s['candidate']:.2f} s")
        if not self.first_call_inputs_equal:
            lines.append("WARNING: the first transformer call's inputs differ between the runs (something\n"
                         "besides the DiTs' attention changed); the per-layer errors include that difference")
        return "\n".join(lines)


def _run_side(pipe, dits, attention, call, seed, generator_device, warmup_runs, reference=None,
              local_processors=None):
    with _attention_on(dits, attention):
        backends = _backends(dits)
        for _ in range(warmup_runs):
            pipe(**call, generator=torch.Generator(device=generator_device).manual_seed(seed))
        recorder = _FirstCallRecorder(dits, _primary(dits), reference=reference, local_processors=local_processors)
        processors = recorder.processors()
        models = list(dits.values())
        with recorder:
            _sync(models)
            started = time.perf_counter()
            result = pipe(**call, generator=torch.Generator(device=generator_device).manual_seed(seed))
            _sync(models)
            elapsed = time.perf_counter() - started
    if recorder.calls <= recorder.call_index:
        raise RuntimeError(f"{type(pipe).__name__}'s transformer was never called; nothing to compare")
    return result, recorder, processors, backends, elapsed


def _output_array(result: Any) -> tuple[str, np.ndarray]:
    frames = getattr(result, "frames", None)
    if frames is not None:
        return "video", np.asarray(frames, dtype=np.float32)
    images = getattr(result, "images", None)
    if images is None:
        raise TypeError(f"{type(result).__name__} has neither images nor frames")
    return "image", np.asarray(images, dtype=np.float32)


def compare_pipelines(
    pipe: Any,
    reference: Any = DEFAULT_REFERENCE,
    candidate: Any = None,
    *,
    seed: int = 0,
    generator_device: str = "cpu",
    diff_gain: float = DEFAULT_DIFF_GAIN,
    warmup_runs: int = 0,
    local_errors: bool = True,
    **call_kwargs: Any,
) -> QualityReport:
    """Run ``pipe(**call_kwargs)`` under ``reference`` and under ``candidate`` attention with the same seed and
    compare the outputs (PSNR, SSIM, a side-by-side image) and the attention outputs of the first transformer call.

    Args:
        pipe: a Diffusers or Omni pipeline whose DiTs diffusers-omni supports; its attention is restored afterwards.
        reference: an attention config (backend name, dict, JSON, ``AttentionConfig``) or ``"stock"`` (Diffusers'
            own processors). Default ``"native"``: ``TORCH_SDPA``.
        candidate: the configuration under test, same forms (required).
        seed (`int`): both runs get ``torch.Generator(generator_device).manual_seed(seed)``.
        diff_gain (`float`): the difference panel shows ``|candidate − reference| × diff_gain``.
        warmup_runs (`int`): untimed runs of each side before the measured one (kernel compilation, plan caches).
        local_errors (`bool`): also rerun each attention module's reference processor on the candidate's inputs
            (``local_rel_err``; one extra attention call per module in the first transformer call).
        call_kwargs: the pipeline call (``prompt``, ``num_inference_steps``, ``height``, ``num_frames``...); not
            ``generator``, ``output_type`` or ``return_dict`` (set here: ``output_type="np"``).

    Returns:
        A ``QualityReport``: ``psnr_db``, ``ssim``, ``layers``, ``wall_s``, ``side_by_side()``, ``to_dict()``.

    Example:
    ```py
    >>> report = compare_pipelines(pipe, "native", {"default": {"backend": "RAINFUSION_ATTN",
    ...                            "block_sparse": {"sparsity": 0.8}}}, prompt="a red fox", num_inference_steps=28)
    >>> print(report.table()); report.save_image("cmp.png")
    ```
    """
    reserved = [key for key in _RESERVED_CALL_KWARGS if key in call_kwargs]
    if reserved:
        raise ValueError(f"compare_pipelines sets {', '.join(reserved)} itself (seed={seed!r}, output_type='np'); "
                         "do not pass them")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed={seed!r} must be an int")
    if isinstance(warmup_runs, bool) or not isinstance(warmup_runs, int) or warmup_runs < 0:
        raise ValueError(f"warmup_runs={warmup_runs!r} must be an int >= 0")
    if isinstance(diff_gain, bool) or not isinstance(diff_gain, (int, float)) or not (0 < diff_gain < math.inf):
        raise ValueError(f"diff_gain={diff_gain!r} must be a finite number > 0")
    ref_attention = _side(reference, "reference")
    cand_attention = _side(candidate, "candidate")
    dits = pipeline_dits(pipe)
    call = {**call_kwargs, "output_type": "np"}

    ref_result, ref_rec, ref_processors, ref_backends, ref_s = _run_side(
        pipe, dits, ref_attention, call, seed, generator_device, warmup_runs)
    cand_result, cand_rec, _, cand_backends, cand_s = _run_side(
        pipe, dits, cand_attention, call, seed, generator_device, warmup_runs, reference=ref_rec,
        local_processors=ref_processors if local_errors else None)

    kind, ref_out = _output_array(ref_result)
    _, cand_out = _output_array(cand_result)
    per_frame: dict[str, list[float]] = {}
    if kind == "video":
        frames_ref = ref_out.reshape(-1, *ref_out.shape[-3:])
        frames_cand = cand_out.reshape(-1, *cand_out.shape[-3:])
        per_frame = {"psnr_db": [psnr(r, c) for r, c in zip(frames_ref, frames_cand)],
                     "ssim": ssim_per_image(frames_ref, frames_cand)}
    plain = {k: v for k, v in call_kwargs.items() if isinstance(v, (str, int, float, bool)) or v is None}
    return QualityReport(
        kind=kind,
        reference={"attention": _describe(ref_attention), "backends": ref_backends},
        candidate={"attention": _describe(cand_attention), "backends": cand_backends},
        psnr_db=psnr(ref_out, cand_out),
        ssim=ssim(ref_out, cand_out),
        layers=cand_rec.layer_errors(),
        wall_s={"reference": ref_s, "candidate": cand_s, "warmup_runs": warmup_runs},
        first_call_inputs_equal=_inputs_equal(ref_rec.inputs, cand_rec.inputs),
        reference_output=ref_out,
        candidate_output=cand_out,
        diff_gain=float(diff_gain),
        call={"pipeline": type(pipe).__name__, "seed": seed, **plain},
        per_frame=per_frame,
    )


# One transformer call -----------------------------------------------------------------------------------------------


@dataclass
class TransformerCallReport:
    """``compare_transformer_call``: the transformer output's error and the per-module attention errors."""

    reference: dict[str, Any]
    candidate: dict[str, Any]
    output_rel_err: float
    output_max_abs: float
    layers: list[AttentionLayerError]

    def to_dict(self) -> dict[str, Any]:
        return {"reference": self.reference, "candidate": self.candidate, "output_rel_err": self.output_rel_err,
                "output_max_abs": self.output_max_abs, "attention": summarize_layers(self.layers),
                "layers": [row.to_dict() for row in self.layers]}


def compare_transformer_call(
    model: nn.Module,
    inputs: RecordedInputs | dict[str, Any],
    reference: Any = DEFAULT_REFERENCE,
    candidate: Any = None,
    *,
    local_errors: bool = True,
    store_device: Any = "cpu",
) -> TransformerCallReport:
    """One forward of ``model`` on ``inputs`` under each configuration: the relative error of the whole output and
    of every attention module's output (propagated and local, as in ``compare_pipelines``).

    Args:
        model: a supported transformer; its attention is restored afterwards.
        inputs: ``RecordedInputs`` (``record_transformer_inputs``) or the forward's keyword arguments.
        store_device: where the reference's per-module outputs are kept until the candidate runs (``"cpu"``, or the
            model's device when it has room: no copies).
    """
    ref_attention = _side(reference, "reference")
    cand_attention = _side(candidate, "candidate")
    if isinstance(inputs, dict):
        inputs = RecordedInputs((), dict(inputs))
    dits = {"transformer": model}

    def forward(attention, **recorder_kwargs):
        with _attention_on(dits, attention):
            backends = _backends(dits)
            recorder = _FirstCallRecorder(dits, "transformer", store_device=store_device, **recorder_kwargs)
            processors = recorder.processors()
            with recorder, torch.no_grad():
                output = _tensors(model(*inputs.args, **inputs.kwargs))
        return output, recorder, processors, backends

    ref_out, ref_rec, ref_processors, ref_backends = forward(ref_attention)
    ref_out = tuple(t.to(store_device) for t in ref_out)
    cand_out, cand_rec, _, cand_backends = forward(
        cand_attention, reference=ref_rec, local_processors=ref_processors if local_errors else None)
    errors = _Errors()
    errors.add(ref_out, cand_out, "output")
    return TransformerCallReport(
        {"attention": _describe(ref_attention), "backends": ref_backends},
        {"attention": _describe(cand_attention), "backends": cand_backends},
        errors.rel_err, errors.max_abs, cand_rec.layer_errors(),
    )
