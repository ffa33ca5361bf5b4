#!/bin/sh
# Install redis-server (Debian/Ubuntu package) for the offload tests, when it is missing.
# Idempotent and quiet: does nothing when redis-server is already on PATH, and never fails the
# caller (the Redis tests skip with a reason when it is still missing).
command -v redis-server >/dev/null 2>&1 && exit 0
if ! command -v apt-get >/dev/null 2>&1; then
    echo "install_redis.sh: no apt-get; install redis-server yourself to run the Redis tests" >&2
    exit 0
fi
SUDO=""
[ "$(id -u)" -ne 0 ] && command -v sudo >/dev/null 2>&1 && SUDO="sudo -n"
export DEBIAN_FRONTEND=noninteractive
{ $SUDO apt-get update -qq && $SUDO apt-get install -y -qq --no-install-recommends redis-server; } \
    >/dev/null 2>&1 || echo "install_redis.sh: could not install redis-server (the Redis tests will skip)" >&2
exit 0
