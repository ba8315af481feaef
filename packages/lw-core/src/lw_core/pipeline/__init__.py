"""The layer pipeline (docs/design/architecture.md §4) and what it runs on, one module each:

* ``layer_pipeline`` — ``LayerPipeline``, the per-step facade the vLLM connector drives;
* ``context`` — ``PipelineLimits`` (its checked arguments) and ``StepContext``, the frozen state a
  step gets (never the pipeline itself);
* ``load`` / ``save`` — ``LoadStep`` and ``SaveStep``, one step's loads and saves;
* ``save_finisher`` — ``SaveFinisher``, save steps waited for and committed in the background;
* ``pool`` — worker threads, deadline-bounded calls, staging buffers, the bounded error log;
* ``results`` — ``LoadResult`` / ``SaveResult``, what a step reports back;
* ``copier`` — the ``Copier`` protocol (KV cache <-> host bytes) the pipeline moves blocks with;
* ``buffers`` — page-aligned host buffers; ``host_copier`` — a numpy ``Copier`` for tests and
  benches (not imported here: importing the pipeline never loads it).

The pipeline sits above the backend protocol (``lw_core.backend``) and below the connector.
"""

from lw_core.pipeline.layer_pipeline import LayerPipeline
from lw_core.pipeline.results import LoadResult, SaveResult

__all__ = ["LayerPipeline", "LoadResult", "SaveResult"]
