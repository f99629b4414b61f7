"""One-ahead prefetching keeps order, draws items in the caller's thread and prepares them elsewhere."""

from __future__ import annotations

import threading

import pytest

from densepass.prefetch import prefetched


def test_prefetched_keeps_order_and_prepares_one_ahead_in_a_worker_thread():
    caller = threading.get_ident()
    drawn, prepared_in = [], set()

    def items():
        for i in range(5):
            drawn.append((i, threading.get_ident()))
            yield i

    def prepare(i):
        prepared_in.add(threading.get_ident())
        return i * 10

    seen = []
    for value in prefetched(items(), prepare):
        seen.append((value, len(drawn)))
    assert [v for v, _ in seen] == [0, 10, 20, 30, 40]
    assert [n for _, n in seen] == [2, 3, 4, 5, 5]  # item k+1 is drawn before item k is handed over
    assert {t for _, t in drawn} == {caller} and caller not in prepared_in


def test_prefetched_empty_and_errors():
    assert list(prefetched([], lambda x: x)) == []

    def prepare(i):
        if i == 2:
            raise ValueError("bad item")
        return i

    with pytest.raises(ValueError, match="bad item"):
        list(prefetched(range(4), prepare))
