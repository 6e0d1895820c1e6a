"""In-process stand-ins for a rank's surroundings, to test ``PipelineIteration`` in
milliseconds (in the spirit of torch.distributed.pipelining's MockPipelineStage):

* ``LoopbackNetwork`` — one ``Inbox`` per rank; ``transport(rank)`` sends straight into
  the destination's inbox (or drops what goes to ranks nobody runs);
* ``RecordingWork`` — a ``StageWork`` whose F / B / W pass small tensors along and log
  (stage, task) in one global sequence, so tests can check cross-stage dependencies.
"""
from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass
from typing import Optional

import torch

from megatron_rrfp.policy.actions import Task
from megatron_rrfp.runtime.inbox import Inbox
from megatron_rrfp.runtime.transport import SelfDelivering


@dataclass(frozen=True, slots=True)
class LoopbackMessage:
    kind: str
    microbatch: int
    chunk: int
    tensor: torch.Tensor
    src: int

    def wait(self) -> torch.Tensor:
        return self.tensor


class LoopbackNetwork:
    def __init__(self, ranks) -> None:
        self.inboxes = {rank: Inbox() for rank in ranks}

    def transport(self, rank: int) -> LoopbackTransport:
        return LoopbackTransport(self, rank)

    def deliver(self, dst: int, kind: str, microbatch: int, chunk: int, src: int,
                tensor: Optional[torch.Tensor] = None) -> None:
        """Put a message into ``dst``'s inbox as if ``src`` had sent it."""
        tensor = torch.zeros(2) if tensor is None else tensor
        self.inboxes[dst].put(LoopbackMessage(kind, microbatch, chunk, tensor, src))


class LoopbackTransport(SelfDelivering):
    def __init__(self, network: LoopbackNetwork, rank: int) -> None:
        self.network, self.rank = network, rank
        self.sent: list[tuple[int, str, int, int]] = []

    def send(self, dst: int, kind: str, microbatch: int, chunk: int, tensor: torch.Tensor) -> None:
        self.sent.append((dst, kind, microbatch, chunk))
        if dst in self.network.inboxes:
            self.network.deliver(dst, kind, microbatch, chunk, self.rank, tensor.detach().clone())

    def expect(self, src: int, count: int) -> None:
        pass  # the loopback delivers everything it is given

    def flush(self, timeout: float) -> None:
        pass

    # the executor's progress hooks (runtime.executor.Transport): nothing to advance

class RecordingWork:
    """F sends ``input + 1`` downstream, B sends the gradient upstream; all log globally."""

    log: list = []
    _counter = itertools.count()
    _lock = threading.Lock()

    def __init__(self, stage: int) -> None:
        self.stage = stage

    def _record(self, task: Task) -> None:
        with self._lock:
            self.log.append((next(self._counter), self.stage, task))

    def forward(self, task: Task, input_tensor, send) -> None:
        self._record(task)
        if send is not None:
            send((input_tensor if input_tensor is not None else torch.zeros(2)) + 1)

    def backward(self, task: Task, output_grad, send) -> None:
        self._record(task)
        if send is not None:
            send(output_grad if output_grad is not None else torch.ones(2))

    def weight(self, task: Task) -> None:
        self._record(task)
