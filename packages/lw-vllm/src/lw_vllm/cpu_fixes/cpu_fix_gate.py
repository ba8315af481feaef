"""When a workaround for a vLLM CPU defect applies (``rope_fix``, ``seed_fix``): on the CPU platform,
for the vLLM versions known to need it, unless its switch (an environment variable) is ``0``."""

from __future__ import annotations

import os


def needs_fix(switch: str, versions: tuple[str, ...]) -> tuple[bool, str]:
    """(apply it?, why) for a fix turned off by ``switch=0`` and needed by vLLM ``versions`` (prefixes)."""
    if os.environ.get(switch, "1") == "0":
        return False, f"disabled by {switch}=0"
    import vllm
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return False, "not the CPU platform"
    if not vllm.__version__.startswith(versions):
        return False, f"vLLM {vllm.__version__} is not a version known to need it"
    return True, f"vLLM {vllm.__version__} on CPU"
