"""``lw-proxy``: parse and check the flags, then serve until SIGINT/SIGTERM."""

from __future__ import annotations

import asyncio
import logging
import sys

from . import logfilter, server
from .config import ProxyConfig, parse_args

log = logging.getLogger("lw_proxy")


def serve(cfg: ProxyConfig, *, access_log: bool = False) -> None:
    log.info("lw-proxy on %s:%d; prefillers %s; decoders %s; metaserver %s", cfg.host, cfg.port,
             cfg.prefillers, cfg.decoders, cfg.metaserver_url)
    server.raise_fd_limit(cfg)
    asyncio.run(server.serve_forever(cfg, access_log=logging.getLogger("aiohttp.access") if access_log else None))


def main(argv: list[str] | None = None) -> int:
    cfg, args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logfilter.install(cfg.log_repeat_window)
    try:
        serve(cfg, access_log=args.log_level == "debug")
    except OSError as e:  # port taken, address not on this host: say so in one line
        print(f"lw-proxy: cannot listen on {cfg.host}:{cfg.port}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
