"""The draft at the gateway: ``model`` (what the engine calls), ``request``, ``batcher`` (the shared decodes),
``chain`` and ``tree`` (the two shapes), ``lookup`` (lookup proposals), ``forced`` (a grammar's runs in a tree)."""

from app.drafting.model import DraftModel
from app.drafting.request import DraftRequest

__all__ = ["DraftModel", "DraftRequest"]
