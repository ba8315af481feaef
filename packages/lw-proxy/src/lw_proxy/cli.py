"""``lw-proxy``: parse and check the flags, then serve until SIGINT/SIGTERM."""

from __future__ import annotations

import logging
import sys

from aiohttp import web

from .app import create_app
from .config import ProxyConfig, parse_args

log = logging.getLogger("lw_proxy")


def serve(cfg: ProxyConfig, *, access_log: bool = False) -> None:
    app = create_app(cfg)
    log.info("lw-proxy on %s:%d; prefillers %s; decoders %s; metaserver %s", cfg.host, cfg.port,
             cfg.prefillers, cfg.decoders, cfg.metaserver_url)
    # handler_cancellation: a client that disconnects cancels its handler, which aborts upstream.
    web.run_app(app, host=cfg.host, port=cfg.port, handler_cancellation=True, print=None,
                access_log=logging.getLogger("aiohttp.access") if access_log else None,
                shutdown_timeout=5.0)


def main(argv: list[str] | None = None) -> int:
    cfg, args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        serve(cfg, access_log=args.log_level == "debug")
    except OSError as e:  # port taken, address not on this host: say so in one line
        print(f"lw-proxy: cannot listen on {cfg.host}:{cfg.port}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
