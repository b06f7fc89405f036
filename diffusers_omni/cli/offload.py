"""The offload flags of ``generate`` and ``tune``, derived from the registered offload configs.

``--offload`` offers every registered strategy (``model_level`` spelt ``model-level``); each field of a strategy's
config that the CLI can set (``offload_option(..., cli=True)``) is one flag: ``--<field-name>``, or ``--no-<name>``
for a bool that defaults to ``True`` (or the name the field's metadata gives, e.g. ``--no-allgather``), with the
field's help, prefixed by the strategies that read it. A field shared by several strategies is one flag. A flag
given to a strategy that does not read it is refused naming the strategies that do.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from typing import Any

from ..config.offload import OffloadConfig, OffloadStrategy, offload_strategies, offload_strategy_entry
from ..config.offload_base import OffloadStrategyEntry, init_fields
from .common import UsageError, non_negative_int, positive_int


def cli_name(strategy: str) -> str:
    """``"model_level"`` → ``"model-level"``: how the CLI spells a strategy."""
    return str(strategy).replace("_", "-")


@dataclass(frozen=True)
class OffloadFlag:
    """One command-line flag standing for the config field ``field`` of the strategies ``strategies``."""

    field: str
    flag: str
    dest: str
    kind: str
    inverted: bool  # a bool field defaulting to True: the flag sets it to False
    default: Any
    help: str
    minimum: int | None
    strategies: tuple[str, ...]  # CLI names, lowest priority first
    choices: tuple[str, ...] = ()  # the names a "choice" flag takes

    def value(self, given: Any) -> Any:
        """The field's value for the flag's parsed value."""
        return (not given) if self.inverted else given


def offload_entries(collective: bool = True) -> list[OffloadStrategyEntry]:
    """The registered strategies a command offers, lowest priority first; ``collective=False`` leaves out those
    that run on every rank of a process group (a command that runs in one process)."""
    return [entry for entry in offload_strategies() if collective or not entry.config.collective]


def offload_flags(collective: bool = True) -> list[OffloadFlag]:
    """The flags of the offered strategies' CLI fields, one per field name, in registration order."""
    flags: dict[str, OffloadFlag] = {}
    for entry in offload_entries(collective):
        for name, f in init_fields(entry.config).items():
            meta = f.metadata
            if not meta.get("cli"):
                continue
            if name in flags:
                known = flags[name]
                flags[name] = OffloadFlag(**{**known.__dict__, "strategies": (*known.strategies, cli_name(entry.name))})
                continue
            inverted = meta["kind"] == "bool" and f.default is True
            flag = meta.get("flag") or ("--no-" if inverted else "--") + name.replace("_", "-")
            flags[name] = OffloadFlag(
                field=name, flag=flag, dest=flag.lstrip("-").replace("-", "_"), kind=meta["kind"], inverted=inverted,
                default=f.default, help=meta["help"], minimum=meta.get("minimum"),
                strategies=(cli_name(entry.name),), choices=tuple(meta.get("choices", ())),
            )
    return list(flags.values())


def _int_type(minimum: int | None):
    if minimum == 1:
        return positive_int
    if minimum == 0:
        return non_negative_int

    def bounded_int(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
        if minimum is not None and value < minimum:
            raise argparse.ArgumentTypeError(f"must be an integer ≥ {minimum}, got {text!r}")
        return value

    return bounded_int


def add_offload_arguments(parser: argparse.ArgumentParser, *, collective: bool = True,
                          help: str = "offload strategy") -> None:
    """Add ``--offload`` (the registered strategies) and one flag per CLI field of their configs to ``parser``."""
    entries = offload_entries(collective)
    names = [cli_name(entry.name) for entry in entries]
    launched = [cli_name(entry.name) for entry in entries if entry.config.collective]
    help = f"{help}: {', '.join(names)}"
    if launched:
        help = f"{help}; {', '.join(launched)} run{'s' * (len(launched) == 1)} under torchrun"
    # STRATEGY in the usage line: the choices listed there made it wider than an 80-column terminal.
    parser.add_argument("--offload", choices=names, metavar="STRATEGY", default=cli_name(OffloadStrategy.NONE),
                        help=help)
    for flag in offload_flags(collective):
        text = f"{', '.join(flag.strategies)}: {flag.help}"
        if flag.kind == "bool":
            parser.add_argument(flag.flag, dest=flag.dest, action="store_true", help=text)
            continue
        if flag.kind == "int" and flag.default is not None:
            text += f" (default: {flag.default})"
        kind = _int_type(flag.minimum) if flag.kind == "int" else str
        choices = list(flag.choices) if flag.kind == "choice" else None
        parser.add_argument(flag.flag, dest=flag.dest, type=kind, default=None, help=text, choices=choices)


def collective_names() -> list[str]:
    """CLI names of the strategies that run under ``torchrun`` (every rank of a process group)."""
    return [cli_name(entry.name) for entry in offload_entries() if entry.config.collective]


def is_collective(strategy: str) -> bool:
    """Whether ``--offload strategy`` runs on every rank of a process group."""
    return bool(offload_strategy_entry(strategy).config.collective)


def installs_nothing(config: OffloadConfig) -> bool:
    """Whether ``config``'s strategy installs no offload (``none``): the pipeline is moved to the device instead."""
    return offload_strategy_entry(type(config)).handler is None


def offload_config(args: argparse.Namespace, device: Any, *, collective: bool = True) -> OffloadConfig:
    """The config ``--offload`` and its flags ask for, on ``device``, built (and so validated) before anything
    loads. A flag of another strategy, or a value the config refuses, is a ``UsageError`` (exit status 2) naming
    the flag."""
    entry = offload_strategy_entry(args.offload)
    own = init_fields(entry.config)
    flags = offload_flags(collective)
    fields = {}
    for flag in flags:
        given = getattr(args, flag.dest, None)
        if given is None or given is False:
            continue
        if flag.field not in own:
            raise UsageError(f"{flag.flag}={given} needs --offload {' or '.join(flag.strategies)} (got --offload "
                             f"{args.offload})")
        fields[flag.field] = flag.value(given)
    try:
        return entry.config(device=device, **fields)
    except (TypeError, ValueError) as exc:
        message = str(exc)
        named = [flag for flag in flags if re.search(rf"\b{flag.field}\b", message)]
        legend = ", ".join(f"{flag.flag} sets {flag.field}{'=False' if flag.inverted else ''}" for flag in named)
        raise UsageError(f"--offload {args.offload}: {message}" + (f" (flags: {legend})" if legend else "")) from None
