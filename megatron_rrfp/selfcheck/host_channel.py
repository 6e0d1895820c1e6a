"""Host channels with random FIFO latency between threads of one process (``rounds.HostChannel``).

``ChannelHub`` delivers each posted record after a random latency, in order per direction;
``EmulatedChannel`` is one rank's channel on it. The self-check's one-GPU loopback step runs
two stages as threads over it; tests run whole jobs over it on a single-queue stand-in device.
"""
from __future__ import annotations

import heapq
import itertools
import random
import threading
import time
from collections.abc import Callable


class ChannelHub:
    """Delivers host-channel records after a random latency, FIFO per direction."""

    def __init__(self, *, max_latency_s: float, seed: int) -> None:
        self.max_latency_s, self.rng = max_latency_s, random.Random(seed)
        self.cv = threading.Condition()
        self.heap: list = []
        self.handlers: dict[int, tuple[Callable, Callable]] = {}
        self._last_due: dict = {}
        self._early: dict = {}  # records for ranks without a handler yet, in order
        self._seq = itertools.count()
        self._stop = False
        threading.Thread(target=self._serve, daemon=True, name="channel-hub").start()

    def post(self, src: int, dst: int, rec: list[int]) -> None:
        with self.cv:
            due = max(time.monotonic() + self.rng.random() * self.max_latency_s, self._last_due.get((src, dst), 0.0))
            self._last_due[(src, dst)] = due
            heapq.heappush(self.heap, (due, next(self._seq), src, dst, list(rec)))
            self.cv.notify()

    def abort(self, error: BaseException) -> None:
        for _, on_error in list(self.handlers.values()):
            on_error(error)

    def stop(self) -> None:
        with self.cv:
            self._stop = True
            self.cv.notify()

    def _serve(self) -> None:
        while True:
            with self.cv:
                while not self._stop and (not self.heap or self.heap[0][0] > time.monotonic()):
                    self.cv.wait(self.heap[0][0] - time.monotonic() if self.heap else None)
                if self._stop:
                    return
                item = heapq.heappop(self.heap)
                handler = self.handlers.get(item[3])
                if handler is None:  # that rank has not made its transport yet: keep the order
                    self._early.setdefault(item[3], []).append(item)
                    continue
            handler[0](item[2], item[4])

    def register(self, rank: int, on_record, on_error) -> None:
        with self.cv:
            self.handlers[rank] = (on_record, on_error)
            # at their own due times (all past): a record of the same direction still in the heap is due
            # later, so it cannot overtake them
            for item in self._early.pop(rank, []):
                heapq.heappush(self.heap, item)
            self.cv.notify()


class EmulatedChannel:
    """``rounds.HostChannel`` of one rank on a ``ChannelHub``."""

    def __init__(self, hub: ChannelHub, rank: int, on_record, on_error) -> None:
        self.hub, self.rank = hub, rank
        hub.register(rank, on_record, on_error)

    def post(self, dst: int, rec: list[int]) -> None:
        self.hub.post(self.rank, dst, rec)

    def close(self) -> None:
        pass


__all__ = ["ChannelHub", "EmulatedChannel"]
