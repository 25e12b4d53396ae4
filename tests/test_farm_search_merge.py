"""bench/farm_search.py --merge: a case's guided and random runs, made on two GPUs at once and
written to two JSONs, give the figures one invocation would have given; bad input is refused with
one line; so are guided seeds that would reach the random ones. --pool joins sessions whose seeds
repeat, and every choice of 3 runs a side gives the measure's spread."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
WORKLOAD = "matmul(M=64,N=64,K=64,dtype=float32)"


def run_record(search: str, seed: int, latency_us: list[float | None]) -> dict:
    """One run as farm_search writes it: its trials' latencies, best-so-far curve and origins."""
    curve, best = [], float("inf")
    for v in latency_us:
        best = min(best, v if v is not None else float("inf"))
        curve.append(None if best == float("inf") else best)
    origin = ["random"] * len(latency_us) if search == "random" else ["random"] * 4 + ["plan"] * (len(latency_us) - 4)
    return {"search": search, "seed": seed, "wall_s": 1.0, "job_wall_s": 1.0, "measuring_share": None,
            "busy_share": None, "statuses": {"ok": len(latency_us)}, "curve_us": curve,
            "config_index": list(range(len(latency_us))), "latency_us": latency_us, "origin": origin,
            "model_trials": [None] * 4 + [4] * (len(latency_us) - 4)}


def write(path: Path, runs: list[dict], workload: str = WORKLOAD) -> Path:
    path.write_text(json.dumps({"workload": workload, "target": "llvm", "history": None, "runs": runs}))
    return path


def merge(tmp_path: Path, *jsons: Path, pool: bool = False) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "bench/farm_search.py", "--merge", *map(str, jsons),
                           *(["--pool"] if pool else []), "--out", str(tmp_path / "out"), "--json",
                           str(tmp_path / "merged.json")], cwd=ROOT, capture_output=True, text=True, timeout=120)


def three_a_side() -> tuple[list[dict], list[dict]]:
    """(3 guided runs, 3 random runs). The random runs have 15 trials each, and their bests are 10,
    20 and 30 µs, one trial each: (15 + 1) / 2 = 8 trials expected to each. The guided runs (12
    trials) reach 30 and 20 µs at trials 2, 4 and 6, and 10 µs at trials 5, 7 and never."""
    random = [run_record("random", 1000 + k, [best] + [100.0 + j for j in range(14)])
              for k, best in enumerate((10.0, 20.0, 30.0))]
    guided = [run_record("xgb", 0, [50.0, 20.0, 40.0, 40.0, 10.0] + [60.0] * 7),
              run_record("xgb", 1, [50.0, 40.0, 40.0, 20.0, 40.0, 40.0, 10.0] + [60.0] * 5),
              run_record("xgb", 2, [50.0] * 5 + [20.0] + [60.0] * 6)]
    return guided, random


def test_merge_gives_issue_15s_measure_of_the_two_sides(tmp_path: Path) -> None:
    # `three_a_side`: to 20 and 30 µs the guided median is 4 trials (2x), to 10 µs 7 (8 / 7).
    guided, random = three_a_side()
    done = merge(tmp_path, write(tmp_path / "guided.json", guided), write(tmp_path / "random.json", random))
    assert done.returncode == 0, done.stderr
    figures = json.loads((tmp_path / "merged.json").read_text())["searches"]["xgb"]
    ratios = {c["latency_us"]: (c["guided_median"], c["ratio"]) for c in figures["to_random_best"]}
    assert ratios[20.0] == (4, 2.0) and ratios[10.0] == (7, pytest.approx(8 / 7))
    assert figures["to_random_best_median_ratio"] == 2.0  # the middle of 8 / 7, 2 and 2
    # Trials at or under 1.05 x the median random best (21 µs) per quarter of the 12 trials, by
    # origin (the first 4 of each run random, the rest the plan's): the 20s and the 10s.
    hits = figures["hits_by_origin"]
    assert hits["threshold_us"] == pytest.approx(21.0) and hits["quarters_of"] == 12
    assert hits["hits_trials"] == {"random": [[1, 9], [1, 3], [0, 0], [0, 0]],
                                   "plan": [[0, 0], [2, 6], [1, 9], [0, 9]]}
    assert (tmp_path / "out" / "curves.png").is_file()


