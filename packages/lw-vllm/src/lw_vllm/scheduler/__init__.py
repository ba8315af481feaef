"""The scheduler side (vLLM's scheduler process): ``SchedulerSide`` answers vLLM's lookups, plans
each step's loads and saves, and keeps the per-request bookkeeping.

Holds ``scheduler_side`` (the side itself), ``pool_lookup`` (how many leading chunks the pool
holds), ``late_frees`` (finished requests whose blocks are freed after their background saves)
and ``request_stats`` (the per-request stats file).

May import: ``pd``, ``hybrid``, ``request``, ``identity`` and the top-level plumbing (``pool``,
``meta``, ``metrics``, ``pool_events``). Never the worker side (``worker``): the two sides talk
only through ``meta``. The layer rules: root ``pyproject.toml``, checked by ``lint-imports``.
"""
