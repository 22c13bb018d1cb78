"""A flat group's gradients: the full buffer a unit's backward fills, the reduced shard the step
reads, and the slice set aside between two reductions ([Note: a fresh full gradient], [Note: gradient
shard lifetime], [Note: a second reduction before the step (stages 0/1)]).

`GradientBuffers` is the gradient half of `FlatGroup` (group.py), which sets what it reads: `policy`,
`layout`, `grad_dtype`, `device`, `rank`, `trainable`, `grad_store`, `tp_specs`, `opt_range`, and the
state it keeps: `full_grad`, `grad_shard`, `reduced_slice`, `holds_reduced_slice`, `grad_seen`. This
module holds state and does arithmetic; the reductions are issued by unit.py through comm.py.
"""

from __future__ import annotations

import torch


# [Note: spent full gradients reused]
# At stages 2/3 each unit's full gradient is made empty by its first gradient and dropped once its
# reduce-scatter is waited for. A block of the 202M GPT has a 50 MB one, above glibc's largest
# mmap threshold (32 MB), so every unit's buffer was fresh pages: 123 thousand first-touch faults
# on the main thread a step, 470 ms of the gradient copy's 472 (docs/performance.md, "Twelfth
# session"). Within one backward a buffer whose reduction completed is handed to the next unit of
# the same size instead (`SpentGradients`); its stale values are treated as an empty buffer's
# ([Note: a fresh full gradient]). Only buffers of completed reductions are kept (an abandoned one
# may still be written by a peer), and none outlives the backward: Lifecycle.end_backward and
# abort clear them, so the step and the next forward hold what they held before.
class SpentGradients:
    """Full-gradient buffers of completed reductions, by (numel, dtype, device), for this backward."""

    def __init__(self):
        self._free: dict[tuple, list[torch.Tensor]] = {}

    def give(self, tensor: torch.Tensor) -> None:
        self._free.setdefault((tensor.numel(), tensor.dtype, tensor.device), []).append(tensor)

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        kept = self._free.get((numel, dtype, device))
        return kept.pop() if kept else torch.empty(numel, dtype=dtype, device=device)

    def clear(self) -> None:
        self._free.clear()


