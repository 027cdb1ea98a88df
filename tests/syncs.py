"""A CPU stand-in for ``torch.cuda.set_sync_debug_mode("error")`` over a worker's step (issue 73). On a GPU a
step that reads a value back, or copies host data in from pageable memory, makes the host wait for the device;
on the CPU nothing waits, so this detector says where it *would*.

Between the step's upload (``StepUpload.send``) and its one copy back (``StepUpload.download``) — armed — it
refuses:
- the host reading a device tensor: ``item``, ``bool``/``int``/``float``/``index`` of one, ``tolist``,
  ``numpy``, ``cpu``
  (a ``TorchDispatchMode`` sees ``aten._local_scalar_dense``; what reads memory without an op is caught on
  ``torch.Tensor``);
- ops whose output size is a value (``nonzero``, ``masked_select``, ``unique``, ``repeat_interleave`` by a
  tensor,
  ``bincount``, ``equal``, indexing by a boolean mask): on a GPU each reads back;
- host data made a device tensor (``torch.tensor`` of a list: ``aten.lift_fresh``), or a host tensor fed to a
  device op (an
  index tensor built on the host, a constant made once on the CPU): on a GPU a copy from pageable memory,
  which waits. A Python number given to an elementwise op is a 0-dim host tensor, a number to the kernel, as
  on a GPU; set by an index (``x[rows, ids] = 0.0``: ``index_put_``) or copied (``copy_``) it is copied in
  from the host, which waits there. What the CPU cannot tell apart is ``torch.tensor(3, device=...)`` (a copy
  of one number) from a host-side ``torch.tensor(3)``.

Device tensors are known by their storage: every tensor the runner holds (weights, KV stores, graph buffers,
the upload's device buffer), what the upload sends, and every op's output with a device input or with none (a
factory, armed). Whatever was made on the host outside that is a host tensor. 0-dim host tensors are scalars
to a device op, as on a GPU."""

from __future__ import annotations

import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import fields, is_dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from core.runners.step_upload import StepUpload

REFUSED = {
    "_local_scalar_dense",
    "item",
    "nonzero",
    "masked_select",
    "unique",
    "_unique",
    "_unique2",
    "unique_dim",
    "unique_consecutive",
    "unique_dim_consecutive",
    "bincount",
    "equal",
    "is_nonzero",
    "histc",
    "lift_fresh",
    "lift_fresh_copy",
}
READS = ("item", "tolist", "numpy", "cpu", "__bool__", "__int__", "__float__", "__index__")
# ops that copy a host tensor's value to the device even when it is 0-dim (elementwise ops take a 0-dim host
# tensor as a number)
COPIES_VALUE = {
    "index_put",
    "index_put_",
    "_index_put_impl_",
    "copy_",
    "_to_copy",
    "index_copy",
    "index_copy_",
    "scatter",
    "scatter_",
    "masked_scatter",
    "masked_scatter_",
}


