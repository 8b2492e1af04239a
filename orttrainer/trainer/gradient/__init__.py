"""Gradient builders: how the forward model becomes a model that also outputs `<param>_grad`.

- `choice.py`: which builder (`_internal_use.gradient_builder`: auto, ort, torch) and why;
- `differentiate.py`: runs the chosen builder, and freezes parameters that do not reach the loss ('auto''s
  fallback to the torch route is `build.build_from_torch`'s);
- `ort_builder.py`, `ort_options.py`: ONNX Runtime's C++ gradient builder (onnxruntime-training only) and the
  options it takes (cast propagation, memory-efficient gradients);
- `torch_builder.py`, `torch_trace.py`, `torch_graphs.py`, `torch_private/`: PyTorch's autograd traced into the
  graph (any ONNX Runtime build), with dynamic dims, and every private torch API it needs; `eager_fallback.py`:
  the traced ops torch.onnx cannot translate, run by PyTorch inside the graph (`runtime/eager_ops.py`);
- `recurrent_layers.py`, `recurrent_ops.py`: nn.LSTM/GRU/RNN as the torch builder traces them (layer by layer with
  the dropout between layers; an LSTM's or GRU's layer's recurrence as one custom op, which `aten_onnx.py`, the
  direct translation, unrolls);
- `onnx_module/`: an ONNX model as a torch module (one torch function per ONNX op, one file per op family) for the
  torch builder (`graph/state_names.py` renames its gradient model to the initializer names);
- `errors.py`: `GradientBuildError`.
"""
