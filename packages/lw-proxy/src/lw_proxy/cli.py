"""``lw-proxy``: parse and check the flags, then serve until SIGINT/SIGTERM."""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Callable

from . import logfilter, server
from .config import EVENT_LOOPS, ProxyConfig, parse_args

log = logging.getLogger("lw_proxy")


def loop_factory(choice: str) -> tuple[str, Callable[[], asyncio.AbstractEventLoop] | None]:
    """The event loop ``--event-loop`` names: ("uvloop", its factory) or ("asyncio", None). "auto"
    takes uvloop when it can be imported; "uvloop" without it stops with what to install."""
    if choice not in EVENT_LOOPS:
        raise SystemExit(f"lw-proxy: --event-loop {choice!r}: expected one of {', '.join(EVENT_LOOPS)}")
    if choice == "asyncio":
        return "asyncio", None
    try:
        import uvloop
    except ImportError:
        if choice == "uvloop":
            raise SystemExit("lw-proxy: --event-loop uvloop: uvloop is not installed (pip install uvloop)") from None
        return "asyncio", None
    return "uvloop", uvloop.new_event_loop


def log_auth(cfg: ProxyConfig) -> None:
    """Say at start-up whether clients must authenticate (never the key itself)."""
    if cfg.api_key is not None:
        log.info("client auth: on (generation, model-list and admin endpoints need 'Authorization: Bearer <key>'; "
                 "metaserver callbacks their request's lw_token)")
    else:
        log.warning("client auth: off (no LW_PROXY_API_KEY, --api-key-file or --api-key): anyone who reaches "
                    "%s:%d may generate; /reset_prefix_cache is %s", cfg.host, cfg.port,
                    "open (--allow-unauthenticated-admin)" if cfg.allow_unauthenticated_admin else "refused")
    log.info("backend auth: %s", "a bearer key is sent to every backend" if cfg.backend_api_key is not None
             else "none sent (no LW_BACKEND_API_KEY, --backend-api-key-file or --backend-api-key)")


def serve(cfg: ProxyConfig, *, access_log: bool = False, event_loop: str = "auto") -> None:
    name, factory = loop_factory(event_loop)
    log.info("lw-proxy on %s:%d; prefillers %s; decoders %s; metaserver %s; event loop %s", cfg.host, cfg.port,
             cfg.prefillers, cfg.decoders, cfg.metaserver_url, name)
    log_auth(cfg)
    server.raise_fd_limit(cfg)
    main = server.serve_forever(cfg, access_log=logging.getLogger("aiohttp.access") if access_log else None)
    with asyncio.Runner(loop_factory=factory) as runner:
        runner.run(main)


def main(argv: list[str] | None = None) -> int:
    cfg, args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logfilter.install(cfg.log_repeat_window)
    try:
        serve(cfg, access_log=args.log_level == "debug", event_loop=args.event_loop)
    except OSError as e:  # port taken, address not on this host: say so in one line
        print(f"lw-proxy: cannot listen on {cfg.host}:{cfg.port}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
