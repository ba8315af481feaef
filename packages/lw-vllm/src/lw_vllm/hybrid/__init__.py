"""Hybrid models (vLLM's HMA: several KV cache groups; Mamba2 and gated delta-net states).

Holds the attention groups' blocks (``group_blocks``: scheduler side; ``group_copier``: worker
side) and the recurrent-state objects: their layout and key space (``state_layout``), what the
scheduler plans for them (``state_plan``), and how a worker saves and restores them
(``state_store``, ``state_loads``).

May import: ``request``, ``identity`` and the top-level plumbing (``pool``, ``meta``,
``metrics``). Never the sides (``scheduler``, ``worker``) or ``pd``.
"""
