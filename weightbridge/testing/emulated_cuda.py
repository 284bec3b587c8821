"""An emulated CUDA device for tests on machines without a GPU (a test tool, not a runtime path).

`EmulatedCudaTensor` is a wrapper tensor that reports ``cuda:0`` while its real values live in a
host tensor inside it, so code written for GPU parameters runs here bit for bit. It enforces the
device rules real CUDA enforces, so a host/device mix-up fails here as it would on a GPU:

- refused (``RuntimeError``, CUDA's own wording): an op mixing a device tensor with a host
  tensor that is not 0-d (``a_cuda + host_matrix``, ``index_select`` with host indices), an
  ``out=`` on the other device (``torch.ne(a_cuda, b_cuda, out=host)``), ``.numpy()`` (a
  ``TypeError``, as on CUDA);
- allowed: copies across devices (``host.copy_(a_cuda)``, ``a_cuda.copy_(host)``, ``.to``,
  ``.cpu()``, ``.cuda()``), 0-d host tensors and Python scalars as operands, host index tensors
  in indexing (``a_cuda[host_idx]``), ``.item()`` / ``.tolist()``.

Device allocations are counted (each storage once, freed when its last tensor goes): `memory`
reports current and peak bytes, so tests and benchmarks measure peak device memory.

What it does not emulate: streams and their ordering, pinned host memory, Triton launches,
device memory limits, autograd (``requires_grad`` stays False: torch's autograd takes a CUDA
device guard this build cannot serve). A composite op that allocates on the CUDA backend inside
(``scaled_dot_product_attention``) runs whole on the host values, after the device check.
``torch.cuda.is_available()`` stays False, so library code that asks it
(`weightbridge.execution.executor.default_kernels`) runs its torch path on these tensors and
never launches Triton.

Typical usage (in a test, or in each Monarch proc: `activate` is process-wide)::

    from weightbridge.testing import emulated_cuda
    with emulated_cuda.active():
        w = torch.zeros(4, 4, device="cuda")     # an EmulatedCudaTensor on cuda:0
        w.copy_(torch.ones(4, 4))                # host -> device: allowed
        w + torch.ones(4, 4)                     # RuntimeError: ... cuda:0 and cpu!
        emulated_cuda.memory.reset_peak()
        ...
        print(emulated_cuda.memory.peak)         # bytes

`activate` patches torch's factory functions and ``Tensor.to`` / ``Tensor.cuda`` process-wide
(every thread: workers run on threads, and Monarch's runtime owns threads of its own) until
`deactivate`; tensors made while active keep working after it.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import weakref
from typing import Iterator

import torch
from torch.utils._pytree import tree_flatten, tree_map

DEVICE = torch.device("cuda", 0)
_aten = torch.ops.aten


class _Memory:
    """Device bytes held by live `EmulatedCudaTensor` storages (each storage counted once)."""

    def __init__(self):
        # Reentrant: a storage freed by the garbage collector while `_track` holds the lock
        # runs `_free` on the same thread.
        self._lock = threading.RLock()
        self._live: dict[int, int] = {}
        self.current = 0
        """Bytes allocated now."""
        self.peak = 0
        """Most bytes allocated at once since the last `reset_peak`."""

    def reset_peak(self) -> None:
        """Start a new peak at the current allocation."""
        with self._lock:
            self.peak = self.current

    def _track(self, inner: torch.Tensor) -> None:
        storage = inner.untyped_storage()
        nbytes, ptr = storage.nbytes(), storage.data_ptr()
        if not nbytes:
            return
        with self._lock:
            if ptr in self._live:
                return
            self._live[ptr] = nbytes
            self.current += nbytes
            self.peak = max(self.peak, self.current)
        weakref.finalize(storage, self._free, ptr)

    def _free(self, ptr: int) -> None:
        with self._lock:
            self.current -= self._live.pop(ptr, 0)


memory = _Memory()
"""The emulated device's allocations: ``memory.current``, ``memory.peak`` (bytes),
``memory.reset_peak()``."""


def _mismatch(op) -> RuntimeError:
    return RuntimeError(f"Expected all tensors to be on the same device, but found at least two "
                        f"devices, cuda:0 and cpu! (emulated CUDA, in {op})")


def _is_cuda(device) -> bool:
    if device is None:
        return False
    if isinstance(device, int):  # torch takes a bare index as a CUDA ordinal
        return True
    return torch.device(device).type == "cuda"


class EmulatedCudaTensor(torch.Tensor):
    """A tensor on the emulated ``cuda:0``: shape, strides and dtype of its host tensor
    ``inner``, which holds the values (views share it, as views of device memory do)."""

    inner: torch.Tensor

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _GUARDED:  # torch functions that take a CUDA device guard before dispatch
            return getattr(args[0], _GUARDED[func])(*args[1:], **kwargs)
        try:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        except (NotImplementedError, RuntimeError) as e:
            # A composite op (scaled_dot_product_attention) that makes tensors of its own on
            # the CUDA backend, which this build lacks: run it whole on the host values, as
            # the device would run it whole.
            if not any(sign in str(e) for sign in _NO_CUDA_BACKEND):
                raise
            _check_devices(func, args, kwargs)
            with torch._C.DisableTorchFunctionSubclass():
                out = func(*tree_map(_unwrap, args), **tree_map(_unwrap, kwargs))
            return _rewrap(out, args, kwargs)

    @staticmethod
    def __new__(cls, inner: torch.Tensor):
        assert type(inner) is torch.Tensor and inner.device.type == "cpu", type(inner)
        out = torch.Tensor._make_wrapper_subclass(
            cls, inner.size(), strides=inner.stride(), storage_offset=inner.storage_offset(),
            dtype=inner.dtype, layout=inner.layout, device=DEVICE, requires_grad=False)
        out.inner = inner
        memory._track(inner)
        return out

    def __repr__(self, *, tensor_contents=None) -> str:
        return f"EmulatedCudaTensor({self.inner!r}, device='cuda:0')"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        packet = func.overloadpacket
        if packet in _COPIES:  # copies cross devices
            return _copy(func, args, kwargs)
        target = kwargs.get("device")
        if target is not None:  # a factory-like op with an explicit device
            kwargs = {**kwargs, "device": torch.device("cpu")}
        _check_devices(func, args, kwargs)
        out = func(*tree_map(_unwrap, args), **tree_map(_unwrap, kwargs))
        if target is not None and not _is_cuda(target):
            return out
        return _rewrap(out, args, kwargs)

    # -- calls that real CUDA serves before dispatch (a device guard), or in C++ on storage ---

    def requires_grad_(self, requires_grad=True):
        # No autograd here: torch's autograd takes a CUDA device guard, which a CPU-only build
        # cannot serve (it aborts the process). nn.Parameter(t) keeps requires_grad False.
        return self

    def numpy(self, *args, **kwargs):
        raise TypeError("can't convert cuda:0 device type tensor to numpy. Use Tensor.cpu() to "
                        "copy the tensor to host memory first. (emulated CUDA)")

    def __array__(self, *args, **kwargs):
        return self.numpy()

    def tolist(self):
        return self.inner.tolist()

    def item(self):
        return self.inner.item()

    def __int__(self):
        return int(self.inner)

    def __float__(self):
        return float(self.inner)

    def __bool__(self):
        return bool(self.inner)

    def __index__(self):
        return self.inner.__index__()

    def data_ptr(self) -> int:
        return self.inner.data_ptr()

    def untyped_storage(self):
        return self.inner.untyped_storage()

    def contiguous(self, memory_format=torch.contiguous_format):
        if self.inner.is_contiguous(memory_format=memory_format):
            return self
        return EmulatedCudaTensor(self.inner.contiguous(memory_format=memory_format))

    def nonzero(self, *, as_tuple=False):
        out = self.inner.nonzero(as_tuple=as_tuple)
        return tuple(map(EmulatedCudaTensor, out)) if as_tuple else EmulatedCudaTensor(out)

    def copy_(self, src, non_blocking=False):
        if not isinstance(src, torch.Tensor):
            raise TypeError(f"copy_(): argument 'src' must be Tensor, not {type(src).__name__}")
        self.inner.copy_(_unwrap(src))
        return self

    def __getitem__(self, index):
        return _wrap_result(self.inner[_unwrap_index(index)])

    def __setitem__(self, index, value):
        index = _unwrap_index(index)
        if isinstance(value, torch.Tensor) and not isinstance(value, EmulatedCudaTensor) \
                and value.dim() and _advanced(index):
            raise _mismatch("index_put_")  # basic indexing is a copy_, which crosses devices
        self.inner[index] = _unwrap(value)


_GUARDED = {torch.nonzero: "nonzero"}
_NO_CUDA_BACKEND = ("from the 'CUDA' backend", "not linked with support for cuda",
                    "Torch not compiled with CUDA")
"""How this CPU-only build says it has no CUDA kernel or device guard for a call."""
_COPIES = {_aten.copy_, _aten._to_copy, _aten._copy_from, _aten._copy_from_and_resize}


def _unwrap(x):
    return x.inner if isinstance(x, EmulatedCudaTensor) else x


def _unwrap_index(index):
    if isinstance(index, tuple):
        return tuple(_unwrap(i) for i in index)
    return _unwrap(index)


def _advanced(index) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, (torch.Tensor, list)) for i in items)


def _wrap_result(x):
    return EmulatedCudaTensor(x) if type(x) is torch.Tensor and x.device.type == "cpu" else x


def _check_devices(func, args, kwargs) -> None:
    """Refuse what CUDA refuses: host operands of more than 0 dims next to device ones (host
    index tensors of ``index`` / ``index_put_`` excepted, as on CUDA), and ``out=`` on host."""
    operands = args
    if getattr(func, "overloadpacket", None) in (_aten.index, _aten.index_put, _aten.index_put_,
                               _aten._index_put_impl_):
        operands = (args[0],) + tuple(args[2:])  # args[1]: the indices, allowed on the host
    flat, _ = tree_flatten((operands, kwargs))
    tensors = [t for t in flat if isinstance(t, torch.Tensor)]
    if not any(isinstance(t, EmulatedCudaTensor) for t in tensors):
        return
    out = kwargs.get("out")
    if isinstance(out, torch.Tensor) and not isinstance(out, EmulatedCudaTensor):
        raise RuntimeError(f"Expected out tensor to have device cuda:0, but got cpu instead "
                           f"(emulated CUDA, in {func})")
    if any(not isinstance(t, EmulatedCudaTensor) and t.dim() for t in tensors):
        raise _mismatch(func)


def _rewrap(out, args, kwargs):
    """Outputs of an op run on inner tensors, as device tensors; an output that is one of the
    inputs' inner tensors (in-place ops, ``out=``) becomes that input again."""
    inputs = {id(t.inner): t for t in tree_flatten((args, kwargs))[0]
              if isinstance(t, EmulatedCudaTensor)}

    def wrap(x):
        if isinstance(x, torch.Tensor) and type(x) is torch.Tensor:
            return inputs[id(x)] if id(x) in inputs else EmulatedCudaTensor(x)
        return x
    return tree_map(wrap, out)


