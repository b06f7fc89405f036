"""Helpers shared by the benchmark scripts: timing, error against a float32 reference, chart set-up."""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F


def sync() -> None:
    """Wait for the GPU's queued work (nothing without CUDA)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def time_ms(fn: Callable[[], Any], repeats: int, inner: int, warmup: int = 2) -> float:
    """Median per-call milliseconds of ``fn`` over ``repeats`` samples of ``inner`` calls, after ``warmup`` calls
    (CUDA events on the GPU, wall clock otherwise)."""
    for _ in range(warmup):
        fn()
    sync()
    samples = []
    for _ in range(repeats):
        if torch.cuda.is_available():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(inner):
                fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / inner)
        else:
            t0 = time.perf_counter()
            for _ in range(inner):
                fn()
            samples.append((time.perf_counter() - t0) * 1e3 / inner)
    return statistics.median(samples)


def random_parameters_on(model: torch.nn.Module, device, dtype: torch.dtype = torch.bfloat16, seed: int = 0):
    """Give every meta-device parameter of ``model`` storage on ``device`` filled with N(0, 0.02) (drawn there: a
    12B-parameter model in seconds); buffers are left as the model built them. Returns the model on ``device``."""
    generator = torch.Generator(device=device).manual_seed(seed)
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is not None and param.is_meta:
                data = torch.empty(param.shape, device=device, dtype=dtype)
                data.normal_(0.0, 0.02, generator=generator)
                module._parameters[name] = torch.nn.Parameter(data, requires_grad=False)
    return model.to(device)


def flux_inputs(config: dict[str, Any], tokens: int, text_tokens: int, device, seed: int) -> dict[str, torch.Tensor]:
    """Random inputs of a FLUX.1 transformer of ``config``: ``tokens`` image and ``text_tokens`` text tokens, batch 1,
    bf16 on ``device`` (the position ids float32)."""
    g = torch.Generator().manual_seed(seed)
    made = {"hidden_states": torch.randn(1, tokens, config["in_channels"], generator=g),
            "encoder_hidden_states": torch.randn(1, text_tokens, config["joint_attention_dim"], generator=g),
            "pooled_projections": torch.randn(1, config["pooled_projection_dim"], generator=g),
            "timestep": torch.tensor([0.5]), "guidance": torch.tensor([3.5]),
            "img_ids": torch.zeros(tokens, 3), "txt_ids": torch.zeros(text_tokens, 3)}
    return {k: v.to(device, torch.float32 if k.endswith("_ids") else torch.bfloat16) for k, v in made.items()}


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Float32 attention of ``[B, S, H, D]`` tensors (``mask``: ``[B, S_kv]`` key padding); on the GPU through the
    memory-efficient kernel (no S×S materialisation, fp32 accumulation throughout)."""
    if mask is not None:
        mask = mask[:, None, None, :]
    q, k, v = (x.float().permute(0, 2, 1, 3) for x in (q, k, v))
    if q.is_cuda:
        with torch.nn.attention.sdpa_kernel([torch.nn.attention.SDPBackend.EFFICIENT_ATTENTION]):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).permute(0, 2, 1, 3)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).permute(0, 2, 1, 3)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative L2 error of ``out`` against ``ref`` in float32 (NaN when ``out`` is not finite)."""
    out = out.float()
    if not torch.isfinite(out).all():
        return float("nan")
    return ((out - ref.float()).norm() / ref.float().norm()).item()


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the non-interactive Agg backend, or ``None`` when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def save_figure(plt: Any, fig: Any, path: Path) -> None:
    """Lay out ``fig``, write it to ``path`` at 120 dpi and close it."""
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
