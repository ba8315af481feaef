#!/usr/bin/env bash
# System libraries Mooncake's client needs (lw-mooncake[store]): its wheels link libibverbs even
# for TCP. Installs the Debian/Ubuntu package libibverbs1 when it is missing and we are root;
# otherwise says what to run. Idempotent: a second run only checks.
set -euo pipefail

if ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1 '; then
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "install-mooncake-deps: libibverbs.so.1 is missing and this is not a Debian/Ubuntu system;" \
         "install your distribution's libibverbs (rdma-core) package for backend 'mooncake'" >&2
    exit 0
fi
if [ "$(id -u)" != "0" ]; then
    echo "install-mooncake-deps: libibverbs.so.1 is missing; run as root:" \
         "apt-get update && apt-get install -y libibverbs1 (needed by backend 'mooncake')" >&2
    exit 0
fi
echo "install-mooncake-deps: installing libibverbs1 (needed by Mooncake's client, even over TCP)" >&2
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libibverbs1 >/dev/null
