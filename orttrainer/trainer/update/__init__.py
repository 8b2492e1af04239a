"""The optimizer update, in one home: where it runs and the parameter groups (`path.py`), the update as ONNX ops in
the training graph (`in_graph.py`), and torch's fused update applied in place to the session's state
(`torch_fused.py`). The semantics are the same on every path (graph/training.py's module docstring)."""
