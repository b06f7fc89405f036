"""Install omni attention processors on a model and take them off again.

This sits above both the attention layer (which resolves a backend per role) and the model declarations (which say
where a model's attention sites and roles are): see docs/design/layers.md.

Installing is all or nothing across every model of one call (the DiTs of a pipeline): every role is resolved and
every backend, site binding and processor built before any processor changes; each module is snapshotted in one
``utils.journal.Journal`` before its first change, and any failure restores all of them exactly (processors, hooks,
attributes), newest first.
"""

from __future__ import annotations

import dataclasses
import json
import functools
import logging
import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from .attention.backends.base import AttentionBackend, AttentionCall
from .attention.model_state import remove_states
from .attention.platform import Platform, current_platform
from .attention.processors import MaskPolicy, RoleAttention, is_omni_processor
from .attention.backends.flash.backend import FlashAttentionBackend, load_kernels, usable_implementations
from .attention.plan import AttentionPlan
from .attention.registry import get_backend_class, is_registered, registered_backend_names
from .attention.routing import ShapeRouter, active_table, load_table, lossy_key, measured_error, rule_key
from .attention.selector import (
    Resolution,
    check_per_role_keys,
    clear_resolution_cache,
    require_plan,
    resolve_role,
)
from .attention.tuning import CallShape, build_table, measure, near_ties, save_table, use_tuned_table
from .config.attention import AttentionConfig
from .models.base import check_layer_counts, declaration_for, supported_transformers
from .utils.journal import Journal
from .utils.modules import model_dtype

logger = logging.getLogger("diffusers_omni.attention")

_STATE_ATTR = "_omni_attention"


class UnsupportedModelError(TypeError):
    """The model has no diffusers-omni declaration."""


@dataclass
class _InstalledAttention:
    config: AttentionConfig
    originals: dict[str, Any]
    report: list[dict]
    installed: list[tuple[nn.Module, Any]]
    guard: Any = None

    def __getstate__(self) -> dict:
        # A pickled (or deep-copied) model holds the stock processors its routed ones stood for (see
        # RoutedProcessor.__reduce_ex__): no processor is recorded as installed, so the copy's forward guard
        # (``_keep_applied``) installs this config again before its first forward.
        state = dict(self.__dict__)
        state["installed"] = [(module, None) for module, _ in self.installed]
        return state


def _call_device_type(model: nn.Module, platform: Platform) -> str:
    for tensor in model.parameters():
        if tensor.device.type not in ("cpu", "meta"):
            return tensor.device.type
        break
    # Models are usually built or loaded on the host and moved to the accelerator afterwards.
    return platform.device_type


def _declaration(model: nn.Module):
    declaration = declaration_for(model)
    if declaration is None:
        raise UnsupportedModelError(
            f"{type(model).__name__} has no diffusers-omni attention declaration; supported transformers: "
            f"{', '.join(supported_transformers())}"
        )
    check_layer_counts(model, type(model).__name__)
    return declaration


def plan_attention(model: nn.Module, plan: AttentionPlan, *, check_roles: bool = True):
    """Resolve every attention role of ``model`` from ``plan`` without changing it.

    ``plan``: the ``AttentionPlan`` the entry point built (``apply_attention_all``, ``enable_omni_attention``, the
    CLI parse the user's config once into one and pass it down); anything else raises ``TypeError``.

    Returns ``(declaration, [(site, {role: Resolution})])``: per role the backend, its options, its shape routes and
    the selection trace. Raises when an explicit backend cannot run a role, and (with ``check_roles``) when a
    ``per_role`` key names no role or category of the model.
    """
    require_plan(plan, "plan_attention")
    declaration = _declaration(model)
    device_type = _call_device_type(model, plan.platform)
    dtype = model_dtype(model)
    deterministic = plan.deterministic
    sites = []
    for site in declaration.find_sites(model):
        site = dataclasses.replace(site, model_name=declaration.name)
        resolutions = {}
        for role in site.roles:
            call = AttentionCall(
                device_type=device_type,
                dtype=dtype,
                head_dim=site.head_dim,
                has_mask=role.masked,
                gqa=role.gqa,
                mask_free_path=declaration.mask_free,
                deterministic=deterministic,
            )
            resolutions[role.role] = resolve_role(plan, role.role, role.category, call)
        sites.append((site, resolutions))
    if check_roles:
        check_roles_of_plans(plan, [(model, declaration, sites)])
    return declaration, sites


