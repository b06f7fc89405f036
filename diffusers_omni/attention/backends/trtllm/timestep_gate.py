"""Normalised denoising timestep of a DiT, read from the DiT's own ``timestep`` input.

A forward pre-hook on the transformer records ``t`` in ``[0, 1]`` (1 = pure noise) before each step; attention
backends that gate on it (Skip-Softmax's ``disabled_until_timestep``) read ``TimestepState.t``. Normalisation is
per model: DiTs that receive the scheduler's 0–1000 timesteps (Wan, SD3, HunyuanVideo, …) divide by 1000; DiTs whose
pipelines already pass ``t / 1000`` (FLUX) take it as is. ``register_timestep_normalizer`` adds or replaces one.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch

from ...model_state import remember_state

logger = logging.getLogger("diffusers_omni.attention")

Normalizer = Callable[[float], float]


def _per_mille(t: float) -> float:
    return t / 1000.0


def _identity(t: float) -> float:
    return t


def _auto(t: float) -> float:
    return t if t <= 1.0 else t / 1000.0


# Keyed by TransformerDeclaration.name.
TIMESTEP_NORMALIZERS: dict[str, Normalizer] = {
    "wan": _per_mille,
    "sd3": _per_mille,
    "hunyuanvideo15": _per_mille,
    "flux": _identity,
    "flux2": _identity,
}


def register_timestep_normalizer(model_name: str, normalizer: Normalizer) -> None:
    TIMESTEP_NORMALIZERS[model_name] = normalizer


def normalizer_for(model_name: str) -> Normalizer:
    """The model's normaliser; models without one use ``t`` when ``t <= 1`` and ``t / 1000`` otherwise."""
    return TIMESTEP_NORMALIZERS.get(model_name, _auto)


class TimestepState:
    """The last normalised timestep seen by one model (``None`` until its first forward with a timestep)."""

    __slots__ = ("t", "normalizer", "_warned", "handle")

    def __init__(self, normalizer: Normalizer) -> None:
        self.t: float | None = None
        self.normalizer = normalizer
        self._warned = False
        self.handle = None

    def observe(self, timestep: Any) -> None:
        if timestep is None:
            self.t = None
            return
        if isinstance(timestep, torch.Tensor):
            if timestep.numel() == 0:
                self.t = None
                return
            # Batched timesteps are equal within a step for every supported pipeline; take the first.
            value = float(timestep.reshape(-1)[0].item())
        else:
            value = float(timestep)
        self.t = min(max(self.normalizer(value), 0.0), 1.0)

    def allows_sparse(self, disabled_until: float, who: str) -> bool:
        """True once ``t <= disabled_until``. With no timestep seen, stays dense and warns once."""
        if self.t is None:
            if not self._warned:
                self._warned = True
                logger.warning(
                    "%s: no timestep seen from the transformer's forward; keeping attention dense "
                    "(disabled_until_timestep=%s needs the DiT's timestep input)",
                    who,
                    disabled_until,
                )
            return False
        return self.t <= disabled_until


_STATE_ATTR = "_omni_timestep_state"


def timestep_state(model: torch.nn.Module, model_name: str) -> TimestepState:
    """The model's ``TimestepState``, installing its forward pre-hook on first use."""
    state = getattr(model, _STATE_ATTR, None)
    if state is not None:
        return state
    state = TimestepState(normalizer_for(model_name))

    def hook(module, args, kwargs):
        if torch.compiler.is_compiling():
            return None
        # Diffusers pipelines pass ``timestep=`` by keyword; positional order differs per DiT, so it is not guessed.
        state.observe(kwargs.get("timestep"))
        return None

    state.handle = model.register_forward_pre_hook(hook, with_kwargs=True)
    setattr(model, _STATE_ATTR, state)
    remember_state(model, _STATE_ATTR)
    return state
