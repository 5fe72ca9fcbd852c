"""Synchronising random number generators from process 0."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from shardplug.core._internal.collectives import broadcast_object

__all__ = ["RNG_TYPES", "check_rng_types", "rng_states", "apply_rng_states", "synchronize_rng_states"]

RNG_TYPES = ("torch", "cuda", "xla", "generator")


def check_rng_types(rng_types: Iterable[str] | None) -> tuple[str, ...]:
    """Validate ``rng_types`` and return them as a new tuple (the caller's list is never touched)."""
    if rng_types is None:
        return ()
    if isinstance(rng_types, str):
        rng_types = [rng_types]
    try:
        checked = tuple(rng_types)
    except TypeError:
        raise TypeError(
            f"rng_types={rng_types!r} is not a list of RNG names; pass a list of names from {list(RNG_TYPES)} "
            "(e.g. rng_types=['generator']), or None to synchronise none"
        ) from None
    for name in checked:
        if name not in RNG_TYPES:
            raise ValueError(f"rng_types contains {name!r}, which is not one of {list(RNG_TYPES)}; remove it")
    return checked


def rng_states(rng_types: Iterable[str], generator: torch.Generator | None = None) -> dict[str, Any]:
    """This process's states of the named RNGs (those that exist here)."""
    states: dict[str, Any] = {}
    for name in rng_types:
        if name == "torch":
            states[name] = torch.get_rng_state()
        elif name == "cuda" and torch.cuda.is_available():
            states[name] = torch.cuda.get_rng_state()
        elif name == "xla":
            try:
                import torch_xla.core.xla_model as xm
            except ImportError:
                continue
            states[name] = xm.get_rng_state()
        elif name == "generator" and generator is not None:
            states[name] = generator.get_state()
    return states


def apply_rng_states(states: dict[str, Any], generator: torch.Generator | None = None) -> None:
    for name, state in states.items():
        if name == "torch":
            torch.set_rng_state(state)
        elif name == "cuda" and torch.cuda.is_available():
            torch.cuda.set_rng_state(state)
        elif name == "xla":
            import torch_xla.core.xla_model as xm

            xm.set_rng_state(state)
        elif name == "generator" and generator is not None:
            generator.set_state(state)


def synchronize_rng_states(rng_types: Iterable[str], generator: torch.Generator | None = None) -> None:
    """Copy process 0's states of the named RNGs to every process (no-op without a process group)."""
    names = check_rng_types(rng_types)
    apply_rng_states(broadcast_object(rng_states(names, generator), what="the states of the RNGs to agree"), generator)
