"""`device.mem_limit` on the CPU: a cap on ONNX Runtime's CPU arena.

With CUDA the option is the CUDA provider's `gpu_mem_limit` (per session). ONNX Runtime's CPU provider takes no
arena options per session; the one way to cap its arena from Python is an environment-wide allocator,
`create_and_register_allocator(OrtMemoryInfo('Cpu', arena), OrtArenaCfg(max_mem=mem_limit))`, which sessions use
when their option `session.use_env_allocators` is 1. It covers what the trainer's sessions allocate — a step's
intermediate tensors and the updated state they return — so a step that needs more fails with ONNX Runtime's
"Available memory of N is smaller than requested bytes of M". There is one such allocator per process and it cannot
be replaced: every CPU trainer with a mem_limit in the process shares it, so they must ask for the same limit.
"""

from __future__ import annotations

_registered_limit: int | None = None


def cap_cpu_arena(session_options, limit: int) -> None:
    """Make sessions created with `session_options` allocate from the process's CPU arena capped at `limit` bytes."""
    global _registered_limit
    import onnxruntime as ort

    if _registered_limit is None:
        info = ort.OrtMemoryInfo("Cpu", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0, ort.OrtMemType.DEFAULT)
        ort.create_and_register_allocator(info, ort.OrtArenaCfg(limit, -1, -1, -1))
        _registered_limit = limit
    elif _registered_limit != limit:
        raise ValueError(
            f"options device.mem_limit={limit}: this process already caps ONNX Runtime's shared CPU arena "
            f"at {_registered_limit} bytes, and the cap cannot change (one per process)"
        )
    session_options.add_session_config_entry("session.use_env_allocators", "1")
