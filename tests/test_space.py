"""Config spaces: exact sizes, the index <-> config bijection, JSON, shards, validity."""

from __future__ import annotations

import json
import random

import pytest

from farm.core.errors import FarmError
from farm.core.space import ChoiceKnob, ConfigSpace, SplitKnob, factorizations
from farm.core.targets import parse_target
from farm.core.task import Task
from farm.core.workloads import make_workload


def test_factorizations_are_exact_and_complete() -> None:
    fs = factorizations(12, 3)
    assert len(fs) == len(set(fs)) == 18  # ordered triples with product 12
    assert all(a * b * c == 12 for a, b, c in fs)
    assert factorizations(7, 4) == [(1, 1, 1, 7), (1, 1, 7, 1), (1, 7, 1, 1), (7, 1, 1, 1)]


def test_resnet_last_conv_cuda_space_has_the_tutorials_size() -> None:
    """The tutorial's knobs and sizes, times the knobs it lacks (split-K, the way tiles are fetched)."""
    task = Task(make_workload("resnet-last-conv"), parse_target("cuda"))
    sizes = {k.name: len(k) for k in task.space.knobs}
    assert sizes["tile_f"] == 220 and sizes["tile_y"] == 4 and sizes["tile_rc"] == 55
    assert task.space.size == 10_454_400 * sizes["split_k"] * sizes["fetch"]


@pytest.fixture
def space() -> ConfigSpace:
    return ConfigSpace([SplitKnob("a", 64, 3), SplitKnob("b", 7, 2), ChoiceKnob("u", [0, 512, 1500])])


def test_bijection_on_random_indices(space: ConfigSpace) -> None:
    rng = random.Random(1)
    big = Task(make_workload("resnet-last-conv"), parse_target("cuda")).space
    for sp in (space, big):
        for _ in range(500):
            i = rng.randrange(sp.size)
            config = sp.get(i)
            assert sp.index(dict(config.values)) == i
            # JSON round trip keeps the index
            assert sp.from_json(json.loads(config.dumps())).index == i


def test_every_index_distinct(space: ConfigSpace) -> None:
    configs = {space.get(i).dumps() for i in range(space.size)}
    assert len(configs) == space.size == 28 * 2 * 3


@pytest.mark.parametrize("k", [1, 2, 3, 7, 10])
def test_shards_partition_the_space(space: ConfigSpace, k: int) -> None:
    shards = space.shards(k)
    seen: list[int] = []
    for shard in shards:
        members = list(shard)
        assert len(members) == shard.size
        assert all(i in shard for i in members)
        assert [shard.index(j) for j in range(shard.size)] == members
        assert all(shard.local(i) == j for j, i in enumerate(members))
        seen.extend(members)
    assert sorted(seen) == list(range(space.size))  # disjoint and covering
    assert space.shards(k) == shards  # deterministic


def test_out_of_space_configs_are_refused(space: ConfigSpace) -> None:
    with pytest.raises(FarmError):
        space.get(space.size)
    with pytest.raises(FarmError):
        space.from_json({"a": [1, 1, 63], "b": [1, 7], "u": 0})  # 63 != 64
    with pytest.raises(FarmError):
        space.from_json({"a": [1, 1, 64], "b": [1, 7], "u": 7})  # not a choice
    with pytest.raises(FarmError):
        space.from_json({"a": [1, 1, 64], "b": [1, 7]})  # missing knob


def test_a_knob_added_later_with_a_default_keeps_the_old_configs_and_their_indices() -> None:
    """Configs exported before a template grew a knob still fit: the knob's default is filled in,
    and as the last knob with its default first, every old config keeps its index."""
    old = ConfigSpace([SplitKnob("a", 64, 3), ChoiceKnob("u", [0, 1, 2])])
    new = ConfigSpace([SplitKnob("a", 64, 3), ChoiceKnob("u", [0, 1, 2]), ChoiceKnob("p", [1, 4], default=1)])
    for i in random.Random(0).sample(range(old.size), 20):
        doc = old.get(i).to_json()
        assert new.from_json(doc).index == i and new.from_json(doc)["p"] == 1
        assert new.from_json({**doc, "p": 4}).index == i + old.size
    with pytest.raises(ValueError, match="not one of its values"):
        ChoiceKnob("p", [1, 4], default=2)


def test_validity_filter_rejects_what_cannot_launch() -> None:
    task = Task(make_workload("resnet-last-conv"), parse_target("cuda"))
    sp = task.space
    base = dict(sp.get(0).values)
    too_many_threads = {**base, "tile_f": (1, 1, 64, 8), "tile_y": (1, 1, 7, 1), "tile_x": (1, 1, 7, 1)}
    assert "threads" in (task.check(sp.from_json(too_many_threads)) or "")
    too_much_smem = {**base, "tile_f": (1, 1, 1, 512), "tile_rc": (1, 1, 512), "tile_ry": (1, 1, 3),
                     "tile_rx": (1, 1, 3)}
    assert "shared memory" in (task.check(sp.from_json(too_much_smem)) or "")
    many_vthreads = {**base, "tile_f": (32, 16, 1, 1)}
    assert "vthreads" in (task.check(sp.from_json(many_vthreads)) or "")
    fine = {**base, "tile_f": (64, 1, 8, 1), "tile_y": (1, 1, 7, 1), "tile_x": (1, 1, 7, 1),
            "tile_rc": (64, 8, 1)}
    assert task.check(sp.from_json(fine)) is None
    # Random sampling: most of the space is invalid, and the filter says so without compiling.
    rng = random.Random(0)
    invalid = sum(task.check(sp.get(rng.randrange(sp.size))) is not None for _ in range(300))
    assert 0 < invalid < 300
