"""A guard over parameters whose all-gather is still in flight between step() and the next forward.

[Note: reads before the next forward]
With the deferred parameter gather ([Note: deferred parameter gather] in param_gather.py) step()
returns while the other ranks' slices are still arriving in each unit's full buffer. zeroshard's
own readers wait for them; a script's own read between step() and the next forward (an EMA update
`ema_p.lerp_(p, 1e-3)`, `p.data.clamp_(...)`, `p.norm()` for a log line) is caught by this
TorchFunctionMode, which step() pushes on the calling thread's mode stack: the first torch call that
touches a gathering buffer (a parameter, `p.data`, any view on the same storage, also one taken
before the step) waits for every gather first, then runs. The next forward, or any wait for all
gathers, takes the guard off the stack again.
  * Metadata queries (`shape`, `dtype`, `.grad`, `size()`, ...) need no values and do not wait, so
    `module.zero_grad()` keeps the overlap; a call that touches nothing (the data loader's
    collation, `loss.item()`) costs one Python call and a scan of its arguments.
  * torch's modes leave a `with` by popping the top of the stack, whatever it is. A mode entered
    before step() and left before the forward would pop ours and leave its own on the stack, so
    the guard is pushed only onto a stack that holds nothing but other engines' guards (two
    engines stepped in turn, a GAN's): inside a TorchFunctionMode, under `with torch.device(...)`
    or after `torch.set_default_device`, step() waits for its gathers as without the overlap.
    Modes entered after step() sit above the guard, and the guard is taken out from under them
    without disturbing them.
  * The stack is per thread: a read from another thread is not seen (zeroshard's own readers wait
    on any thread). Nor is a DTensor parameter's `.data` (a new DTensor, recognised by no storage),
    and a torch.compile'd function called in between runs with the mode on the stack (not tried).
    `zeroshard.overlap_param_gather: false` turns the overlap off.
The guard uses torch's (private) mode-stack accessors to take itself out from under other modes;
nothing of torch is patched.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch.overrides import TorchFunctionMode

_T = torch.Tensor
# Answered from a tensor's metadata or autograd state: they read no values (also used by
# compat/zero/init.py, whose stubs have shapes and no values).
METADATA = frozenset(
    [getattr(_T, name).__get__ for name in (
        "shape", "dtype", "device", "requires_grad", "is_leaf", "grad", "grad_fn", "ndim", "is_cuda", "is_meta",
        "is_sparse", "is_quantized", "is_nested", "layout", "names", "_version", "output_nr", "itemsize", "nbytes")
     if hasattr(_T, name)]
    + [_T.requires_grad.__set__, _T.grad.__set__, _T.dim, _T.size, _T.numel, _T.nelement, _T.element_size,  # type: ignore[attr-defined, union-attr]  # descriptors: torch's stubs type them as their values
       _T.is_floating_point, _T.is_complex, _T.get_device, _T.requires_grad_, _T.register_hook,
       _T.register_post_accumulate_grad_hook, _T.new, _T.new_empty, _T.new_zeros, _T.new_ones, _T.new_full,
       _T.__len__, _T.__hash__])


def _storage_ptr(value) -> int | None:
    if type(value) not in (torch.Tensor, torch.nn.Parameter):  # a subclass (DTensor) has no plain storage
        return None
    try:
        return value.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # sparse and other layouts without one storage
        return None


class ReadGuard(TorchFunctionMode):
    """See [Note: reads before the next forward]. `wait` completes every gather in flight."""

    def __init__(self, wait: Callable[[], None]):
        super().__init__()
        self._wait = wait
        self._storages: frozenset[int] = frozenset()  # data pointers of the gathering buffers' storages
        self._params: frozenset[int] = frozenset()  # ids of tensors that have no plain storage (DTensor)
        self.armed = False
        self.on_stack = False
        self._handling = False
        self.waits = 0  # reads that waited (tests count them)

    def watch(self, buffers: list[torch.Tensor | None], params: list[torch.Tensor]) -> None:
        self._storages = frozenset(filter(None, (_storage_ptr(b) for b in buffers)))
        self._params = frozenset(id(p) for p in params if _storage_ptr(p) is None)

    # -- on the stack ------------------------------------------------------------------------------
    def push(self) -> bool:  # type: ignore[override]  # ours arms this guard; torch's is a deprecated classmethod
        """Arm the guard on this thread's mode stack, empty but for other engines' guards; False
        (nothing pushed) where other modes are."""
        if self.on_stack:
            self.armed = True
            return True
        stack = torch._C._len_torch_function_stack()
        if any(not isinstance(torch._C._get_function_stack_at(i), ReadGuard) for i in range(stack)):
            return False
        torch._C._push_on_torch_function_stack(self)
        self.on_stack = self.armed = True
        return True

    def pop(self) -> None:
        """Disarm, and take the guard off the stack wherever it sits (modes above it stay, in order).
        Inside the guard's own handler torch has set it aside and puts it back afterwards: it is then
        only disarmed, and taken off by the next call from outside."""
        self.armed = False
        if not self.on_stack or self._handling:
            return
        above = []
        while torch._C._len_torch_function_stack() > 0:
            mode = torch._C._pop_torch_function_stack()
            if mode is self:
                self.on_stack = False
                break
            above.append(mode)
        for mode in reversed(above):
            torch._C._push_on_torch_function_stack(mode)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.armed and func not in METADATA and (self._touches(args) or self._touches(kwargs.values())):
            self.armed, self._handling = False, True
            self.waits += 1
            try:
                self._wait()
            finally:
                self._handling = False
        return func(*args, **kwargs)

    def _touches(self, values) -> bool:
        for value in values:
            if isinstance(value, (list, tuple)):  # torch._foreach_*(tensors, ...), torch.cat(...)
                if self._touches(value):
                    return True
            elif isinstance(value, torch.Tensor):
                ptr = _storage_ptr(value)
                if (ptr in self._storages) if ptr is not None else id(value) in self._params:
                    return True
        return False
