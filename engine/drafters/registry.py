"""The drafters by speculation method: what a host builds from the checkpoints it loaded.

A drafter is a module of this package with `build(sources) -> Drafter | None` (None: these sources
cannot build it, e.g. no draft model was loaded), named by its method's row (engine/method.py). The
pooled endpoint offers every method its sources build, in the table's order (the first is what a
session that names none gets). A method's row may name a backup method (SSD's: n-gram), whose drafter
is built with it.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import KW_ONLY, dataclass, field

from specpool.engine.drafters.base import Drafter
from specpool.engine.drafters.lookup import SuffixArrayDatastore
from specpool.engine.method import METHODS, Method
from specpool.engine.plan import TreeShape
from specpool.engine.runtime.model import Llama


@dataclass(frozen=True, slots=True)
class DraftSources:
    """What drafters are built from: the models a host loaded, its n-gram datastore, and its limits."""

    max_sequences: int  # sequences drafted for at once
    max_len: int  # tokens a sequence may hold
    _: KW_ONLY  # the rest by name: a field added in between must not take another's value
    draft: Llama | None = None  # a draft model
    head: Llama | None = None  # a feature-fed draft head
    datastore: SuffixArrayDatastore | None = None
    tree_shape: TreeShape = field(default_factory=TreeShape)  # the trees tree sessions grow (their room in a model's cache)
    # Every propose grows trees of tree_shape (an in-process decoder's drafter); False: chains, or trees per call.
    trees: bool = False
    ssd: Mapping[str, object] = field(default_factory=dict)  # SsdDrafter options


def build(method: Method, sources: DraftSources) -> Drafter | None:
    """A new drafter of this method, or None where the method or these sources have none; a method with
    a backup (SSD) gets a new drafter of that one to fall back to."""
    row = method.row
    if row.drafter is None:
        return None
    module = importlib.import_module(f"{__package__}.{row.drafter}")
    if row.backup is None:
        return module.build(sources)
    return module.build(sources, backup=build(row.backup, sources))


def build_all(sources: DraftSources) -> dict[Method, Drafter]:
    """Every drafter these sources build, in the method table's order."""
    built = {row.method: build(row.method, sources) for row in METHODS}
    return {method: drafter for method, drafter in built.items() if drafter is not None}
