#!/usr/bin/env bash
# Script cost: the time Redis spends inside one EVALSHA of tollgate's script, per batch
# shape, from INFO commandstats (usec_per_call). That leaves out the network, the client
# and the other processes on the machine, so it is much steadier than req/s, and it is
# the CPU that every replica sharing one Redis pays for.
#
#   bench/script.sh              # this checkout's lua/, by EVALSHA and by FCALL
#   bench/script.sh REV          # REV's lua/ and this checkout's, interleaved, side by side
#
# Columns: `now` is this checkout's script by EVALSHA, `fcall` the same text loaded as a
# function library (FUNCTION LOAD, as src/store/redis/function.rs builds it) and called by
# FCALL, which is what the store sends from Redis 7 on; REV's script by EVALSHA before them.
#
# Environment: REQUESTS=60000 per measurement, REPEAT=3 measurements per shape (the table
# shows the median), CLIENTS=16 (redis-benchmark -c), COSTLY=2000 calls per measurement
# of the cost-10 000 shapes, ONLY=<regex> to measure only the shapes it matches. Every
# measurement starts on an empty Redis (FLUSHALL), so
# that two revisions never read each other's keys.
# COUNT=instructions: instead of time, the instructions Redis executes per call, counted
# by valgrind's callgrind around each measurement (the whole server: parsing, the
# command, the reply), which a busy machine does not disturb; then REQUESTS defaults to
# 3000, COSTLY to 200, CLIENTS to 1 and REPEAT to 1 (counts repeat exactly).
#
# Shapes (every limit 1e9 per second, so nothing is rejected; the script reads Redis TIME;
# the sliding window log keeps the last second's requests, some 10^4 members):
#   <alg>x1        one request against one limit, for each algorithm
#   tb/gcra x1 reserve  the same with a reservation section (max_wait), never waiting
#   sw cost 1       one request of cost 1, then of cost 10 000, on the sliding window
#   sw cost 10000   log, COSTLY=2000 calls per measurement (both: short runs cost more
#                   per call), since before the weighted log such a call wrote 10 000
#                   members
#   fw x13 one key  13 requests on one key in one call (a coalesced global key)
#   fw x13 keys     13 requests on 13 keys in one call (coalesced per-client keys)
#   fw x13 new keys the same on 13 keys never seen before (each request opens a window)
#   fw x1 one.lua   one request against one fixed window by the library's own function
#                   for it (FCALL <library>_fw, what the store sends for that shape)
#   fwn x13 keys    13 such requests on 13 keys in one call of the function for many
#                   (FCALL <library>_fwn: a cluster master's share of a batch)
#   fwn x13 new keys the same on 13 keys never seen before
#   incr (ref)      the hand-written INCR + PEXPIRE script of bench_server, for scale
# It starts its own redis-server on a free port (never 6379) and stops it on exit.
set -euo pipefail
cd "$(dirname "$0")/.."

REV=${1:-}

die() {
  echo "script.sh: $*" >&2
  exit 1
}
COUNT=${COUNT:-time}
if [[ $COUNT == instructions ]]; then
  REQUESTS=${REQUESTS:-3000}
  COSTLY=${COSTLY:-200}
  REPEAT=${REPEAT:-1}
  CLIENTS=${CLIENTS:-1}
else
  [[ $COUNT == time ]] || die "COUNT is time or instructions, not $COUNT"
  REQUESTS=${REQUESTS:-60000}
  COSTLY=${COSTLY:-2000}
  REPEAT=${REPEAT:-3}
  CLIENTS=${CLIENTS:-16}
fi
for tool in redis-server redis-cli redis-benchmark; do
  command -v "$tool" >/dev/null || die "$tool not found (Debian: apt-get install redis-server redis-tools)"
done

[[ -z $REV ]] || git rev-parse --verify --quiet "$REV^{commit}" >/dev/null ||
  die "unknown revision $REV"

# The script exactly as the crate joins it: the include_str! order of src/store/redis.
# (Only the include_str! lines: comments name lua/ files too.)
FILES=$(grep -o 'include_str!("[./]*lua/[a-z_]*\.lua")' src/store/redis/mod.rs |
  grep -o 'lua/[a-z_]*\.lua')
[[ -n $FILES ]] || die "no lua/ files named in src/store/redis/mod.rs"
source_at() { # source_at [REV]: the joined script of REV, or of the checkout
  local file
  for file in $FILES; do
    if [[ -n ${1:-} ]]; then git show "$1:$file"; else cat "$file"; fi
  done
}

WORK=$(mktemp -d)
PORT=
cleanup() {
  [[ -n $PORT ]] && redis-cli -p "$PORT" SHUTDOWN NOSAVE >/dev/null 2>&1 || true
  rm -rf "$WORK"
}
trap cleanup EXIT
for _ in $(seq 100); do
  candidate=$((15000 + RANDOM % 7000))
  (: </dev/tcp/127.0.0.1/"$candidate") 2>/dev/null && continue
  PORT=$candidate
  break
