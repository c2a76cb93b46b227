"""Activation offload: the tensors autograd saves for backward wait in host memory.

``parallel.activation_offload=true`` runs each training forward under saved-tensor hooks that copy
every saved activation to (pinned) host memory as forward produces it, and back to the device when
backward needs it. Parameters (and views of them, such as the ``weight.t()`` a linear saves) stay
where they are: they are model state, already resident, and FSDP2 / ZeRO-3 manage their lifetime.
Device memory then holds the model states and the working set of the current op; the price is two
host copies of every activation. On a CPU device activations already live in host memory, so the
setting is a documented no-op there.
"""

from __future__ import annotations

import contextlib
import logging

import torch

log = logging.getLogger("tformer.parallel")
_warned: set[str] = set()


def can_pin_memory() -> bool:
    try:
        return bool(torch.empty(1).pin_memory().is_pinned())
    except RuntimeError:  # no accelerator, or the OS refuses to lock pages
        return False


class OffloadActivations(torch.autograd.graph.saved_tensors_hooks):
    """Saved tensors to host memory in forward (a synchronous copy: the device buffer may be reused
    at once), back to their device in backward (asynchronous from pinned memory)."""

    def __init__(self, pin_memory: bool):
        self.copies = self.kept = 0  # activations copied out, parameters left in place

        def pack(t: torch.Tensor):
            base = t if t._base is None else t._base
            if isinstance(base, torch.nn.Parameter) or t.layout != torch.strided:
                self.kept += 1
                return None, t
            host = torch.empty(t.size(), dtype=t.dtype, device="cpu", pin_memory=pin_memory)
            host.copy_(t)
            self.copies += 1
            return t.device, host

        def unpack(packed):
            device, t = packed
            return t if device is None else t.to(device, non_blocking=pin_memory)

        super().__init__(pack, unpack)


def activation_offload(device: torch.device, enabled: bool, force: bool = False):
    """The context to run a training forward in: offload on an accelerator (or with ``force``, for
    tests on CPU), nothing on a CPU device. Without pinnable memory: one warning, pageable copies."""
    if not enabled or (device.type == "cpu" and not force):
        return contextlib.nullcontext()
    pin = device.type != "cpu" and can_pin_memory()
    if device.type != "cpu" and not pin and "pin" not in _warned:
        _warned.add("pin")
        log.warning(
            "parallel.activation_offload: this machine cannot pin host memory; offloading with "
            "pageable copies (slower, no overlap with compute)"
        )
    return OffloadActivations(pin)