def check_roles_of_plans(plan: AttentionPlan, planned: list[tuple[nn.Module, Any, list]], seen_roles=()) -> None:
    """Check the ``per_role`` keys of ``plan``'s config against the roles and categories of the planned models
    together (declared by their architectures, or met in their plans or in ``seen_roles``: ``(role, category)`` pairs a
    pipeline plans beyond the installed processors, e.g. PAG's)."""
    declared, present = set(), set(seen_roles)
    for _model, declaration, sites in planned:
        declared.update((role.role, role.category) for role in declaration.roles)
        present.update((r.role, r.category) for _site, resolutions in sites for r in resolutions.values())
    owner = " and ".join(dict.fromkeys(type(model).__name__ for model, _, _ in planned))
    check_per_role_keys(plan, declared, present, owner)


def _transaction(journal: Journal, steps):
    """Run ``steps()``; on any failure (KeyboardInterrupt included) restore every journaled module and re-raise."""
    try:
        return steps()
    except BaseException:
        journal.rollback()
        raise


def apply_attention(model: nn.Module, config: Any = None) -> list[dict]:
    """Route every attention call of ``model`` through the backend resolved for its role.

    Args:
        model (`torch.nn.Module`): a supported Diffusers transformer (e.g. ``FluxTransformer2DModel``).
        config: anything ``AttentionConfig.parse`` accepts; ``None`` resolves every role through the
            environment variable or the platform default.

    Returns:
        The attention report: one dict per attention call site with ``module``, ``role``, ``category``,
        ``backend`` and ``source``.

    All or nothing: every role is resolved, every backend built and bound to its site and every processor made
    before any processor changes; if anything fails, the model is restored exactly (processors, hooks,
    attributes). Applying again replaces the previous omni processors.

    Example:
    ```py
    >>> from diffusers_omni import apply_attention
    >>> apply_attention(pipe.transformer, {"default": {"backend": "TORCH_SDPA"}})
    ```
    """
    return apply_attention_all([model], config)[0]


def apply_attention_all(models, config: Any = None, *, seen_roles=(), check_roles: bool = True) -> list[list[dict]]:
    """``apply_attention`` for several models (the DiTs of one pipeline, e.g. Wan 2.2's two experts) as one
    all-or-nothing step: if any model fails at any stage, every model is left exactly as it was.

    ``per_role`` keys are checked against the roles and categories of all models together (see
    ``check_roles_of_plans``). Returns one report per model.
    """
    plan = AttentionPlan.build(config)  # the one parse and check of this call; every model below gets the plan
    models = list(models)
    unique = list({id(model): model for model in models}.values())
    planned = [(model, *plan_attention(model, plan, check_roles=False)) for model in unique]
    if check_roles:
        check_roles_of_plans(plan, planned, seen_roles)
    journal = Journal()

    def steps() -> dict[int, list[dict]]:
        # Stage every model (backends, bind_site, make_processor) before installing on any.
        staged = [(model, _stage(model, declaration, sites, journal, plan.platform))
                  for model, declaration, sites in planned]
        return {id(model): _commit(model, plan.config, processors, journal) for model, processors in staged}

    reports = _transaction(journal, steps)
    _warn_lossy([entry for report in reports.values() for entry in report])
    return [[dict(entry) for entry in reports[id(model)]] for model in models]


_warned_lossy: set[str] = set()


def _warn_lossy(entries: list[dict]) -> None:
    """One warning per lossy setting and process, naming the backend, the roles and its measured error."""
    roles: dict[str, list[str]] = {}
    notes: dict[str, tuple[str, str]] = {}
    for entry in entries:
        if entry.get("lossy") and entry.get("lossy_key"):
            roles.setdefault(entry["lossy_key"], [])
            if entry["role"] not in roles[entry["lossy_key"]]:
                roles[entry["lossy_key"]].append(entry["role"])
            notes[entry["lossy_key"]] = (entry["backend"], entry["measured_error"])
    for key, role_names in roles.items():
        if key in _warned_lossy:
            continue
        _warned_lossy.add(key)
        backend, error = notes[key]
        logger.warning(
            "lossy attention: %s (%s) approximates attention for role(s) %s — %s. Compare it with an exact config "
            "on your pipeline: diffusers-omni compare --candidate '<config>'",
            key, backend, ", ".join(role_names), error,
        )


