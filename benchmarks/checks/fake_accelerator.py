"""A fake accelerator: a second torch device, ``fakegpu``, that computes on the CPU, for catching device bugs in CI.

On a GPU machine the model, its activations and whatever the code builds with ``device=x.device`` live on the GPU,
while a tensor built without a device (``torch.ones(n, k)``, ``torch.tensor(list)``, a collator's batch) lands on
the CPU; an operation that meets both fails ("Expected all tensors to be on the same device"). On a CPU-only machine
both are CPU tensors and nothing fails. Inside ``fake_accelerator()`` the accelerator is ``fakegpu``: torch's
PrivateUse1 backend registered from Python (``torch.utils.backend_registration``), with ``torch.accelerator`` and
accelerate (``ACCELERATE_TORCH_DEVICE``) pointing at it, so Trainer and our device choice move the model there as
they would to a GPU. Its tensors are ``OnFake`` wrappers around CPU tensors; one dispatch mode runs every aten
operation on the wrapped CPU tensors and enforces CUDA's placement rules:

- an operation mixing a ``fakegpu`` tensor with a CPU tensor raises, as CUDA does (a 0-dimensional CPU tensor is a
  scalar CUDA accepts in an elementwise operation, torch's ``pointwise`` tag, not in ``cat`` or ``stack``; CPU index
  tensors in indexing are accepted, as CUDA does);
- ``.to("fakegpu")``, ``device="fakegpu"`` factories and ``torch.tensor(..., device=)`` give ``fakegpu`` tensors;
  ``.cpu()`` gives a plain CPU tensor; ``.numpy()`` of a ``fakegpu`` tensor raises, as for a CUDA tensor.

What it cannot catch: CUDA-only code paths (``if device.type == "cuda"``: memory statistics, TF32, bf16 autocast on
the GPU), kernels or dtypes the GPU lacks or computes differently, streams and asynchrony, out-of-memory, and
anything in the C++ of a library that reads a tensor's memory directly (it would fail here, never pass wrongly).
The arithmetic is the CPU's, so results equal a CPU run's; only placement is checked. About 3-5x slower than plain
CPU (a Python call per operation).
"""

from __future__ import annotations

import contextlib
import os

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

NAME = "fakegpu"
aten = torch.ops.aten

# operations CUDA runs with CPU tensors among their arguments: copies between devices, and indexing with CPU indices
_CROSS_DEVICE = {aten._to_copy.default, aten.copy_.default, aten.index.Tensor, aten.index_put_.default,
                 aten._index_put_impl_.default, aten.index_put.default, aten.lift_fresh.default,
                 aten._has_compatible_shallow_copy_type.default}
_HOST_BUILT = {torch.tensor, torch.as_tensor, torch.asarray, torch.scalar_tensor}


_ACTIVE = [False]  # inside fake_accelerator(): the backend says it is available only there


def _register() -> None:
    """torch's PrivateUse1 backend named ``fakegpu``, once per process (torch allows one rename); available (to
    torch.accelerator, `--device fakegpu`) only inside ``fake_accelerator()``, so that other tests of the process
    still see a machine without an accelerator."""
    if torch._C._get_privateuse1_backend_name() == NAME:
        return
    from torch.utils import backend_registration as registration

    if not hasattr(registration, "_setup_privateuseone_for_python_backend"):  # experimental in torch 2.13
        raise RuntimeError(f"torch {torch.__version__} has no torch.utils.backend_registration."
                           "_setup_privateuseone_for_python_backend: the fake accelerator cannot register its device; "
                           "find its successor in torch's test/test_privateuseone_python_backend.py")

    class Hooks(registration._DummyPrivateUse1Hook):
        def is_available(self) -> bool:
            return _ACTIVE[0]

    class Module(registration._DummyBackendModule):
        def is_available(self) -> bool:
            return _ACTIVE[0]

        def device_count(self) -> int:
            return int(_ACTIVE[0])

    registration._setup_privateuseone_for_python_backend(NAME, backend_module=Module(), hook=Hooks())


_register()
FAKE = torch.device(NAME, 0)


class OnFake(torch.Tensor):
    """A tensor on ``fakegpu``: a CPU tensor (``elem``) behind a tensor whose device says ``fakegpu:0``."""

    elem: torch.Tensor
    __slots__ = ["elem"]

    @staticmethod
    def __new__(cls, elem: torch.Tensor):
        wrapper = torch.Tensor._make_wrapper_subclass(
            cls, elem.shape, strides=elem.stride(), storage_offset=elem.storage_offset(), dtype=elem.dtype,
            layout=elem.layout, device=FAKE, requires_grad=elem.requires_grad)
        wrapper.elem = elem
        return wrapper

    def __repr__(self) -> str:
        return f"OnFake({self.elem!r})"

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return NotImplemented  # the mode handles every operation

    def __reduce_ex__(self, protocol):  # torch.save of a fakegpu tensor: saved as a CUDA tensor would be, on the CPU
        return torch._utils._rebuild_tensor_v2, _host_state(self.elem)

    def __deepcopy__(self, memo):
        return OnFake(self.elem.clone())


