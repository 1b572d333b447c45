"""The drafters by speculation method: what a host builds from the checkpoints it loaded.

A drafter is a module of this package with `build(sources) -> Drafter | None` (None: these sources
cannot build it, e.g. no draft model was loaded) and one line in BUILDERS. The pooled endpoint offers
every method its sources build, in BUILDERS' order (the first is what a session that names none
gets); SSD takes its fast backup from here too.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from specpool.engine.drafters import head, model, ngram, ssd
from specpool.engine.drafters.base import Drafter
from specpool.engine.drafters.lookup import SuffixArrayDatastore
from specpool.engine.method import Method
from specpool.engine.plan import TreeShape
from specpool.engine.runtime.model import Llama


@dataclass(frozen=True, slots=True)
class DraftSources:
    """What drafters are built from: the models a host loaded, its n-gram datastore, and its limits."""

    max_sequences: int  # sequences drafted for at once
    max_len: int  # tokens a sequence may hold
    draft: Llama | None = None  # a draft model
    head: Llama | None = None  # a feature-fed draft head
    datastore: SuffixArrayDatastore | None = None
    tree_shape: TreeShape = field(default_factory=TreeShape)  # the trees tree sessions grow (their room in a model's cache)
    ssd: Mapping[str, object] = field(default_factory=dict)  # SsdDrafter options


def _ssd(sources: DraftSources) -> Drafter | None:
    return ssd.build(sources, fast=ngram.build(sources))  # n-gram drafts are its fast backup


BUILDERS: dict[Method, Callable[[DraftSources], Drafter | None]] = {
    Method.DRAFT_MODEL: model.build,
    Method.HEAD: head.build,
    Method.SSD: _ssd,
    Method.NGRAM: ngram.build,
}


def build(method: Method, sources: DraftSources) -> Drafter | None:
    """A new drafter of this method, or None where the registry or these sources have none."""
    builder = BUILDERS.get(method)
    return builder(sources) if builder is not None else None


def build_all(sources: DraftSources) -> dict[Method, Drafter]:
    """Every drafter these sources build, in BUILDERS' order."""
    built = {method: builder(sources) for method, builder in BUILDERS.items()}
    return {method: drafter for method, drafter in built.items() if drafter is not None}
