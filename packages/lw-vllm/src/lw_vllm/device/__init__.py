"""The copy path between vLLM's KV tensors and the pool's host buffers: ``copier``
(``TorchCopier``: CPU copies inline; the block order of the views), and for devices (cuda, npu)
``device_path`` (asynchronous block copies on side streams), ``device_streams`` (the device
operations, behind one seam) and ``staging`` (pinned host buffers).

The bottom room: imports nothing else of lw-vllm, and never vLLM (torch and numpy only), so the
device bench and ``scripts/device-check.sh`` use it without an engine.
"""
