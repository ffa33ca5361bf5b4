#!/bin/sh
# Install the Debian runtime libraries the Mooncake wheel (mooncake-transfer-engine-non-cuda) links
# against, when they are missing. Idempotent and quiet: does nothing when all are installed, and
# never fails the caller (the Mooncake tests skip with the reason when the wheel still cannot load).
PKGS="libibverbs1 librdmacm1 libnuma1 liburing2 libcurl4"
MISSING=""
for p in $PKGS; do
    # Debian 13 / Ubuntu 24.04 renamed some of them (libcurl4t64); either name satisfies the wheel.
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" && continue
    dpkg-query -W -f='${Status}' "${p}t64" 2>/dev/null | grep -q "ok installed" && continue
    MISSING="$MISSING $p"
done
[ -z "$MISSING" ] && exit 0
if ! command -v apt-get >/dev/null 2>&1; then
    echo "install_mooncake_deps.sh: no apt-get; install$MISSING yourself to run the Mooncake tests" >&2
    exit 0
fi
SUDO=""
[ "$(id -u)" -ne 0 ] && command -v sudo >/dev/null 2>&1 && SUDO="sudo -n"
export DEBIAN_FRONTEND=noninteractive
{ $SUDO apt-get update -qq && $SUDO apt-get install -y -qq --no-install-recommends $MISSING; } \
    >/dev/null 2>&1 || echo "install_mooncake_deps.sh: could not install$MISSING (the Mooncake tests will skip)" >&2
exit 0
