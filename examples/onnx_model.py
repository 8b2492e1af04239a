"""Train an ONNX model directly: no PyTorch module anywhere, only a `.onnx` file whose graph computes a loss.

    python examples/onnx_model.py [--epochs 20]

ORTModule only ever trained PyTorch modules; ORTTrainer also takes an `onnx.ModelProto`. This example writes a small
classifier for scikit-learn's bundled 8x8 digits with `onnx.helper` (in practice the file would come from another
framework or tool), loads it back, trains every floating-point initializer with ORTTrainer, measures accuracy with
`eval_step`, and runs the trained file with a plain `onnxruntime.InferenceSession`.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import numpy as np
import onnx
import onnxruntime as ort
import torch
from onnx import TensorProto, helper, numpy_helper
from sklearn.datasets import load_digits

from orttrainer import ORTTrainer, ORTTrainerOptions, optim


def build_model(hidden: int = 64, seed: int = 0) -> onnx.ModelProto:
    """pixels [batch, 64] -> Gemm -> Relu -> Gemm -> logits [batch, 10]; loss = SoftmaxCrossEntropyLoss(logits, label).
    The loss is an ordinary graph output: ORTTrainer differentiates the graph with respect to the initializers."""
    rng = np.random.default_rng(seed)

    def weight(name, rows, cols):  # He initialisation: keeps the ReLU activations at a stable scale
        return numpy_helper.from_array(
            (rng.standard_normal((rows, cols)) * np.sqrt(2.0 / rows)).astype(np.float32), name
        )

    initializers = [
        weight("w1", 64, hidden),
        numpy_helper.from_array(np.zeros(hidden, np.float32), "b1"),
        weight("w2", hidden, 10),
        numpy_helper.from_array(np.zeros(10, np.float32), "b2"),
    ]
    nodes = [
        helper.make_node("Gemm", ["pixels", "w1", "b1"], ["h"]),
        helper.make_node("Relu", ["h"], ["a"]),
        helper.make_node("Gemm", ["a", "w2", "b2"], ["logits"]),
        helper.make_node("SoftmaxCrossEntropyLoss", ["logits", "label"], ["loss"], reduction="mean"),
    ]
    graph = helper.make_graph(
        nodes,
        "digits_mlp",
        inputs=[
            helper.make_tensor_value_info("pixels", TensorProto.FLOAT, ["batch", 64]),
            helper.make_tensor_value_info("label", TensorProto.INT64, ["batch"]),
        ],
        outputs=[
            helper.make_tensor_value_info("loss", TensorProto.FLOAT, []),
            helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 10]),
        ],
        initializer=initializers,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model)
    return model


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--out", default=None, help="directory for the .onnx files (default: a temporary one)")
    args = parser.parse_args(argv)
    out = args.out or tempfile.mkdtemp(prefix="orttrainer_onnx_")
    os.makedirs(out, exist_ok=True)

    # The starting point is a file, as it would be when the model comes from elsewhere.
    source = os.path.join(out, "digits_mlp.onnx")
    onnx.save(build_model(), source)
    model = onnx.load(source)

    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target, dtype=torch.int64)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    train, test = order[: int(0.8 * len(x))], order[int(0.8 * len(x)) :]

    # Names must match the graph's inputs and outputs; the output flagged True is the loss. No loss_fn: the graph
    # computes its own loss.
    model_desc = {
        "inputs": [("pixels", ["batch", 64]), ("label", ["batch"])],
        "outputs": [("loss", [], True), ("logits", ["batch", 10])],
    }
    trainer = ORTTrainer(
        model, model_desc, optim.AdamConfig(lr=3e-3), options=ORTTrainerOptions({"device": {"id": "cpu"}})
    )
    torch.manual_seed(0)
    for epoch in range(args.epochs):
        shuffled = train[torch.randperm(len(train))]
        for i in range(0, len(shuffled) - args.batch + 1, args.batch):
            batch = shuffled[i : i + args.batch]
            loss, _ = trainer.train_step(x[batch], y[batch])
        test_loss, logits = trainer.eval_step(x[test], y[test])
        accuracy = (logits.argmax(dim=1) == y[test]).float().mean().item()
        if epoch % 5 == 4 or epoch == args.epochs - 1:
            print(
                f"epoch {epoch + 1:3d}  train loss {loss.item():.4f}  test loss {test_loss.item():.4f}  "
                f"test accuracy {accuracy:.3f}"
            )

    # The trained model is again a plain ONNX file: same graph, trained initializers.
    trained = os.path.join(out, "digits_mlp_trained.onnx")
    trainer.save_as_onnx(trained)
    session = ort.InferenceSession(trained, providers=["CPUExecutionProvider"])
    onnx_logits = session.run(["logits"], {"pixels": x[test].numpy(), "label": y[test].numpy()})[0]
    onnx_accuracy = float((onnx_logits.argmax(axis=1) == y[test].numpy()).mean())
    print(
        f"onnxruntime.InferenceSession on {trained}: test accuracy {onnx_accuracy:.3f} "
        f"(max logit difference to eval_step {np.abs(onnx_logits - logits.numpy()).max():.1e})"
    )
    return {
        "accuracy": accuracy,
        "onnx_accuracy": onnx_accuracy,
        "max_diff": float(np.abs(onnx_logits - logits.numpy()).max()),
    }


if __name__ == "__main__":
    main()
