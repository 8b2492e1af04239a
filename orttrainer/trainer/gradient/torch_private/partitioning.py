"""AOTAutograd's partitioner on the torch builder's joint graphs: selective activation checkpointing.

Part of `torch_private` (see its docstring for the rule); verified on torch 2.13.0 (CPU).

PyTorch's selective activation checkpointing tags forward nodes with a `CheckpointPolicy` (`node.meta["recompute"]`)
and a region id (`node.meta["ac_graph_id"]`); `torch._functorch.partitioners.default_partition` then splits a
joint graph into a forward graph, which returns the values the backward needs (the saved values: every forward
value a backward node reads, except those tagged to be recomputed), and a backward graph, which takes the saved
values and recomputes the tagged nodes from them. Within one region the tagged nodes are recomputed; a tagged
value that feeds a later region is saved (the boundary between two checkpointed blocks).

Verified facts (torch 2.13):
- `default_partition` keeps the forward as the joint graph placed it (every node up to the last one tagged
  `partitioner_tag == "is_forward"`); its backward graph names each saved value's placeholder like the forward
  node it came from, and each recomputed node like its forward original.
- It requires every forward `call_function` node to carry `meta["val"]` or `meta["tensor_meta"]`, and reads the
  output node's `meta["desc"]` (when present) as one descriptor per output.
- Random ops tagged for recompute are "functionalised" into philox-seeded ops that torch.onnx cannot export: they
  must never be tagged (their outputs are saved instead).
- Its own reordering of the backward (`reordering_to_mimic_autograd_engine`) starts from the tangent inputs; the
  torch builder's joint graphs have none (the loss's tangent is the constant 1), so it keeps the recomputed nodes
  at the start of the backward graph: the caller places them (gradient/torch_recompute.py).
"""

from __future__ import annotations

import torch


def tag_recompute(node: torch.fx.Node, region: int) -> None:
    """Tag `node` for recomputation in the backward, in checkpoint region `region`."""
    from torch.utils.checkpoint import CheckpointPolicy

    node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
    node.meta["ac_graph_id"] = region


def is_tagged(node: torch.fx.Node) -> bool:
    """Whether `node` is tagged for recomputation."""
    from torch.utils.checkpoint import CheckpointPolicy

    return node.meta.get("recompute") in (CheckpointPolicy.MUST_RECOMPUTE, CheckpointPolicy.PREFER_RECOMPUTE)


def is_forward(node: torch.fx.Node) -> bool:
    """Whether the joint trace placed `node` in the forward (AOTAutograd's `partitioner_tag`)."""
    return node.meta.get("partitioner_tag") == "is_forward"


def is_random(node: torch.fx.Node) -> bool:
    """Whether `node` draws random numbers (PyTorch's `nondeterministic_seeded` tag): never recomputed."""
    tags = getattr(node.target, "tags", ())
    return torch.Tag.nondeterministic_seeded in tags


def is_view(node: torch.fx.Node) -> bool:
    """Whether `node` is an aten view (`OpOverload.is_view`): it costs nothing to recompute."""
    return node.op == "call_function" and bool(getattr(node.target, "is_view", False))


def partition(joint: torch.fx.GraphModule, forward_outputs: int) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule]:
    """(forward graph, backward graph) of `joint`, whose first `forward_outputs` outputs are the forward's and the
    rest the backward's (gradients), by `default_partition` (module docstring). `joint` is modified: output
    descriptors are dropped (the torch builder rewrote the outputs) and forward nodes without a value get an empty
    `tensor_meta` (the constant seeds the trace adds)."""
    from torch._functorch.partitioners import default_partition

    out = joint.graph.output_node()
    out.meta.pop("desc", None)
    for node in joint.graph.nodes:
        if node.op == "call_function" and "val" not in node.meta and "tensor_meta" not in node.meta:
            node.meta["tensor_meta"] = None
    return default_partition(joint, [], num_fwd_outputs=forward_outputs)