def _stage(model: nn.Module, declaration, plan, journal: Journal, platform: Platform) -> dict[str, tuple]:
    """Build the processors of ``model`` without installing them, for ``platform`` (the plan's: shape routes pick
    among its family's kernels). ``bind_site`` may attach state to the model (attributes, forward pre-hooks): the
    model and each site module are journaled before it runs."""
    journal.snapshot(model)
    backends: dict[tuple, AttentionBackend] = {}
    mask_policy = MaskPolicy()
    processors = {}
    for site, resolutions in plan:
        journal.snapshot(site.module)
        attend = {}
        for role, resolution in resolutions.items():
            backend = _instance(backends, resolution.backend, resolution.spec, resolution.call.deterministic)
            if resolution.shape_routed:
                names = (resolution.backend, *resolution.shape_routed)
                backend = ShapeRouter(
                    platform.family,
                    {n: _instance(backends, n, resolution.spec, resolution.call.deterministic) for n in names},
                )
            # Optional enable-time hook: a backend may specialise itself per site and role (calibration, layer
            # exemptions, per-role guards) or raise.
            bind_site = getattr(backend, "bind_site", None)
            if bind_site is not None:
                backend = bind_site(model, site, resolution)
            # Block-sparse backends read the video layout the declaration derives from each forward's inputs.
            attach = getattr(backend, "attach_geometry_source", None)
            if attach is not None and getattr(declaration, "video_geometry", None) is not None:
                attach(model, declaration.video_geometry)
            attend[role] = RoleAttention(resolution, backend, mask_policy)
        current = site.module.processor
        original = current.original if is_omni_processor(current) else current
        processors[site.name] = (site, declaration.make_processor(site, original, attend), original)
    return processors


def _commit(model: nn.Module, config: AttentionConfig, processors: dict[str, tuple], journal: Journal) -> list[dict]:
    previous = getattr(model, _STATE_ATTR, None)
    report, installed, originals = [], [], {}
    for name, (site, processor, original) in processors.items():
        journal.snapshot(site.module)
        originals[name] = original
        site.module.set_processor(processor)
        installed.append((site.module, processor))
        for role in site.roles:
            attend = processor.attend[role.role]
            report.append(_report_entry(name, role, attend.resolution, attend.backend))
    journal.snapshot(model)
    if previous is not None and previous.guard is not None:
        previous.guard.remove()
    state = _InstalledAttention(config, originals, report, installed)
    state.guard = model.register_forward_pre_hook(_keep_applied)
    setattr(model, _STATE_ATTR, state)
    _route_set_default_attn_processor(model)
    return report


def _route_set_default_attn_processor(model: nn.Module) -> None:
    """While omni attention is applied, ``model.set_default_attn_processor()`` (where the model has one) first
    removes omni attention, then runs Diffusers' own method: the model ends on Diffusers' default processors, as it
    would without diffusers-omni. (Diffusers' method accepts only processor classes it lists, so it would refuse
    the omni processors.)"""
    stock = getattr(type(model), "set_default_attn_processor", None)
    if stock is None or "set_default_attn_processor" in model.__dict__:
        return

    # A partial of module-level functions, not a closure: the model stays picklable (and deep-copyable).
    set_default_attn_processor = functools.partial(_set_default_attn_processor, model, stock)
    set_default_attn_processor.__doc__ = stock.__doc__
    model.__dict__["set_default_attn_processor"] = set_default_attn_processor


def _set_default_attn_processor(model: nn.Module, stock: Any) -> None:
    remove_attention(model)
    logger.warning(
        "%s.set_default_attn_processor() removed omni attention and set Diffusers' default processors; call "
        "enable_omni_attention() (or apply_attention) to route attention through omni backends again",
        type(model).__name__,
    )
    stock(model)


def _instance(backends: dict, name: str, spec, deterministic: bool) -> AttentionBackend:
    """One backend object per (name, spec, deterministic) for the whole model, shared by its roles."""
    key = (name, spec, deterministic)
    if key not in backends:
        backends[key] = get_backend_class(name)(spec)
        if deterministic:
            backends[key].enable_deterministic()
    return backends[key]


def _keep_applied(model: nn.Module, args) -> None:
    """Re-apply omni attention when Diffusers swapped processors since the last call (IP-adapter or LoRA
    loading, PAG, …); raises naming the module when the new processor cannot be replaced."""
    if torch.compiler.is_compiling():
        return
    state = getattr(model, _STATE_ATTR, None)
    if state is None:
        return
    for module, processor in state.installed:
        if module.processor is not processor:
            break
    else:
        return
    if all(processor is None for _, processor in state.installed):  # a pickled or deep-copied model
        logger.debug("%s: installing omni attention on a copied model", type(model).__name__)
        reapply_attention(model)
        return
    swapped = [
        f"{name}: {type(module.processor).__name__}"
        for name, module in model.named_modules()
        if name in state.originals and not is_omni_processor(getattr(module, "processor", None))
    ]
    logger.info("Diffusers replaced attention processors (%s); re-applying omni attention", ", ".join(swapped[:3]))
    reapply_attention(model)


