"""The worker side (each vLLM worker process): ``WorkerSide`` turns each step's plan into
``LayerPipeline`` loads and saves over the worker's KV caches.

Holds ``worker_side`` (the side itself) and its collaborators: ``load_sources`` (which objects a
load reads), ``save_book`` and ``save_ledger`` (one step's saves, and saves across steps),
``stream_loads`` (asynchronous loads: streaming PD, hybrid models), ``recurrent_states`` (a hybrid's
Mamba / gated delta-net states) and ``worker_report`` (what goes back to vLLM each pass).

May import: ``pd``, ``hybrid``, ``request``, ``identity``, ``device`` and the top-level plumbing
(``pool``, ``meta``, ``metrics``, ``pool_events``). Never the scheduler side (``scheduler``): the
two sides talk only through ``meta``. The layer rules: root ``pyproject.toml``, ``lint-imports``.
"""
