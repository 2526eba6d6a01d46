"""A run's jobs in memory: each done once, its result read after."""

from __future__ import annotations

from autotune.config import TrainConfig
from autotune.jobs import LocalJobs, Relayed, job_key


def test_a_job_is_done_once_and_read_after() -> None:
    jobs, done = LocalJobs(), []

    def do() -> list[int]:
        done.append(1)
        return [len(done)]

    key = job_key("verify", TrainConfig(micro_batch_size=2))
    assert jobs.once(key, do, "verifying") == [1]
    assert jobs.once(key, do, "verifying") == [1]  # read, not done again
    assert jobs.once(job_key("verify", TrainConfig(micro_batch_size=4)), do, "verifying") == [2]
    assert len(done) == 2


def test_a_relayed_job_runs_in_the_relay_and_is_done_once() -> None:
    relayed: list[str] = []

    def relay(fn):  # as rank_zero relays: run here, the result sent to every rank
        relayed.append("sent")
        return fn()

    jobs = Relayed(LocalJobs(), relay)
    assert jobs.storage is None and jobs.name is None
    assert jobs.once("profile", lambda: 7, "profiling") == 7
    assert jobs.once("profile", lambda: 8, "profiling") == 7  # done once, read after
    assert relayed == ["sent", "sent"]
