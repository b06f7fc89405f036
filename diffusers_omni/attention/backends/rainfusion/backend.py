"""``RAINFUSION_ATTN``: block-sparse attention — MindIE-SD RainFusion (rf_v2) on Ascend NPU (``mindiesd``), and
FlashInfer's paged FA3 prefill on Hopper (sm_90, ``flashinfer-python``), an extension of the contract.

What runs sparse is decided from the video layout the model publishes (``publish_video_geometry``; models whose
declaration has a ``video_geometry`` publish it on every forward). Warm-up steps (``block_sparse.start_step``),
``block_sparse.skip_layers``, cross-attention (KV not the query sequence) and sequences under 32 blocks delegate to
the dense ``TORCH_SDPA`` backend, so a model can select RainFusion unconditionally. Incompatible with ring sequence
parallelism (blocks are ranked over the whole key sequence): ``check_sequence_parallel(ring_degree)`` refuses it.

On CUDA (``diffusers_omni.attention.backends.rainfusion.block_sparse``) each (batch, head) keeps, per 128-row query block, the
``round((1 - sparsity) · blocks)`` key blocks with the best pooled score ``mean(q_block) · mean(k_block)``; with a
published geometry the prefix (text) rows attend densely and the prefix and first-frame key blocks are always kept;
without one (geometry-free) the same data-dependent selection runs on the natural row order. With
``block_sparse.mass_threshold`` (instead of ``sparsity``) each query block needs the smallest set of key blocks whose
share of ``softmax(scale · pooled scores)`` reaches the threshold (forced blocks first); a call keeps one count, the
largest needed one rounded up to a bucket, for every query block (a superset of each needed set; the plan is cached
per count). Rows keep their order (a
block is a strip of consecutive latent rows), so K and V are read in place.

The kernel call (``_rf_v2``) follows the contract's description of rf_v2 (128-row blocks, kept prefix, first-frame
blocks kept, nominal sparsity); its exact MindIE-SD entry point and argument names are NOT verified — no NPU or
``mindiesd`` documentation was available here. Everything before that boundary is tested on CPU.
"""

from __future__ import annotations

import copy
import importlib
import logging
import re
from typing import ClassVar

import torch

from ...model_state import remember_state

from .block_sparse import BLOCK, BlockSparseRunner, SparseLayout, kept_blocks, kept_pages
from .plan import (
    MIN_VIDEO_BLOCKS,
    RainFusionPlan,
    VideoGeometry,
    dense_reason,
    plan_geometry,
    video_order,
)
from ...platform import current_platform
from ...tables import sparse_dense_above, sparse_rules
from ..base import AttentionBackend, package_importable
from ..sdpa.backend import TorchSDPABackend

logger = logging.getLogger("diffusers_omni.attention")

_STATE_ATTR = "_omni_rainfusion_state"


class RainFusionState:
    """Per model: the published geometry (and its plan) and the denoise step, counted by the model's forwards."""

    def __init__(self) -> None:
        self.plan: RainFusionPlan | None = None
        self.step = -1
        self.handle = None
        # ``(model, args, kwargs) -> VideoGeometry | None`` from the model's declaration; an explicit
        # ``publish_video_geometry`` call takes precedence over it from then on.
        self.source = None
        self.explicit = False

    def publish(self, geometry: VideoGeometry | None) -> None:
        self.plan = plan_geometry(geometry) if geometry is not None else None


def rainfusion_state(model: torch.nn.Module) -> RainFusionState:
    state = getattr(model, _STATE_ATTR, None)
    if state is None:
        state = RainFusionState()

        def count_step(module, args, kwargs):
            state.step += 1
            if state.source is not None and not state.explicit:
                state.publish(state.source(module, args, kwargs))

        state.handle = model.register_forward_pre_hook(count_step, with_kwargs=True)
        setattr(model, _STATE_ATTR, state)
        remember_state(model, _STATE_ATTR)
    return state


def publish_video_geometry(model: torch.nn.Module, geometry: VideoGeometry | None, step: int | None = None) -> None:
    """Models (or pipelines) call this before a forward: the prefix length and the latent grid ``(t, h, w)``.
    ``step`` sets the denoise step explicitly (otherwise each transformer forward counts one step). An explicit
    call overrides the geometry a model declaration publishes by itself."""
    state = rainfusion_state(model)
    state.explicit = True
    state.publish(geometry)
    if step is not None:
        state.step = step - 1  # the pre-hook adds one at the next forward


