"""Any TIR PrimFunc as a workload (farm.core.tir) tuned in MetaSchedule's design spaces
(farm.core.templates.design_space), on llvm on this machine: the space's exact domains and
bijection, validity without repair, shards, a 2-worker job with its exact budget, the export
applied by TVM's compile_tir and MetaScheduleApplyDatabase, and bad input."""

from __future__ import annotations

import json
import math
import random
import re
import sqlite3
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from farm.core.design_features import DesignSpaceFeaturizer
from farm.core.errors import FarmError
from farm.core.space import ChoiceKnob, ConfigSpace, TileKnob, UnionSpace, factorizations
from farm.core.targets import TargetSpec, parse_target
from farm.core.task import Task
from farm.core.tir import TirWorkload, tir_from_file, tir_from_params
from farm.core.workloads import workload_from_json
from workers.compiler import _registers_per_kernel, _threads_per_kernel

# A fused matmul + bias + ReLU and a softmax over rows, as te.create_prim_func prints them.
MATMUL_BIAS_RELU = '''from tvm.script import tirx as T

@T.prim_func(s_tir=True)
def matmul_bias_relu(A: T.Buffer((16, 32), "float32"), B: T.Buffer((32, 16), "float32"),
                     bias: T.Buffer((16,), "float32"), D: T.Buffer((16, 16), "float32")):
    T.func_attr({"tirx.noalias": True})
    C = T.sblock_alloc_buffer((16, 16))
    for i, j, k in T.grid(16, 16, 32):
        with T.sblock("C"):
            v_i, v_j, v_k = T.axis.remap("SSR", [i, j, k])
            T.reads(A[v_i, v_k], B[v_k, v_j])
            T.writes(C[v_i, v_j])
            with T.init():
                C[v_i, v_j] = T.float32(0.0)
            C[v_i, v_j] = C[v_i, v_j] + A[v_i, v_k] * B[v_k, v_j]
    for i, j in T.grid(16, 16):
        with T.sblock("D"):
            v_i, v_j = T.axis.remap("SS", [i, j])
            T.reads(C[v_i, v_j], bias[v_j])
            T.writes(D[v_i, v_j])
            D[v_i, v_j] = T.max(C[v_i, v_j] + bias[v_j], T.float32(0.0))
'''

SOFTMAX = '''from tvm.script import tirx as T

@T.prim_func(s_tir=True)
def softmax(X: T.Buffer((4, 32), "float32"), Y: T.Buffer((4, 32), "float32")):
    T.func_attr({"tirx.noalias": True})
    M = T.sblock_alloc_buffer((4,))
    E = T.sblock_alloc_buffer((4, 32))
    S = T.sblock_alloc_buffer((4,))
    for i0, k in T.grid(4, 32):
        with T.sblock("M"):
            v_i0, v_k = T.axis.remap("SR", [i0, k])
            T.reads(X[v_i0, v_k])
            T.writes(M[v_i0])
            with T.init():
                M[v_i0] = T.float32(-3.4e38)
            M[v_i0] = T.max(M[v_i0], X[v_i0, v_k])
    for i0, i1 in T.grid(4, 32):
        with T.sblock("E"):
            v_i0, v_i1 = T.axis.remap("SS", [i0, i1])
            T.reads(X[v_i0, v_i1], M[v_i0])
            T.writes(E[v_i0, v_i1])
            E[v_i0, v_i1] = T.exp(X[v_i0, v_i1] - M[v_i0])
    for i0, k in T.grid(4, 32):
        with T.sblock("S"):
            v_i0, v_k = T.axis.remap("SR", [i0, k])
            T.reads(E[v_i0, v_k])
            T.writes(S[v_i0])
            with T.init():
                S[v_i0] = T.float32(0.0)
            S[v_i0] = S[v_i0] + E[v_i0, v_k]
    for i0, i1 in T.grid(4, 32):
        with T.sblock("Y"):
            v_i0, v_i1 = T.axis.remap("SS", [i0, i1])
            T.reads(E[v_i0, v_i1], S[v_i0])
            T.writes(Y[v_i0, v_i1])
            Y[v_i0, v_i1] = E[v_i0, v_i1] / S[v_i0]
'''

# The attention-mask kernel of a BERT import (transformers' masking): which rows hold a key to
# attend to, an int8 output; integers have no NaN for the output check to fill unwritten elements with.
MASK_ROWS = '''from tvm.script import tirx as T

@T.prim_func(s_tir=True)
def mask_rows(S: T.Buffer((2, 8, 16), "float32"), R: T.Buffer((2, 8, 1), "int8")):
    T.func_attr({"tirx.noalias": True})
    C = T.sblock_alloc_buffer((2, 8, 16), "int8")
    for i, j, k in T.grid(2, 8, 16):
        with T.sblock("C"):
            v_i, v_j, v_k = T.axis.remap("SSS", [i, j, k])
            T.reads(S[v_i, v_j, v_k])
            T.writes(C[v_i, v_j, v_k])
            C[v_i, v_j, v_k] = T.Cast("int8", not S[v_i, v_j, v_k] == T.float32("-inf"))
    for i, j, z, k in T.grid(2, 8, 1, 16):
        with T.sblock("R"):
            v_i, v_j, v_z, v_k = T.axis.remap("SSSR", [i, j, z, k])
            T.reads(C[v_i, v_j, v_k])
            T.writes(R[v_i, v_j, v_z])
            with T.init():
                R[v_i, v_j, v_z] = T.int8(-128)
            R[v_i, v_j, v_z] = T.max(R[v_i, v_j, v_z], C[v_i, v_j, v_k])
'''