def reapply_attention(model: nn.Module) -> list[dict]:
    """Install the config already applied to ``model`` again (after Diffusers swapped processors), all or nothing.
    Its ``per_role`` keys were checked when it was applied and are not checked again. Returns the report."""
    state = getattr(model, _STATE_ATTR, None)
    if state is None:
        raise ValueError(f"{type(model).__name__} has no omni attention to re-apply; call apply_attention() first")
    return apply_attention_all([model], state.config, check_roles=False)[0]


def _report_entry(module: str, role, resolution: Resolution, backend=None) -> dict:
    lossy = bool(getattr(backend, "lossy", False)) if backend is not None else resolution.lossy
    # A tuned table made with allow_lossy may shape-route some calls to a lossy kernel.
    lossy_routes = [n for n in resolution.shape_routed if get_backend_class(n).is_lossy(None)]
    entry = {
        "module": module,
        "role": role.role,
        "category": role.category,
        "backend": resolution.backend,
        "shape_routed": list(resolution.shape_routed),
        "source": resolution.source,
        "lossy": lossy or bool(lossy_routes),
        "quality": resolution.quality_note() if lossy else "exact",
    }
    if lossy:
        entry.update(lossy_key=lossy_key(resolution.backend, resolution.spec),
                     measured_error=measured_error(resolution.backend, resolution.spec))
    elif lossy_routes:
        entry.update(quality=f"shape-routed to lossy {', '.join(lossy_routes)} (tuned with allow_lossy)",
                     lossy_key=lossy_key(lossy_routes[0], None), measured_error=measured_error(lossy_routes[0], None))
    return entry


def remove_attention(model: nn.Module) -> bool:
    """Put back the exact processor objects omni attention replaced. Returns False when none was installed."""
    return remove_attention_all([model])[0]


def remove_attention_all(models) -> list[bool]:
    """``remove_attention`` for several models as one step: if removal fails on any, all stay as they were."""
    journal = Journal()
    return _transaction(journal, lambda: [_remove(model, journal) for model in models])


def _remove(model: nn.Module, journal: Journal) -> bool:
    state = getattr(model, _STATE_ATTR, None)
    if state is None:
        return False
    journal.snapshot(model)
    if state.guard is not None:
        state.guard.remove()
    model.__dict__.pop("set_default_attn_processor", None)
    remove_states(model)
    modules = dict(model.named_modules())
    for name, original in state.originals.items():
        module = modules.get(name)
        if module is not None and is_omni_processor(getattr(module, "processor", None)):
            journal.snapshot(module)
            module.set_processor(original)
    delattr(model, _STATE_ATTR)
    return True


def attention_report(model: nn.Module) -> list[dict]:
    """The report of the processors currently installed on ``model`` (empty when none)."""
    state = getattr(model, _STATE_ATTR, None)
    return [dict(entry) for entry in state.report] if state else []


def is_attention_applied(model: nn.Module) -> bool:
    return getattr(model, _STATE_ATTR, None) is not None


def applied_attention_config(model: nn.Module) -> AttentionConfig | None:
    """The config omni attention was last applied to ``model`` with (``None`` when it is not applied).

    Example:
    ```py
    >>> config = applied_attention_config(pipe.transformer)
    >>> ...  # something that swaps processors
    >>> if config is not None:
    ...     apply_attention(pipe.transformer, config)
    ```
    """
    state = getattr(model, _STATE_ATTR, None)
    return state.config if state is not None else None


# Tuning on this GPU ----------------------------------------------------------------------------------------------


class _ShapeRecorder:
    """Stands in for one role's backend while the model runs once: notes each call's shape, then runs the backend."""

    def __init__(self, attention: RoleAttention, sink: dict) -> None:
        self._attention = attention
        self._backend = attention.backend
        self._sink = sink

    def __getattr__(self, name: str):
        return getattr(self._backend, name)

    def __call__(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                 enable_gqa=False):
        shape = CallShape(query.shape[0], query.shape[1], key.shape[1], query.shape[2], key.shape[2],
                          query.shape[3], str(query.dtype).replace("torch.", ""), attn_mask is not None)
        entry = self._sink.get(shape.signature)
        if entry is None:
            mask = attn_mask.detach().clone() if attn_mask is not None else None
            entry = self._sink[shape.signature] = {"shape": shape, "mask": mask, "device": query.device,
                                                   "calls": {}, "count": 0}
        entry["calls"].setdefault(self._attention.role, self._attention.resolution.call)
        entry["count"] += 1
        return self._backend(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)


