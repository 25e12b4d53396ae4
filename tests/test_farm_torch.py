"""farm.torch on llvm, with small models built here: `farm.torch.compile` and the ``"farm"``
torch.compile backend match eager PyTorch on fresh inputs, return what the module returns (a
tensor, a tuple), hand tensors to TVM and back without copying, and refuse bad inputs and
options with one-line FarmErrors. No records are given: every kernel uses TVM's default schedules."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import farm.torch as farm_torch  # noqa: E402
from farm.core.errors import FarmError  # noqa: E402

# No records: compile_model warns that every kernel uses TVM's default schedules.
# torch.export's pytree, copied while the model is imported into Relax, warns of a deprecation.
pytestmark = [pytest.mark.filterwarnings("ignore:.*have no tuned record:UserWarning"),
              pytest.mark.filterwarnings("ignore:`isinstance\\(treespec, LeafSpec\\)` is deprecated:FutureWarning")]

ROOT = Path(__file__).resolve().parent.parent
TOL = {"rtol": 1e-4, "atol": 1e-5}  # fp32: TVM's kernels sum in another order than PyTorch's


class SmallCNN(torch.nn.Module):
    """conv + ReLU + max pool + linear."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.pool = torch.nn.MaxPool2d(2)
        self.fc = torch.nn.Linear(8 * 4 * 4, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.pool(torch.relu(self.conv(x))).flatten(1))


class TinyBlock(torch.nn.Module):
    """A transformer block: layer norm, single-head attention, GELU MLP, residuals."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.norm1, self.norm2 = torch.nn.LayerNorm(dim), torch.nn.LayerNorm(dim)
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.proj = torch.nn.Linear(dim, dim)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(dim, 2 * dim), torch.nn.GELU(), torch.nn.Linear(2 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)
        attention = torch.softmax(q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5, dim=-1)
        x = x + self.proj(attention @ v)
        return x + self.mlp(self.norm2(x))


class TwoHeads(torch.nn.Module):
    """An MLP returning a tuple: logits and the hidden activation's row sums."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(16, 32), torch.nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.nn.functional.gelu(self.a(x))
        return self.b(h), h.sum(-1)


def eager(model: torch.nn.Module, *inputs: torch.Tensor) -> Any:
    with torch.no_grad():
        return model(*inputs)


@pytest.fixture(scope="module")
def cnn() -> tuple[torch.nn.Module, farm_torch.FarmModule]:
    torch.manual_seed(0)
    model = SmallCNN().eval()
    return model, farm_torch.compile(model, torch.randn(2, 3, 8, 8), target="llvm")


@pytest.fixture
def fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_a_small_cnn_matches_eager_on_fresh_inputs(cnn: tuple[torch.nn.Module, farm_torch.FarmModule]) -> None:
    model, fast = cnn
    assert isinstance(fast, torch.nn.Module)
    assert fast.compiled.target.kind == "llvm"
    assert fast.compiled.untuned and not fast.compiled.tuned  # no records given
    for seed in (1, 2):
        x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(seed))
        out = fast(x)
        assert isinstance(out, torch.Tensor) and out.shape == (2, 10)
        torch.testing.assert_close(out, eager(model, x), **TOL)


def test_a_transformer_block_matches_eager_and_the_target_defaults_to_llvm_on_cpu() -> None:
    torch.manual_seed(0)
    model = TinyBlock().eval()
    fast = farm_torch.compile(model, torch.randn(1, 8, 16))  # CPU inputs: llvm
    assert fast.compiled.target.kind == "llvm"
    x = torch.randn(1, 8, 16)
    torch.testing.assert_close(fast(x), eager(model, x), **TOL)


def test_a_model_returning_a_tuple_returns_a_tuple() -> None:
    torch.manual_seed(0)
    model = TwoHeads().eval()
    fast = farm_torch.compile(model, (torch.randn(3, 16),), target="llvm")
    x = torch.randn(3, 16)
    out = fast(x)
    assert type(out) is tuple and len(out) == 2
    torch.testing.assert_close(out, eager(model, x), **TOL)


class _SpyVM:
    """A Relax VM that records the data pointers of what goes into and comes out of ``main``."""

    def __init__(self, vm: Any) -> None:
        self.vm, self.seen_in, self.seen_out = vm, [], []

    def __getitem__(self, name: str) -> Any:
        from farm.build_model import flatten

        def call(*args: Any) -> Any:
            self.seen_in = [a.data_ptr() for a in args]
            result = self.vm[name](*args)
            self.seen_out = [t.data_ptr() for t in flatten(result)]
            return result

        return call


def test_tensors_reach_tvm_and_come_back_without_copies(cnn: tuple[torch.nn.Module, farm_torch.FarmModule]) -> None:
    model, fast = cnn
    spy = _SpyVM(fast.compiled.vm)
    fast.compiled._vm = spy
    try:
        x = torch.randn(2, 3, 8, 8)
        out = fast(x)
        assert spy.seen_in == [x.data_ptr()]  # the TVM tensor is the torch tensor's memory
        assert spy.seen_out == [out.data_ptr()]  # and the torch output is TVM's
        # A transposed input is made contiguous, a misaligned view is copied: both still compute right.
        xt = torch.randn(2, 3, 8, 8).transpose(2, 3)
        torch.testing.assert_close(fast(xt), eager(model, xt), **TOL)
        assert spy.seen_in != [xt.data_ptr()]
        view = torch.randn(2 * 3 * 8 * 8 + 1)[1:].view(2, 3, 8, 8)
        assert view.data_ptr() % 64
        torch.testing.assert_close(fast(view), eager(model, view), **TOL)
    finally:
        fast.compiled._vm = spy.vm


