"""CommWorker: jobs run in submission order on one background thread; results and errors reach the waiter."""

import threading

import pytest
from _launch import free_port

from lightning_qcomm.comm.comm_worker import CommWorker, FutureWork, dedicated_group


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


def test_future_work_waits_for_the_job_and_reraises_its_exception():
    """FSDP2 only calls Work.wait(): it must block until the job ran and surface the job's error."""
    import torch.distributed as dist

    worker = CommWorker()
    gate = threading.Event()
    ran = []
    try:
        work = FutureWork(worker.submit(lambda: (gate.wait(5), ran.append(1))))
        assert isinstance(work, dist.Work)
        assert not work.is_completed() and not ran
        gate.set()
        assert work.wait() is True and ran == [1] and work.is_completed()

        def boom():
            raise RuntimeError("gather failed")

        with pytest.raises(RuntimeError, match="gather failed"):
            FutureWork(worker.submit(boom)).wait()
    finally:
        worker.close()


def test_dedicated_group_inherits_or_takes_the_timeout():
    """torch.distributed.new_group gives a new group torch's 30-minute default; ours inherits the parent's
    timeout, or takes the one passed (checked in a fresh process with a world of one)."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent(
        """
        import datetime, sys
        import torch, torch.distributed as dist
        from lightning_qcomm.comm.comm_worker import dedicated_group, group_timeout
        port = int(sys.argv[1])
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                                timeout=datetime.timedelta(seconds=17))
        print("inherited", group_timeout(dedicated_group()).total_seconds())
        print("explicit", group_timeout(dedicated_group(timeout=datetime.timedelta(seconds=9))).total_seconds())
        dist.destroy_process_group()
        """
    )
    out = subprocess.run([sys.executable, "-c", code, str(free_port())], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "inherited 17.0" in out.stdout and "explicit 9.0" in out.stdout, out.stdout
