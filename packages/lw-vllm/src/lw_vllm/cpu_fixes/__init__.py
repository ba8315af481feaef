"""Workarounds for defects of vLLM 0.32's CPU build, installed by the plugin (``lw_vllm.plugin``):
``rope_fix`` (MLA rotary inputs), ``seed_fix`` (seeded chunked prefills), ``mamba2_fix`` (Mamba2
prefills with prefix caching), each applied only where ``cpu_fix_gate`` says it is needed (the CPU
platform, the vLLM versions known to need it, unless its switch is ``0``).

The bottom room: imports nothing else of lw-vllm.
"""