@dataclass
class TuneResult:
    """What ``tune_attention`` measured and wrote."""

    path: str
    table: dict
    shapes: list[dict]
    seconds: float

    def summary(self) -> list[dict]:
        """One row per recorded call shape: the roles, the fastest backend and each candidate's time."""
        rows = []
        for measured in self.table["measured"]:
            seconds = measured["seconds"]
            if not seconds:
                continue
            fastest = min(seconds, key=seconds.get)
            rows.append({
                "shape": measured["describe"],
                "fastest": fastest,
                "times (ms)": ", ".join(f"{n} {s * 1e3:.3f}" for n, s in sorted(seconds.items(), key=lambda i: i[1])),
                "failed": "; ".join(f"{n}: {why}" for n, why in measured["failed"].items()),
            })
        return rows


def _tune_candidates(platform: Platform, allow_lossy: bool):
    """``shape -> {name: backend}``: every registered backend that can run a recorded call (Hub kernels excepted:
    they download, and are chosen explicitly), exact ones only unless ``allow_lossy``. When several FlashAttention
    implementations are installed, each is timed too (``FLASH_ATTN[FA2]``…), for the record: routing runs
    ``FLASH_ATTN`` with its best installed implementation."""
    flash_impls = usable_implementations(platform)

    def candidates(shape: CallShape, calls: dict) -> dict:
        chosen = {}
        for name in registered_backend_names():
            if name.endswith("_HUB"):
                continue
            backend_cls = get_backend_class(name)
            if backend_cls.is_lossy(None) and not allow_lossy:
                continue
            reasons = [r for call in calls.values()
                       for r in backend_cls.not_supported_reasons(dataclasses.replace(
                           call, has_mask=shape.masked, gqa=shape.kv_heads != shape.heads), platform)]
            if reasons:
                continue
            try:
                chosen[name] = backend_cls(None)
            except Exception:  # noqa: BLE001 - a backend that cannot even be built is not a candidate
                continue
        if "FLASH_ATTN" in chosen and len(flash_impls) > 1:
            for impl in flash_impls:
                chosen[f"FLASH_ATTN[{impl.label}]"] = FlashAttentionBackend(kernels=load_kernels(impl))
        return chosen

    return candidates


