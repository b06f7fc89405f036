"""Shape-aware routing for platform-default roles, from a data table derived from committed benchmark results.

The KV length of a call is only known at call time, so a ``ShapeRouter`` holds the candidate backends that can
run a role and picks one per call signature ``(family, q bucket, kv bucket, head_dim, masked)``: the first call
with a signature reads ``routing_table.json`` (written by ``benchmarks/derive_routing.py``), later calls are a dict
lookup. Signatures the table does not cover go to the first candidate (the routing list's own choice).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch

TABLE_PATH = Path(__file__).with_name("routing_table.json")
# Upper bounds of the sequence-length buckets (tokens); longer sequences fall in the last bucket.
BUCKET_EDGES = (1024, 8192, 40960)


def length_bucket(n: int) -> int:
    for i, edge in enumerate(BUCKET_EDGES):
        if n <= edge:
            return i
    return len(BUCKET_EDGES)


def rule_key(q_len: int, kv_len: int, head_dim: int, masked: bool) -> str:
    return f"q{length_bucket(q_len)}/kv{length_bucket(kv_len)}/d{head_dim}/{'masked' if masked else 'dense'}"


@functools.lru_cache(maxsize=4)
def load_table(path: str | None = None) -> dict:
    return json.loads(Path(path or TABLE_PATH).read_text())


def table_choice(table: dict, family: str, q_len: int, kv_len: int, head_dim: int, masked: bool,
                 candidates) -> str | None:
    """The table's ranking for this shape class, filtered to ``candidates``; ``None`` when the class is not covered."""
    rules = table.get("families", {}).get(family, {})
    ranking = rules.get(rule_key(q_len, kv_len, head_dim, masked), {}).get("ranking")
    if not ranking:
        return None
    return next((name for name in ranking if name in candidates), None)


class ShapeRouter:
    """A backend-like callable choosing among ``candidates`` (name → backend instance, in routing order) per call."""

    def __init__(self, family: str, candidates: dict, table: dict | None = None) -> None:
        if not candidates:
            raise ValueError("ShapeRouter needs at least one candidate backend")
        self.family = family
        self.candidates = dict(candidates)
        self.table = table if table is not None else load_table()
        self._chosen: dict[tuple, object] = {}
        self.supports_mask = all(getattr(b, "supports_mask", True) for b in self.candidates.values())
        self.supports_backward = all(getattr(b, "supports_backward", True) for b in self.candidates.values())

    def choose(self, q_len: int, kv_len: int, head_dim: int, masked: bool) -> str:
        name = table_choice(self.table, self.family, q_len, kv_len, head_dim, masked, self.candidates)
        return name or next(iter(self.candidates))

    def __call__(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        signature = (query.shape[1], key.shape[1], query.shape[-1], attn_mask is not None)
        backend = self._chosen.get(signature)
        if backend is None:
            backend = self.candidates[self.choose(*signature)]
            if not torch.compiler.is_compiling():
                self._chosen[signature] = backend
        return backend(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)

    def describe(self) -> dict:
        return {
            "backend": "ROUTER",
            "implementation": f"diffusers_omni.attention.routing.ShapeRouter({', '.join(self.candidates)})",
            "chosen": {str(k): type(v).__name__ for k, v in self._chosen.items()},
        }