def attach_geometry_source(model: torch.nn.Module, source) -> None:
    """Publish ``source(model, args, kwargs)`` (a declaration's ``video_geometry``) before every forward."""
    rainfusion_state(model).source = source


def check_sequence_parallel(ring_degree: int) -> None:
    if ring_degree > 1:
        raise ValueError(
            f"RAINFUSION_ATTN is incompatible with ring sequence parallelism (ring_degree={ring_degree}): rf_v2 ranks "
            "key blocks over the whole sequence; use Ulysses sequence parallelism with ring_degree=1"
        )


def layer_index(module_name: str) -> int | None:
    """The DiT block index of an attention module (``blocks.12.attn1`` → 12)."""
    match = re.search(r"(?:^|\.)(\d+)(?:\.|$)", module_name)
    return int(match.group(1)) if match else None


def _import_mindiesd():
    """Kernel boundary (tests replace it with a fake module)."""
    return importlib.import_module("mindiesd")


def _dense_delegate() -> AttentionBackend:
    """Dense calls (warm-up steps, skipped layers, cross-attention) run on FLASH_ATTN where it is available on CUDA
    (FlashAttention-3 on Hopper; it hands masks and float32 to SDPA itself), on TORCH_SDPA otherwise."""
    from ...platform import current_platform
    from ..flash.backend import FlashAttentionBackend

    platform = current_platform()
    if platform.device_type == "cuda" and not FlashAttentionBackend.availability_reasons(platform):
        return FlashAttentionBackend(None)
    return TorchSDPABackend()


_MINDIESD_HINT = "Huawei MindIE-SD (a release implementing protected video tails for rf_v2)"
_FLASHINFER_HINT = "pip install flashinfer-python apache-tvm-ffi"


