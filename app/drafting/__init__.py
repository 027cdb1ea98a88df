"""The draft at the gateway, one role per module: ``model`` (``DraftModel``: what the engine
calls), ``request`` (one draft's ``DraftRequest`` and its rows q̂), ``batcher`` (the shared
decode steps), ``chain`` and ``tree`` (the two shapes), ``lookup`` (lookup proposals, how they
join a draft, the acceptance they learn), ``forced`` (a grammar's forced runs in a tree)."""

from app.drafting.model import DraftModel
from app.drafting.request import DraftRequest

__all__ = ["DraftModel", "DraftRequest"]