done
[[ -n $PORT ]] || die "found no free port"
SERVER=(redis-server --port "$PORT" --bind 127.0.0.1 --save "" --appendonly no --dir "$WORK"
  --logfile "$WORK/log")
if [[ $COUNT == instructions ]]; then
  command -v valgrind >/dev/null || die "valgrind not found (Debian: apt-get install valgrind)"
  # hz 1: Redis's timer work (serverCron, 10 times a second by default) would otherwise
  # add more per call the slower a busy machine runs the calls.
  valgrind --tool=callgrind --callgrind-out-file="$WORK/callgrind.out" "${SERVER[@]}" --hz 1 \
    >"$WORK/valgrind.log" 2>&1 &
  VALGRIND=$!
else
  "${SERVER[@]}" --daemonize yes
fi
for _ in $(seq 600); do
  [[ $(redis-cli -p "$PORT" PING 2>/dev/null) == PONG ]] && break
  sleep 0.05
done
cli() { redis-cli -p "$PORT" "$@"; }

# The script as a library, the way src/store/redis/function.rs makes it: two lines swapped
# (the globals, and main.lua's "Per call" line opens the function), a header and a footer.
library_of() {
  echo "#!lua name=tollgate_bench"
  sed -e 's/^local KEYS, ARGV = KEYS, ARGV$/local KEYS, ARGV/' \
    -e "s/^-- Per call: from here on.*/local function decide(keys, args) KEYS, ARGV = keys, args/"
  echo "end"
  [[ -f lua/one.lua ]] && cat lua/one.lua
  echo "redis.register_function('tollgate_bench', decide)"
  [[ -f lua/one.lua ]] && echo "redis.register_function('tollgate_bench_fw', decide_fixed_window)"
  grep -qs decide_fixed_windows lua/one.lua &&
    echo "redis.register_function('tollgate_bench_fwn', decide_fixed_windows)"
  true
}

# label -> the command and its first argument (the script's SHA or the function's name)
declare -A SHA
SHA[now]="EVALSHA $(cli SCRIPT LOAD "$(source_at)")"
LABELS=(now)
if grep -q '^-- Per call: from here on' lua/main.lua; then
  cli FUNCTION LOAD REPLACE "$(source_at | library_of)" >/dev/null
  SHA[fcall]="FCALL tollgate_bench"
  LABELS=(now fcall)
fi
if [[ -n $REV ]]; then
  SHA[$REV]="EVALSHA $(cli SCRIPT LOAD "$(source_at "$REV")")"
  LABELS=("$REV" "${LABELS[@]}")