class RainFusionBackend(AttentionBackend):
    name: ClassVar[str] = "RAINFUSION_ATTN"
    devices = frozenset({"npu", "cuda"})
    dtypes = frozenset({torch.float16, torch.bfloat16})
    supports_mask = False
    supports_gqa = False
    supports_backward = False
    deterministic = False
    lossy = True  # block-sparse

    def __init__(self, spec=None, runner: BlockSparseRunner | None = None) -> None:
        super().__init__(spec)
        block = spec.block_sparse if spec is not None else None
        from ....config.attention import BlockSparseSpec

        self.block_sparse = block or BlockSparseSpec()
        self.dense = _dense_delegate()
        self.runner = runner or BlockSparseRunner()  # shared by the per-site copies: one plan cache
        self.state: RainFusionState | None = None
        self.site_name: str | None = None
        self.layer: int | None = None
        self._logged: set[str] = set()
        self._layouts: dict[tuple, SparseLayout] = {}
        from ...platform import current_platform

        # Which kernel path runs: MindIE-SD rf_v2 on Ascend, the FlashInfer block-sparse path elsewhere.
        self.kernel = "rf_v2" if current_platform().device_type == "npu" else "block_sparse"
        if self.kernel == "rf_v2" and self.block_sparse.mass_threshold is not None:
            raise ValueError(
                f"block_sparse.mass_threshold={self.block_sparse.mass_threshold} is not supported by MindIE-SD rf_v2 "
                "(Ascend), which selects a fixed share of blocks; set block_sparse.sparsity instead (the "
                "cumulative-mass selection runs on the CUDA path only)"
            )

    @classmethod
    def extra_availability_reasons(cls, platform) -> list[str]:
        if platform.device_type == "npu" and not package_importable("mindiesd"):
            return [f"package 'mindiesd' is not importable; to install: {_MINDIESD_HINT}"]
        if platform.device_type == "cuda":
            reasons = []
            if platform.compute_capability is not None and platform.compute_capability[0] != 9:
                reasons.append(f"compute capability is {platform.sm}; {cls.name} on CUDA requires sm_90 (FlashInfer's "
                               "FA3 paged prefill)")
            if not package_importable("flashinfer"):
                reasons.append(f"package 'flashinfer' is not importable; to install: {_FLASHINFER_HINT}")
            return reasons
        return []

    def attach_geometry_source(self, model, source) -> None:
        """Called by the installer with the model declaration's ``video_geometry``."""
        attach_geometry_source(model, source)

    def bind_site(self, model, site, resolution) -> "RainFusionBackend":
        bound = copy.copy(self)
        bound.state = rainfusion_state(model)
        bound.site_name = site.name
        bound.layer = layer_index(site.name)
        bound._logged = set()
        return bound

    def why_dense(self, query: torch.Tensor, key: torch.Tensor) -> str | None:
        if self.block_sparse.mass_threshold is None and self.block_sparse.sparsity == 0:
            return "block_sparse.sparsity is 0"
        state = self.state
        plan = state.plan if state is not None else None
        reason = dense_reason(
            plan,
            step=state.step if state is not None else None,
            start_step=self.block_sparse.start_step,
            layer=self.layer,
            skip_layers=self.block_sparse.skip_layers or (),
        )
        if reason is None:
            expected = plan.geometry.prefix_len + plan.video_rows
            if query.shape[1] != expected or key.shape[1] != expected:
                reason = f"sequence lengths {query.shape[1]}/{key.shape[1]} are not the published {expected} rows"
        return reason

    def layout_for(self, seq_len: int) -> SparseLayout:
        """The CUDA block layout of a self-attention call of ``seq_len`` rows under the published geometry (prefix
        rows dense, prefix and first-frame key blocks kept) or, without one, geometry-free."""
        plan = self.state.plan if self.state is not None else None
        geometry = plan.geometry if plan is not None else None
        key = (seq_len, geometry)
        layout = self._layouts.get(key)
        if layout is None:
            if geometry is None:
                layout = SparseLayout(seq_len, source="geometry-free")
            else:
                prefix = geometry.prefix_len
                kept_rows = prefix + plan.first_frame_rows
                forced = tuple(range(min(-(-kept_rows // BLOCK), seq_len // BLOCK)))
                layout = SparseLayout(seq_len, None, -(-prefix // BLOCK), forced,
                                      source=f"geometry prefix={prefix} grid={geometry.grid}")
            self._layouts[key] = layout
        return layout

    def why_dense_cuda(self, query: torch.Tensor, key: torch.Tensor) -> str | None:
        """Why this call runs dense on the CUDA path (``None``: it runs block-sparse)."""
        mass = self.block_sparse.mass_threshold is not None
        if not mass and self.block_sparse.sparsity == 0:
            return "block_sparse.sparsity is 0"
        state = self.state
        if state is not None and state.step < self.block_sparse.start_step:
            return f"denoise step {state.step} < block_sparse.start_step={self.block_sparse.start_step}"
        skip = self.block_sparse.skip_layers or ()
        if self.layer is not None and self.layer in skip:
            return f"layer {self.layer} is in block_sparse.skip_layers"
        q_len, kv_len = query.shape[1], key.shape[1]
        if q_len != kv_len:
            return f"cross-attention (KV length {kv_len} is not the query length {q_len})"
        if query.shape[2] != key.shape[2]:
            return f"grouped-query attention ({query.shape[2]} query heads, {key.shape[2]} KV heads)"
        plan = state.plan if state is not None else None
        if plan is not None and q_len != plan.geometry.prefix_len + plan.video_rows:
            return f"sequence lengths {q_len}/{kv_len} are not the published {plan.geometry.prefix_len + plan.video_rows} rows"
        blocks = q_len // BLOCK
        if blocks < MIN_VIDEO_BLOCKS:
            return f"the sequence has {blocks} whole 128-row blocks; block-sparse attention needs at least {MIN_VIDEO_BLOCKS}"
        layout = self.layout_for(q_len)
        if not mass and kept_blocks(layout, self.block_sparse.sparsity) >= layout.full_key_blocks:
            return f"block_sparse.sparsity={self.block_sparse.sparsity} keeps every key block at {q_len} rows"
        limit = self.dense_above(query)
        if not mass and limit is not None:
            share = kept_blocks(layout, self.block_sparse.sparsity) / layout.full_key_blocks
            if share > limit:
                return (f"block_sparse.sparsity={self.block_sparse.sparsity} keeps {share:.0%} of the key blocks, above "
                        f"the measured break-even {limit:.0%} where block-sparse is slower than dense")
        return None

    @staticmethod
    def dense_above(query: torch.Tensor) -> float | None:
        """The kept share above which a call of this shape runs dense (measured break-even; ``None``: unmeasured)."""
        return sparse_dense_above(current_platform().family, query.shape[1], query.shape[1], query.shape[-1])

    def _log_once(self, kind: str, message: str, *args) -> None:
        if kind not in self._logged:
            self._logged.add(kind)
            logger.info(message, *args)

    def __call__(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        cuda = self.kernel != "rf_v2"
        reason = self.why_dense_cuda(query, key) if cuda else self.why_dense(query, key)
        if reason is None and (attn_mask is not None or is_causal or dropout_p):
            reason = "the call passes a mask, causal=True or dropout"
        if reason is not None:
            kind = reason.split(" ")[0] + reason.split(" ")[1]
            self._log_once(kind, "RAINFUSION_ATTN (%s): dense for this call — %s", self.site_name, reason)
            return self.dense(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
        if not cuda:
            return self._rf_v2(query, key, value, self.state.plan, scale)
        layout = self.layout_for(query.shape[1])
        spec = self.block_sparse
        if spec.mass_threshold is not None:
            self._log_once(("sparse", layout.source), "RAINFUSION_ATTN (%s): block-sparse on CUDA, %s layout, each "
                           "query block keeps the key blocks holding %s of its pooled attention mass (of %d)",
                           self.site_name, layout.source, spec.mass_threshold, layout.full_key_blocks)
            limit = self.dense_above(query)
            out = self.runner(query, key, value, layout, scale=scale, mass_threshold=spec.mass_threshold,
                              dense_above=limit)
            if out is None:
                self._log_once(("mass-dense", layout.source), "RAINFUSION_ATTN (%s): dense for this call — "
                               "cumulative mass %s keeps %.0f%% of the key blocks, above the measured break-even "
                               "%.0f%% where block-sparse is slower than dense (logged once)", self.site_name,
                               spec.mass_threshold, 100 * self.runner.last_kept_share, 100 * limit)
                return self.dense(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
            return out
        self._log_once(("sparse", layout.source), "RAINFUSION_ATTN (%s): block-sparse on CUDA, %s layout, %d of %d "
                       "key blocks kept per query block (a partial tail block counts as one)", self.site_name,
                       layout.source, kept_pages(layout, spec.sparsity), layout.key_pages)
        return self.runner(query, key, value, layout, spec.sparsity, scale)

    def _rf_v2(self, query, key, value, plan: RainFusionPlan, scale):
        prefix = plan.geometry.prefix_len
        order = video_order(plan).to(query.device) + prefix
        index = torch.cat([order[: plan.sparse_rows], torch.arange(prefix, device=query.device), order[plan.sparse_rows :]])
        q, k, v = (x.index_select(1, index) for x in (query, key, value))
        mindiesd = _import_mindiesd()
        out = mindiesd.rain_fusion_attention(  # unverified entry point, see the module docstring
            q, k, v,
            sparse_rows=plan.sparse_rows,
            kept_rows=plan.kept_rows,
            first_frame_blocks=plan.first_frame_blocks,
            block_size=128,
            sparsity=self.block_sparse.sparsity,
            scale=scale,
            layout="BSND",
        )
        result = torch.empty_like(out)
        result.index_copy_(1, index, out)
        return result

    def describe(self) -> dict:
        if self.kernel == "rf_v2":
            implementation = "mindiesd rf_v2 (unverified entry point)"
        else:
            selection = "cumulative-mass" if self.block_sparse.mass_threshold is not None else "top-k"
            implementation = (f"diffusers_omni.attention.backends.rainfusion.block_sparse: pooled {selection} block selection + "
                              "flashinfer.BatchPrefillWithPagedKVCacheWrapper(backend='fa3')")
        return {**super().describe(), "implementation": implementation, "lossy": True,
                "sparsity": self.block_sparse.sparsity, "mass_threshold": self.block_sparse.mass_threshold,
                "start_step": self.block_sparse.start_step, "skip_layers": list(self.block_sparse.skip_layers or ())}
