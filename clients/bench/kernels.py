"""What a step asks of the device, counted on any device by a dispatch mode (issue 73): the ops that launch a
kernel (an op whose output is new memory, or that writes in place; views and aliases launch none), and the
static forward's ops per decoder layer — the difference between the forward over all its layers and over one,
over the layers between."""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class Kernels(TorchDispatchMode):
    """``with Kernels() as k: ...``; ``k.ops``: the kernel-launching ops run inside, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = {
            t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)
        }
        made = any(
            t.untyped_storage().data_ptr() not in inputs
            for t in tree_leaves(out)
            if isinstance(t, torch.Tensor)
        )
        if made or func._schema.is_mutable:
            self.ops.append(str(func.overloadpacket.__name__))
        return out

    def counts(self) -> Counter[str]:
        return Counter(self.ops)


def per_layer(forward: Any, inputs: Any, span: int) -> tuple[float, int, Counter[str]]:
    """A static forward's (core.runners.static_forward.StaticForward) kernels per decoder layer over a step's
    ``inputs``, the kernels outside its layers, and what a layer runs (op → count). It writes the step's
    cells, as the step itself would."""
    layers = forward.layers
    if len(layers) < 2:
        raise ValueError("counting per layer needs a model of two layers or more")
    with torch.inference_mode():
        with Kernels() as whole:
            forward.hidden(inputs, span)
        forward.layers = layers[:1]
        try:
            with Kernels() as one:
                forward.hidden(inputs, span)
        finally:
            forward.layers = layers
    others = len(layers) - 1
    per = (len(whole.ops) - len(one.ops)) / others
    return (
        per,
        round(len(one.ops) - per),
        Counter({op: n // others for op, n in (whole.counts() - one.counts()).items()}),
    )