class GradientBuffers:
    """Mixed into FlatGroup: every gradient buffer of one flat group and how it changes."""

    # The state it keeps, which FlatGroup.__init__ sets (declared here for the type checker).
    full_grad: torch.Tensor | None
    grad_shard: torch.Tensor | None
    reduced_slice: torch.Tensor | None
    _unwritten: list[bool] | None
    _scaled: list[bool] | None

    @property
    def grads_persist_full(self) -> bool:
        """Stages 0/1: the full gradient buffer lives across micro steps."""
        return not self.policy.shard_gradients

    @property
    def grad_shard_is_transient(self) -> bool:
        """Is the gradient shard freed after each step ([Note: gradient shard lifetime])? Stages 2/3
        with the shard in compute memory; a store's shard stays where the store put it."""
        return self.trainable and not self.grads_persist_full and self.grad_store is None

    def grad(self) -> torch.Tensor | None:
        """The gradient this rank accumulates: the full buffer (stages 0/1) or its shard (2/3),
        zeros where nothing was reduced since the last step."""
        if self.grads_persist_full:
            self.complete_full_grad()  # [Note: zeroed when first read]
            return self.full_grad
        return self._own_grad_shard() if self.trainable else None

    def zeros_full_grad(self) -> torch.Tensor:
        return torch.zeros(self.layout.padded_numel, dtype=self.grad_dtype, device=self.device)

    # [Note: a fresh full gradient]
    # At stages 2/3 a unit's full gradient buffer is made by its first gradient of each backward and
    # freed once reduced. Zero filling it and adding each gradient to the zeros wrote and read the
    # whole buffer once more per unit (the 202M GPT: 0.45 s of main-thread CPU per step in
    # add_grad, docs/performance.md): so it is allocated empty, a slot's first gradient is copied
    # in, later ones (a tied or reused parameter) are added, and `complete_full_grad` zeroes what
    # no gradient wrote (slots without one, the padding) before the reduction reads the buffer.
    # Bit for bit 0 + g, except that a -0.0 stays -0.0 (DDP keeps it too; no update it feeds differs).
    def add_grad(self, index: int, grad: torch.Tensor, scale: float | None = None) -> None:
        """Add a parameter's gradient to its slot. `scale`: the backward reduces this buffer, which
        is multiplied by it first ([Note: the pre-divide in the copy])."""
        if self.full_grad is None:
            self.full_grad = self.spent.take(self.layout.padded_numel, self.grad_dtype, self.device)
            self._mark_unwritten()
        slot = self.layout.slots[index]
        if self.tp_specs[index] is not None:
            grad = self.tp_specs[index].local_grad(grad)
        target = self.full_grad[slot.offset : slot.offset + slot.numel]
        grad = grad.reshape(-1)
        if self._scaled is not None and self._scaled[index]:
            target.add_(grad, alpha=scale)  # a second gradient in the same backward (a pipeline's)
        elif self._unwritten is not None and self._unwritten[index]:
            if scale is not None and grad.dtype == target.dtype:
                torch.mul(grad, scale, out=target)
                self._scaled = self._scaled or [False] * len(self.layout.slots)
                self._scaled[index] = True
            else:
                target.copy_(grad)
            self._unwritten[index] = False
        else:
            target.add_(grad)
        self.grad_seen[index] = True

    # [Note: the pre-divide in the copy]
    # A reduction pre-divides the buffer by the world size (unit.py reduce_grads), one more pass over
    # it after the copies that filled it (15 ms of the 33.7M GPT's step at stage 0,
    # docs/performance.md). DDP multiplies each gradient by 1/N as it copies it into its bucket; so
    # does add_grad when the backward will reduce (`scale`) and the slot is written for the first
    # time in the window: torch.mul(grad, 1/N, out=slot) is the copy followed by mul_(1/N), element
    # for element. `_scaled` marks those slots; `prescale` multiplies the others (accumulated over
    # earlier micro-steps, or of another dtype than the buffer) and clears the marks. A second
    # gradient into a marked slot before the reduction is added times 1/N: exact for N a power of two
    # (a /2^k is exact), within one rounding of (a + b)/N otherwise.
    def prescale(self, scale: float) -> None:
        """Multiply by `scale` what add_grad did not, before a reduction."""
        marks, self._scaled = self._scaled, None
        assert self.full_grad is not None  # what is about to be reduced
        if marks is None:
            self.full_grad.mul_(scale)
            return
        for slot, done in zip(self.layout.slots, marks):
            if not done:
                self.full_grad[slot.offset : slot.offset + slot.numel].mul_(scale)

    # [Note: zeroed when first read]
    # Stages 0/1 keep their full gradient buffer across steps. Zeroing it in zero_grads and adding the
    # next backward's gradients to the zeros wrote the buffer once more per step and read it once
    # more per gradient (6 ms of the 33.7M GPT's step, docs/performance.md); DDP copies a bucket's
    # first gradient instead. So zero_grads (and setting the reduced slice aside) only marks every
    # slot unwritten, as a fresh buffer's are ([Note: a fresh full gradient]), and the stale values
    # stay until a gradient is copied over them; whoever reads the buffer otherwise goes through
    # `grad()` / `grad_for_optimizer()` (a checkpoint, safe_*_grad, a step without a backward) or the
    # reduction, which first zero what is still unwritten.
    def _mark_unwritten(self) -> None:
        self._unwritten = [True] * len(self.layout.slots)
        self._scaled = None

    def complete_full_grad(self) -> None:
        """Zero what no gradient wrote since the buffer was made or marked unwritten ([Note: a fresh
        full gradient], [Note: zeroed when first read]); no-op when nothing is marked."""
        if self.full_grad is None or self._unwritten is None:
            return
        for slot, unwritten in zip(self.layout.slots, self._unwritten):
            if unwritten:
                self.full_grad[slot.offset : slot.offset + slot.numel].zero_()
        self.full_grad[self.layout.numel :].zero_()  # the padding
        self._unwritten = None

    def note_loaded_grads(self) -> None:
        """Gradients accumulated before a checkpoint (saved mid-window) were loaded: a slot counts
        as having had a gradient where the part held here is non-zero (the checkpoint does not say
        which had one; the step's all-reduce of these flags joins every rank's part)."""
        grad = self.grad()
        assert grad is not None  # a trainable group's, which a checkpoint gave values
        start = 0 if self.grads_persist_full else self.layout.shard_range(self.rank)[0]
        end = start + grad.numel()
        for index, slot in enumerate(self.layout.slots):
            lo, hi = max(start, slot.offset), min(end, slot.offset + slot.numel)
            if lo < hi and bool(grad[lo - start : hi - start].any()):
                self.grad_seen[index] = True

    def drop_full_grad(self) -> None:
        """Stages 2/3, its reduction completed: the full gradient goes to the next unit of this
        backward ([Note: spent full gradients reused])."""
        self.spent.give(self.full_grad)
        self.full_grad = None

    # [Note: gradient shard lifetime]
    # At stages 2/3 the reduced gradient shard (this rank's 1/N of the gradients, 4Ψ/N bytes in fp32)
    # is needed only from the window's first reduction to its step. Kept allocated between steps and
    # zeroed, as a persistent buffer would be, it sits under the next forward's activations, the
    # largest thing a training step allocates: so it is freed by the step and by zero_grads (what
    # torch's zero_grad(set_to_none=True) does for FSDP2's sharded gradients), and the first
    # reduce-scatter of the next backward lands in a tensor that becomes the shard (`add_reduced`),
    # while the activations of the units already done are being freed. Later micro-steps of the
    # window add into it. Bit for bit the same as adding into zeros, except that a -0.0 stays -0.0
    # (DDP keeps it too; no update it feeds differs). Whoever reads or writes the gradient outside
    # a backward (checkpoint, safe_*_grad, a step with no backward) gets zeros made on demand.
    # Shards in an offload store keep the store's tensor for good (the store's memory is elsewhere).
    def add_reduced(self, out: torch.Tensor) -> None:
        """Stages 2/3: take one reduction's output (1-D, numel = shard_numel) into the shard."""
        if (
            self.grad_shard is None
            and self.grad_shard_is_transient
            and out.dtype == self.grad_dtype
            and out.device == self.device
        ):
            self.grad_shard = out
        else:
            shard = self._own_grad_shard()
            shard.add_(out.to(shard.device))  # accumulate; offload: to host

    def _own_grad_shard(self) -> torch.Tensor:
        if self.grad_shard is None:
            self.grad_shard = torch.zeros(self.layout.shard_numel, dtype=self.grad_dtype, device=self.device)
        return self.grad_shard

    def free_grad_shard(self) -> None:
        """The step no longer needs this group's gradient ([Note: gradient shard lifetime])."""
        if self.grad_shard_is_transient:
            self.grad_shard = None

    def grad_for_optimizer(self) -> torch.Tensor:
        """The reduced gradient matching `master`, in grad_dtype."""
        if not self.grads_persist_full:
            return self._own_grad_shard()
        self.complete_full_grad()  # [Note: zeroed when first read]
        start, end = self.opt_range
        assert self.full_grad is not None  # stages 0/1 keep it
        return self.full_grad[start:end]

    def zero_grads(self) -> None:
        """Discard every gradient since the last step: accumulated, reduced, set aside, and (stages
        2/3) a full gradient a failed backward left unreduced."""
        if self.grads_persist_full and self.full_grad is not None:
            self._mark_unwritten()  # [Note: zeroed when first read]
        elif not self.grads_persist_full:
            self.full_grad = None
        if self.grad_shard_is_transient:
            self.grad_shard = None  # [Note: gradient shard lifetime]
        elif self.grad_shard is not None:
            self.grad_shard.zero_()
        self.reduced_slice = None
        self.holds_reduced_slice = False
        self.grad_seen = [False] * len(self.layout.slots)

    # [Note: a second reduction before the step (stages 0/1)]
    # Stages 0/1 reduce the full gradient buffer in place (stage 1 reduce-scatters it): afterwards this
    # rank's slice (stage 0: the whole buffer) holds the reduced gradient and, at stage 1, the rest of
    # the buffer only stale local values. A script may run another
    # backward before the step (a GAN's discriminator: one backward on real, one on fake data). Adding
    # its local gradients to that buffer and reducing again would mix reduced and local values, so the
    # reduced slice is set aside and the buffer zeroed when the next backward begins, and the slice is
    # added back once that backward's reduction is done: reduced(g1) + reduced(g2), what stages 2/3 do
    # by reducing into a separate grad_shard. Stage 0 could re-reduce reduced(g1) + g2 as DDP does, but
    # that rounds differently from the other stages; one meaning at every stage is the simpler contract.
    def set_aside_reduced_slice(self) -> None:
        if not self.holds_reduced_slice:
            return
        own = self.grad_for_optimizer()
        self.reduced_slice = own.clone() if self.reduced_slice is None else self.reduced_slice.add_(own)
        self._mark_unwritten()  # [Note: zeroed when first read]
        self.holds_reduced_slice = False

    def restore_reduced_slice(self) -> None:
        if self.reduced_slice is not None:
            self.grad_for_optimizer().add_(self.reduced_slice)
            self.reduced_slice = None
        self.holds_reduced_slice = True
