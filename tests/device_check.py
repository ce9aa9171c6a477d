"""A device check without a device: `on_device()` emulates "the models live on an accelerator, a
tensor made without a device lives on the host" while every tensor stays on the CPU, and raises what CUDA
raises ("Expected all tensors to be on the same device ...") where an op mixes the two. An entry point that
forgets to move its inputs to the model's device fails here, in CI, as it would on a GPU.

    with on_device(policy, reward_model):   # these models' weights are on the device
        llm_rlhf.train_ppo(policy=policy, reward_model=reward_model, ...)

A tensor is *placed* (on the device) when it is
  - a parameter, buffer or gradient of a model given to `on_device` or `place`;
  - the result of `Tensor.to(device)` / `.cuda()` / `.to(device=...)` / `.to(other_tensor_placed)`, or of
    `nn.Module.to(device)` (each weight's `.to`), so what the library moves itself (`accelerator.prepare`,
    the Trainer, `model.to(device)`) is placed too, and a model it forgets to move stays on the host;
  - made by a factory with an explicit device (`torch.zeros(..., device=x.device)`, `new_*` / `*_like` of a
    placed tensor);
  - the output of any op with a placed input.
Everything else is on the *host*: a tokenizer's `return_tensors="pt"`, `torch.tensor(list)`, `torch.load`,
safetensors, a DataLoader's batch, `.cpu()`, `.to("cpu")` (a literal "cpu": a device object, as
`model.device` or `accelerator.device` give on a CPU machine, counts as the device).

Placement is kept per storage (a weak set of `UntypedStorage` objects, which torch keeps alive with their
tensors), so views, `.data` and `param.data = ...` (what `nn.Module.to` does) keep it. A move between host
and device returns a copy, as a real move does, so the tensor moved from keeps its own placement.

What CUDA allows is allowed (see `_mixing_allowed`): a 0-dim host tensor in an op with placed ones (CUDA
takes CPU scalars), copies across devices (`copy_`, `.to`, setting `.data`), indexing a placed tensor with
host indices or assigning host values into it. `.numpy()` of a placed tensor raises as CUDA's does.

Only ops that pass through `__torch_function__` at the top level are seen: what an op does inside (or what
autograd's engine does in backward) is not, its outputs are tagged by its inputs.
"""

from __future__ import annotations

import contextlib
import weakref

import torch
from torch.overrides import TorchFunctionMode

MESSAGE = "Expected all tensors to be on the same device, but found at least two devices, cuda:0 and cpu!"


def _tensors(obj, out: list) -> list:
    """The tensors in an op's arguments: tensors, and those in tuples, lists and dicts (torch.cat's list)."""
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            _tensors(item, out)
    elif isinstance(obj, dict):
        for item in obj.values():
            _tensors(item, out)
    return out


def _is_device(value) -> bool:
    return isinstance(value, (str, int, torch.device)) and not isinstance(value, bool)


def _names_host(device) -> bool:
    """A device argument that says "the host" in any world: the literal string 'cpu'. A torch.device object is
    what `model.device` or `accelerator.device` gives (cpu on this machine, cuda on a GPU): the device."""
    return isinstance(device, str) and device.split(":")[0] == "cpu"


def _to_target(args, kwargs):
    """What `Tensor.to(...)` moves to: (True, placed?) with a device (or another tensor), (False, None) for a
    dtype-only call. The forms: to(device, dtype), to(dtype), to(tensor), to(device=..., dtype=...)."""
    if "device" in kwargs and kwargs["device"] is not None:
        return True, not _names_host(kwargs["device"])
    for arg in args[1:]:
        if isinstance(arg, torch.Tensor):
            return True, None  # placed as that tensor is: decided by the caller
        if isinstance(arg, torch.dtype):
            return False, None
        if _is_device(arg):
            return True, not _names_host(arg)
    return False, None


