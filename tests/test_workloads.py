"""Workloads: parameter validation, presets, references checked against direct loops."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from farm.core.errors import FarmError
from farm.core.workloads import PRESETS, WORKLOADS, make_workload, parse_assignments


def test_presets_match_design() -> None:
    rc = make_workload("resnet-last-conv").p
    shape = (rc["N"], rc["CI"], rc["H"], rc["W"], rc["CO"], rc["KH"], rc["KW"], rc["pad"])
    assert shape == (1, 512, 7, 7, 512, 3, 3, 1)
    sg = make_workload("spio-grouped").p
    assert (sg["N"], sg["CI"], sg["CO"], sg["groups"], sg["dtype"]) == (32, 64, 64, 8, "float16")
    assert make_workload("seed-avgpool").p["kind"] == "avg"
    assert set(PRESETS) == {"resnet-last-conv", "seed-depthwise", "seed-maxpool", "seed-avgpool", "spio-grouped"}
    assert set(WORKLOADS) == {"conv2d_nchw", "depthwise_conv2d_nchw", "pool2d", "group_conv2d_nchw", "matmul",
                              "batch_matmul"}


@pytest.mark.parametrize(("name", "params", "message"), [
    ("conv3d", {}, "unknown workload"),
    ("matmul", {"M": "x", "N": 4, "K": 4}, "must be an integer"),
    ("matmul", {"M": 0, "N": 4, "K": 4}, "must be >= 1"),
    ("matmul", {"M": -3, "N": 4, "K": 4}, "must be >= 1"),
    ("matmul", {"M": "2.5", "N": 4, "K": 4}, "must be an integer"),
    ("matmul", {"N": 4, "K": 4}, "missing parameter M"),
    ("matmul", {"M": 4, "N": 4, "K": 4, "Q": 1}, "unknown parameter"),
    ("conv2d_nchw", dict(N=1, CI=3, H=4, W=4, CO=8, KH=7, KW=3), "larger than the padded input"),
    ("group_conv2d_nchw", dict(N=1, CI=6, H=8, W=8, CO=8, KH=3, KW=3, groups=4), "not divisible by groups"),
    ("matmul", {"M": 4, "N": 4, "K": 4, "dtype": "int7"}, "not one of"),
])
def test_bad_parameters_are_one_clear_error(name: str, params: dict, message: str) -> None:
    with pytest.raises(FarmError, match=message) as info:
        make_workload(name, params)
    assert "\n" not in str(info.value)


def test_parse_assignments() -> None:
    assert parse_assignments(["CI=256", "pad=1"]) == {"CI": "256", "pad": "1"}
    with pytest.raises(FarmError, match="key=value"):
        parse_assignments(["CI256"])
    with pytest.raises(FarmError, match="whitespace"):  # was taken as pad=1
        parse_assignments([" pad = 1"])
    with pytest.raises(FarmError, match="given twice"):  # was taken as CI=128
        parse_assignments(["CI=256", "CI=128"])


def _direct_conv(x: np.ndarray, w: np.ndarray, stride: int, pad: int, dil: int, groups: int = 1) -> np.ndarray:
    n, _, h, wd = x.shape
    co, cig, kh, kw = w.shape
    xp = np.pad(x, ((0, 0), (0, 0), (pad, pad), (pad, pad)))
    oh = (h + 2 * pad - dil * (kh - 1) - 1) // stride + 1
    ow = (wd + 2 * pad - dil * (kw - 1) - 1) // stride + 1
    out = np.zeros((n, co, oh, ow))
    cog = co // groups
    for b in range(n):
        for f in range(co):
            g = f // cog
            for y in range(oh):
                for z in range(ow):
                    patch = xp[b, g * cig:(g + 1) * cig, y * stride:y * stride + dil * (kh - 1) + 1:dil,
                               z * stride:z * stride + dil * (kw - 1) + 1:dil]
                    out[b, f, y, z] = np.sum(patch * w[f])
    return out


def test_conv_references_match_direct_loops() -> None:
    wl = make_workload("conv2d_nchw", dict(N=2, CI=3, H=9, W=8, CO=4, KH=3, KW=2, stride=2, pad=1, dilation=2))
    xs = [x.astype(np.float64) for x in wl.random_inputs(1)]
    np.testing.assert_allclose(wl.definition.reference(wl.p, xs), _direct_conv(*xs, 2, 1, 2), rtol=1e-10)
    g = make_workload("group_conv2d_nchw", dict(N=1, CI=8, H=6, W=6, CO=4, KH=3, KW=3, groups=2, pad=1))
    xs = [x.astype(np.float64) for x in g.random_inputs(2)]
    np.testing.assert_allclose(g.definition.reference(g.p, xs), _direct_conv(*xs, 1, 1, 1, groups=2), rtol=1e-10)
    assert wl.output_shape() == (2, 4, 4, 4)


def test_depthwise_and_pool_references() -> None:
    dw = make_workload("depthwise_conv2d_nchw", dict(N=1, C=3, H=6, W=5, KH=3, KW=3, pad=1, multiplier=2))
    x, w = (a.astype(np.float64) for a in dw.random_inputs(3))
    # depthwise == grouped conv with groups = C and the kernel reshaped
    expected = _direct_conv(x, w.reshape(6, 1, 3, 3), 1, 1, 1, groups=3)
    np.testing.assert_allclose(dw.definition.reference(dw.p, [x, w]), expected, rtol=1e-10)
    mp = make_workload("pool2d", dict(N=1, C=2, H=5, W=5, KH=3, KW=3, stride=2, pad=1, kind="max"))
    (x,) = (a.astype(np.float64) for a in mp.random_inputs(4))
    ref = mp.definition.reference(mp.p, [x])
    assert ref.shape == (1, 2, 3, 3)
    assert ref[0, 0, 0, 0] == x[0, 0, :2, :2].max()
    ap = make_workload("pool2d", dict(N=1, C=2, H=5, W=5, KH=3, KW=3, stride=2, pad=1, kind="avg"))
    ref = ap.definition.reference(ap.p, [x])
    assert ref[0, 1, 0, 0] == pytest.approx(x[0, 1, :2, :2].sum() / 9)  # padding counts


def test_costs() -> None:
    rc = make_workload("resnet-last-conv")
    assert rc.flops() == 2 * 512 * 7 * 7 * 512 * 9
    assert rc.bytes() == (512 * 49 + 512 * 512 * 9 + 512 * 49) * 4
    assert make_workload("spio-grouped").bytes() % 2 == 0


def _tvm_compute_extents(wl: Any) -> tuple[int, ...]:
    from farm.core.templates.base import new_schedule

    sch = new_schedule(wl)
    return tuple(int(sch.get(loop).extent) for loop in sch.get_loops(sch.get_sblock("compute")))


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_compute_extents_are_what_tvm_builds_for_every_preset(name: str) -> None:
    wl = make_workload(name)
    assert wl.compute_extents() == _tvm_compute_extents(wl)


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_compute_extents_are_what_tvm_builds(data: st.DataObject) -> None:
    """Templates size their spaces from Workload.compute_extents, without TVM: it must be what
    TVM's schedule of the workload shows, for every workload and any parameters."""
    name = data.draw(st.sampled_from(sorted(WORKLOADS)))
    params = {p.name: data.draw(st.integers(p.minimum, 12)) for p in WORKLOADS[name].params if p.choices is None}
    if name == "pool2d":
        params["kind"] = data.draw(st.sampled_from(["max", "avg"]))
    if name == "group_conv2d_nchw":
        params["CI"] *= params["groups"]
        params["CO"] *= params["groups"]
    try:
        wl = make_workload(name, params)
    except FarmError:  # a window larger than the input and the like: no kernel to compare
        return
    assert wl.compute_extents() == _tvm_compute_extents(wl)
