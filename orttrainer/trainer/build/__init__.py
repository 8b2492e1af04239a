"""Stage 1 of a trainer's first step: the model -> its post-processed forward ONNX model and the parameter split.

- `forward.py`: the routes (TorchScript export, the torch builder's route, an ONNX model), which initializers train
  and which stay frozen, and their result, `Forward`;
- `export.py`: the model with its loss (`_ModelWithLoss`), the dry run, the TorchScript export, the dtypes written
  into model_desc, and the lock held while exporting or tracing;
- `torch_route.py`: the torch route's state (from the module) and its eval-mode forward model (torch.export).
Stage 2 is compile/, stage 3 runtime/; trainer/model.py runs the three (docs/architecture.md).
"""