def _storage(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


class HostSyncs(TorchDispatchMode):
    """``with HostSyncs(runner) as syncs: steps.verify_batch(...)``; then ``syncs.found`` (each a line naming
    the op and where in the project it ran), ``syncs.sends`` and ``syncs.downloads`` (per step: one each)."""

    def __init__(self, *holders: Any) -> None:
        super().__init__()
        self._device: set[int] = set()
        self._kept: list[torch.Tensor] = []  # alive, so no storage address is reused while known
        for holder in holders:
            for tensor in device_tensors(holder):
                self._mark(tensor)
        self.armed = False
        self.found: list[str] = []
        self.sends = 0
        self.downloads = 0
        self._quiet = 0

    def _mark(self, tensor: torch.Tensor) -> None:
        self._device.add(_storage(tensor))
        self._kept.append(tensor)

    def is_device(self, tensor: torch.Tensor) -> bool:
        return _storage(tensor) in self._device

    def _refuse(self, what: str) -> None:
        frames = [
            f
            for f in traceback.extract_stack()[:-2]
            if "/tests/syncs.py" not in f.filename and "/torch/" not in f.filename
        ]
        where = next(
            (
                f"{f.filename.rsplit('/', 2)[-2]}/{f.filename.rsplit('/', 1)[-1]}:{f.lineno} {f.name}"
                for f in reversed(frames)
            ),
            "?",
        )
        self.found.append(f"{what} at {where}")

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        on_device = [self.is_device(t) for t in inputs]
        if self.armed and not self._quiet:
            name = func.overloadpacket.__name__
            if name.startswith("lift_fresh"):
                # torch.tensor(host data): a 0-dim one is a scalar to a device op (a Python number set into
                # one)
                if inputs and inputs[0].dim() > 0:
                    self._refuse(f"aten.{name} of host data {tuple(inputs[0].shape)}")
            elif name in REFUSED and any(on_device):
                self._refuse(f"aten.{name}")
            elif (
                name == "repeat_interleave"
                and isinstance(args[0], torch.Tensor)
                and func._overloadname != "self_int"
            ):
                self._refuse("aten.repeat_interleave by a tensor of repeats")
            elif name in ("index", "index_put", "index_put_", "_index_put_impl_") and any(
                isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in tree_leaves(args[1])
            ):
                self._refuse(f"aten.{name} by a boolean mask")
            elif any(on_device):
                # these copy a host value in, a 0-dim one too (an index set to a Python number)
                copies = name in COPIES_VALUE
                for tensor, device in zip(inputs, on_device):
                    if not device and (tensor.dim() > 0 or copies):
                        self._refuse(
                            f"aten.{name} of a host tensor {tuple(tensor.shape)} beside device tensors"
                        )
                        break
        out = func(*args, **kwargs)
        if any(on_device) or (self.armed and not inputs):
            for tensor in tree_leaves(out):
                if isinstance(tensor, torch.Tensor):
                    self._mark(tensor)
        return out

    @contextmanager
    def quiet(self) -> Iterator[None]:
        self._quiet += 1
        try:
            yield
        finally:
            self._quiet -= 1

    def read(self, tensor: torch.Tensor, how: str) -> None:
        """A host read of ``tensor`` (a method of torch.Tensor that reads its memory)."""
        if self.armed and not self._quiet and self.is_device(tensor):
            self._refuse(f"Tensor.{how}() of a device tensor")


@contextmanager
def host_syncs(*holders: Any) -> Iterator[HostSyncs]:
    """The detector over ``holders``' device tensors, with the step's send and download watched and the host
    reads caught."""
    detector = HostSyncs(*holders)
    real_send, real_download = StepUpload.send, StepUpload.download
    real_reads = {name: getattr(torch.Tensor, name) for name in READS}

    def send(upload: StepUpload) -> None:
        with detector.quiet():
            real_send(upload)
        detector._mark(upload._device)  # what it sent is on the device
        detector.sends += 1
        detector.armed = True

    def download(upload: StepUpload, tensor: torch.Tensor) -> Any:
        if not detector.armed:
            detector._refuse("a download with no upload before it")
        with detector.quiet():
            out = real_download(upload, tensor)
        detector.downloads += 1
        detector.armed = False
        return out

    def reader(name: str) -> Any:
        real = real_reads[name]

        def read(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            detector.read(self, name)
            return real(self, *args, **kwargs)

        return read

    StepUpload.send, StepUpload.download = send, download  # type: ignore[method-assign]
    for name in READS:
        setattr(torch.Tensor, name, reader(name))
    try:
        with detector:
            yield detector
    finally:
        StepUpload.send, StepUpload.download = real_send, real_download  # type: ignore[method-assign]
        for name, real in real_reads.items():
            setattr(torch.Tensor, name, real)


def device_tensors(holder: Any, depth: int = 4) -> Iterator[torch.Tensor]:
    """Every tensor ``holder`` holds: a module's parameters and buffers, and tensors in its attributes, lists,
    dicts and dataclasses, ``depth`` levels down."""
    seen: set[int] = set()

    def walk(value: Any, level: int) -> Iterator[torch.Tensor]:
        if id(value) in seen or level < 0:
            return
        seen.add(id(value))
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, torch.nn.Module):
            yield from value.parameters()
            yield from value.buffers()
        elif isinstance(value, (list, tuple)):
            for item in value:
                yield from walk(item, level - 1)
        elif isinstance(value, dict):
            for item in value.values():
                yield from walk(item, level - 1)
        elif is_dataclass(value) and not isinstance(value, type):
            for field in fields(value):
                yield from walk(getattr(value, field.name), level - 1)
        elif hasattr(value, "__dict__") and type(value).__module__.split(".")[0] in (
            "core",
            "workers",
            "app",
        ):
            for item in vars(value).values():
                yield from walk(item, level - 1)

    yield from walk(holder, depth)
