"""The soak's verdict on synthetic series: growth after warm-up fails, a plateau passes."""

from __future__ import annotations

from kvstrata._dev.faults.soak import SoakSample, Tolerances, levelling_problems

MIB = 1 << 20


def series(n: int = 30, rss=lambda i: 400 * MIB, fds=lambda i: 60, threads=lambda i: 40, shm=lambda i: MIB, disk=lambda i: 8 * MIB, hit=lambda i: 1.0):
    return [SoakSample(float(i), rss(i), fds(i), threads(i), shm(i), disk(i), hit(i), 1.0) for i in range(n)]


def test_a_plateau_after_warm_up_levels_off():
    # Warm-up growth in the first third, noise within tolerance after it.
    samples = series(rss=lambda i: (200 + 20 * min(i, 10) + (i % 3)) * MIB, fds=lambda i: 40 + min(i, 10) + i % 2)
    assert levelling_problems(samples, shm_capacity=2 * MIB, disk_capacity=16 * MIB) == []


def test_rss_growing_every_round_is_a_leak():
    samples = series(rss=lambda i: (300 + 8 * i) * MIB)  # 8 MiB a round: 80 MiB from the middle third to the last
    problems = levelling_problems(samples, shm_capacity=2 * MIB, disk_capacity=16 * MIB)
    assert len(problems) == 1 and "rss_bytes keeps growing" in problems[0]


def test_fds_and_threads_that_keep_climbing_are_leaks():
    samples = series(fds=lambda i: 50 + 2 * i, threads=lambda i: 30 + i)
    problems = levelling_problems(samples, shm_capacity=2 * MIB, disk_capacity=16 * MIB)
    assert [p.split(" keeps")[0] for p in problems] == ["store fds", "store threads"]


def test_tiers_over_capacity_and_a_falling_hit_rate_fail():
    samples = series(shm=lambda i: 3 * MIB if i == 5 else MIB, disk=lambda i: 17 * MIB if i == 29 else MIB, hit=lambda i: 1.0 if i < 20 else 0.5)
    problems = levelling_problems(samples, shm_capacity=2 * MIB, disk_capacity=16 * MIB)
    assert len(problems) == 3
    assert "arena files" in problems[0] and "disk tier" in problems[1] and "hit rate falls" in problems[2]


def test_too_short_a_soak_cannot_pass():
    assert "too short" in levelling_problems(series(n=5), shm_capacity=2 * MIB, disk_capacity=16 * MIB)[0]


def test_tolerances_are_the_threshold():
    samples = series(rss=lambda i: (300 + 2 * i) * MIB)  # 20 MiB from the middle third's max to the last's
    assert levelling_problems(samples, 2 * MIB, 16 * MIB, Tolerances(rss_bytes=19 * MIB))
    assert not levelling_problems(samples, 2 * MIB, 16 * MIB, Tolerances(rss_bytes=20 * MIB))
