"""RainFusion geometry planner: which rows of a ``[prefix | video]`` sequence run block-sparse. Pure Python.

MindIE-SD's rf_v2 works on 128-row blocks and never pads (it takes no mask for padded keys). Given the video latent
grid ``t × h × w`` (rows in ``(t, h, w)`` order after the prefix):

1. The first frame (``h·w`` rows) stays in natural order at the head of the video; its blocks are always kept.
2. Frames ``1 … t-1`` are rearranged into 8×8 spatial tiles so that a 128-row block is a spatial neighbourhood.
   Rows outside the 8-aligned ``(h − h mod 8) × (w − w mod 8)`` window cannot form a tile: these
   ``(t − 1) · (h·w − h₈·w₈)`` rows form the *spatial residue*, moved to the end.
3. What remains (``N − spatial``) is cut to a multiple of 128: its last ``(N − spatial) mod 128`` rows are the
   *temporal residue*.
4. Spatial + temporal residue are *promoted* into the always-kept segment (visible to every query and key); the
   remaining ``N − promoted`` rows, a whole number of 128-row blocks, run sparse.

MiniMax-H3 at 1344×768, grid (62, 24, 42): 62,496 rows; spatial residue 61 · (1008 − 24·40) = 2,928; 59,568 mod 128 =
48; promoted 2,976; sparse 59,520 = 465 × 128.

A call runs dense (delegated) when the video has fewer than ``MIN_VIDEO_BLOCKS`` sparse blocks, during warm-up steps
(``start_step``), on ``skip_layers``, or without published geometry.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK = 128
TILE = 8
MIN_VIDEO_BLOCKS = 32


@dataclass(frozen=True)
class VideoGeometry:
    """The video layout a model publishes: ``prefix_len`` rows (text, conditions, audio) then a ``t×h×w`` latent grid."""

    prefix_len: int
    grid: tuple[int, int, int]

    def __post_init__(self) -> None:
        if isinstance(self.prefix_len, bool) or not isinstance(self.prefix_len, int) or self.prefix_len < 0:
            raise ValueError(f"VideoGeometry.prefix_len={self.prefix_len!r} must be an int >= 0")
        grid = tuple(self.grid)
        if len(grid) != 3 or any(isinstance(x, bool) or not isinstance(x, int) or x <= 0 for x in grid):
            raise ValueError(f"VideoGeometry.grid={self.grid!r} must be three positive ints (t, h, w)")
        object.__setattr__(self, "grid", grid)

    @property
    def video_rows(self) -> int:
        t, h, w = self.grid
        return t * h * w


@dataclass(frozen=True)
class RainFusionPlan:
    geometry: VideoGeometry
    video_rows: int
    first_frame_rows: int
    spatial_residue_rows: int
    temporal_residue_rows: int
    promoted_rows: int
    sparse_rows: int
    sparse_blocks: int
    first_frame_blocks: int
    dense_reason: str | None = None

    @property
    def kept_rows(self) -> int:
        """Rows of the always-kept segment: the prefix plus the promoted video rows."""
        return self.geometry.prefix_len + self.promoted_rows

    @property
    def runs_sparse(self) -> bool:
        return self.dense_reason is None


def plan_geometry(geometry: VideoGeometry) -> RainFusionPlan:
    t, h, w = geometry.grid
    frame = h * w
    rows = t * frame
    aligned_frame = (h - h % TILE) * (w - w % TILE)
    spatial = (t - 1) * (frame - aligned_frame)
    temporal = (rows - spatial) % BLOCK
    promoted = spatial + temporal
    sparse_rows = rows - promoted
    blocks = sparse_rows // BLOCK
    first_blocks = min(-(-frame // BLOCK), blocks)
    reason = None
    if blocks < MIN_VIDEO_BLOCKS:
        reason = f"the video has {blocks} sparse 128-row blocks; RainFusion needs at least {MIN_VIDEO_BLOCKS}"
    return RainFusionPlan(geometry, rows, frame, spatial, temporal, promoted, sparse_rows, blocks, first_blocks, reason)


def dense_reason(
    plan: RainFusionPlan | None, *, step: int | None, start_step: int, layer: int | None, skip_layers
) -> str | None:
    """Why this call runs dense (``None``: it runs sparse)."""
    if plan is None:
        return "the model published no video geometry"
    if step is not None and step < start_step:
        return f"denoise step {step} < block_sparse.start_step={start_step}"
    if layer is not None and skip_layers and layer in skip_layers:
        return f"layer {layer} is in block_sparse.skip_layers"
    return plan.dense_reason


def video_order(plan: RainFusionPlan) -> torch.Tensor:
    """Row order of the video segment for the kernel: ``[sparse rows | promoted rows]`` as indices into the
    ``(t, h, w)``-ordered video rows. Sparse rows: first frame, then frames ``1…t-1`` tile by tile (8×8 tiles
    row-major within a frame), less the temporal residue; promoted rows: temporal residue, then spatial residue."""
    t, h, w = plan.geometry.grid
    idx = torch.arange(plan.video_rows).reshape(t, h, w)
    first = idx[0].reshape(-1)
    h8, w8 = h - h % TILE, w - w % TILE
    rest = idx[1:]
    aligned = (
        rest[:, :h8, :w8].reshape(t - 1, h8 // TILE, TILE, w8 // TILE, TILE).permute(0, 1, 3, 2, 4).reshape(-1)
    )
    keep = torch.ones(t - 1, h, w, dtype=torch.bool)
    keep[:, :h8, :w8] = False
    residue = rest[keep]
    body = torch.cat([first, aligned])
    cut = max(body.numel() - plan.temporal_residue_rows, 0)
    return torch.cat([body[:cut], body[cut:], residue])
