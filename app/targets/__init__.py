"""The targets of the federation (docs/design.md §1): ``ReplicaSet``s speaking a ``Dialect``, pipelines, in a
``TargetSet``."""
