"""Micro-batching: the queries of concurrent requests go to the searcher together, in one ``search_batch`` call.

Requests wait in a bounded FIFO queue (counted in queries). One worker task takes waiting requests whole, in
order, up to ``max_batch_size`` queries, as soon as the batch is full or ``max_wait_ms`` has passed since the
first of them arrived, and runs the searcher in a worker thread so that the event loop keeps answering; one
batch at a time, so while a batch is searched the next one fills. The searcher is asked for the largest k of
the batch and each request gets its own slice, cut to its own k. If a batch of several requests fails (say one
query the model rejects), each request is searched alone, so that only the bad one gets the error.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from densepass.serve.searcher import Searcher, hit_to_json

Results = list[list[dict[str, Any]]]


class Unavailable(Exception):
    """The request cannot be taken now (the queue is full, or the service is shutting down): HTTP 503."""


@dataclass
class _Job:
    queries: list[str]
    k: int
    future: asyncio.Future
    arrived: float = field(default_factory=time.monotonic)


class MicroBatcher:
    """Collects concurrent :meth:`search` calls into batched ``searcher.search_batch`` calls (see the module doc).

    :meth:`start` and :meth:`close` run on the event loop (the app's lifespan calls them).
    """

    def __init__(self, searcher: Searcher, max_batch_size: int, max_wait_ms: float, max_queue: int):
        self.searcher = searcher
        self.max_batch_size = max_batch_size
        self.max_wait_s = max_wait_ms / 1000
        self.max_queue = max_queue
        self.waiting = 0  # queries in the queue, not yet taken into a batch
        self.batches = self.queries = self.searcher_calls = 0
        self.closing = False
        self._pending: deque[_Job] = deque()
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        """Start the worker task on the running event loop."""
        self._task = asyncio.get_running_loop().create_task(self._work(), name="densepass-batcher")

    async def close(self) -> None:
        """Take no more requests, search the ones waiting (without waiting for more), and stop the worker."""
        self.closing = True
        self._wakeup.set()
        if self._task is not None:
            await self._task

    @property
    def stopped(self) -> bool:
        """Whether the worker task was started and has ended (after :meth:`close`)."""
        return self._task is not None and self._task.done()

    async def search(self, queries: list[str], k: int) -> Results:
        """Hits (as JSON dicts) for ``queries``, at most ``k`` each, searched in a batch with other requests.

        Raises :class:`Unavailable` when the queue is full or the service is closing, and whatever the
        searcher raised for this request."""
        if self.closing:
            raise Unavailable("the service is shutting down")
        if self.waiting + len(queries) > self.max_queue:
            raise Unavailable(
                f"the search queue is full ({self.waiting} queries waiting, at most {self.max_queue}); retry shortly"
            )
        job = _Job(list(queries), k, asyncio.get_running_loop().create_future())
        self._pending.append(job)
        self.waiting += len(queries)
        self._wakeup.set()
        return await job.future

    async def _work(self) -> None:
        while True:
            while not self._pending:
                if self.closing:
                    return
                await self._wait_for_wakeup(None)
            deadline = self._pending[0].arrived + self.max_wait_s
            while self.waiting < self.max_batch_size and not self.closing and time.monotonic() < deadline:
                await self._wait_for_wakeup(deadline - time.monotonic())
            batch = self._take_batch()
            if batch:
                outcomes = await asyncio.to_thread(self._search_jobs, batch)
                for job, outcome in zip(batch, outcomes):
                    if job.future.done():  # its request was cancelled meanwhile
                        continue
                    if isinstance(outcome, Exception):
                        job.future.set_exception(outcome)
                    else:
                        job.future.set_result(outcome)

    async def _wait_for_wakeup(self, timeout: float | None) -> None:
        self._wakeup.clear()
        try:
            await asyncio.wait_for(self._wakeup.wait(), timeout)
        except asyncio.TimeoutError:
            pass

    def _take_batch(self) -> list[_Job]:
        batch: list[_Job] = []
        size = 0
        while self._pending and (not batch or size + len(self._pending[0].queries) <= self.max_batch_size):
            job = self._pending.popleft()
            self.waiting -= len(job.queries)
            if not job.future.done():
                batch.append(job)
                size += len(job.queries)
        return batch

    def _search_jobs(self, jobs: list[_Job]) -> list[Results | Exception]:
        """Runs in the worker thread: each job's results, or the exception its search raised."""
        try:
            results = self._search([q for job in jobs for q in job.queries], max(job.k for job in jobs))
        except Exception as err:  # noqa: BLE001 - handed to the request(s) that caused it
            if len(jobs) == 1:
                return [err]
            return [outcome for job in jobs for outcome in self._search_jobs([job])]
        self.batches += 1
        self.queries += len(results)
        outcomes: list[Results | Exception] = []
        start = 0
        for job in jobs:
            outcomes.append([hits[: job.k] for hits in results[start : start + len(job.queries)]])
            start += len(job.queries)
        return outcomes

    def _search(self, queries: list[str], k: int) -> Results:
        self.searcher_calls += 1
        results = self.searcher.search_batch(queries, k)
        if len(results) != len(queries):
            raise RuntimeError(f"the searcher returned {len(results)} result lists for {len(queries)} queries")
        return [[hit_to_json(hit) for hit in hits[:k]] for hits in results]