def _copy(func, args, kwargs):
    """copy_ / _to_copy: across devices, as CUDA allows."""
    if func.overloadpacket is _aten._to_copy:
        (src,), target = args, kwargs.get("device")
        kwargs = {k: v for k, v in kwargs.items() if k != "device"}
        out = _aten._to_copy(_unwrap(src), **kwargs)
        to_device = _is_cuda(target) if target is not None else isinstance(src, EmulatedCudaTensor)
        return EmulatedCudaTensor(out) if to_device else out
    if func.overloadpacket is _aten.copy_:
        dst, src = args[0], args[1]
        _unwrap(dst).copy_(_unwrap(src))
        return dst
    # _copy_from(src, dst): rarely reached (copy_ is caught first)
    src, dst = args[0], args[1]
    _unwrap(dst).copy_(_unwrap(src))
    return dst


# --------------------------------------------------------------------------------------------
# Activation: factory calls with device="cuda", and Tensor.to / Tensor.cuda of host tensors
# --------------------------------------------------------------------------------------------

_FACTORIES = ("empty", "zeros", "ones", "full", "arange", "tensor", "as_tensor", "empty_strided",
              "rand", "randn", "randint", "randperm", "linspace", "eye", "zeros_like",
              "ones_like", "empty_like", "full_like", "rand_like", "randn_like", "randint_like")