@pytest.mark.parametrize(("inputs", "expected"), [
    ((torch.randn(1, 3, 8, 8),), "input x: expected float32[2, 3, 8, 8], got float32[1, 3, 8, 8]"),
    ((torch.randn(2, 3, 8, 8, dtype=torch.float64),), "input x: expected float32[2, 3, 8, 8], got float64[2, 3, 8, 8]"),
    ((torch.randn(2, 3, 8, 8), torch.randn(2, 3, 8, 8)), "model SmallCNN takes 1 inputs (x), got 2"),
    (("x",), "input x: expected a tensor float32[2, 3, 8, 8], got str"),
    ((torch.empty(2, 3, 8, 8, device="meta"),), "input x is on meta"),
], ids=["shape", "dtype", "count", "not-a-tensor", "device"])
def test_wrong_inputs_are_one_line_errors(cnn: tuple[torch.nn.Module, farm_torch.FarmModule], inputs: tuple[Any, ...],
                                          expected: str) -> None:
    _, fast = cnn
    with pytest.raises(FarmError) as e:
        fast(*inputs)
    assert expected in str(e.value)
    assert "\n" not in str(e.value)


def test_compile_refuses_what_it_cannot_take(tmp_path: Path) -> None:
    with pytest.raises(FarmError, match=r"takes a torch\.nn\.Module, got function"):
        farm_torch.compile(lambda x: x, torch.randn(2))  # type: ignore[arg-type]
    with pytest.raises(FarmError, match="example inputs must be a tensor or a sequence of tensors"):
        farm_torch.compile(SmallCNN(), [1, 2])
    with pytest.raises(FarmError, match=r"SmallCNN does not export .* float32\[2, 5\]") as e:
        farm_torch.compile(SmallCNN(), torch.randn(2, 5))
    assert "\n" not in str(e.value)
    # `db` opens the farm's database: an empty one holds no record of the model's kernels.
    with pytest.raises(FarmError, match="the database holds no record of any kernel of model TwoHeads"):
        farm_torch.compile(TwoHeads(), torch.randn(3, 16), target="llvm", db=f"sqlite:///{tmp_path / 'farm.db'}")


@pytest.mark.usefixtures("fresh_dynamo")
def test_the_torch_compile_backend_matches_eager_for_each_static_shape() -> None:
    torch.manual_seed(0)
    model = TwoHeads().eval()
    fast = torch.compile(model, backend="farm", dynamic=False, options={"target": "llvm"})
    for rows in (3, 5):  # a new shape is a new static graph, compiled again
        x = torch.randn(rows, 16)
        out = fast(x)
        assert type(out) is tuple and len(out) == 2
        torch.testing.assert_close(out, eager(model, x), **TOL)


@pytest.mark.usefixtures("fresh_dynamo")
def test_the_backend_is_farm_torch_backend_and_defaults_to_llvm_on_cpu() -> None:
    torch.manual_seed(0)
    model = SmallCNN().eval()
    fast = torch.compile(model, backend=farm_torch.backend, dynamic=False)
    x = torch.randn(2, 3, 8, 8)
    torch.testing.assert_close(fast(x), eager(model, x), **TOL)


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize(("kwargs", "message"), [
    ({"options": {"target": "llvm", "trials": 3}}, "unknown option 'trials' for the farm backend"),
    ({"mode": "max-autotune"}, "the farm backend has no modes"),
    ({"options": {"target": "tpu"}}, "unknown target 'tpu'"),
], ids=["option", "mode", "target"])
def test_bad_backend_settings_are_farm_errors(kwargs: dict[str, Any], message: str) -> None:
    fast = torch.compile(TwoHeads().eval(), backend="farm", dynamic=False, **kwargs)
    with pytest.raises(Exception) as e:  # TorchDynamo wraps it in BackendCompilerFailed
        fast(torch.randn(3, 16))
    inner = getattr(e.value, "inner_exception", e.value)
    assert isinstance(inner, FarmError)
    assert message in str(inner) and "\n" not in str(inner)


@pytest.mark.usefixtures("fresh_dynamo")
def test_symbolic_shapes_are_refused_with_what_to_do() -> None:
    fast = torch.compile(TwoHeads().eval(), backend="farm", options={"target": "llvm"})
    fast(torch.randn(3, 16))  # the first graph is static
    with pytest.raises(Exception) as e:  # TorchDynamo wraps it in BackendCompilerFailed
        fast(torch.randn(5, 16))  # TorchDynamo's automatic dynamic shapes: a symbolic graph
    inner = getattr(e.value, "inner_exception", e.value)
    assert isinstance(inner, FarmError)
    assert "symbolic shapes" in str(inner) and "dynamic=False" in str(inner)


def test_importing_farm_does_not_import_torch() -> None:
    code = "import sys, farm, farm.build_model; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "False"