class DevicePlacement(TorchFunctionMode):
    """The tracer; use `on_device`. `placed` holds the storages on the device, `placed_objects` the tensors
    without a storage (oneDNN's prepacked weights, the fast sampler's on an AMD CPU) that are."""

    def __init__(self):
        super().__init__()
        self.placed: weakref.WeakSet = weakref.WeakSet()
        self.placed_objects: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # by id()

    # --- the tags ------------------------------------------------------------------------------------------

    def is_placed(self, t: torch.Tensor) -> bool:
        try:
            return t.untyped_storage() in self.placed
        except (RuntimeError, NotImplementedError):  # no storage (oneDNN's prepacked weights): the tensor
            return self.placed_objects.get(id(t)) is t

    def tag(self, obj, placed: bool) -> None:
        if placed:
            for t in _tensors(obj, []):
                try:
                    self.placed.add(t.untyped_storage())
                except (RuntimeError, NotImplementedError):
                    self.placed_objects[id(t)] = t

    def place(self, *models) -> None:
        """Declare each model (an nn.Module, or anything with `parameters()`/`buffers()`) on the device."""
        for model in models:
            if isinstance(model, (list, tuple)):
                self.place(*model)
                continue
            tensors = list(model.parameters())
            if hasattr(model, "buffers"):
                tensors += list(model.buffers())
            self.tag(tensors, True)

    # --- every op --------------------------------------------------------------------------------------------

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        tensors = _tensors(args, []) + _tensors(kwargs, [])
        placed = [self.is_placed(t) for t in tensors]

        if name in ("to", "cuda", "cpu"):
            return self._move(func, name, args, kwargs, tensors, placed)
        if name in ("numpy", "__array__") and any(placed):
            raise TypeError(
                "can't convert cuda:0 device type tensor to numpy. Use Tensor.cpu() to copy the tensor to "
                "host memory first."
            )
        if any(placed) and not self._mixing_allowed(name, tensors, placed):
            host = [tuple(t.shape) for t, p in zip(tensors, placed) if not p and t.dim() > 0]
            if host:
                raise RuntimeError(f"{MESSAGE} (device_check: {name} got host tensors of shapes {host})")

        out = func(*args, **kwargs)
        device = kwargs.get("device")
        if device is not None and _is_device(device):  # a factory (or *_like, new_*) told where
            self.tag(out, not _names_host(device))
        elif name == "__get__" and tensors and placed[0]:  # .grad, .data of a placed tensor
            self.tag(out, True)
        elif any(placed) and name not in ("__set__", "copy_", "__setitem__"):
            self.tag(out, True)  # copy_ and setters write into their first argument: it keeps its place
        return out

    def _move(self, func, name, args, kwargs, tensors, placed):
        """.to / .cuda / .cpu: a copy when the placement changes (a real move copies), the tensor itself when
        it does not (as torch returns self)."""
        source = args[0]
        if name == "cuda":
            moves, target = True, True
        elif name == "cpu":
            moves, target = True, False
        else:
            moves, target = _to_target(args, kwargs)
            if moves and target is None:  # to(other_tensor)
                target = placed[1] if len(placed) > 1 else False
        if name == "cuda" and not torch.cuda.is_available():
            args, kwargs = (source,), {}  # no CUDA here: the move is a copy on the CPU
            func = torch.Tensor.cpu
        out = func(*args, **kwargs)
        if not moves or target == placed[0]:
            self.tag(out, placed[0])  # a dtype change keeps the place; no move
            return out
        if out is source or out.untyped_storage() is source.untyped_storage():
            out = out.clone()  # torch returned self on the CPU: a move gives a new tensor
        self.tag(out, target)
        return out

    @staticmethod
    def _mixing_allowed(name: str, tensors: list, placed: list) -> bool:
        """Ops CUDA runs with placed and host tensors together.
        - copy_ and setting .data/.grad (`__set__`): copies across devices are what they are for; the Module.to
          of a host model sets each weight's .data to its placed copy this way.
        - `_has_compatible_shallow_copy_type`, `is_same_size`: questions about types and shapes, no data.
        - indexing a placed tensor (`__getitem__`, `__setitem__`) with host indices or host values: torch
          moves them (`cuda_t[cpu_idx]`, `cuda_t[0:2] = cpu_t`); a host tensor indexed by placed indices is not
          allowed on CUDA and raises here.
        """
        if name in ("copy_", "__set__", "_has_compatible_shallow_copy_type", "is_same_size"):
            return True  # the last two compare types and shapes (nn.Module._apply's), no data
        if name in ("__getitem__", "__setitem__"):
            return placed[0]
        return False


@contextlib.contextmanager
def on_device(*models):
    """Run the body under the placement tracer with `models` (nn.Modules, `RewardModel`s, lists of them)
    declared on the device. Yields the tracer (`.place(model)` declares more, `.is_placed(t)`)."""
    tracer = DevicePlacement()
    tracer.place(*[m for m in models if m is not None])
    with tracer:
        yield tracer
