"""A CUDA device made of CPU memory, for checking on a CPU-only torch that every tensor the
engine makes meets its logits on their device.

`OnDevice` is a tensor subclass that holds a CPU tensor and reports ``cuda:0``.  Every
operation on it runs on the CPU tensor inside, after the device check CUDA would make: an
operation that mixes it with a CPU tensor of one or more dimensions fails as on CUDA, except
where CUDA allows the mix (copies, ``.to``, CPU indexes into a CUDA tensor, CPU scalars), and
a CPU random generator driving it fails too.  Reading values (``tolist``, ``item``, ``bool``)
is a host copy, as on CUDA.  `FakeCuda` (a torch function mode) makes ``device="cuda"`` and
``.to("cuda")`` produce `OnDevice` tensors; `to_fake_cuda` moves a module's weights there.

What this cannot model: CUDA's own kernels and numerics (the values are the CPU's) and a
generator made on CUDA (``torch.Generator(device="cuda")`` needs a CUDA build).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

__all__ = ["OnDevice", "FakeCuda", "to_fake_cuda", "CUDA"]

CUDA = torch.device("cuda", 0)
aten = torch.ops.aten

# host reads: a copy to the host, allowed on CUDA
_HOST_READS = {torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.item, torch.Tensor.__float__,
               torch.Tensor.__int__, torch.Tensor.__bool__, torch.Tensor.__index__}
# operations CUDA runs with CPU and CUDA tensors mixed (indexes: see `_check_index`)
_MIXING = {torch.Tensor.copy_}                      # at the function level
_METADATA = {torch.Tensor.dim, torch.Tensor.size, torch.Tensor.numel, torch.Tensor.stride,
             torch.Tensor.is_floating_point, torch.Tensor.get_device, torch.Tensor.__len__}
_COPIES = {aten.copy_.default, aten._to_copy.default, aten._local_scalar_dense.default}
_INDEXING = {aten.index.Tensor, aten.index_put_.default, aten.index_put.default,
             aten._index_put_impl_.default}


def _mixed(where: str) -> RuntimeError:
    return RuntimeError("Expected all tensors to be on the same device, but found at least "
                        f"two devices, cuda:0 and cpu! ({where})")


class OnDevice(torch.Tensor):
    """A CPU tensor (``inner``) that is ``cuda:0`` to everyone else."""

    inner: torch.Tensor

    @staticmethod
    def __new__(cls, inner: torch.Tensor) -> OnDevice:
        out = torch.Tensor._make_wrapper_subclass(
            cls, inner.shape, strides=inner.stride(), storage_offset=inner.storage_offset(),
            dtype=inner.dtype, device=CUDA, requires_grad=inner.requires_grad)
        out.inner = inner
        return out

    def __repr__(self) -> str:
        return f"OnDevice({self.inner!r})"

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _HOST_READS:
            return func(_inner(args[0]), *args[1:], **kwargs)
        # indexing's Python entry points open a CUDA device guard: do them on the CPU tensor
        if func is torch.Tensor.__getitem__:
            return _wrap(_inner(args[0])[_unwrap(args[1])])
        if func is torch.Tensor.__setitem__:
            target, index, value = args
            if _advanced(index) and isinstance(value, torch.Tensor) and value.dim() > 0 \
                    and isinstance(value, OnDevice) != isinstance(target, OnDevice):
                raise _mixed("index_put_ of values on another device")
            if _advanced(index) and not isinstance(target, OnDevice) and _any_on_device(index):
                raise _mixed("indexing a CPU tensor with CUDA indexes")
            _inner(target)[_unwrap(index)] = _unwrap(value)
            return None
        if getattr(func, "__name__", "") == "__get__" or func in _METADATA:
            with torch._C.DisableTorchFunctionSubclass():     # shape, dtype, device: the wrapper's
                return func(*args, **kwargs)
        if func is torch.Tensor.to:
            return _to(args[0], list(args[1:]), dict(kwargs))
        # any other operation runs on the CPU tensors inside, after CUDA's device check (its
        # Python bindings would open a CUDA device guard, which a CPU build does not have)
        if func not in _MIXING:
            _check_same_device(func, args, kwargs)
        ins = {id(_inner(t)): t for t in tree_flatten((args, kwargs))[0] if isinstance(t, OnDevice)}
        out = func(*tree_map(_inner, args), **tree_map(_inner, kwargs))
        return tree_map(lambda t: ins.get(id(t), _wrap(t)) if isinstance(t, torch.Tensor) else t,
                        out)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is aten._to_copy.default:
            target = kwargs.pop("device", None)
            out = func(_inner(args[0]), **kwargs)
            if target is None:
                return _wrap(out) if isinstance(args[0], OnDevice) else out
            return _wrap(out) if torch.device(target).type == "cuda" else out
        if func in _INDEXING:
            _check_index(func, args)
        elif func not in _COPIES:
            _check_same_device(func, args, kwargs)
        out = func(*tree_map(_unwrap, args), **tree_map(_unwrap, kwargs))
        if func is aten._local_scalar_dense.default:
            return out
        ins = {id(_inner(t)): t for t in tree_flatten((args, kwargs))[0] if isinstance(t, OnDevice)}
        return tree_map(lambda t: ins.get(id(t), _wrap(t)) if isinstance(t, torch.Tensor) else t,
                        out)


def _inner(t: Any) -> Any:
    return t.inner if isinstance(t, OnDevice) else t


def _unwrap(t: Any) -> Any:
    if isinstance(t, tuple):
        return tuple(_unwrap(x) for x in t)
    return _inner(t)


def _wrap(t: Any) -> Any:
    return OnDevice(t) if isinstance(t, torch.Tensor) and not isinstance(t, OnDevice) else t


def _advanced(index: Any) -> bool:
    parts = index if isinstance(index, tuple) else (index,)
    return any(isinstance(p, (list, torch.Tensor)) for p in parts)


def _any_on_device(index: Any) -> bool:
    return any(isinstance(t, OnDevice) for t in tree_flatten(index)[0])


def _check_same_device(func, args, kwargs) -> None:
    leaves = tree_flatten((args, kwargs))[0]
    if not any(isinstance(t, OnDevice) for t in leaves):
        return
    for t in leaves:
        if isinstance(t, torch.Tensor) and not isinstance(t, OnDevice) and t.dim() > 0:
            raise _mixed(str(func))
        if isinstance(t, torch.Generator) and t.device.type != "cuda":
            raise RuntimeError(f"Expected a 'cuda' device type for generator but found "
                               f"'{t.device.type}' ({func})")


def _check_index(func, args) -> None:
    """CPU indexes into a CUDA tensor are allowed; CUDA indexes into a CPU tensor are not, nor
    are values of one device put into a tensor of the other (CPU scalars aside)."""
    target, rest = args[0], args[2:] if len(args) > 2 else ()
    if not isinstance(target, OnDevice) and _any_on_device(args[1]):
        raise _mixed(f"{func}: CUDA indexes into a CPU tensor")
    for value in rest[:1]:
        if isinstance(value, torch.Tensor) and value.dim() > 0 \
                and isinstance(value, OnDevice) != isinstance(target, OnDevice):
            raise _mixed(f"{func}: values on another device")


def _is_cuda(device: Any) -> bool:
    return isinstance(device, (str, torch.device)) and torch.device(device).type == "cuda"


class FakeCuda(TorchFunctionMode):
    """``device="cuda"`` makes `OnDevice` tensors and ``.to("cuda")`` moves to them (this
    thread only: enter it on every thread that runs the engine)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.to:
            return _to(args[0], list(args[1:]), kwargs)
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
            return _wrap(func(*args, **kwargs))
        return func(*args, **kwargs)


def _to(src: torch.Tensor, rest: list, kwargs: dict) -> torch.Tensor:
    device = kwargs.pop("device", None)
    for i, a in enumerate(rest):
        if isinstance(a, (str, torch.device)):
            device, rest[i] = a, None
    rest = rest if any(a is not None for a in rest) else []
    out = _inner(src).to(*rest, **kwargs)
    if device is None:
        return _wrap(out) if isinstance(src, OnDevice) else out
    if _is_cuda(device):
        if isinstance(src, OnDevice) and out is _inner(src):
            return src
        return OnDevice(out.clone() if out is _inner(src) else out)
    return out.clone() if isinstance(src, OnDevice) and out is _inner(src) else out


def to_fake_cuda(module: torch.nn.Module) -> torch.nn.Module:
    """``module`` with its weights and buffers as `OnDevice` tensors, in place (tied weights
    stay tied)."""
    moved: dict[int, OnDevice] = {}
    for mod in module.modules():
        for store in (mod._parameters, mod._buffers):
            for name, t in list(store.items()):
                if t is not None:
                    store[name] = moved.setdefault(id(t), OnDevice(t.detach()))
    return module
