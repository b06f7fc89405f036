"""Per-model state that backends attach when they bind to a model (forward pre-hooks and what they record).

Each piece of state lives in a model attribute and carries the ``handle`` of its hook; ``remove_attention``
removes them all, so a model leaves omni attention exactly as it came.
"""

from __future__ import annotations

import torch.nn as nn

_ATTACHED = "_omni_attached_states"


def remember_state(model: nn.Module, attr: str) -> None:
    """Record that ``model.<attr>`` holds backend state whose ``handle`` must be removed with omni attention."""
    attached = model.__dict__.setdefault(_ATTACHED, set())
    attached.add(attr)


def remove_states(model: nn.Module) -> None:
    for attr in sorted(model.__dict__.pop(_ATTACHED, set())):
        state = model.__dict__.pop(attr, None)
        handle = getattr(state, "handle", None)
        if handle is not None:
            handle.remove()
