"""Targets are checked without TVM (farm.core.targets.TVM_OPTIONS), and the check agrees with TVM:
the table is TVM's own list of attributes, and TVM builds every target the farm accepts."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from farm.core.errors import FarmError
from farm.core.targets import TVM_OPTIONS, parse_target
from farm.core.tvm_import import import_tvm

tvm = import_tvm()

# Values of every type TVM's attributes take, and of types none takes.
VALUES = st.one_of(
    st.text(max_size=8), st.integers(-(2**64), 2**64), st.booleans(), st.none(), st.floats(allow_nan=False),
    st.lists(st.text(max_size=4), max_size=3), st.lists(st.integers(0, 9), min_size=1, max_size=2),
    st.sampled_from(["llvm", {"kind": "llvm"}, {"kind": "llvm", "mcpu": "x"}, {"kind": "cuda"},
                     {"kind": "llvm", "nope": 1}, {"kind": "llvm", "mattr": "+avx"}]),
)
NAMES = sorted({name for options in TVM_OPTIONS.values() for name in options} | {"no-such-attr", "Arch"})


@pytest.mark.parametrize("kind", sorted(TVM_OPTIONS))
def test_the_table_is_tvms_own_list_of_attributes(kind: str) -> None:
    assert TVM_OPTIONS[kind] == dict(tvm.target.TargetKind.options_from_name(kind))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kind=st.sampled_from(sorted(TVM_OPTIONS)),
       attrs=st.dictionaries(st.sampled_from([n for n in NAMES if n != "kind"]), VALUES, max_size=3))
def test_tvm_builds_every_target_the_farm_accepts(kind: str, attrs: dict[str, Any]) -> None:
    try:
        spec = parse_target({"kind": kind, **attrs})
    except FarmError as e:
        assert "\n" not in str(e)
        return
    spec.tvm()  # raises if TVM refuses what the farm let through


# (target, the farm's message, whether TVM refuses it too: where TVM converts, the farm is stricter)
@pytest.mark.parametrize(("doc", "message", "tvm_refuses"), [
    ({"kind": "llvm", "no-such-attr": 1}, "not one TVM knows for llvm", True),
    ({"kind": "cuda", "mattr": ["+avx"]}, "not one TVM knows for cuda", True),
    ({"kind": "llvm", "mattr": "+avx2"}, "must be a list of strings", True),
    ({"kind": "llvm", "opt-level": 2**63}, "must be a 64-bit integer", True),
    ({"kind": "cuda", "host": {"kind": "llvm", "opt-level": "3"}}, "must be a 64-bit integer", True),
    ({"kind": "llvm", "fast-math": 1}, "must be true or false", False),
    ({"kind": "llvm", "opt-level": True}, "must be a 64-bit integer", False),
    ({"kind": "cuda", "host": {"kind": "cuda"}}, '"llvm" or an llvm target dict', False),
    ({"kind": "cuda", "host": {"kind": "llvm", "host": "llvm"}}, "a host has no host", False),
])
def test_bad_attributes_are_one_line(doc: dict[str, Any], message: str, tvm_refuses: bool) -> None:
    with pytest.raises(FarmError, match=message) as info:
        parse_target(doc)
    assert "\n" not in str(info.value)
    try:
        tvm.target.Target(doc)
    except Exception:  # TVM's own errors are of several types
        assert tvm_refuses
    else:
        assert not tvm_refuses


def test_good_targets_keep_their_attributes() -> None:
    spec = parse_target({"kind": "cuda", "arch": "sm_80", "host": {"kind": "llvm", "mcpu": "skylake"},
                         "l2_cache_size_bytes": 50 * 2**20})
    assert spec.doc["host"] == {"kind": "llvm", "mcpu": "skylake"} and spec.arch == "sm_80"
    assert str(spec.tvm().attrs["arch"]) == "sm_80"
