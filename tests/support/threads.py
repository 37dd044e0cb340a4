"""Threads in the tests: run a function on another thread (as autograd's device thread
would), and an observer that records which collectives a thread's scope saw."""

from __future__ import annotations

import threading

from oases.parallel.comm import CommObserver


class SeenCollectives(CommObserver):
    def __init__(self):
        self.names = []

    def collective(self, name, lane, work, start=None):
        self.names.append(name)


def on_thread(fn):
    """Run ``fn`` on a new thread (as autograd's device thread would) and re-raise."""
    err = []

    def run():
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            err.append(e)

    th = threading.Thread(target=run)
    th.start()
    th.join(60)
    if err:
        raise err[0]
