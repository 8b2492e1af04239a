"""Stage 2 of a trainer's first step: the forward ONNX model -> training and eval graphs plus the initial state.

- `compiler.py`: `compile_model`, whose numbered stages run the pass lists of graph/pipeline.py, and the torch
  builder's graphs for other input shapes (`TorchShapeGraphs`);
- `contract.py`: the graphs' state contract (`TrainingGraph`, `GradientStepGraph`) and every state and step input
  name, defined once.
"""
