"""CommWorker: jobs run in submission order on one background thread; results and errors reach the waiter."""

import threading

import pytest

from lightning_qcomm.comm.comm_worker import CommWorker, dedicated_group


def test_jobs_run_in_order_off_the_calling_thread():
    worker = CommWorker()
    seen: list[tuple[int, str]] = []
    main = threading.current_thread().name
    futs = [worker.submit(lambda i=i: seen.append((i, threading.current_thread().name)) or i * i) for i in range(50)]
    assert [f.wait() for f in futs] == [i * i for i in range(50)]
    assert [i for i, _ in seen] == list(range(50))
    assert all(name != main for _, name in seen)
    worker.close()


def test_exception_reaches_the_waiter_and_worker_keeps_running():
    worker = CommWorker()

    def boom():
        raise ValueError("bucket 3 failed")

    bad = worker.submit(boom)
    good = worker.submit(lambda: 7)
    with pytest.raises(ValueError, match="bucket 3 failed"):
        bad.wait()
    assert good.wait() == 7
    worker.close()
    worker.close()  # idempotent
    assert worker.submit(lambda: 1).wait() == 1  # restarts after close
    worker.close()


def test_dedicated_group_without_process_group_is_none():
    assert dedicated_group() is None
