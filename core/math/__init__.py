"""Pure math (docs/design.md §1): tensors in, tensors or small dataclasses out. No I/O, no globals."""
