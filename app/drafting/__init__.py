"""The draft at the gateway: ``drafters`` (``DraftModel``, what the engine calls, and the drafters),
``request``, ``batcher`` (the shared decodes), ``chain`` and ``tree`` (the two shapes), ``lookup`` (lookup
proposals), ``forced`` (a grammar's runs in a tree)."""

from app.drafting.drafters import DraftModel
from app.drafting.request import DraftRequest

__all__ = ["DraftModel", "DraftRequest"]
