"""The targets of the federation (DESIGN §1): ``ReplicaSet``s speaking a ``Dialect``, pipelines, in a ``TargetSet``."""