LLVM = parse_target("llvm")


def farm(*args: str, cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "farm", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=timeout)


@pytest.fixture(scope="module")
def kernels(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("kernels")
    out = {}
    for name, text in (("matmul_bias_relu", MATMUL_BIAS_RELU), ("softmax", SOFTMAX), ("mask_rows", MASK_ROWS)):
        out[name] = folder / f"{name}.py"
        out[name].write_text(text)
    return out


@pytest.fixture(scope="module")
def matmul(kernels: dict[str, Path]) -> TirWorkload:
    return tir_from_file(str(kernels["matmul_bias_relu"]))


def test_a_tir_workload_round_trips_and_its_reference_is_the_function_itself(matmul: TirWorkload) -> None:
    assert str(matmul).startswith("tir:matmul_bias_relu@")
    assert matmul.input_shapes() == [(16, 32), (32, 16), (16,)] and matmul.output_shape() == (16, 16)
    again = workload_from_json(json.loads(json.dumps(matmul.to_json())))
    assert again == matmul and again.key == matmul.key and again.hash == matmul.hash
    inputs = matmul.random_inputs()
    expected = np.maximum(inputs[0].astype(np.float64) @ inputs[1] + inputs[2], 0.0)
    np.testing.assert_allclose(matmul.reference(inputs), expected, rtol=1e-5, atol=1e-5)
    # A workload whose IR does not hash to its hash is refused (edited by hand, another TVM).
    with pytest.raises(FarmError, match="hashes to"):
        tir_from_params({**matmul.p, "hash": "0" * 16})


def test_design_space_domains_are_exact_and_index_is_a_bijection(matmul: TirWorkload) -> None:
    task = Task(matmul, LLVM, "ms.llvm")  # its design space (its hand template comes first)
    space = task.space
    assert task.template.name == "ms.llvm" and isinstance(space, UnionSpace)
    assert space.size == sum(math.prod(len(k) for k in part.knobs) for part in space.parts)
    for part in space.parts:
        for knob in part.knobs:
            if isinstance(knob, TileKnob):  # every factorization within the innermost bound, nothing else
                bound = knob.max_innermost or knob.extent
                assert knob.values == [f for f in factorizations(knob.extent, knob.parts) if f[-1] <= bound]
    rng = random.Random(0)
    for index in [0, space.size - 1, *(rng.randrange(space.size) for _ in range(300))]:
        config = space.get(index)
        assert space.index(dict(config.values)) == index
        assert space.from_json(json.loads(config.dumps())).index == index
    with pytest.raises(FarmError):
        space.from_json({"sketch": len(space.parts)})
    shards = space.shards(3)
    seen: set[int] = set()
    for shard in shards:
        members = set(shard)
        assert not members & seen
        seen |= members
    assert seen == set(range(space.size))


def test_invalid_decisions_are_rejected_not_repaired(matmul: TirWorkload) -> None:
    from farm.core.space import Config
    from farm.core.templates.design_space import design_space

    task = Task(matmul, LLVM, "ms.llvm")  # its design space (its hand template comes first)
    space = design_space(matmul, LLVM)
    valid = next(c for c in (task.space.get(i) for i in range(task.space.size)) if task.check(c) is None)
    sch = task.schedule(valid)  # a valid config replays to exactly its own decisions
    replayed = [inst for inst in sch.trace.insts if inst.kind.name.startswith("Sample")]
    assert len(replayed) == len(valid.values) - 1
    # Decisions outside the domains (a tile that does not divide its loop, one of the right
    # product whose innermost factor is over the bound): TVM's replay would change the first and
    # take the second; the farm refuses both, and schedules neither.
    tile = next(k for k in space.space.parts[valid["sketch"]].knobs if isinstance(k, TileKnob))
    wrong_product = (tile.extent + 1, *[1] * (tile.parts - 1))
    too_inner = (*[1] * (tile.parts - 1), tile.extent)
    for value in (wrong_product, too_inner) if tile.max_innermost and tile.extent > tile.max_innermost \
            else (wrong_product,):
        config = Config(valid.index, tuple((k, value if k == tile.name else v) for k, v in valid.values))
        sch, why = space.replay(config)
        assert sch is None and why is not None and tile.name in why, why
    assert space.replay(valid)[1] is None


def test_features_of_a_design_space(matmul: TirWorkload) -> None:
    task = Task(matmul, LLVM, "ms.llvm")  # its design space (its hand template comes first)
    feats = DesignSpaceFeaturizer(task)
    indices = np.random.default_rng(0).integers(0, task.space.size, size=500)
    codes = feats.codes(indices)
    assert (feats.indices(codes) == indices).all()
    configs = [task.space.get(int(i)).to_json() for i in indices[:50]]
    from_configs, fits = feats.codes_of_configs(configs)
    assert fits.all() and (from_configs == codes[:50]).all()
    matrix = feats.features(codes)
    assert matrix.shape == (500, len(feats.names)) and np.isfinite(matrix[:, :4]).all()
    moved = feats.neighbours(codes, np.random.default_rng(1))
    moved_indices = feats.indices(moved)
    assert ((moved_indices >= 0) & (moved_indices < task.space.size)).all()
    assert (moved_indices != indices).mean() > 0.5


def test_union_of_spaces() -> None:
    parts = [ConfigSpace([ChoiceKnob("a", [1, 2, 3])]), ConfigSpace([ChoiceKnob("a", [7]), ChoiceKnob("b", [0, 1])])]
    space = UnionSpace(parts, "sketch")
    assert space.size == 5
    assert [dict(space.get(i).values) for i in range(5)] == [
        {"sketch": 0, "a": 1}, {"sketch": 0, "a": 2}, {"sketch": 0, "a": 3},
        {"sketch": 1, "a": 7, "b": 0}, {"sketch": 1, "a": 7, "b": 1}]
    with pytest.raises(FarmError):
        space.index({"sketch": 0, "a": 7})


def test_kernels_of_plain_types_get_the_targets_sketches_without_tensor_intrinsics(
        kernels: dict[str, Path]) -> None:
    """A kernel of 32- and 64-bit types gets its target kind's plain rules: a fresh process makes
    its space without importing TVM's tensor intrinsics (seconds), and the sketches and
    postprocessors that matter are those of the target's own rules (on sm_90 the tensor-core ones).
    An 8-bit kernel keeps the target's own."""
    import tvm
    from tvm.s_tir import meta_schedule as ms

    from farm.core.templates.design_space import plain_rules
    from farm.core.tvm_import import import_tensor_intrinsics

    cuda = parse_target("cuda")
    code = (f"import sys; from farm.core.task import Task; from farm.core.targets import parse_target; "
            f"from farm.core.tir import tir_from_file\n"
            f"for name in ({str(kernels['matmul_bias_relu'])!r}, {str(kernels['softmax'])!r}):\n"
            f"    for kind in ('cuda', 'llvm'):\n"
            f"        assert Task(tir_from_file(name), parse_target(kind), 'ms.' + kind).space.size > 1\n"
            f"print(sorted(m for m in sys.modules if m.startswith('tvm.s_tir.tensor_intrin')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300)
    assert out.stdout.split() == ["[]"]

    import_tensor_intrinsics()  # the target's own rules need them

    def sketches(func: object, target: object, rules: str) -> tuple[list[str], list[str]]:
        context = ms.TuneContext(mod=tvm.IRModule({"main": func}), target=target, task_name="t", num_threads=1,
                                 rand_state=1, space_generator=ms.space_generator.PostOrderApply(
                                     sch_rules=rules, postprocs=rules, mutator_probs=rules))
        return ([str(s.trace) for s in context.generate_design_space()],
                [type(p).__name__ for p in context.space_generator.postprocs])

    for name in ("matmul_bias_relu", "softmax"):
        func = tir_from_file(str(kernels[name])).prim_func()
        for spec in (cuda, LLVM):
            rules = plain_rules(func, spec)
            assert rules == spec.kind
            plain, own = sketches(func, spec.tvm(), rules), sketches(func, spec.tvm(), "from-target")
            assert plain[0] == own[0]
            # The target's own postprocessors on sm_90 add RewriteTensorize, a no-op without tensor cores.
            assert [p for p in own[1] if p != "RewriteTensorize"] == plain[1]
    assert plain_rules(tir_from_file(str(kernels["mask_rows"])).prim_func(), cuda) is None
    assert plain_rules(func, parse_target({"kind": "llvm", "mcpu": "skylake-avx512"})) is None


def test_gpu_shared_memory_fit_matches_the_lowered_kernels(matmul: TirWorkload) -> None:
    """On cuda (built, not run): each sketch's fitted shared memory equals what lowering allocates."""
    from farm.core.templates.design_space import design_space

    cuda = parse_target("cuda")
    space = design_space(matmul, cuda)
    rng = random.Random(3)
    compared = 0
    for _ in range(200):
        config = space.space.get(rng.randrange(space.space.size))
        sketch = config["sketch"]
        space.bound_error(config)  # fits the sketch's footprints
        fitted = space._footprints[sketch]
        real = space._shared_buffers(config)
        if fitted is None or real is None:
            continue
        for kernel in fitted:
            assert kernel.bytes(config, space.slots[sketch]) == sum(
                n * size for (name, _), (n, size) in real.items() if name == kernel.name)
        compared += 1
        if compared == 8:
            break
    assert compared == 8


def test_register_check_pairs_each_kernel_with_its_own_block() -> None:
    ptxas = ("ptxas info    : Compiling entry function 'main_kernel' for 'sm_90'\n"
             "ptxas info    : Used 87 registers, used 1 barriers\n"
             "ptxas info    : Compiling entry function 'main_kernel_1' for 'sm_90'\n"
             "ptxas info    : Used 10 registers, used 0 barriers\n")
    source = ('extern "C" __global__ void __launch_bounds__(128) main_kernel(float* a) {}\n'
              'extern "C" __global__ void __launch_bounds__(1024) main_kernel_1(float* a) {}\n')
    assert _registers_per_kernel(ptxas) == {"main_kernel": 87, "main_kernel_1": 10}
    assert _threads_per_kernel(source) == {"main_kernel": 128, "main_kernel_1": 1024}


def test_a_job_on_two_workers_then_its_export_in_tvm(kernels: dict[str, Path], tmp_path: Path) -> None:
    """`farm tune FILE.py` on 2 llvm workers spends exactly its budget on distinct configs; the
    MetaSchedule export is applied by compile_tir and by Relax's MetaScheduleApplyDatabase, and the
    kernels they build compute the function's own output."""
    import tvm
    from tvm import relax
    from tvm.s_tir import meta_schedule as ms

    db = tmp_path / "farm.db"
    proc = farm("tune", str(kernels["softmax"]), "--target", "llvm", "--trials", "12", "--workers", "2",
                "--batch-size", "3", "--db", f"sqlite:///{db}", "--export", "best.json", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "tir:softmax@" in proc.stdout + proc.stderr
    with sqlite3.connect(db) as con:
        rows = con.execute("SELECT config_index, status FROM trials").fetchall()
    assert len(rows) == 12 and len({index for index, _ in rows}) == 12
    assert {status for _, status in rows} == {"ok"}  # invalid configs never reach a build
    proc = farm("export", "1", "-o", "msdb", "--format", "metaschedule", "--db", f"sqlite:///{db}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr

    workload = tir_from_file(str(kernels["softmax"]))
    target = tvm.target.Target({"kind": "llvm", "num-cores": 2})
    database = ms.database.JSONDatabase(str(tmp_path / "msdb/database_workload.json"),
                                        str(tmp_path / "msdb/database_tuning_record.json"), allow_missing=False)
    inputs = workload.random_inputs(seed=1)
    expected = workload.reference(inputs)
    scheduled = ms.tir_integration.compile_tir(database, tvm.IRModule({"main": workload.prim_func()}), target)
    assert scheduled is not None
    lib = tvm.compile(scheduled.mod, target=target)
    out = tvm.runtime.empty(workload.output_shape(), workload.dtype, tvm.cpu())
    lib["main"](*[tvm.runtime.tensor(x) for x in inputs], out)
    np.testing.assert_allclose(out.numpy(), expected, rtol=1e-5, atol=1e-6)

    # A Relax program calling the kernel: MetaScheduleApplyDatabase puts the tuned schedule in.
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((4, 32), "float32"))
    with bb.function("main", [x]):
        kernel = bb.add_func(workload.prim_func().without_attr("global_symbol"), "softmax")
        with bb.dataflow():
            y = bb.emit_output(relax.call_tir(kernel, [x], relax.TensorType((4, 32), "float32")))
        bb.emit_func_output(y)
    with target, database:
        applied = relax.transform.MetaScheduleApplyDatabase()(bb.get())
    assert applied["softmax"].attrs["tirx.is_scheduled"]
    vm = relax.VirtualMachine(tvm.compile(applied, target=target), tvm.cpu())
    np.testing.assert_allclose(vm["main"](tvm.runtime.tensor(inputs[0])).numpy(), expected, rtol=1e-5, atol=1e-6)


def test_a_kernel_with_an_integer_output_is_tuned_and_checked(kernels: dict[str, Path], tmp_path: Path) -> None:
    """A model's mask kernel (int8 output): its candidates are built, run and checked against the
    function's own output like any other, every trial ok, none a failure of the farm's own check."""
    db = tmp_path / "farm.db"
    proc = farm("tune", str(kernels["mask_rows"]), "--target", "llvm", "--trials", "6", "--batch-size", "3",
                "--db", f"sqlite:///{db}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    with sqlite3.connect(db) as con:
        statuses = [status for (status,) in con.execute("SELECT status FROM trials")]
    assert statuses == ["ok"] * 6, statuses


@pytest.mark.parametrize(("name", "text", "message"), [
    ("unparsable", "from tvm.script import tirx as T\n\n@T.prim_func(s_tir=True)\ndef f(A: T.Buffer((4,), "
     "\"float32\")):\n    A[0] = undefined_name\n", "does not parse as TVMScript"),
    ("dynamic", "from tvm.script import tirx as T\n\n@T.prim_func(s_tir=True)\ndef f(a: T.handle, b: T.handle):\n"
     "    n = T.int32()\n    A = T.match_buffer(a, (n,))\n    B = T.match_buffer(b, (n,))\n"
     "    for i in range(n):\n        with T.sblock(\"B\"):\n            vi = T.axis.spatial(n, i)\n"
     "            B[vi] = A[vi]\n", "dynamic shape"),
    ("empty", "from tvm.script import tirx as T\n\n@T.prim_func(s_tir=True)\ndef f(A: T.Buffer((4,), \"float32\")):\n"
     "    T.evaluate(0)\n", "nothing to schedule"),
    ("no_definition", "x = 1\n", "no @T.prim_func"),
])
def test_bad_tir_input_is_one_line_and_writes_nothing(tmp_path: Path, name: str, text: str, message: str) -> None:
    path = tmp_path / f"{name}.py"
    path.write_text(text)
    proc = farm("tune", str(path), "--target", "llvm", "--trials", "4", cwd=tmp_path, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert not (tmp_path / "farm.db").exists()


def test_a_missing_file_is_one_line(tmp_path: Path) -> None:
    proc = farm("tune", "missing.py", "--target", "llvm", cwd=tmp_path, timeout=120)
    assert proc.returncode == 2 and "does not exist" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and not (tmp_path / "farm.db").exists()


# --- fused operators on the hand templates (farm.core.fused) ------------------------------------


def _relax_kernels() -> dict[str, TirWorkload]:
    """A fused conv2d + bias + ReLU, a strided conv2d alone, a matmul + bias + GELU, a depthwise
    convolution (two outputs per channel) + scale + shift + ReLU, a grouped convolution + ReLU, a max
    pooling, an average pooling that leaves the padding out of its count, a max pooling in ceil mode, a
    batch matmul + scale (attention's scores), one of two batch axes and a linear layer + bias on one and on two
    sequences, as Relax's pipeline makes them (LegalizeOps, FuseOps, FuseTIR; MetaSchedule's
    extract_tasks)."""
    import tvm
    from tvm import relax
    from tvm.s_tir import meta_schedule as ms

    from farm.core.tir import tir_workload

    def tensor(name: str, *shape: int) -> relax.Var:
        return relax.Var(name, relax.TensorType(shape, "float32"))

    bb = relax.BlockBuilder()
    x, w, b = tensor("x", 1, 8, 10, 10), tensor("w", 16, 8, 3, 3), tensor("b", 1, 16, 1, 1)
    w2, a, m, bias = tensor("w2", 8, 8, 3, 3), tensor("a", 16, 32), tensor("m", 32, 24), tensor("bias", 24)
    dw, scale, grouped = tensor("dw", 16, 1, 3, 3), tensor("scale", 1, 16, 1, 1), tensor("grouped", 8, 4, 3, 3)
    q, k, q4, k4 = tensor("q", 4, 8, 6), tensor("k", 4, 6, 8), tensor("q4", 1, 3, 8, 6), tensor("k4", 1, 3, 6, 5)
    rows, batches, proj = tensor("rows", 1, 5, 12), tensor("batches", 2, 5, 12), tensor("proj", 12, 20)
    with bb.function("main", [x, w, b, w2, a, m, bias, dw, scale, grouped, q, k, q4, k4, rows, batches, proj]):
        with bb.dataflow():
            nn = relax.op.nn
            conv = bb.emit(nn.relu(relax.op.add(nn.conv2d(x, w, padding=1), b)))
            strided = bb.emit(nn.conv2d(x, w2, strides=2, padding=1))
            dense = bb.emit(nn.gelu(relax.op.add(relax.op.matmul(a, m), bias)))
            depthwise = bb.emit(nn.relu(relax.op.add(relax.op.multiply(nn.conv2d(x, dw, padding=1, groups=8), scale),
                                                     scale)))
            group = bb.emit(nn.relu(nn.conv2d(x, grouped, strides=2, padding=1, groups=2)))
            pools = [bb.emit(nn.max_pool2d(x, 3, 2, 1)), bb.emit(nn.avg_pool2d(x, 3, 2, 1, count_include_pad=False)),
                     bb.emit(nn.max_pool2d(x, 3, 2, 0, ceil_mode=True))]
            scores = bb.emit(relax.op.multiply(relax.op.matmul(q, k), relax.const(0.125, "float32")))
            batched = bb.emit(relax.op.matmul(q4, k4))
            one = relax.const(1.0, "float32")
            linear = [bb.emit(relax.op.add(relax.op.matmul(seq, proj), one)) for seq in (rows, batches)]
            out = bb.emit_output(relax.Tuple([conv, strided, dense, depthwise, group, *pools, scores, batched,
                                              *linear]))
        bb.emit_func_output(out)
    passes = [relax.transform.LegalizeOps(), relax.transform.AnnotateTIROpPattern(), relax.transform.FoldConstant(),
              relax.transform.FuseOps(), relax.transform.FuseTIR()]
    mod = tvm.transform.Sequential(passes)(bb.get())
    return {t.task_name: tir_workload(t.dispatched[0]["main"], t.task_name)
            for t in ms.relax_integration.extract_tasks(mod, tvm.target.Target("llvm"))}


@pytest.fixture(scope="module")
def relax_kernels() -> dict[str, TirWorkload]:
    return _relax_kernels()


def test_fused_kernels_are_recognised_as_the_farm_operators_they_compute(
        relax_kernels: dict[str, TirWorkload], kernels: dict[str, Path]) -> None:
    from farm.core.fused import match_operator

    conv = match_operator(relax_kernels["fused_conv2d_add_relu"])
    assert conv is not None and conv.name == "conv2d_nchw"
    assert conv.p == {"N": 1, "CI": 8, "H": 10, "W": 10, "CO": 16, "KH": 3, "KW": 3, "stride": 1, "pad": 1,
                      "dilation": 1, "dtype": "float32"}
    assert conv.stage("compute") == "conv2d_nchw" and conv.stage("pad") == "pad_temp"
    assert conv.stage("epilogue") is not None and len(conv.inline) == 1  # the add, inlined into the relu
    strided = next(match_operator(w) for name, w in relax_kernels.items() if name.startswith("conv2d"))
    assert strided is not None and strided.p["stride"] == 2 and strided.stage("epilogue") is None
    dense = match_operator(next(w for n, w in relax_kernels.items() if "gelu" in n))
    assert dense is not None and dense.name == "matmul" and dense.p["M"] == 16 and dense.p["N"] == 24
    assert match_operator(tir_from_file(str(kernels["softmax"]))) is None  # a softmax is none of them
    found = {name: match_operator(w) for name, w in relax_kernels.items()}
    depthwise = next(f for f in found.values() if f is not None and f.name == "depthwise_conv2d_nchw")
    assert depthwise.p == {"N": 1, "C": 8, "H": 10, "W": 10, "KH": 3, "KW": 3, "stride": 1, "pad": 1, "multiplier": 2,
                           "dtype": "float32"}
    assert depthwise.fuse_loops == ((4, 2),) and len(depthwise.inline) == 2 and depthwise.stage("epilogue") is not None
    group = next(f for f in found.values() if f is not None and f.name == "group_conv2d_nchw")
    assert group.p == {"N": 1, "CI": 8, "H": 10, "W": 10, "CO": 8, "KH": 3, "KW": 3, "groups": 2, "stride": 2,
                       "pad": 1, "dtype": "float32"}
    pools = sorted((f.p["kind"], f.p["pad"], f.stage("epilogue") is not None) for f in found.values()
                   if f is not None and f.name == "pool2d")
    assert pools == [("avg", 1, True), ("max", 1, False)]  # the ceil mode's output is not pool2d's
    batches = sorted((f.p["B"], f.p["M"], f.p["N"], f.p["K"], f.fuse_loops, f.stage("epilogue") is not None)
                     for f in found.values() if f is not None and f.name == "batch_matmul")
    assert batches == [(3, 8, 5, 6, ((0, 2),), False), (4, 8, 8, 6, (), True)]
    linear = next(f for f in found.values() if f is not None and f.name == "matmul" and f.fuse_loops)
    assert (linear.p["M"], linear.p["N"], linear.p["K"], linear.fuse_loops) == (5, 20, 12, ((0, 2),))
    # The ceil-mode pooling, and the linear layer on 2 sequences: its rows' two loops fused would not tile
    # as boxes of its buffers (farm.core.fused.FusedOperator.fuse_loops).
    assert sum(f is None for f in found.values()) == 2


def test_hand_templates_schedule_fused_kernels_correctly(relax_kernels: dict[str, TirWorkload]) -> None:
    """The llvm template's kernels of each fused kernel compute its own output; on cuda (built here,
    not run) the tiled template's pass GPU verification and compile."""
    import tempfile

    import tvm

    from farm.core.fused import match_operator
    from farm.core.templates.verify import verify_gpu
    from farm.export import _replays as replays
    from workers.compiler import BuildResult, compile_into

    cuda = parse_target("cuda")
    gpu_templates = {"conv2d_nchw": "cuda.tiled", "group_conv2d_nchw": "cuda.tiled", "matmul": "cuda.tiled",
                     "batch_matmul": "cuda.tiled", "depthwise_conv2d_nchw": "cuda.depthwise", "pool2d": "cuda.pool"}
    for workload in relax_kernels.values():
        operator = match_operator(workload)
        if operator is None:  # the ceil-mode max pooling, the linear layer on two sequences
            continue
        task = Task(workload, LLVM)
        assert task.template.name == "llvm.tiled" and task.scheduled_as.source == workload
        inputs = workload.random_inputs()
        expected = workload.reference(inputs)
        rng = random.Random(0)
        for _ in range(2):
            config = next(c for c in (task.space.get(rng.randrange(task.space.size)) for _ in range(1000))
                          if task.check(c) is None)
            lib = tvm.compile(task.schedule(config).mod, target="llvm")
            out = tvm.runtime.empty(workload.output_shape(), workload.dtype, tvm.cpu())
            lib["main"](*[tvm.runtime.tensor(x) for x in inputs], out)
            error = np.linalg.norm(out.numpy() - expected) / np.linalg.norm(expected)
            assert error <= workload.tolerance(), f"{workload} {config.dumps()}: {error:.2e}"
            # MetaSchedule's replay of the trace on the kernel as given makes the same module (export).
            assert replays(task, task.schedule(config))
        gpu = Task(workload, cuda)
        assert gpu.template.name == gpu_templates[operator.name]
        config = next(c for c in (gpu.space.get(rng.randrange(gpu.space.size)) for _ in range(5000))
                      if gpu.check(c) is None)
        sch = gpu.schedule(config)
        assert verify_gpu(sch.mod, cuda) is None
        built = BuildResult(config.index, config.to_json())
        compile_into(sch.mod, cuda, Path(tempfile.mkdtemp()) / "kernel", built)
        assert built.ok, built.error
    # Every template that schedules a fused kernel: its hand template first, then its design space.
    from farm.core.templates import templates_for

    names = [t.name for _, t in templates_for(relax_kernels["fused_conv2d_add_relu"], LLVM)]
    assert names == ["llvm.tiled", "ms.llvm"]


def test_half_precision_fused_kernels_reach_the_tensor_cores() -> None:
    """A float16 matmul (float32 sums) + bias + GELU as Relax makes it gets cuda.tensorcore with its
    stages folded into the store: WMMA code that passes GPU verification, builds, and whose trace
    MetaSchedule replays on the kernel as given. A float16 convolution + ReLU, which no tensor-core
    hand template takes fused, goes to its design space (tensor-core sketches) before cuda.tiled."""
    import tempfile

    import tvm
    from tvm import relax
    from tvm.s_tir import meta_schedule as ms

    from farm.core.templates import templates_for
    from farm.core.templates.base import compile_scheduled
    from farm.core.templates.verify import verify_gpu
    from farm.core.tir import tir_workload
    from farm.export import _replays as replays
    from workers.compiler import BuildResult, compile_into

    bb = relax.BlockBuilder()
    a, w = relax.Var("a", relax.TensorType((32, 64), "float16")), relax.Var("w", relax.TensorType((64, 48), "float16"))
    bias = relax.Var("bias", relax.TensorType((48,), "float16"))
    x = relax.Var("x", relax.TensorType((1, 16, 8, 8), "float16"))
    k = relax.Var("k", relax.TensorType((16, 16, 3, 3), "float16"))
    with bb.function("main", [a, w, bias, x, k]):
        with bb.dataflow():
            product = bb.emit(relax.op.astype(relax.op.matmul(a, w, out_dtype="float32"), "float16"))
            dense = bb.emit(relax.op.nn.gelu(relax.op.add(product, bias)))
            conv = bb.emit(relax.op.nn.relu(relax.op.nn.conv2d(x, k, padding=1, out_dtype="float16")))
            out = bb.emit_output(relax.Tuple([dense, conv]))
        bb.emit_func_output(out)
    passes = [relax.transform.LegalizeOps(), relax.transform.AnnotateTIROpPattern(), relax.transform.FoldConstant(),
              relax.transform.FuseOps(), relax.transform.FuseTIR()]
    fused = tvm.transform.Sequential(passes)(bb.get())
    extracted = {t.task_name: tir_workload(t.dispatched[0]["main"], t.task_name)
                 for t in ms.relax_integration.extract_tasks(fused, tvm.target.Target("llvm"))}
    cuda = parse_target("cuda")
    conv_kernel = next(w for name, w in extracted.items() if "conv2d" in name)
    assert [t.name for _, t in templates_for(conv_kernel, cuda)] == ["ms.cuda", "cuda.tiled"]
    assert [t.name for _, t in templates_for(conv_kernel, parse_target({"kind": "cuda", "arch": "sm_61"}))] == \
        ["cuda.tiled", "ms.cuda"]  # no tensor cores before Volta
    task = Task(next(w for name, w in extracted.items() if "matmul" in name), cuda)
    assert task.template.name == "cuda.tensorcore" and task.scheduled_as.name == "matmul"
    rng = random.Random(0)
    for _ in range(2):
        config = next(c for c in (task.space.get(rng.randrange(task.space.size)) for _ in range(5000))
                      if task.check(c) is None)
        sch = task.schedule(config)
        assert verify_gpu(sch.mod, cuda) is None and replays(task, sch)
        source = compile_scheduled(sch.mod, cuda).mod.imports[0].inspect_source("")
        assert "wmma::mma_sync" in source and "erff(" in source  # the GELU, in the kernel that stores the output
        built = BuildResult(config.index, config.to_json())
        compile_into(sch.mod, cuda, Path(tempfile.mkdtemp()) / "kernel", built)
        assert built.ok, built.error


def _half_precision_convolution(target: TargetSpec) -> Task:
    """The task of a float16 convolution + ReLU that sums in float32 and rounds once, as
    farm.core.half_import imports PyTorch's: MetaSchedule's tensor-core sketches, in dynamic shared
    memory."""
    import tvm
    from tvm import relax
    from tvm.s_tir import meta_schedule as ms

    from farm.core.tir import tir_workload

    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, 64, 14, 14), "float16"))
    k = relax.Var("k", relax.TensorType((64, 64, 3, 3), "float16"))
    with bb.function("main", [x, k]):
        with bb.dataflow():
            conv = relax.op.astype(relax.op.nn.conv2d(x, k, padding=1, out_dtype="float32"), "float16")
            out = bb.emit_output(relax.op.nn.relu(conv))
        bb.emit_func_output(out)
    passes = [relax.transform.LegalizeOps(), relax.transform.AnnotateTIROpPattern(), relax.transform.FoldConstant(),
              relax.transform.FuseOps(), relax.transform.FuseTIR()]
    fused = tvm.transform.Sequential(passes)(bb.get())
    (task_,) = ms.relax_integration.extract_tasks(fused, tvm.target.Target("llvm"))
    task = Task(tir_workload(task_.dispatched[0]["main"], task_.task_name), target)
    assert task.template.name == "ms.cuda"
    return task


def test_a_half_precision_convolution_summing_in_float32_builds_on_the_tensor_cores(
        matmul: TirWorkload, monkeypatch: pytest.MonkeyPatch) -> None:
    """A float16 convolution that sums in float32 and rounds once (as farm.core.half_import imports
    PyTorch's) gets tensor-core sketches in dynamic shared memory: no probe is lowered to fit their
    shared memory (a checked config is replayed alone), and each config builds through the farm's pipeline, where
    TVM's default one fails every such config (StorageRewrite: base.needs_plain_storage), alone and
    in a module of several kernels as a model's build lowers them, each with its own options."""
    import tempfile

    import tvm

    from farm.core.templates import design_space as design_space_module
    from farm.core.templates.base import (
        compile_scheduled,
        needs_plain_storage,
        register_default_pipeline,
        with_async_copies,
    )
    from farm.core.templates.verify import verify_gpu
    from workers.compiler import BuildResult, compile_into

    cuda = parse_target("cuda")
    task = _half_precision_convolution(cuda)

    def no_probe(*_: object) -> None:
        raise AssertionError("a probe was lowered to fit a sketch in dynamic shared memory")

    monkeypatch.setattr(design_space_module.DesignSpace, "_shared_buffers", no_probe)
    rng = random.Random(0)
    scheduled = []
    for _ in range(2):
        config = next(c for c in (task.space.get(rng.randrange(task.space.size)) for _ in range(5000))
                      if task.check(c) is None)
        sch = task.schedule(config)
        assert "wmma_sync" in str(sch.trace) and needs_plain_storage(sch.mod["main"])
        assert verify_gpu(sch.mod, cuda) is None
        with pytest.raises(Exception, match="tvm_access_ptr element type"):  # TVM 0.27's fault
            tvm.tirx.build(sch.mod, target=cuda.tvm(), pipeline="default")
        built = BuildResult(config.index, config.to_json())
        compile_into(sch.mod, cuda, Path(tempfile.mkdtemp()) / "kernel", built)
        assert built.ok, built.error
        scheduled.append(sch.mod["main"])
    # A model's build: these kernels, and a matmul on CUDA cores, pipelined, once marked for
    # asynchronous copies as a record's kernel is (build_model) and once not (DLight's).
    tiled = Task(matmul, cuda)
    assert tiled.template.name == "cuda.tiled"
    pipelined = next(c for c in (tiled.space.get(rng.randrange(tiled.space.size)) for _ in range(20000))
                     if c["pipeline"] >= 2 and tiled.check(c) is None)
    tiled_mod = tiled.schedule(pipelined).mod
    plain = tiled_mod["main"]

    def kernels(source: str) -> dict[str, str]:
        """Each kernel's definition in CUDA source (a declaration before it is overwritten)."""
        return {re.search(r"(\w+)\(", part.replace("__launch_bounds__(", ""))[1]: part
                for part in source.split('extern "C" __global__')[1:]}

    measured = kernels(compile_scheduled(tiled_mod, cuda).mod.imports[0].inspect_source(""))
    assert not needs_plain_storage(plain)
    functions = {**{f"conv{i}": func for i, func in enumerate(scheduled)}, "tiled": plain, "tiled_async": plain}
    mod = with_async_copies(tvm.IRModule({name: func.with_attr("global_symbol", name)
                                          for name, func in functions.items()}), ["tiled_async"])
    source = tvm.tirx.build(mod, target=cuda.tvm(), pipeline=register_default_pipeline()).imports[0].inspect_source("")
    built = kernels(source)
    assert {"conv0_kernel", "conv1_kernel", "tiled_kernel", "tiled_async_kernel"} <= set(built), list(built)
    assert all("wmma::mma_sync" in built[f"conv{i}_kernel"] for i in range(2))
    assert built["tiled_async_kernel"].replace("tiled_async_kernel", "main_kernel") == measured["main_kernel"]
    assert built["tiled_kernel"].replace("tiled_kernel", "main_kernel") != measured["main_kernel"]


def test_a_tensor_core_sketch_bounds_its_dynamic_shared_memory_from_below() -> None:
    """The precheck of a float16 convolution's tensor-core sketches fits their dynamic shared
    buffers, as compacted before lowering merges them: it refuses configs whose largest buffer is
    over the opt-in limit, never one that the full check (a replay, VerifyGPUCode) accepts, and
    what it computes never exceeds what the lowered kernel allocates."""
    from tvm import s_tir

    from farm.core.templates.design_space import design_space
    from farm.core.templates.verify import lower

    cuda = parse_target("cuda")
    task = _half_precision_convolution(cuda)
    space = design_space(task.scheduled_as, cuda)
    rng = random.Random(1)
    refused = lowered = 0
    for _ in range(60):
        config = task.space.get(rng.randrange(task.space.size))
        reason = task.precheck(config)
        if reason is not None:
            refused += "dynamic shared buffer" in reason
            assert space.replay(config, bounds=False)[1] is not None, reason
        elif lowered < 2 and task.check(config) is None:
            sketch = config["sketch"]
            (kernel,) = space._footprints[sketch]
            assert kernel.dynamic
            allocated = max(int(s_tir.analysis.calculate_allocated_bytes(func)["main"].get("shared.dyn", 0))
                            for func in lower(task.schedule(config).mod, cuda).functions.values())
            assert 0 < kernel.bytes(config, space.slots[sketch]) <= allocated
            lowered += 1
    assert refused and lowered == 2


def test_a_job_with_every_template_keeps_the_faster(matmul: TirWorkload, kernels: dict[str, Path],
                                                    tmp_path: Path) -> None:
    """`--templates all` tunes the fused matmul + bias + ReLU with its hand template and its design
    space, one task each; the export holds one record, the faster's, and its MetaSchedule form is
    applied by compile_tir whichever template won."""
    import tvm
    from tvm.s_tir import meta_schedule as ms

    db = tmp_path / "farm.db"
    proc = farm("tune", str(kernels["matmul_bias_relu"]), "--target", "llvm", "--trials", "8", "--templates", "all",
                "--batch-size", "2", "--db", f"sqlite:///{db}", "--export", "best.json", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    with sqlite3.connect(db) as con:
        templates = dict(con.execute("SELECT template, count(*) FROM tasks JOIN trials ON trials.task_id = tasks.id "
                                     "GROUP BY template").fetchall())
        best = con.execute("SELECT template, min(latency) FROM tasks JOIN trials ON trials.task_id = tasks.id "
                           "WHERE status = 'ok' GROUP BY template ORDER BY min(latency) LIMIT 1").fetchone()
    assert templates == {"llvm.tiled": 4, "ms.llvm": 4}
    records = json.loads((tmp_path / "best.json").read_text())["records"]
    assert len(records) == 1 and records[0]["template"] == best[0]
    for template in ("llvm.tiled", "ms.llvm"):  # each template's own kernel, through MetaSchedule
        proc = farm("export", "1", "-o", f"ms-{template}", "--format", "metaschedule", "--db", f"sqlite:///{db}",
                    cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr
    database = ms.database.JSONDatabase(str(tmp_path / "ms-llvm.tiled/database_workload.json"),
                                        str(tmp_path / "ms-llvm.tiled/database_tuning_record.json"))
    scheduled = ms.tir_integration.compile_tir(database, tvm.IRModule({"main": matmul.prim_func()}),
                                               tvm.target.Target({"kind": "llvm", "num-cores": 2}))
    lib = tvm.compile(scheduled.mod, target="llvm")
    inputs = matmul.random_inputs()
    out = tvm.runtime.empty(matmul.output_shape(), matmul.dtype, tvm.cpu())
    lib["main"](*[tvm.runtime.tensor(x) for x in inputs], out)
    np.testing.assert_allclose(out.numpy(), matmul.reference(inputs), rtol=1e-5, atol=1e-5)
