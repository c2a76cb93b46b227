"""Measured memory by tensor bytes (not process RSS, which on CPU is allocator behaviour):
model states held by a rank, and the activations autograd saves during a forward pass."""

from __future__ import annotations

import resource

import torch


# DeepSpeed's gradient-reduction buckets (ZeRO-3 with contiguous_gradients allocates one of
# reduce_bucket_size elements, 5e8 by default: ~1 GB in bf16) are communication buffers, the ZeRO
# paper's "residual states", not model states: they are counted apart.
BUFFER_KEYS = ("ipg_bucket", "ipg_buckets", "ipg_buffer")


def peak_memory_mb(device: torch.device) -> float:
    """The process's peak memory in MB: allocated on a CUDA device, else the peak RSS."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def local_part(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor holding ``t``'s bytes on this rank: a DTensor's local shard (FSDP2, tensor
    parallel), the result inside funcol's AsyncCollectiveTensor, the weight inside torchao's float8
    FSDP2 wrapper; read without an autograd op, so that saved-tensor hooks can call it."""
    while True:
        inner = getattr(t, "_local_tensor", None)  # DTensor
        if inner is None:
            inner = getattr(t, "elem", None)  # AsyncCollectiveTensor
        if inner is None:
            inner = getattr(t, "_tensor", None)  # torchao's float8-all-gathered FSDP2 weight (precision=fp8)
        if not isinstance(inner, torch.Tensor):
            return t
        t = inner


def _storages(obj, seen: dict, depth: int = 0, buffers: dict | None = None) -> None:
    """Collect the storages of every tensor reachable from ``obj`` (dicts, lists, attributes);
    those under a DeepSpeed reduction bucket go to ``buffers`` instead (when given)."""
    if depth > 4:
        return
    if isinstance(obj, torch.Tensor):
        # the tensor, its gradient (FSDP2: a DTensor too) and a ZeRO-3 partition
        for t in (obj, getattr(obj, "grad", None), getattr(obj, "ds_tensor", None)):
            if isinstance(t, torch.Tensor):
                t = local_part(t)
                if t.device.type != "meta":
                    st = t.untyped_storage()
                    if st.nbytes():
                        seen[st.data_ptr()] = st.nbytes()
        return
    if isinstance(obj, dict):
        for v in obj.values():
            _storages(v, seen, depth + 1, buffers)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _storages(v, seen, depth + 1, buffers)
    elif hasattr(obj, "__dict__") and not isinstance(obj, (torch.nn.Module, type)):
        for k, v in vars(obj).items():
            if any(key in k for key in BUFFER_KEYS):
                if buffers is not None:
                    _storages(v, buffers, depth + 1)
                continue
            _storages(v, seen, depth + 1, buffers)


def model_state_bytes(model: torch.nn.Module, optimizer, buffers: dict | None = None) -> int:
    """Bytes of parameters, gradients and optimizer states this rank holds (shared storage once).
    Walks the optimizer object too, so DeepSpeed's fp32 master partitions and gradient partitions
    count; its reduction buckets do not (they go to ``buffers``, storage -> bytes, if given)."""
    seen: dict[int, int] = {}
    for p in model.parameters():
        _storages(p, seen)
    _storages(optimizer, seen, buffers=buffers)
    inner = getattr(optimizer, "optimizer", None)
    if inner is not None:
        _storages(inner.state, seen)
    if buffers is not None:
        for ptr in list(buffers):
            if ptr in seen:  # a bucket that is also model state stays model state
                del buffers[ptr]
    return sum(seen.values())


class SavedActivations:
    """Context manager counting the bytes autograd saves for backward (unique storages)."""

    def __init__(self):
        self.storages: dict[int, int] = {}

    def _pack(self, t: torch.Tensor):
        # parameters and views of them (a linear saves ``weight.t()``) are model state, not activations
        if not isinstance(t if t._base is None else t._base, torch.nn.Parameter) and t.device.type != "meta":
            s = local_part(t).untyped_storage()  # a DTensor (tensor parallel): this rank's part
            self.storages[s.data_ptr()] = s.nbytes()
        return t

    def __enter__(self):
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        self._ctx.__exit__(*exc)

    @property
    def bytes(self) -> int:
        return sum(self.storages.values())


def activation_peak_tracker():
    """torch's MemTracker (tensor bytes by category, per op), extended to keep the running maximum
    of activation + temporary bytes: the peak activation memory, wherever in forward or backward
    it occurs (MemTracker itself only snapshots the moment of the peak *total*). Use as a context
    manager after ``track_external(model)``; read ``peak_activations`` after it."""
    from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType

    class Tracker(MemTracker):
        peak_activations = 0

        def _update_peak_stats(self, peak_state):
            super()._update_peak_stats(peak_state)
            for snap in self._curr_mem_snap.values():
                now = snap.get(_MemRefType.ACT, 0) + snap.get(_MemRefType.TEMP, 0)
                self.peak_activations = max(self.peak_activations, now)

    return Tracker()
