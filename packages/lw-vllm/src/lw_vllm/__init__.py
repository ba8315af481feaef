"""lw-vllm: the vLLM KV connector (``LayerwiseStoreConnector``) over the layerwise KV pool.

At the top: ``connector`` (the facade vLLM loads, ``kv_connector_module_path``), ``plugin`` (the
``vllm.general_plugins`` entry point) and the plumbing both sides share: ``pool`` (config, key
space, one backend per process), ``meta`` (what the scheduler tells the workers and they report
back), ``metrics`` and ``pool_events`` (KV cache events). The rest lives in rooms, each importing
only the rooms below it (a layers contract in the root ``pyproject.toml``, ``lint-imports``)::

    connector | plugin
    scheduler | worker      the two sides (independent: they talk through meta)
    pd                      prefill/decode disaggregation
    hybrid                  several KV cache groups, recurrent states
    request | pool          one request's keys and state; the shared pool plumbing
    identity | device | cpu_fixes | meta | metrics | pool_events
"""

__version__ = "0.1.0"
