"""``lw-bench proxy``: lw-proxy's own overhead against mock engines (``mode``), its soak with failing
mocks (``soak``, ``--soak N``), and the processes both start (``stack``: mock backends, the proxy).
Uses lw-proxy's public API only (``lw_proxy.config.ProxyConfig``, ``lw_proxy.cli.serve``)."""