_saved: dict[tuple[object, str], object] = {}
_lock = threading.Lock()


def _factory(fn):
    @functools.wraps(fn)
    def call(*args, **kwargs):
        if not _is_cuda(kwargs.get("device")):
            return fn(*args, **kwargs)
        kwargs["device"] = "cpu"
        if kwargs.pop("pin_memory", False):
            raise RuntimeError("pin_memory is for host tensors (emulated CUDA)")
        args = tree_map(_unwrap, args)
        return EmulatedCudaTensor(fn(*args, **kwargs))
    return call


def _to(fn):
    @functools.wraps(fn)
    def to(self, *args, **kwargs):
        if isinstance(self, EmulatedCudaTensor):
            return fn(self, *args, **kwargs)
        parse = {k: v for k, v in kwargs.items() if k != "copy"}
        device, dtype, _, memory_format = torch._C._nn._parse_to(*args, **parse)
        if not _is_cuda(device):
            return fn(self, *args, **kwargs)
        out = fn(self, dtype=dtype or self.dtype, copy=True,
                 memory_format=memory_format or torch.preserve_format)
        return EmulatedCudaTensor(out.detach() if out.requires_grad else out)
    return to


def _cuda(fn):
    @functools.wraps(fn)
    def cuda(self, device=None, non_blocking=False, memory_format=torch.preserve_format):
        if isinstance(self, EmulatedCudaTensor):
            return self
        return EmulatedCudaTensor(self.detach().clone(memory_format=memory_format))
    return cuda


