"""Record the transformer inputs of a real pipeline call, to replay them under other attention configurations."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

RECORD_FORMAT = "diffusers-omni.transformer-inputs/1"


def map_tensors(value: Any, fn) -> Any:
    """Apply ``fn`` to every tensor inside nested tuples, lists and dicts."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, tuple):
        return tuple(map_tensors(v, fn) for v in value)
    if isinstance(value, list):
        return [map_tensors(v, fn) for v in value]
    if isinstance(value, dict):
        return {k: map_tensors(v, fn) for k, v in value.items()}
    return value


@dataclass
class RecordedInputs:
    """Positional and keyword arguments of one transformer call, detached and cloned.

    Args:
        args (`tuple`): positional arguments of the call.
        kwargs (`dict`): keyword arguments of the call (``hidden_states``, ``timestep``, ...).
        model_class (`str`): class name of the transformer they were recorded from.
        meta (`dict`): free-form provenance (pipeline class, call index, call kwargs that are plain values).
    """

    args: tuple
    kwargs: dict[str, Any]
    model_class: str = ""
    meta: dict[str, Any] = field(default_factory=dict)

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> "RecordedInputs":
        """A copy on ``device`` with floating tensors cast to ``dtype`` (integer ids and masks keep theirs)."""

        def move(t: torch.Tensor) -> torch.Tensor:
            if dtype is not None and t.is_floating_point():
                t = t.to(dtype)
            return t.to(device) if device is not None else t

        return RecordedInputs(map_tensors(self.args, move), map_tensors(self.kwargs, move), self.model_class, dict(self.meta))

    def save(self, path: str | Path) -> Path:
        """``torch.save`` the inputs (moved to CPU) with their provenance."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        cpu = self.to("cpu")
        torch.save(
            {"format": RECORD_FORMAT, "args": cpu.args, "kwargs": cpu.kwargs, "model_class": self.model_class, "meta": self.meta},
            path,
        )
        return path

    @classmethod
    def load(cls, path: str | Path) -> "RecordedInputs":
        """Load inputs written by ``save`` (tensors, plain values and containers only: ``weights_only`` loading)."""
        data = torch.load(path, map_location="cpu", weights_only=True)
        if not isinstance(data, dict) or data.get("format") != RECORD_FORMAT:
            raise ValueError(f"{path} holds no recorded transformer inputs (format {RECORD_FORMAT!r})")
        return cls(tuple(data["args"]), dict(data["kwargs"]), data.get("model_class", ""), dict(data.get("meta", {})))


class _Recorded(Exception):
    """Raised from the pre-hook to stop the pipeline once the inputs are captured."""


def record_transformer_inputs(
    pipe: Any,
    *,
    component: str = "transformer",
    call_index: int = 0,
    stop: bool = True,
    **call_kwargs: Any,
) -> RecordedInputs:
    """Run ``pipe(**call_kwargs)`` and capture the arguments of its DiT's ``call_index``-th forward.

    Args:
        pipe: a Diffusers (or Omni) pipeline.
        component (`str`, defaults to ``"transformer"``): the DiT attribute of the pipeline (``"transformer_2"`` for
            Wan 2.2's low-noise expert).
        call_index (`int`, defaults to 0): which forward to capture; 0 is the first denoising step (with classifier
            free guidance the conditional and unconditional passes count separately).
        stop (`bool`, defaults to `True`): abort the pipeline right after the capture instead of finishing it.
        call_kwargs: the pipeline call (``prompt``, ``num_inference_steps``, ``generator``, ...).

    Returns:
        The captured ``RecordedInputs`` (tensors detached and cloned, on the device the pipeline ran on).

    Example:
    ```py
    >>> inputs = record_transformer_inputs(pipe, prompt="a red fox", num_inference_steps=4, height=512, width=512)
    >>> inputs.save("inputs.pt")
    ```
    """
    model = getattr(pipe, component, None)
    if not isinstance(model, nn.Module):
        raise ValueError(f"{type(pipe).__name__} has no transformer component {component!r}")
    if isinstance(call_index, bool) or not isinstance(call_index, int) or call_index < 0:
        raise ValueError(f"call_index={call_index!r} must be an int >= 0")
    seen = {"calls": 0}
    captured: list[RecordedInputs] = []

    def hook(module, args, kwargs):
        index = seen["calls"]
        seen["calls"] += 1
        if index != call_index:
            return None
        clone = lambda t: t.detach().clone()  # noqa: E731
        plain = {k: v for k, v in call_kwargs.items() if isinstance(v, (str, int, float, bool)) or v is None}
        captured.append(
            RecordedInputs(
                map_tensors(tuple(args), clone),
                map_tensors(dict(kwargs), clone),
                type(module).__name__,
                {"pipeline": type(pipe).__name__, "component": component, "call_index": call_index, "call": plain},
            )
        )
        if stop:
            raise _Recorded
        return None

    handle = model.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        pipe(**call_kwargs)
    except _Recorded:
        pass
    finally:
        handle.remove()
    if not captured:
        raise RuntimeError(
            f"{type(pipe).__name__}.{component} was called {seen['calls']} time(s); call_index={call_index} was never "
            "reached"
        )
    return captured[0]
