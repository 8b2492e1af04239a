"""Convergence debugging: per-step activation statistics of a model and of its gradients.

Usage (the legacy ``onnxruntime.training.utils.hooks`` API)::

    from orttrainer.debug import GlobalSubscriberManager, StatisticsSubscriber, inspect_activation

    GlobalSubscriberManager.subscribe(model, [StatisticsSubscriber("pt_out", override_output_dir=True)])
    ...  # inside a forward: x = inspect_activation("attn_scores", x)

    python -m orttrainer.debug.merge_activation_summary --pt_dir pt_out --ort_dir ort_out --output_dir merged

Building blocks for other collection paths (the in-graph ONNX Runtime one): ``compute_statistics``,
``statistics_from_reductions``, ``format_statistics``, ``write_statistics``, ``trace_activations``.
No onnxruntime import here.
"""

from __future__ import annotations

from .inspect import inspect_activation
from .statistics import (
    TensorStatistics,
    compute_statistics,
    format_statistics,
    parse_statistics,
    statistics_from_reductions,
)
from .statistics_subscriber import (
    StatisticsSubscriber,
    activation_file_name,
    module_activation_name,
    rank_output_dir,
    step_dir,
    write_statistics,
)
from .subscriber import (
    GlobalSubscriberManager,
    RuntimeStates,
    SubscriberBase,
    SubscriberManager,
    no_increase_global_step,
)
from .trace import ActivationRecord, RecordingSubscriber, order_for_step, trace_activations

__all__ = [
    "ActivationRecord",
    "ComparisonReport",
    "GlobalSubscriberManager",
    "RecordingSubscriber",
    "RuntimeStates",
    "StatisticsSubscriber",
    "SubscriberBase",
    "SubscriberManager",
    "TensorStatistics",
    "activation_file_name",
    "compare_activation_summaries",
    "compute_statistics",
    "format_statistics",
    "inspect_activation",
    "merge_activation_summaries",
    "module_activation_name",
    "no_increase_global_step",
    "order_for_step",
    "parse_statistics",
    "rank_output_dir",
    "statistics_from_reductions",
    "step_dir",
    "trace_activations",
    "write_statistics",
]


_MERGE_NAMES = ("ComparisonReport", "compare_activation_summaries", "merge_activation_summaries")


def __getattr__(name: str):
    # Imported lazily: an eager import would make `python -m orttrainer.debug.merge_activation_summary` warn that
    # the module is already in sys.modules before it runs as __main__.
    if name in _MERGE_NAMES:
        from . import merge_activation_summary as merge

        return getattr(merge, name)
    raise AttributeError(f"module 'orttrainer.debug' has no attribute {name!r}")
