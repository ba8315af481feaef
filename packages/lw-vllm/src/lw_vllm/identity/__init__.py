"""What an engine puts in every pool key besides token ids, so that only engines whose KV bytes
agree share objects: the model's identity (``model_identity``: config and weights by content),
the engine's part (``engine_identity``: the config as vLLM resolved it, quantization, load
format) and the KV layout (``kv_layout``: the order of heads and tokens in a block).

The bottom room: imports nothing else of lw-vllm.
"""
