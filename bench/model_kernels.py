"""The TIR kernels of a BERT-base encoder layer, as TVM's Relax pipeline makes them: TVMScript files
that `farm tune FILE.py` and bench/vs_metaschedule.py take.

    python bench/model_kernels.py [--out bench/kernels] [--hidden 768 --heads 12 --feed-forward 3072]

The layer's operators (sequence 128, hidden 768, 12 heads of 64, feed-forward 3072, fp32) are
written with Relax's own operators, legalized and fused as `relax.get_pipeline` does before
MetaSchedule extracts its tasks (LegalizeOps, AnnotateTIROpPattern, FoldConstant, FuseOps,
FuseTIR), and every extracted task's PrimFunc is written as it is: a layer norm, the first
feed-forward matmul with its bias and GELU fused, the attention scores' batch matmul, the softmax
over them, and a mean over the hidden units (a reduction). None is a shape the farm's hand
templates cover.
"""

from __future__ import annotations

import argparse
from pathlib import Path

SEQUENCE, HIDDEN, HEADS, HEAD_DIM, FEED_FORWARD = 128, 768, 12, 64, 3072


def bert_layer_kernels(hidden: int = HIDDEN, heads: int = HEADS, feed_forward: int = FEED_FORWARD) -> dict[str, object]:
    """{task name: PrimFunc} of the layer's operators, as MetaSchedule's extract_tasks gives them
    (other sizes: another model of the family, BERT-large's 1024, 16, 4096)."""
    import tvm
    from tvm import relax
    from tvm.s_tir import meta_schedule as ms

    def tensor(name: str, *shape: int) -> relax.Var:
        return relax.Var(name, relax.TensorType(shape, "float32"))

    bb = relax.BlockBuilder()
    x, w1, b1 = tensor("x", SEQUENCE, hidden), tensor("w1", hidden, feed_forward), tensor("b1", feed_forward)
    gamma, beta = tensor("gamma", hidden), tensor("beta", hidden)
    q, k = tensor("q", heads, SEQUENCE, HEAD_DIM), tensor("k", heads, HEAD_DIM, SEQUENCE)
    with bb.function("main", [x, w1, b1, gamma, beta, q, k]):
        with bb.dataflow():
            normed = bb.emit(relax.op.nn.layer_norm(x, gamma, beta, axes=[-1]))
            hidden = bb.emit(relax.op.nn.gelu(relax.op.add(relax.op.matmul(normed, w1), b1)))
            scores = bb.emit(relax.op.matmul(q, k))
            probs = bb.emit(relax.op.nn.softmax(scores, axis=-1))
            mean = bb.emit(relax.op.mean(hidden, axis=[-1]))
            out = bb.emit_output(relax.Tuple([hidden, probs, mean]))
        bb.emit_func_output(out)
    passes = [relax.transform.LegalizeOps(), relax.transform.AnnotateTIROpPattern(), relax.transform.FoldConstant(),
              relax.transform.FuseOps(), relax.transform.FuseTIR()]
    mod = tvm.transform.Sequential(passes)(bb.get())
    tasks = ms.relax_integration.extract_tasks(mod, tvm.target.Target("llvm"))
    return {task.task_name: task.dispatched[0]["main"] for task in tasks}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "kernels")
    parser.add_argument("--hidden", type=int, default=HIDDEN)
    parser.add_argument("--heads", type=int, default=HEADS)
    parser.add_argument("--feed-forward", type=int, default=FEED_FORWARD)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for name, func in bert_layer_kernels(args.hidden, args.heads, args.feed_forward).items():
        text = func.script().replace("# from tvm.script import tirx as T", "from tvm.script import tirx as T")
        name = "attention_scores" if name.startswith("matmul") and "q" in [p.name for p in func.params] else name
        text = text.replace("def main(", f"def {name}(", 1)
        path = args.out / f"{name}.py"
        sizes = f"hidden {args.hidden}, {args.heads} heads, feed-forward {args.feed_forward}"
        path.write_text(f'"""Kernel `{name}` of a BERT encoder layer ({sizes}), written by bench/model_kernels.py."""\n'
                        f"{text}")
        print(path)


if __name__ == "__main__":
    main()