def test_pool_counts_each_sessions_runs_as_their_own_and_gives_every_choice_of_three(tmp_path: Path) -> None:
    # Session 2 repeats guided seed 0 with a run that reaches nothing: refused as a run given twice,
    # unless --pool says the JSONs are of different sessions. Pooled, the 4 guided runs need [5, 7,
    # never, never] trials to 10 µs and [2, 4, 6, never] to 20 and 30: medians never, 5 and 5, so
    # ratios 0, 8 / 5 and 8 / 5, whose middle is 1.6. Each choice of 3 of the 4 guided runs (one of
    # the 3 random runs): with runs 0 and 1, medians 7, 4, 4 give 2x; without one of them, never, 6,
    # 6 give 8 / 6: two choices at 2x, two at 4 / 3, none at 3x, median 5 / 3.
    guided, random = three_a_side()
    first = write(tmp_path / "session1.json", guided + random)
    # Session 2's random seed 1000 draws session 1's configs again: left out of the pool, or it
    # would count that sample twice.
    second = write(tmp_path / "session2.json", [run_record("xgb", 0, [50.0] * 12),
                                                 run_record("random", 1000, [40.0] + [100.0] * 14)])
    refused = merge(tmp_path, first, second)
    assert refused.returncode != 0 and "--pool" in refused.stderr
    done = merge(tmp_path, first, second, pool=True)
    assert done.returncode == 0, done.stderr
    figures = json.loads((tmp_path / "merged.json").read_text())["searches"]["xgb"]
    assert "random seed 1000 of JSON 2: the configs of seed 1000 of JSON 1 again, left out" in done.stdout
    assert [c["random_run"] for c in figures["to_random_best"]] == [f"seed {1000 + k} of JSON 1" for k in range(3)]
    assert figures["to_random_best_median_ratio"] == pytest.approx(1.6)
    assert figures["resampled"] == {"runs_a_side": 3, "choices": 4, "share_at_least_3x": 0.0,
                                    "median": pytest.approx(5 / 3), "p10": pytest.approx(4 / 3), "p90": 2.0}


@pytest.mark.parametrize("bad", ["other case", "a run twice", "not json"])
def test_merge_refuses_runs_of_other_cases_or_given_twice_in_one_line(tmp_path: Path, bad: str) -> None:
    guided = write(tmp_path / "guided.json", [run_record("xgb", 0, [5.0] * 8)])
    if bad == "other case":
        other = write(tmp_path / "other.json", [run_record("random", 1000, [4.0] * 8)], "matmul(M=8,N=8,K=8)")
    elif bad == "a run twice":
        other = guided
    else:
        other = tmp_path / "broken.json"
        other.write_text("{")
    done = merge(tmp_path, guided, other)
    assert done.returncode != 0 and not (tmp_path / "merged.json").exists()
    assert len(done.stderr.strip().splitlines()) == 1 and done.stderr.startswith("farm_search: --merge")


@pytest.mark.parametrize(("args", "says"), [(["--first-seed", "-1"], "--first-seed"),
                                            (["--first-seed", "998"], "--first-seed"), (["--pool"], "--pool")])
def test_seeds_that_reach_the_random_ones_or_pool_without_merge_are_refused(tmp_path: Path, args: list[str],
                                                                            says: str) -> None:
    """Guided seeds of 1000 and up would start as the random runs of those seeds, and --pool only
    qualifies --merge: refused in one line before any run."""
    done = subprocess.run([sys.executable, "bench/farm_search.py", *args, "--seeds", "3", "--out",
                           str(tmp_path / "out")], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and not (tmp_path / "out").exists()
    assert len(done.stderr.strip().splitlines()) == 1 and done.stderr.startswith(f"farm_search: {says}")
