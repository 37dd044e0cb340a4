"""Saved-activation memory on CPU: the peak bytes of tensors kept for backward.

``with SavedTensorMeter() as m: ...`` counts every tensor autograd saves
(through ``saved_tensors_hooks``) plus every tensor a schedule stashes for
recompute (:meth:`SavedTensorMeter.track`), each storage once, from when it is
saved until it is freed. ``m.forward_bytes`` is what is held when the forward
of the micro-batch ends (the saved activations; schedules call
:meth:`SavedTensorMeter.end_of_forward`), ``m.peak_bytes`` the high-water mark
(which under ``oases`` includes graphs rebuilt by recompute during backward). Tensors saved
*inside* a ``torch.utils.checkpoint`` region are not saved at all (the
checkpoint keeps only its inputs, which the meter sees), which is the point of
recompute. On CUDA, use ``torch.cuda.max_memory_allocated`` instead.

A meter is active on the thread that entered it, never process-wide, so two
engines on two threads each measure their own step. Both ways a tensor reaches it
follow that thread: autograd's ``saved_tensors_hooks`` are thread-local and
PyTorch hands them to the threads that run a backward started here (a
``torch.utils.checkpoint`` recompute is seen); :meth:`track` and
:meth:`end_of_forward` are called by the schedule on the thread that runs it.
A tensor may be freed on any thread (the release is locked).
"""

from __future__ import annotations

import threading
import weakref

import torch


class SavedTensorMeter:
    _tls = threading.local()

    def __init__(self) -> None:
        self._lock = threading.RLock()  # a finalizer may run inside _add (GC)
        self.current = 0
        self.peak_bytes = 0
        self.forward_bytes = 0
        self._live: dict[int, list] = {}   # storage ptr -> [bytes, refs]
        self._hooks = None

    def __enter__(self) -> "SavedTensorMeter":
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        self._active().append(self)
        return self

    def __exit__(self, *exc) -> None:
        self._active().remove(self)
        self._hooks.__exit__(*exc)

    @classmethod
    def _active(cls) -> list["SavedTensorMeter"]:
        """The meters entered on this thread."""
        act = getattr(cls._tls, "meters", None)
        if act is None:
            act = cls._tls.meters = []
        return act

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        self._add(t)
        return t

    def _add(self, t: torch.Tensor) -> None:
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            return
        st = t.untyped_storage()
        key = st.data_ptr()
        with self._lock:
            entry = self._live.get(key)
            if entry is None:
                entry = self._live[key] = [st.nbytes(), 0]
                self.current += entry[0]
                self.peak_bytes = max(self.peak_bytes, self.current)
            entry[1] += 1
        weakref.finalize(t, self._release, key)

    def _release(self, key: int) -> None:
        with self._lock:
            entry = self._live.get(key)
            if entry is None:
                return
            entry[1] -= 1
            if entry[1] == 0:
                self.current -= entry[0]
                del self._live[key]

    @classmethod
    def track(cls, t: torch.Tensor) -> None:
        """A schedule stashed ``t`` for recompute: count it while it lives."""
        for m in cls._active():
            m._add(t)

    @classmethod
    def end_of_forward(cls) -> None:
        for m in cls._active():
            m.forward_bytes = m.current
