"""`Scheduler`: continuous batching over a request queue, whatever holds the K/V.

Each `schedule()` builds one step:
1. admit waiting requests in arrival order while the batch has room and the KV store
   can hold the request's prompt next to what running prefills still need
   (memory-capped admission; no skipping ahead in the queue);
2. give every running request its work: a prefill chunk of at most `prefill_step`
   positions, or one decode position;
3. reserve room for that work; when the store is exhausted, preempt the youngest
   request not yet served this step (its K/V freed, re-queued at the front for
   recompute) and retry; a request that is itself the youngest preempts itself.
`complete(step)` advances the served requests after the step ran and releases the
finished ones. A request has `prompt_len` prompt positions and decodes `output_len`
positions (where its end-of-sequence falls, unknown to the stores), at most
`max_new_tokens` (the cap a store may reserve for); after a preemption its prefill
covers the decoded positions too.

| store method              | job                                                 |
|---------------------------|-----------------------------------------------------|
| `can_admit(req, running)` | whether `req`'s prompt fits beside running prefills |
| `admit(req)`              | start holding `req`'s K/V                            |
| `reserve(req, n)`         | room for n more positions or `PoolExhausted`, unchanged |
| `release(req)`            | give back everything `req` holds                     |
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field

from .errors import PoolExhausted, ServingError


class State(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    ABORTED = "aborted"


@dataclass(eq=False)
class Request:
    rid: int
    prompt_len: int
    max_new_tokens: int
    output_len: int | None = None   # defaults to max_new_tokens
    state: State = State.WAITING
    computed: int = 0       # positions whose K/V the store holds
    generated: int = 0      # decode positions completed
    preemptions: int = 0
    admitted: int = -1      # admission order; the youngest has the largest

    def __post_init__(self):
        if self.output_len is None:
            self.output_len = self.max_new_tokens

    @property
    def prefill_target(self) -> int:
        return self.prompt_len + self.generated

    @property
    def in_prefill(self) -> bool:
        return self.computed < self.prefill_target


@dataclass(frozen=True)
class Work:
    request: Request
    start: int              # first new position
    count: int              # positions added this step
    decode: bool


@dataclass
class Step:
    prefills: list[Work] = field(default_factory=list)
    decodes: list[Work] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def works(self) -> list[Work]:
        return self.prefills + self.decodes


class Scheduler:
    def __init__(self, store, *, max_batch: int, prefill_step: int):
        if max_batch < 1 or prefill_step < 1:
            raise ServingError("capacity", f"max_batch and prefill_step must be >= 1, got {max_batch}, {prefill_step}")
        self.store, self.max_batch, self.prefill_step = store, max_batch, prefill_step
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []        # in admission order, oldest first
        self.done: list[Request] = []
        self._admissions = 0
        self._in_flight: Step | None = None
        self._known: set[int] = set()
        self.peak_running = 0

    def add(self, req: Request) -> None:
        if req.rid in self._known:
            raise ServingError("request", f"request id {req.rid} was added already")
        if req.prompt_len < 1 or not 0 <= req.output_len <= req.max_new_tokens:
            raise ServingError("request", f"request {req.rid}: prompt_len must be >= 1 and "
                                          "0 <= output_len <= max_new_tokens")
        if not self.store.could_ever_hold(req):
            raise ServingError("capacity", f"request {req.rid} ({req.prompt_len} + {req.max_new_tokens} positions) "
                                           "can never fit in the KV store, even alone")
        self._known.add(req.rid)
        self.waiting.append(req)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> Step:
        if self._in_flight is not None:
            raise ServingError("request", "complete() the previous step before scheduling another")
        step = Step()
        while self.waiting and len(self.running) < self.max_batch and \
                self.store.can_admit(self.waiting[0], self.running):
            req = self.waiting.popleft()
            self.store.admit(req)
            req.state, req.admitted = State.RUNNING, self._admissions
            self._admissions += 1
            self.running.append(req)
        self.peak_running = max(self.peak_running, len(self.running))
        served: list[Request] = []
        for req in list(self.running):
            if req.state is not State.RUNNING:
                continue                         # preempted earlier in this loop
            work = self._work_for(req)
            if work is None:
                continue
            while req.state is State.RUNNING:
                try:
                    self.store.reserve(req, work.count)
                except PoolExhausted:
                    self._preempt(self._youngest_unserved(served), step)
                    continue
                (step.decodes if work.decode else step.prefills).append(work)
                served.append(req)
                break
        self._in_flight = step
        return step

    def complete(self, step: Step) -> list[Request]:
        """Advances the requests `step` served; returns those that finished."""
        if step is not self._in_flight:
            raise ServingError("request", "complete() takes the step returned by the last schedule()")
        self._in_flight = None
        finished = []
        for work in step.works:
            req = work.request
            req.computed += work.count
            if work.decode:
                req.generated += 1
            if not req.in_prefill and req.generated == req.output_len:
                self._retire(req, State.FINISHED)
                finished.append(req)
        return finished

    def abort(self, rid: int) -> Request:
        if self._in_flight is not None:
            raise ServingError("request", "abort between steps, not while one is in flight")
        for req in self.waiting:
            if req.rid == rid:
                self.waiting.remove(req)
                req.state = State.ABORTED
                self.done.append(req)
                return req
        for req in self.running:
            if req.rid == rid:
                self._retire(req, State.ABORTED)
                return req
        raise ServingError("request", f"request {rid} is neither waiting nor running")

    def _work_for(self, req: Request) -> Work | None:
        if req.in_prefill:
            return Work(req, req.computed, min(self.prefill_step, req.prefill_target - req.computed), False)
        if req.generated < req.output_len:
            return Work(req, req.computed, 1, True)
        return None

    def _youngest_unserved(self, served: list[Request]) -> Request:
        return max((r for r in self.running if r not in served), key=lambda r: r.admitted)

    def _preempt(self, req: Request, step: Step) -> None:
        self.store.release(req)
        self.running.remove(req)
        req.state, req.computed, req.admitted = State.WAITING, 0, -1
        req.preemptions += 1
        self.waiting.appendleft(req)
        step.preempted.append(req)

    def _retire(self, req: Request, state: State) -> None:
        self.store.release(req)
        self.running.remove(req)
        req.state = state
        self.done.append(req)
