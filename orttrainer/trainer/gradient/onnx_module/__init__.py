"""An ONNX graph as a torch module: `OnnxModule` (`module.py`) runs the nodes in graph order, one torch function
per ONNX op, so that PyTorch's autograd (the `torch` gradient builder) differentiates an ONNX model.

Files: `module.py` (the module: state, static values, node order, construction-time checks), `base.py` (what
every op sees: `Call`, the op tables, element types), then one file per op family.
"""

from __future__ import annotations

from .module import OnnxModule, module_name, running_statistics

__all__ = ["OnnxModule", "module_name", "running_statistics"]
