"""Prefill/decode disaggregation (PD; docs/design/architecture.md §6, docs/guide/streaming-pd.md).

Holds ``pd_coordinator`` (the scheduler side's remote prefills: when a decoder request is ready),
``pd_metaserver`` (the decoder's metaserver calls) and ``stream_recv`` (streaming PD, decoder
worker side: pulling a prompt's layers while the prefiller computes them).

May import: ``hybrid``, ``request``, ``identity`` and the top-level plumbing (``pool``, ``meta``,
``metrics``). Used by the scheduler and worker sides, never importing them.
"""
