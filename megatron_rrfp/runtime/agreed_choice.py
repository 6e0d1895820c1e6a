"""How the tensor-parallel ranks of one pipeline stage pick the same next task.

Every TP rank of a stage must run the same task sequence (their collectives must match), but
each rank's messages arrive at its own times. The executor's loop therefore decides from
*agreed* values only: an exchange (``agreement.TPAgreement``) of each rank's ready set and
progress counters, posted while the previous task computes and collected at the next decision.
When the agreed common set holds nothing the policy would run, the stage is in a bubble and
two shortcuts avoid another exchange: follow the one link that can still deliver (every TP
rank receives its messages in the same FIFO order), or let group rank 0 choose and announce.

``AgreedChoice`` is mixed into ``executor.PipelineIteration``: it reads the loop's state
(ready set, arrivals per link, transport counters) and its diagnosis, and owns nothing else.
"""
from __future__ import annotations

import contextlib
import time
from typing import Optional

from ..policy.actions import Kind, Task
from .agreement import Agreed, AgreementError
from .report import PipelineStallError


class AgreedChoice:
    """The TP-agreed decision of ``PipelineIteration`` (used when it has an agreement group)."""

    def _agreed_task(self) -> Optional[Task]:
        first, self._first_decision = self._first_decision, False
        if first and not self.transport.state_words:
            # Nothing of this iteration was sent yet, so the agreed view is known without an
            # exchange: the first stage's forwards, every link at position 0.
            task = self._choose_or_follow(frozenset(self._initial), (0,) * len(self._links))
            if task is not None:
                return task
        while True:
            posted = self.agreement.outstanding  # posted when the last task was dispatched
            if posted:
                seen = self._posted_view
                agreed = self._collect()
            else:
                self._absorb()
                seen, agreed = self._exchange_now()
            # From here on only agreed (identical) values decide what happens next.
            words = self.transport.state_words
            self.transport.advance(agreed.state[:words])
            self._absorb()
            if self.arbiter.done and self.transport.idle():
                return None
            task = None if self.arbiter.done else self._choose(agreed.common)
            if task is not None and posted and self.arbiter.runs_alone_unpaired(task):
                task = self._fresh_choice(task, agreed.common)
            if task is None:
                task = self._follow(agreed.common, agreed.state[words:])
            if task is not None:
                return task
            if agreed.lagging or agreed.unanimous:
                self._wait_for_change(seen)  # something is on its way to us (or to everyone)
            # else: we hold everything anyone holds; block in the next exchange instead

    def _fresh_choice(self, task: Task, posted_common: frozenset) -> Task:
        """The choice from an exchange run now, where ``task`` (chosen from the offers posted when
        the last task was dispatched) is a backward that would run unpaired: the forward to pair it
        with may have arrived while the last task ran, and the simulator's arbiter sees it. Every
        rank gets here together (the condition reads agreed values only)."""
        _, agreed = self._exchange_now()
        self.transport.advance(agreed.state[:self.transport.state_words])
        self._absorb()
        fresh = self._choose(agreed.common)
        if fresh is None:  # a rank without room offered nothing: the first choice, its pairing state restored
            self._choose(posted_common)
            return task
        return fresh

    def _choose_or_follow(self, common: frozenset, positions: tuple[int, ...]) -> Optional[Task]:
        """The agreed choice from ``common``, else ``_follow``'s. None: exchange again."""
        task = None if self.arbiter.done else self._choose(common)
        return task if task is not None else self._follow(common, positions)

    def _follow(self, common: frozenset, positions: tuple[int, ...]) -> Optional[Task]:
        """A bubble: nothing in the agreed ``common`` is choosable. If only one link can still
        deliver, follow it — every TP rank receives its messages in the same order (a FIFO from
        a peer that runs the same tasks), so "what becomes choosable first" is the same
        everywhere; else group rank 0 decides from what it holds once something is choosable
        and announces it (a message it holds reaches every rank: the senders run the same
        tasks). No exchange either way. None: exchange again."""
        if self.arbiter.done or self.transport.state_words:
            return None  # the device transport's readiness comes from agreed counters only
        pending = [(src, at) for src, at in zip(self._links, positions) if at < self._expected[src]]
        if not pending:
            return None
        if len(pending) > 1:
            return self._lead_or_listen(common)
        src, agreed_position = pending[0]
        candidates = set(common)
        for position in range(agreed_position, self._expected[src]):
            self._await(lambda at=position: len(self._arrivals[src]) > at)
            kind, key = self._arrivals[src][position]
            if kind == "activation":
                candidates.add(Task(Kind.F, *key))
            elif key in self.forward_done:
                candidates.add(Task(Kind.B, *key))
            task = self.arbiter.choose(candidates)
            if task is not None:
                self.agreement.stats.followed += 1
                return task
        return None

    def _lead_or_listen(self, common: frozenset) -> Task:
        """Group rank 0 chooses (with its partner, if the arbiter pairs it) and announces; the others
        run what it announced. The partner is admitted on the state every rank shares, and its input
        is on its way to every rank (its senders run the same tasks)."""
        if self.agreement.leads:
            chosen: list = []
            self._await(lambda: bool(chosen.append(self.arbiter.choose(common | self.ready)) or chosen[-1]))
            task = chosen[-1]
            partner = self.arbiter.take_partner(task)
            self.agreement.announce(task, partner)
        else:
            with self._agreeing():
                task, partner = self.agreement.listen()
            self._await(lambda: task in self.ready and (partner is None or partner in self.ready))
        self.arbiter.pair_with(task, partner)  # what _dispatch takes
        return task

    def _state(self) -> tuple[int, ...]:
        """Progress counters to agree on: the transport's, then messages received per link."""
        return self.transport.local_state() + tuple(len(self._arrivals[src]) for src in self._links)

    def _post_offer(self, enabled: set[Task]) -> None:
        room = self.transport.can_dispatch()
        offer = (self.ready | enabled) if room else set()
        state = self._state()
        self._posted_view = (frozenset(self.ready | enabled), state[:self.transport.state_words], room)
        self.agreement.post(offer, state)

    def _exchange_now(self) -> tuple[tuple, Agreed]:
        """(the view it was offered from, the agreed result) of an exchange run now."""
        room = self.transport.can_dispatch()
        state = self._state()
        with self._agreeing():
            seen = (frozenset(self.ready), state[:self.transport.state_words], room)
            return seen, self.agreement.exchange(set(self.ready) if room else set(), state)

    @contextlib.contextmanager
    def _agreeing(self):
        """A blocking agreement step: its time is an "agree" span, and a peer that died or
        hung past the agreement group's timeout becomes this rank's stall diagnosis."""
        start = time.time()
        try:
            yield
        except AgreementError:
            raise
        except Exception as exc:
            raise PipelineStallError(self._diagnosis(f"TP agreement failed: {exc}")) from exc
        finally:
            self._span("agree", "agree", start, time.time())

    def _collect(self) -> Agreed:
        start = time.time()
        try:
            while True:
                idle = time.monotonic() - self._last_progress
                if idle > self.timeout_s:
                    raise PipelineStallError(self._diagnosis(
                        f"no agreement from the tensor-parallel group for {idle:.1f}s (timeout {self.timeout_s}s)"))
                try:
                    return self.agreement.collect(timeout=min(1.0, self.timeout_s - idle + 0.01))
                except TimeoutError:
                    self._absorb()  # surfaces a transport failure while we wait
                except (AgreementError, PipelineStallError):
                    raise
                except Exception as exc:
                    raise PipelineStallError(self._diagnosis(f"TP agreement failed: {exc}")) from exc
        finally:
            self._span("agree", "agree", start, time.time())