fi
INCR=$(cli SCRIPT LOAD "local c = redis.call('INCR', KEYS[1])
if c == 1 then redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
if c > tonumber(ARGV[1]) then return {0, redis.call('PTTL', KEYS[1])} end
return {1, tonumber(ARGV[1]) - c}")

# usec inside Redis per call of `COMMAND args...` (EVALSHA or FCALL), the median of
# REPEAT measurements of CALLS (default REQUESTS) calls.
measure() {
  local i command=$1 lower calls=${CALLS:-$REQUESTS}
  lower=$(echo "$command" | tr '[:upper:]' '[:lower:]')
  for i in $(seq "$REPEAT"); do
    cli FLUSHALL >/dev/null
    cli CONFIG RESETSTAT >/dev/null
    [[ $COUNT == time ]] || callgrind_control -z "$VALGRIND" >/dev/null 2>&1
    # shellcheck disable=SC2086 # BENCH_FLAGS: redis-benchmark's options, split
    redis-benchmark -p "$PORT" -c "$CLIENTS" -n "$calls" -q ${BENCH_FLAGS:-} "$@" >/dev/null 2>&1
    if [[ $COUNT == time ]]; then
      cli INFO commandstats | sed -n "s/.*cmdstat_$lower:.*usec_per_call=\\([0-9.]*\\).*/\\1/p"
    else
      instructions_since_zero "$calls"
    fi
  done | sort -n | sed -n "$(((REPEAT + 1) / 2))p"
}

# Instructions per call since callgrind's counters were zeroed: dumps them and divides
# the total by CALLS. (redis-benchmark's connection setup is in it: a few thousand
# instructions per measurement, nothing per call.)
instructions_since_zero() {
  local dump total
  rm -f "$WORK"/callgrind.out.*
  callgrind_control -d "$VALGRIND" >/dev/null 2>&1
  for _ in $(seq 100); do
    dump=$(ls "$WORK"/callgrind.out.* 2>/dev/null | tail -1)
    [[ -n $dump ]] && grep -q '^totals:' "$dump" && break
    sleep 0.1
  done
  total=$(sed -n 's/^totals: *\([0-9]*\).*/\1/p' "$dump")
  awk -v t="$total" -v n="$1" 'BEGIN { printf "%.0f", t / n }'
}

# one_limit ALG: ARGV for one group of one limit of algorithm code ALG, 1e9 per second,
# no lockout.
one_limit() { echo "1 1 $1 1000000000 1000 1000000000 0"; }
requests() { # requests N [COST]: N requests of cost COST (default 1) in group 1
  local i
  echo -n "$1"
  for i in $(seq "$1"); do echo -n " ${2:-1} 1"; done
}
same_key=$(for _ in $(seq 13); do echo -n " bench:{hot}:fw"; done)
# redis-benchmark -r replaces each __rand_int__ with a random number of its own.
new_keys=$(for i in $(seq 13); do echo -n " bench:{new$i-__rand_int__}:fw"; done)
distinct_keys=$(for i in $(seq 13); do echo -n " bench:{client$i}:fw"; done)

printf '%-16s' "shape"
for label in "${LABELS[@]}"; do printf '%14s' "$label"; done
((${#LABELS[@]} > 1)) && printf '%16s' "${LABELS[-1]} / ${LABELS[0]}"
if [[ $COUNT == time ]]; then
  printf '   (us inside Redis per call)\n'
else
  printf '   (instructions in Redis per call)\n'
fi
row() { # row NAME NUMKEYS KEYS... -- ARGS...: one line of the table
  local name=$1 label value first=
  shift
  [[ -z ${ONLY:-} || $name =~ $ONLY ]] || return 0
  printf '%-16s' "$name"
  for label in "${LABELS[@]}"; do
    # shellcheck disable=SC2086 # the command and its first argument
    value=$(measure ${SHA[$label]} "$@")
    printf '%14s' "$value"
    [[ -z $first ]] && first=$value
  done
  ((${#LABELS[@]} > 1)) && awk -v a="$value" -v b="$first" 'BEGIN { printf "%16.2f", a / b }'
  echo
}
for alg in 1:fw 2:sw 3:swc 4:tb 5:gcra; do
  code=${alg%%:*} name=${alg#*:}
  # shellcheck disable=SC2046 # word splitting is the point: these are EVALSHA's arguments
  row "$name x1" 1 "bench:{one}:$name" "" $(one_limit "$code") $(requests 1)
done
# A reserving request (RateLimitLayer::max_wait on buckets): the empty lease sections and
# one reservation of up to 1 s; with 1e9 per second it never waits, so this is what
# the section and the reservations' definitions cost.
for alg in 4:tb 5:gcra; do
  code=${alg%%:*} name=${alg#*:}
  # shellcheck disable=SC2046 # as above
  row "$name x1 reserve" 1 "bench:{one}:$name" "" $(one_limit "$code") $(requests 1) 0 0 1 1 1000
done
for cost in 1 10000; do
  # shellcheck disable=SC2046 # as above
  CALLS=$COSTLY row "sw cost $cost" 1 "bench:{one}:sw" "" $(one_limit 2) $(requests 1 "$cost")
done
# shellcheck disable=SC2046,SC2086
row "fw x13 one key" 13 $same_key "" $(one_limit 1) $(requests 13)
# shellcheck disable=SC2046,SC2086
row "fw x13 keys" 13 $distinct_keys "" $(one_limit 1) $(requests 13)
# shellcheck disable=SC2046,SC2086
BENCH_FLAGS="-r 1000000000" row "fw x13 new keys" 13 $new_keys "" $(one_limit 1) $(requests 13)
if [[ ${SHA[fcall]:-} && -f lua/one.lua && ( -z ${ONLY:-} || "fw x1 one.lua" =~ $ONLY ) ]]; then
  value=$(measure FCALL tollgate_bench_fw 1 "bench:{one}:fw" "" 1000000000 1000 1)
  printf '%-16s%14s   (FCALL of the library'"'"'s function for one fixed window, lua/one.lua)\n' \
    "fw x1 one.lua" "$value"
fi
if [[ ${SHA[fcall]:-} ]] && grep -qs decide_fixed_windows lua/one.lua &&
  [[ -z ${ONLY:-} || "fwn x13 keys" =~ $ONLY || "fwn x13 new keys" =~ $ONLY ]]; then
  fwn_args=$(for i in $(seq 13); do echo -n " bench:{client$i}:fw 1000000000 1000 1"; done)
  # shellcheck disable=SC2086 # the function's arguments
  value=$(measure FCALL tollgate_bench_fwn 0 "" 0 $fwn_args)
  printf '%-16s%14s   (FCALL of the function for many, lua/one.lua: 13 keys)\n' \
    "fwn x13 keys" "$value"
  fwn_args=$(for i in $(seq 13); do echo -n " bench:{new$i-__rand_int__}:fw 1000000000 1000 1"; done)
  # shellcheck disable=SC2086 # as above
  value=$(BENCH_FLAGS="-r 1000000000" measure FCALL tollgate_bench_fwn 0 "" 0 $fwn_args)
  printf '%-16s%14s   (the same on 13 new keys)\n' "fwn x13 new keys" "$value"
fi
[[ -z ${ONLY:-} || "incr (ref)" =~ $ONLY ]] || exit 0
value=$(measure EVALSHA "$INCR" 1 bench:{ref}:incr 1000000000 1000)
printf '%-16s%14s   (the hand-written INCR script: one request)\n' "incr (ref)" "$value"
