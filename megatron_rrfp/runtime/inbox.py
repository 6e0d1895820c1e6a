"""The mailbox between a rank's transport threads and its compute loop."""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, Optional

Deliver = Callable[[Any, Callable[[Any], None]], None]
"""``deliver(message, put)``: called on the transport's thread for each arriving message;
``put(message)`` hands it to the task loop (now, or later from another thread)."""


class Inbox:
    """Thread-safe mailbox between transport threads and the compute loop."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._messages: list = []
        self._error: Optional[BaseException] = None
        self._woken = False
        self._closed = False
        self.deliver: Optional[Deliver] = None
        """How arriving messages reach the loop (``RRFPConfig.deliver_message``, set by the task
        loop); None: at once."""

    def put(self, message) -> None:
        deliver = self.deliver
        if deliver is None:
            self._put(message)
        else:
            deliver(message, self._put)

    def _put(self, message) -> None:
        arrived = time.time()  # when the message reached the loop's side (the transport's thread, or deliver's)
        with self._cv:
            if not self._closed:
                self._messages.append((arrived, message))
                self._cv.notify()

    def close(self) -> int:
        """Drop what is waiting and refuse what still arrives (the runtime was discarded
        after a failure); returns how many messages were dropped."""
        with self._cv:
            dropped, self._messages, self._closed = len(self._messages), [], True
            return dropped

    def fail(self, error: BaseException) -> None:
        with self._cv:
            self._error = error
            self._cv.notify()

    def drain(self) -> list:
        return [message for _, message in self.drain_timed()]

    def drain_timed(self) -> list:
        """[(arrival time, message)]; raises the transport's error if it failed."""
        with self._cv:
            if self._error is not None:
                raise self._error
            messages, self._messages = self._messages, []
            return messages

    def wait(self, timeout: float) -> None:
        with self._cv:
            if not self._messages and self._error is None and not self._woken:
                self._cv.wait(timeout)
            self._woken = False

    def wake(self) -> None:
        """Wake the loop without a message (the transport has something to advance)."""
        with self._cv:
            self._woken = True
            self._cv.notify()
