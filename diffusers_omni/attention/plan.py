"""``AttentionPlan``: a user's attention config, checked once against the registered kernel families.

The public entries (``apply_attention``, ``enable_omni_attention``, ``resolve``, ``explain`` and the CLI) accept
anything ``AttentionConfig.parse`` does; each parses it once and builds one plan, which everything below them
receives, and takes only a plan (``selector.require_plan``: ``plan_attention``, ``check_roles_of_plans``,
``check_per_role_keys``, ``resolve_role``, ``select_spec``):

```
AttentionConfig.parse(x)       config/attention.py     typed value, checked for shape
        │
        ▼
AttentionPlan.build(config)    attention/plan.py       names and aliases resolved, each family's option checks,
        │                                              the environment and deterministic mode read: frozen
        ▼
resolve_role(plan, role, ...)  attention/selector.py   per role: backend, options, shape routes, trace
```

A plan is immutable and holds no state of a model; the per-role ``Resolution`` values the selector derives from it
for a model's call sites are immutable too. Building one has no side effect.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, replace
from typing import Any

from ..config.attention import AUTO, AttentionConfig, AttentionSpec
from .platform import Platform, current_platform
from .registry import (
    canonical_backend_name,
    check_config,
    check_diffusers_env_name,
    is_registered,
    registered_backend_names,
    registry_generation,
)

logger = logging.getLogger("diffusers_omni.attention")

ENV_BACKEND = "DIFFUSION_ATTENTION_BACKEND"
# Diffusers' own default-backend variable (``diffusers.utils.constants``), honoured when ours is unset.
ENV_DIFFUSERS_BACKEND = "DIFFUSERS_ATTN_BACKEND"
ENV_DETERMINISTIC = "DIFFUSERS_OMNI_DETERMINISTIC"

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")

_env_logged: set[str] = set()


def environment_backend() -> tuple[AttentionSpec | None, str]:
    """The default backend the environment asks for, and a label for where it came from (``None, ""``: neither
    variable is set).

    ``DIFFUSION_ATTENTION_BACKEND`` (ours: our names, aliases or ``auto``) wins; otherwise ``DIFFUSERS_ATTN_BACKEND``
    (Diffusers' names, spelled exactly as Diffusers takes them) is mapped through the families' aliases. A value
    Diffusers itself would refuse is refused whenever it is set, even when ours wins: Diffusers raises on it at
    import. Raises ``ValueError`` in one line naming the variable, the value and the allowed names; the CLI checks
    this before it imports Diffusers.
    """
    theirs = os.environ.get(ENV_DIFFUSERS_BACKEND)
    entry = check_diffusers_env_name(theirs, ENV_DIFFUSERS_BACKEND) if theirs is not None else None
    ours = os.environ.get(ENV_BACKEND, "").strip()
    if ours:
        name = canonical_backend_name(ours, field_name=f"environment variable {ENV_BACKEND}")
        return AttentionSpec(backend=name), f"env {ENV_BACKEND}"
    if entry is None:
        return None, ""
    if entry.omni is None or not is_registered(entry.omni):
        raise ValueError(
            f"environment variable {ENV_DIFFUSERS_BACKEND}={theirs!r} is a Diffusers attention backend with no "
            f"equivalent here ({entry.note}); set {ENV_BACKEND} (it takes precedence) to one of "
            f"{', '.join(registered_backend_names())} or {AUTO!r}, or unset {ENV_DIFFUSERS_BACKEND}"
        )
    if theirs not in _env_logged:  # once per value, not once per role
        _env_logged.add(theirs)
        logger.info("environment variable %s=%r is Diffusers' name for %s (%s)", ENV_DIFFUSERS_BACKEND, theirs,
                    entry.omni, entry.note)
    return AttentionSpec(backend=entry.omni), f"environment variable {ENV_DIFFUSERS_BACKEND}"


def deterministic_requested(config: Any = None) -> tuple[bool, str]:
    """Whether deterministic mode is on for ``config`` (anything ``AttentionConfig.parse`` accepts), and where that
    came from (``config`` / ``env ...`` / ``""``).

    ``AttentionConfig.deterministic`` wins when set; otherwise ``DIFFUSERS_OMNI_DETERMINISTIC`` (1/true/yes/on or
    0/false/no/off) decides. A plan holds what it read when it was built (``AttentionPlan.deterministic``).
    """
    return _deterministic(AttentionConfig.parse(config))


def _deterministic(config: AttentionConfig) -> tuple[bool, str]:
    if config.deterministic is not None:
        return config.deterministic, "config"
    raw = os.environ.get(ENV_DETERMINISTIC, "").strip().lower()
    if raw in _TRUE:
        return True, f"env {ENV_DETERMINISTIC}"
    if raw in _FALSE:
        return False, ""
    raise ValueError(
        f"environment variable {ENV_DETERMINISTIC}={os.environ[ENV_DETERMINISTIC]!r} is not a boolean; allowed: "
        f"{', '.join(_TRUE)} or {', '.join(v for v in _FALSE if v)}"
    )


def clear_logged() -> None:
    """Forget which environment mappings were logged (``selector.clear_resolution_cache`` calls it)."""
    _env_logged.clear()


@dataclass(frozen=True)
class AttentionPlan:
    """A checked attention config and everything read with it, once, for one enable call.

    Attributes:
        config (`AttentionConfig`): the user's config with canonical backend names (Diffusers' names and other
            aliases resolved) and every option checked by the family of its backend.
        platform (`Platform`): where the roles resolve (``current_platform()`` unless given).
        deterministic (`bool`), deterministic_source (`str`): deterministic mode and where it was asked for.
        environment (`AttentionSpec` or `None`), environment_source (`str`): the default the environment variables
            ask for, read when the config has no ``default`` (roles without a ``per_role`` entry fall to it).
        generation (`int`): the registry generation the names were checked against.

    Build one with ``AttentionPlan.build``; the selector resolves each role from it (``resolve_role(plan, role,
    category, call)``: backend, options, shape routes and the selection trace).
    """

    config: AttentionConfig
    platform: Platform
    deterministic: bool = False
    deterministic_source: str = ""
    environment: AttentionSpec | None = None
    environment_source: str = ""
    generation: int = 0

    @classmethod
    def build(cls, config: Any = None, platform: Platform | None = None) -> "AttentionPlan":
        """Parse ``config`` (anything ``AttentionConfig.parse`` accepts) and check it against the registered
        families: backend names and aliases, and each backend's options (refused when it does not read them,
        values checked when it does). Raises ``ValueError``/``TypeError`` naming the field, the value and what is
        allowed. A plan given as ``config`` is returned as is (moved to ``platform`` when one is given).

        Example:
        ```py
        >>> plan = AttentionPlan.build({"default": "_flash_3", "per_role": {"cross": "native"}})
        >>> plan.config.default.backend, plan.config.per_role["cross"].backend
        ('FLASH_ATTN', 'TORCH_SDPA')
        ```
        """
        if isinstance(config, AttentionPlan):
            return config if platform is None or platform == config.platform else replace(config, platform=platform)
        checked = check_config(AttentionConfig.parse(config))
        deterministic, deterministic_source = _deterministic(checked)
        environment, environment_source = environment_backend() if checked.default is None else (None, "")
        return cls(
            config=checked,
            platform=platform or current_platform(),
            deterministic=deterministic,
            deterministic_source=deterministic_source,
            environment=environment,
            environment_source=environment_source,
            generation=registry_generation(),
        )

    def spec_for(self, role: str, category: str) -> tuple[AttentionSpec | None, str]:
        """The spec for a role and a label for where it came from (``None`` → platform default): ``per_role[role]``
        → ``per_role[category]`` → ``default`` → the environment."""
        per_role = self.config.per_role
        if role in per_role:
            return per_role[role], f"per_role[{role!r}]"
        if category in per_role:
            return per_role[category], f"per_role[{category!r}]"
        if self.config.default is not None:
            return self.config.default, "default"
        return self.environment, self.environment_source
