"""``lw-bench serve``: TTFT of real vLLM engines with and without the pool (``mode``), the engine process (``engine``) and its runner (``run``)."""