def tune_attention(models, run, config: Any = None, *, allow_lossy: bool = False, warmup: int = 3,
                   repeats: int = 7, verify_margin: float = 0.05, verify_rounds: int = 3,
                   progress=None) -> TuneResult:
    """Measure every candidate attention backend at the calls ``models`` really make, on this GPU, and cache the
    routing table that ranks them (``attention.tuning``); ``auto`` uses it from then on, in this process and later
    ones, until a driver, CUDA, torch or kernel package version changes.

    Args:
        models: the DiTs whose attention calls are measured (a pipeline's ``_dit_modules``).
        run (`Callable[[], Any]`): runs the models once with real inputs (e.g. one pipeline call of one step).
        config: the attention config to record the calls under (default: the one applied, else ``auto``).
        allow_lossy (`bool`, defaults to `False`): also time lossy backends (SageAttention's INT8 kernels) and let
            the table route to them. Never on by default: a faster kernel that changes the image is not a tuning.
        warmup, repeats: calls per backend before timing, and timed rounds (interleaved across backends).
        verify_margin (`float`, defaults to 0.05): where several backends time within this share of the fastest
            kernel for a shape class, each is timed inside the model too (``run`` with that class routed to it,
            ``verify_rounds`` interleaved rounds after one warm-up) and the fastest whole run decides: a kernel timed
            alone does not see what it costs next to the model's other work. 0 skips this.

    The models end as they began: omni attention re-applied with its config when it was applied (now routed by the
    new table), removed again when it was not.
    """
    models = list(models)
    previous = {id(model): applied_attention_config(model) for model in models}
    config = AttentionConfig.parse(config if config is not None else next(
        (c for c in previous.values() if c is not None), None))
    platform = current_platform()
    started = time.perf_counter()
    sink: dict = {}
    apply_attention_all(models, config)
    swapped = []
    try:
        for model in models:
            for module in model.modules():
                processor = getattr(module, "processor", None)
                for attention in getattr(processor, "attend", {}).values():
                    if attention is not None and not isinstance(attention.backend, _ShapeRecorder):
                        swapped.append((attention, attention.backend))
                        attention.backend = _ShapeRecorder(attention, sink)
        run()
    finally:
        for attention, backend in swapped:
            attention.backend = backend
    if not sink:
        _restore_after_tune(models, previous)
        raise ValueError("tune: the models made no attention call through omni attention while `run` ran; check "
                         "that `run` calls the models given")
    candidates = _tune_candidates(platform, allow_lossy)
    shapes = sorted(sink.values(), key=lambda e: -e["shape"].flops())
    for entry in shapes:
        entry["shape"] = dataclasses.replace(entry["shape"], roles=tuple(sorted(entry["calls"])))
    try:
        calls = {e["shape"]: e["calls"] for e in shapes}
        timings = measure([(e["shape"], e["mask"]) for e in shapes], lambda shape: candidates(shape, calls[shape]),
                          shapes[0]["device"], warmup=warmup, repeats=repeats, progress=progress)
    except BaseException:
        _restore_after_tune(models, previous)
        raise
    table = build_table(platform, timings, rule_key, allow_lossy=allow_lossy, shipped=load_table(),
                        models=sorted({type(m).__name__ for m in models}), seconds=0.0)
    try:
        if verify_margin > 0:
            _verify_in_model(models, run, config, table, platform, verify_margin, verify_rounds, progress)
    except BaseException:
        clear_resolution_cache()
        _restore_after_tune(models, previous)
        raise
    seconds = time.perf_counter() - started
    table["tune_seconds"] = round(seconds, 2)
    path = save_table(table)
    clear_resolution_cache()
    _restore_after_tune(models, previous)
    logger.info("tuned attention routing written to %s (%.1f s)", path, seconds)
    return TuneResult(str(path), active_table(platform), [e["shape"].describe() for e in shapes], seconds)


def _timed_run(run) -> float:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    with torch.inference_mode():
        run()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start


def _verify_in_model(models, run, config, table: dict, platform: Platform, margin: float, rounds: int,
                     progress) -> None:
    """Re-rank the near ties of every measured shape class by the whole ``run`` with that class routed to each of
    them (the other classes as the table has them), in interleaved rounds. Updates ``table`` in place: the class's
    ranking and ``worst_ratio`` become the in-model ones (its kernel times stay under ``kernel_worst_ratio``)."""
    rules = table["families"][platform.family]
    for key, rule in rules.items():
        near = near_ties(rule, margin, lambda n: is_registered(n) and "[" not in n)
        if len(near) < 2:
            continue
        samples: dict[str, list[float]] = {name: [] for name in near}
        for round_index in range(rounds + 1):
            for name in near:
                trial = json.loads(json.dumps(table))
                trial_rule = trial["families"][platform.family][key]
                trial_rule["ranking"] = [name]  # this class goes to ``name`` alone
                trial_rule["worst_ratio"] = {name: 1.0}
                trial["tolerance"] = 0.0
                with use_tuned_table(trial):
                    clear_resolution_cache()
                    apply_attention_all(models, config, check_roles=False)
                    seconds = _timed_run(run)
                if round_index:
                    samples[name].append(seconds)
        clear_resolution_cache()
        medians = {name: statistics.median(values) for name, values in samples.items()}
        fastest = min(medians.values())
        rule["kernel_worst_ratio"] = dict(rule["worst_ratio"])
        rule["in_model_seconds"] = {name: round(value, 6) for name, value in medians.items()}
        in_model = sorted(near, key=medians.get)
        rule["ranking"] = in_model + [n for n in rule["ranking"] if n not in near]
        rule["worst_ratio"] = {**{n: round(fastest / medians[n], 4) for n in near},
                               **{n: r for n, r in rule["worst_ratio"].items() if n not in near}}
        if progress is not None:
            progress(f"{key} in the model: " + ", ".join(f"{n} {medians[n]:.4f} s" for n in in_model))


def _restore_after_tune(models, previous: dict) -> None:
    applied = [m for m in models if previous[id(m)] is not None]
    bare = [m for m in models if previous[id(m)] is None]
    if bare:
        remove_attention_all(bare)
    for model in applied:
        apply_attention_all([model], previous[id(model)], check_roles=False)
