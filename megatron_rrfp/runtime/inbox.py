"""The mailbox between a rank's transport threads and its compute loop."""
from __future__ import annotations

import threading
import time
from typing import Optional


class Inbox:
    """Thread-safe mailbox between transport threads and the compute loop."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._messages: list = []
        self._error: Optional[BaseException] = None
        self._woken = False
        self._closed = False

    def put(self, message) -> None:
        arrived = time.time()  # on the transport thread: when the message was complete here
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
