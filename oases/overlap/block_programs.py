"""Block programs under the ``oases`` engine: a block's partial that waits for transfers
of its own (ring attention: :mod:`oases.parallel.program`) runs inside its sub-batch's
program, and each of its waits is a yield point of the sub-batch, like a collective:

    compute  | a: qkv, post kv1, attend kv0 | b: ... | a: attend kv1 ... | b: ...
    ring             | kv1 of a ------------------->|  | kv1 of b -------->|

(cp 2, forward: a's next kv block travels while a attends its own and b computes.)

:func:`drive` runs a program piece by piece, each piece inside the contexts the engine
computes under (entered again on every resume: its parameters, grad mode, autocast,
the TP region entry, the recorder of deferred backwards), and asks the runner to wait
at each :class:`~oases.parallel.program.Await`, after the other sub-batches' turns.
In the backward, :func:`program_backward` runs each recorded
:class:`~oases.parallel.program.ProgramCut` (the ring's backward, whose waits are yield
points too) between the block's backward to the cut and autograd from its sources.

Random numbers: a program may leave a generator changed across a yield (the ring's
dropout fork, the replay of its masks in backward); the runner keeps each sub-batch's
generator states apart between turns (:func:`~oases.overlap.runner.run_joint`), so each
sub-batch still draws exactly its own stream. A recompute's ``replay`` states are put
in place once, before the first piece, and the sub-batch's own after the last.
"""

from __future__ import annotations

from typing import Callable, ContextManager, Optional

from oases.overlap.memory import SavedTensorMeter
from oases.overlap.runner import MicroBatchRun, Program, Wait
from oases.parallel.backprop import backward
from oases.parallel.program import Steps

Segment = Callable[[bool], ContextManager]
"""``segment(first)``: the contexts of one piece (``first``: the program's first)."""


class Pieces:
    """A :data:`Segment` from ``make(first)``, which returns the contexts of one piece in
    the order they are entered (made anew for each piece: some take effect when made,
    as ``torch.set_grad_enabled``). Cheaper than a generator-based context manager: a
    block's forward pays for it once per sub-batch when it does not yield."""

    __slots__ = ("make", "first", "entered")

    def __init__(self, make: Callable[[bool], tuple]) -> None:
        self.make, self.first, self.entered = make, True, []

    def __call__(self, first: bool) -> "Pieces":
        self.first = first
        return self

    def __enter__(self) -> None:
        self.entered = []
        try:
            for c in self.make(self.first):
                c.__enter__()
                self.entered.append(c)
        except BaseException:
            self.__exit__(None, None, None)
            raise

    def __exit__(self, *exc) -> None:
        entered, self.entered = self.entered, []
        for c in reversed(entered):
            c.__exit__(*exc)


class _Finished:
    __slots__ = ("value",)

    def __init__(self, value) -> None:
        self.value = value


def _step(program: Steps):
    try:
        return program.send(None)
    except StopIteration as e:
        return _Finished(e.value)


def drive(run: MicroBatchRun, start: Callable[[], Steps], segment: Segment,
          replay: Optional[dict] = None, cuts: Optional[list] = None) -> Program:
    """The result of the program ``start()`` (made inside the first piece), through
    ``yield from``: the sub-batch yields at each of its waits. ``replay``: the RNG states
    it draws from (a recompute's; None: the sub-batch's own). ``cuts``: the list its
    deferred backwards are recorded in; the tensors they keep count as saved ones."""
    before = len(cuts) if cuts is not None else 0
    live = None
    if replay is not None:
        live = run.snap()
        run.restore(replay)
    try:
        with segment(True):
            program = start()
            req = _step(program)
        while not isinstance(req, _Finished):
            yield Wait([(None, req)])  # the runner waits for it after the others' turns
            with segment(False):
                req = _step(program)
    finally:
        if replay is not None:
            run.restore(live)
    for c in (cuts[before:] if cuts is not None else ()):
        for t in (*c.sources, *c.held):
            SavedTensorMeter.track(t)
    return req.value


def program_backward(run: MicroBatchRun, cuts: list, segment: Segment) -> Program:
    """Each deferred backward in ``cuts``, the last recorded first (the order autograd
    would take): its program from the leaf's gradient (yielding at its waits), then
    autograd from its sources with what it returned. Empties ``cuts``."""
    while cuts:
        c = cuts.pop()
        if c.leaf.grad is None:
            continue
        grads = yield from drive(run, lambda: c.backward(c.leaf.grad), segment)
        with segment(False):
            backward(c.sources, grads)