def activate() -> None:
    """Make ``device="cuda"`` mean the emulated device, process-wide, until `deactivate`."""
    with _lock:
        if _saved:
            return
        for name in _FACTORIES:
            _saved[(torch, name)] = getattr(torch, name)
            setattr(torch, name, _factory(getattr(torch, name)))
        for name, make in (("to", _to), ("cuda", _cuda)):
            _saved[(torch.Tensor, name)] = getattr(torch.Tensor, name)
            setattr(torch.Tensor, name, make(getattr(torch.Tensor, name)))


def deactivate() -> None:
    """Undo `activate` (emulated tensors made meanwhile keep working)."""
    with _lock:
        for (owner, name), fn in _saved.items():
            setattr(owner, name, fn)
        _saved.clear()


def is_active() -> bool:
    return bool(_saved)


@contextlib.contextmanager
def active() -> Iterator[None]:
    """`activate` for the duration of a block (left as it was if it was already active)."""
    was = is_active()
    activate()
    try:
        yield
    finally:
        if not was:
            deactivate()


def to_device(t: torch.Tensor) -> EmulatedCudaTensor:
    """A copy of host tensor ``t`` on the emulated device (works whether or not active)."""
    return EmulatedCudaTensor(t.detach().clone())


def is_emulated(t: object) -> bool:
    """Whether ``t`` lives on the emulated device."""
    return isinstance(t, EmulatedCudaTensor)
