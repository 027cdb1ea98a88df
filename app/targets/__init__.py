"""The targets of the federation (DESIGN §1): specgate workers and OpenAI-compatible engines,
each a ``ReplicaSet`` speaking its ``Dialect``, gathered in a ``TargetSet``."""