def _host_state(tensor):
    return torch.Tensor.__reduce_ex__(tensor.detach(), 2)[1]


def _is_fake(device) -> bool:
    return device is not None and torch.device(device).type == NAME


class _Placement(TorchDispatchMode):
    """Every aten operation, run on the CPU tensors behind ``OnFake`` under CUDA's rules of placement."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is aten.is_pinned.default:  # pinned host memory is the accelerator's; here it is plain CPU memory
            return False
        if func is aten._pin_memory.default:
            return args[0].clone()
        flat, _ = tree_flatten((args, kwargs))
        on_fake = any(isinstance(t, OnFake) for t in flat)
        # CUDA takes a 0-dimensional CPU tensor as a scalar in an elementwise operation only (not in cat, stack, ...)
        scalars = torch.Tag.pointwise in func.tags
        on_host = [t for t in flat if isinstance(t, torch.Tensor) and not isinstance(t, OnFake)  # Parameters too
                   and t.device.type == "cpu" and (t.dim() > 0 or not scalars)]
        if on_fake and on_host and func not in _CROSS_DEVICE:
            shapes = ", ".join(str(tuple(t.shape)) for t in on_host)
            raise RuntimeError(f"Expected all tensors to be on the same device, but found at least two devices, "
                               f"{FAKE} and cpu! ({func}: CPU tensors of shape {shapes} beside {NAME} tensors)")
        device = kwargs.get("device")
        if _is_fake(device):
            kwargs = {**kwargs, "device": torch.device("cpu")}
        out = func(*tree_map(_unwrap, args), **tree_map(_unwrap, kwargs))
        if func is aten.copy_.default:
            return args[0]  # copy_ writes into its first argument: keep the caller's tensor (and its device)
        onto_fake = _is_fake(device) or (on_fake and device is None and func is not aten._local_scalar_dense.default)
        if func is aten._to_copy.default and device is not None and not _is_fake(device):
            onto_fake = False
        return tree_map(_wrap, out) if onto_fake else out


class _HostBuilt(TorchFunctionMode):
    """torch.tensor(data, device="fakegpu") builds on the CPU then moves (these calls reach no dispatch mode); a
    fakegpu tensor's .numpy() raises as a CUDA tensor's does; its .tolist() reads it, as CUDA does."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _HOST_BUILT and _is_fake(kwargs.get("device")):
            return func(*args, **{**kwargs, "device": "cpu"}).to(FAKE)
        if func is torch.Tensor.numpy and isinstance(args[0], OnFake):
            raise TypeError(f"can't convert {FAKE} device type tensor to numpy. Use Tensor.cpu() to copy the tensor "
                            "to host memory first.")
        if func in (torch.Tensor.tolist, torch.Tensor.__array__) and isinstance(args[0], OnFake):
            return func(args[0].cpu(), *args[1:], **kwargs)
        return func(*args, **kwargs)


_TorchGenerator = torch.Generator


class _Generator(_TorchGenerator):
    """torch.Generator(device="fakegpu") draws on the CPU (a Python backend cannot make device generators); the
    operations that take it run on the CPU tensors behind OnFake anyway."""

    def __new__(cls, device="cpu"):
        return _TorchGenerator("cpu" if _is_fake(device) else device)


def _unwrap(value):
    return value.elem if isinstance(value, OnFake) else value


def _wrap(value):
    return OnFake(value) if type(value) is torch.Tensor else value


@contextlib.contextmanager
def fake_accelerator():
    """Inside: torch.accelerator is ``fakegpu``, and Trainer/accelerate and loramcl's device choice pick it."""
    from accelerate.state import AcceleratorState

    from loramcl.mcl import build

    previous = os.environ.get("ACCELERATE_TORCH_DEVICE")
    os.environ["ACCELERATE_TORCH_DEVICE"] = NAME
    AcceleratorState._reset_state(reset_partial_state=True)  # accelerate keeps its device in a process-wide state
    torch.Generator, _ACTIVE[0] = _Generator, True
    plain = build.PLAIN_WEIGHTS
    build.PLAIN_WEIGHTS = (*plain, OnFake)  # a CUDA weight is a plain Parameter; here it wears OnFake
    try:
        with _HostBuilt(), _Placement():
            yield FAKE
    finally:
        torch.Generator, _ACTIVE[0] = _TorchGenerator, False
        build.PLAIN_WEIGHTS = plain
        AcceleratorState._reset_state(reset_partial_state=True)
        if previous is None:
            os.environ.pop("ACCELERATE_TORCH_DEVICE", None)
        else:
            os.environ["ACCELERATE_TORCH_DEVICE"] = previous
