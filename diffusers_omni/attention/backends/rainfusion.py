"""``RAINFUSION_ATTN``: MindIE-SD RainFusion (rf_v2) block-sparse video attention on Ascend NPU (``mindiesd``).

What runs sparse is decided by ``diffusers_omni.attention.rainfusion_plan`` from the video layout the model
publishes (``publish_video_geometry``). Everything else — no geometry, fewer than 32 video blocks, warm-up steps
(``block_sparse.start_step``), ``block_sparse.skip_layers``, cross-attention (KV not the video) — delegates to the dense
``TORCH_SDPA`` backend, so a model can select RainFusion unconditionally. Incompatible with ring sequence
parallelism (rf_v2 ranks blocks over the whole key sequence): ``check_sequence_parallel(ring_degree)`` refuses it.

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

from ..model_state import remember_state

from ..rainfusion_plan import RainFusionPlan, VideoGeometry, dense_reason, plan_geometry, video_order
from .base import AttentionBackend
from .sdpa import TorchSDPABackend

logger = logging.getLogger("diffusers_omni.attention")

_STATE_ATTR = "_omni_rainfusion_state"


class RainFusionState:
    """Per model: the published geometry (and its plan) and the denoise step, counted by the model's forwards."""

    def __init__(self) -> None:
        self.plan: RainFusionPlan | None = None
        self.step = -1
        self.handle = None

    def publish(self, geometry: VideoGeometry | None) -> None:
        self.plan = plan_geometry(geometry) if geometry is not None else None


def rainfusion_state(model: torch.nn.Module) -> RainFusionState:
    state = getattr(model, _STATE_ATTR, None)
    if state is None:
        state = RainFusionState()

        def count_step(module, args):
            state.step += 1

        state.handle = model.register_forward_pre_hook(count_step)
        setattr(model, _STATE_ATTR, state)
        remember_state(model, _STATE_ATTR)
    return state


def publish_video_geometry(model: torch.nn.Module, geometry: VideoGeometry | None, step: int | None = None) -> None:
    """Models (or pipelines) call this before a forward: the prefix length and the latent grid ``(t, h, w)``.
    ``step`` sets the denoise step explicitly (otherwise each transformer forward counts one step)."""
    state = rainfusion_state(model)
    state.publish(geometry)
    if step is not None:
        state.step = step - 1  # the pre-hook adds one at the next forward


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


class RainFusionBackend(AttentionBackend):
    name: ClassVar[str] = "RAINFUSION_ATTN"
    devices = frozenset({"npu"})
    dtypes = frozenset({torch.float16, torch.bfloat16})
    supports_mask = False
    supports_gqa = False
    supports_backward = False
    deterministic = False
    lossy = True  # block-sparse
    packages = (("mindiesd", "Huawei MindIE-SD (a release implementing protected video tails for rf_v2)"),)

    def __init__(self, spec=None) -> None:
        super().__init__(spec)
        block = spec.block_sparse if spec is not None else None
        from ...config.attention import BlockSparseSpec

        self.block_sparse = block or BlockSparseSpec()
        self.dense = TorchSDPABackend()
        self.state: RainFusionState | None = None
        self.site_name: str | None = None
        self.layer: int | None = None
        self._logged: set[str] = set()

    def bind_site(self, model, site, resolution) -> "RainFusionBackend":
        bound = copy.copy(self)
        bound.state = rainfusion_state(model)
        bound.site_name = site.name
        bound.layer = layer_index(site.name)
        bound._logged = set()
        return bound

    def why_dense(self, query: torch.Tensor, key: torch.Tensor) -> str | None:
        if self.block_sparse.sparsity == 0:
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

    def __call__(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        reason = self.why_dense(query, key)
        if reason is not None:
            kind = reason.split(" ")[0] + reason.split(" ")[1]
            if kind not in self._logged:
                self._logged.add(kind)
                logger.info("RAINFUSION_ATTN (%s): dense for this call — %s", self.site_name, reason)
            return self.dense(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
        return self._rf_v2(query, key, value, self.state.plan, scale)

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
        return {**super().describe(), "implementation": "mindiesd rf_v2 (unverified entry point)", "sparsity": self.block_sparse.sparsity}
