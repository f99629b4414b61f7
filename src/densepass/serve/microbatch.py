"""Micro-batching: the queries of concurrent requests go to the searcher together, in one ``search_batch`` call.

Requests wait in a bounded FIFO queue (counted in queries). One worker task takes waiting requests whole, in
order, up to ``max_batch_size`` queries, as soon as the batch is full or ``max_wait_ms`` has passed since the
first of them arrived, and runs the searcher in a worker thread so that the event loop keeps answering; one
batch at a time, so while a batch is searched the next one fills. A batch holds requests of one k, so that each
gets what a search alone gives: many kinds rank deeper for a larger k (a binary index rescores k x its
multiplier candidates, HNSW searches max(efSearch, k), a hybrid fuses max(k, depth)), and their top hits for k=1
need not be the first of k=50. Where a larger k's hits always start with a smaller k's (:func:`nested_top_k`),
requests of any k share a batch: the searcher is asked for the largest and each request gets its own slice, cut
to its own k. If a batch of several requests fails (say one query the model rejects), each request is searched
alone, so that only the bad one gets the error; a failure outside every request's own work (say the metrics
callback) fails that batch's requests with :class:`BatchFailed`, and the worker goes on with the next batch.

Other work shares the queue, its limit and the worker (:meth:`MicroBatcher.run`): embedding texts, scoring
(query, text) pairs. A job names its operation (say ``embed:query``); a batch holds jobs of one operation only,
those of the oldest waiting job's, in order (the others keep their places), and the operation's function gets
their items together, one output per item.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from densepass.serve.searcher import Searcher, hit_to_json

Results = list[list[dict[str, Any]]]

logger = logging.getLogger("densepass.serve")

# index kinds whose top k is always the start of a larger k's: every passage scored exactly, equal scores by row
# (exact, with fp32 scoring only: a bf16 / int8 first pass keeps rescore x k candidates; SPLADE; FAISS's flat
# search and BM25, whose ties densepass orders by row: faiss_index.faiss_search, bm25.top_k)
NESTED_KINDS = ("exact", "splade", "faiss-flat", "bm25")


class Unavailable(Exception):
    """The request cannot be taken now (the queue is full, or the service is shutting down): HTTP 503."""


class QueueFull(Unavailable):
    """The queue holds as many queries as it may: a client may retry shortly (TEI's routes answer 429)."""


class BatchFailed(RuntimeError):
    """The worker failed on a batch outside every request's own work (say ``on_batch``): each request of that
    batch gets this error (HTTP 500; the cause goes to the server log), and the worker serves the next batch."""


SEARCH = "search"


@dataclass
class _Job:
    queries: list[Any]  # the items: queries to search, texts to embed, pairs to score...
    k: int
    future: asyncio.Future
    operation: str = SEARCH
    function: Callable[[list[Any]], list[Any]] | None = None  # the operation's (None: the searcher's search)
    arrived: float = field(default_factory=time.monotonic)


def nested_top_k(searcher: Any) -> bool:
    """Whether the searcher's top ``k`` hits are always the first ``k`` of its hits for any larger k, so that
    searches of different k may share a batch: what the searcher declares as ``nested_top_k`` (a bool), else
    whether its index (a search pipeline's ``index``, a reranker over it keeping the property) is of
    :data:`NESTED_KINDS`. Unknown: False (each k batched apart)."""
    declared = getattr(searcher, "nested_top_k", None)
    if isinstance(declared, bool):
        return declared
    index = getattr(searcher, "index", None)
    return getattr(index, "kind", None) in NESTED_KINDS and getattr(index, "search_precision", "fp32") == "fp32"


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
        self.on_batch: Callable[[str, int], None] | None = None  # called with (operation, items) per batch
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
        if self._task is not None and not self._task.done():  # (a worker killed earlier: nothing to wait for)
            await self._task

    @property
    def stopped(self) -> bool:
        """Whether the worker task was started and has ended (after :meth:`close`, or killed: then new requests get
        :class:`Unavailable` and ``/health`` says so)."""
        return self._task is not None and self._task.done()

    async def search(self, queries: list[str], k: int) -> Results:
        """Hits (as JSON dicts) for ``queries``, at most ``k`` each, searched in a batch with other requests.

        Raises :class:`Unavailable` when the queue is full or the service is closing, and whatever the
        searcher raised for this request."""
        return await self._queue(list(queries), k, SEARCH, None)

    async def run(self, operation: str, items: list[Any], function: Callable[[list[Any]], list[Any]]) -> list[Any]:
        """``function(items)`` (one output per item), computed in a batch with the items of other requests of the
        same ``operation``: jobs of one operation must give equivalent functions (its parameters belong in its
        name). Counts against the queue like queries; raises :class:`Unavailable` and what ``function`` raised
        for these items."""
        if operation == SEARCH:
            raise ValueError(f"operation {SEARCH!r} is the searcher's: use search()")
        return await self._queue(list(items), 0, operation, function)

    async def _queue(self, items: list[Any], k: int, operation: str, function: Callable | None) -> Any:
        if self.closing:
            raise Unavailable("the service is shutting down")
        if self.stopped:  # the worker ended without close(): nothing would ever answer this request
            raise Unavailable("the search worker has stopped; see the server log")
        if self.waiting + len(items) > self.max_queue:
            raise QueueFull(
                f"the search queue is full ({self.waiting} queries waiting, at most {self.max_queue}); retry shortly"
            )
        job = _Job(items, k, asyncio.get_running_loop().create_future(), operation, function)
        self._pending.append(job)
        self.waiting += len(items)
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
                try:
                    outcomes = await asyncio.to_thread(self._search_jobs, batch)
                except Exception as err:  # noqa: BLE001 - the batch's requests fail; the worker keeps serving
                    logger.error("a batch of %d %s requests failed", len(batch), batch[0].operation, exc_info=err)
                    reason = " ".join(f"{type(err).__name__}: {err}".split())
                    outcomes = [BatchFailed(f"the micro-batch failed ({reason})") for _ in batch]
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
        """The oldest waiting jobs of the oldest job's operation (and k, unless the searcher's results are
        nested: :func:`nested_top_k`), whole and in order, up to ``max_batch_size`` items (one job alone when it
        is larger); cancelled jobs are dropped, the others keep their places."""
        batch: list[_Job] = []
        kept: deque[_Job] = deque()
        size = 0
        any_k = nested_top_k(self.searcher)

        def key(job: _Job) -> tuple[str, int]:
            return job.operation, 0 if any_k or job.operation != SEARCH else job.k

        while self._pending:
            job = self._pending.popleft()
            if job.future.done():  # its request was cancelled
                self.waiting -= len(job.queries)
            elif batch and (key(job) != key(batch[0]) or size + len(job.queries) > self.max_batch_size):
                kept.append(job)
                if key(job) == key(batch[0]):  # full: a later, smaller job would overtake this one
                    break
            else:
                self.waiting -= len(job.queries)
                batch.append(job)
                size += len(job.queries)
        kept.extend(self._pending)
        self._pending = kept
        return batch

    def _search_jobs(self, jobs: list[_Job]) -> list[Any]:
        """Runs in the worker thread: each job's results, or the exception its search (or operation) raised."""
        items = [q for job in jobs for q in job.queries]
        try:
            if jobs[0].operation == SEARCH:
                results: list[Any] = self._search(items, max(job.k for job in jobs))
            else:
                results = list(jobs[0].function(items))
                if len(results) != len(items):
                    raise RuntimeError(f"{jobs[0].operation} gave {len(results)} outputs for {len(items)} items")
        except Exception as err:  # noqa: BLE001 - handed to the request(s) that caused it
            if len(jobs) == 1:
                return [err]
            return [outcome for job in jobs for outcome in self._search_jobs([job])]
        if jobs[0].operation == SEARCH:
            self.batches += 1
            self.queries += len(results)
        if self.on_batch is not None:
            self.on_batch(jobs[0].operation, len(items))
        outcomes: list[Any] = []
        start = 0
        for job in jobs:
            part = results[start : start + len(job.queries)]
            outcomes.append([hits[: job.k] for hits in part] if job.operation == SEARCH else part)
            start += len(job.queries)
        return outcomes

    def _search(self, queries: list[str], k: int) -> Results:
        self.searcher_calls += 1
        results = self.searcher.search_batch(queries, k)
        if len(results) != len(queries):
            raise RuntimeError(f"the searcher returned {len(results)} result lists for {len(queries)} queries")
        return [[hit_to_json(hit) for hit in hits[:k]] for hits in results]
