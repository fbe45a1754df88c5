#!/usr/bin/env bash
# Load benchmark: a hello-world axum server behind each rate limiter, measured with wrk,
# side by side in one run (see BENCHMARKS.md for the method and the last results).
#
#   bench/load.sh                       # 3 rounds x 10 s per mode and scenario, ~13 min
#   ROUNDS=1 DURATION=3 bench/load.sh   # a quick look
#
# Environment:
#   ROUNDS=3 DURATION=10 WARMUP=2   rounds; seconds measured and warmed up per run
#   CONNECTIONS=64 THREADS=1        wrk -c / -t
#   MODES="plain memory redis ..."  which servers (plain is always measured: ratios need it);
#                                   the default set, plus redis-nocache (block cache off),
#                                   redis-lease (leased quota, RedisStore::with_leases) and
#                                   redis-tls (the redis mode over TLS: adds the tls feature,
#                                   certificates made with the openssl CLI); and what
#                                   issue 17's features cost: memory-lockout redis-lockout
#                                   (a lockout on the limit), memory-wait redis-wait
#                                   (max_wait), memory-inflight redis-inflight (an
#                                   InFlightLayer instead of the limit),
#                                   memory-rate-inflight redis-rate-inflight (the limit
#                                   with an in-flight limit in its pipeline); see
#                                   bench/src/bin/bench_server.rs
#   SCENARIOS="allow reject"        nothing rejected / one key flooded (1 per hour); also
#                                   clients: nothing rejected, a key per client, wrk sending
#                                   one of 10 000 x-client headers (bench/clients.lua);
#                                   and flood: the same with a never-seen x-client in
#                                   every request (bench/flood.lua), against recurring
#                                   clients: SCENARIOS="clients flood" MODES=memory;
#                                   and zipf: like clients, but client k sends a share
#                                   proportional to 1/k^1.1 (bench/zipf.lua): a few hot
#                                   keys and a long tail
#   MAX_KEYS=                       the memory modes' MemoryStore bound (--max-keys), to
#                                   flood it several times over in a short run; empty:
#                                   MemoryStore's default (917 504 keys)
#   FEATURES=redis,bb8,cluster      crate features for the server (add metrics to measure
#                                   the metrics facade without a recorder)
#   OUT=bench/results.csv CHART=bench/chart.svg
#
# It installs wrk (and redis-server / redis-cli) with apt-get when missing, builds the
# server once in release, starts its own redis-server and a 3-master Redis Cluster on free
# loopback ports (never 6379), runs the scenarios interleaved (every mode once per round,
# the order rotated each round), stops everything it started (also on Ctrl-C or an error),
# writes every run to $OUT and prints the medians over rounds, with each mode's throughput
# and p99 relative to plain's from the same round and scenario.
#
# Each run also records the server's resident memory at its end (rss_kib, VmRSS): bounded
# under a flood when the store is.
#
# Besides wrk's numbers, each run records the CPU time the server and Redis used per
# request (from /proc/<pid>/stat: steadier than req/s on a shared machine) and Redis calls
# per request (script calls and PINGs, from INFO commandstats: 1/x is the coalesced batch
# size). A run whose answers were not what the scenario says (a store error answered 503,
# a rejection where nothing should be rejected, ...) is marked invalid and left out.
set -euo pipefail
cd "$(dirname "$0")/.."

ROUNDS=${ROUNDS:-3}
DURATION=${DURATION:-10}
WARMUP=${WARMUP:-2}
CONNECTIONS=${CONNECTIONS:-64}
THREADS=${THREADS:-1}
MODES=${MODES:-plain memory memory-noheaders redis redis-nocoalesce redis-pool redis-cluster governor handwritten}
SCENARIOS=${SCENARIOS:-allow reject}
MAX_KEYS=${MAX_KEYS:-}
FEATURES=${FEATURES:-redis,bb8,cluster}
OUT=${OUT:-bench/results.csv}
CHART=${CHART:-bench/chart.svg}

die() {
  echo "load.sh: $*" >&2
  exit 1
}
note() { echo "load.sh: $*" >&2; }

for var in ROUNDS DURATION CONNECTIONS THREADS; do
  [[ ${!var} =~ ^[1-9][0-9]*$ ]] || die "$var must be a positive integer (got '${!var}')"
done
[[ $WARMUP =~ ^[0-9]+$ ]] || die "WARMUP must be a non-negative integer (got '$WARMUP')"
[[ -z $MAX_KEYS || $MAX_KEYS =~ ^[1-9][0-9]*$ ]] ||
  die "MAX_KEYS must be empty or a positive integer (got '$MAX_KEYS')"
for scenario in $SCENARIOS; do
  [[ $scenario == allow || $scenario == reject || $scenario == clients || $scenario == flood ||
    $scenario == zipf ]] ||
    die "unknown scenario '$scenario' (allow, reject, clients, flood or zipf)"
done
KNOWN_MODES=" plain memory memory-noheaders redis redis-nocoalesce redis-nocache redis-lease redis-pool redis-cluster redis-tls governor handwritten memory-lockout redis-lockout memory-wait redis-wait memory-inflight redis-inflight memory-rate-inflight redis-rate-inflight "
for mode in $MODES; do
  [[ $KNOWN_MODES == *" $mode "* ]] || die "unknown mode '$mode'; one of:$KNOWN_MODES"
done
[[ " $MODES " == *" plain "* ]] || MODES="plain $MODES"
if [[ " $MODES " == *" redis-tls "* && ",$FEATURES," != *",tls,"* ]]; then
  FEATURES="$FEATURES,tls"
fi

# --- everything started here is stopped on exit -----------------------------------------
WORK=$(mktemp -d "${TMPDIR:-/tmp}/tollgate-bench.XXXXXX")
PIDS=()
SERVER_PID=

stop_pid() {
  local pid=$1
  kill -0 "$pid" 2>/dev/null || return 0
  kill -TERM "$pid" 2>/dev/null || true
  for _ in $(seq 50); do
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.1
  done
  kill -KILL "$pid" 2>/dev/null || true
  wait "$pid" 2>/dev/null || true
}

cleanup() {
  local status=$?
  trap - EXIT INT TERM
  [[ -n $SERVER_PID ]] && stop_pid "$SERVER_PID"
  for pid in "${PIDS[@]}"; do stop_pid "$pid"; done
  rm -rf "$WORK"
  exit "$status"
}
trap cleanup EXIT
trap 'echo "load.sh: command failed at line $LINENO: $BASH_COMMAND" >&2' ERR
trap 'exit 130' INT
trap 'exit 143' TERM

# --- tools ------------------------------------------------------------------------------
apt_install() {
  local sudo=
  [[ $(id -u) == 0 ]] || sudo=sudo
  command -v apt-get >/dev/null || die "$* missing and no apt-get to install it: install $* yourself"
  note "installing $* with apt-get"
  $sudo apt-get update -qq || die "apt-get update failed"
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "$@" >/dev/null ||
    die "apt-get install $* failed"
}

command -v cargo >/dev/null || die "cargo not found on PATH"
command -v wrk >/dev/null || apt_install wrk
command -v wrk >/dev/null || die "wrk still missing after apt-get install wrk"
if ! command -v redis-server >/dev/null || ! command -v redis-cli >/dev/null; then
  apt_install redis-server redis-tools
fi
command -v redis-server >/dev/null || die "redis-server still missing"
command -v redis-cli >/dev/null || die "redis-cli still missing"

# --- build once -------------------------------------------------------------------------
note "building the benchmark server (release, features $FEATURES)"
# FEATURES names tollgate's features; the bench package has its own `tls` for redis-tls.
BENCH_FEATURES=$(sed -E 's#(^|,)([^,]+)#\1tollgate/\2#g' <<<"$FEATURES")
[[ ",$FEATURES," == *",tls,"* ]] && BENCH_FEATURES="$BENCH_FEATURES,tls"
cargo build --release --quiet -p tollgate-bench --features "$BENCH_FEATURES" ||
  die "cargo build failed"
TARGET_DIR=$(cargo metadata --format-version 1 --no-deps |
  sed -n 's/.*"target_directory":"\([^"]*\)".*/\1/p')
[[ -n $TARGET_DIR ]] || die "could not read the target directory from cargo metadata"
SERVER_BIN=$TARGET_DIR/release/bench_server
CHART_BIN=$TARGET_DIR/release/bench_chart
[[ -x $SERVER_BIN && -x $CHART_BIN ]] || die "built binaries not found in $TARGET_DIR/release"

# --- Redis ------------------------------------------------------------------------------
TAKEN=" "
# Sets FREE_PORT to a port on 127.0.0.1 that nothing listens on (and, with "bus", port +
# 10000 too: a cluster node's bus), from 15000-21999 so that bus ports stay below the
# ephemeral range. (Not called as $(free_port): TAKEN must outlive the call.)
free_port() {
  local want_bus=${1:-} port
  for _ in $(seq 500); do
    port=$((15000 + RANDOM % 7000))
    [[ $TAKEN == *" $port "* ]] && continue
    (: </dev/tcp/127.0.0.1/"$port") 2>/dev/null && continue
    if [[ -n $want_bus ]]; then
      [[ $TAKEN == *" $((port + 10000)) "* ]] && continue
      (: </dev/tcp/127.0.0.1/"$((port + 10000))") 2>/dev/null && continue
      TAKEN+="$((port + 10000)) "
    fi
    TAKEN+="$port "
    FREE_PORT=$port
    return 0
  done
  die "found no free port"
}

# start_redis PORT [extra args]: a redis-server that saves nothing, answering PING.
start_redis() {
  local port=$1 dir=$WORK/redis-$1
  shift
  mkdir -p "$dir"
  redis-server --port "$port" --bind 127.0.0.1 --save "" --appendonly no \
    --dir "$dir" --logfile "$dir/log" "$@" &
  PIDS+=($!)
  local pid=$!
  for _ in $(seq 200); do
    kill -0 "$pid" 2>/dev/null || { cat "$dir/log" >&2; die "redis-server on port $port exited"; }
    [[ $(redis-cli -p "$port" PING 2>/dev/null) == PONG ]] && return 0
    sleep 0.05
  done
  die "redis-server on port $port did not answer PING in 10 s"
}

needs_redis=no
for mode in $MODES; do
  [[ $mode == redis* || $mode == handwritten ]] && needs_redis=yes
done
REDIS_URL=
REDIS_PIDS=
REDIS_PORTS=
if [[ $needs_redis == yes ]]; then
  free_port
  start_redis "$FREE_PORT"
  REDIS_URL=redis://127.0.0.1:$FREE_PORT
  REDIS_PIDS=${PIDS[-1]}
  REDIS_PORTS=$FREE_PORT
fi

# redis-tls: a second redis-server that speaks only TLS, with a CA and a server certificate
# for 127.0.0.1 made here (clients need no certificate).
REDIS_TLS_URL=
REDIS_TLS_PIDS=
REDIS_TLS_PORTS=
TLS_CLI=()
if [[ " $MODES " == *" redis-tls "* ]]; then
  command -v openssl >/dev/null || apt_install openssl
  tls=$WORK/tls
  mkdir -p "$tls"
  openssl req -x509 -newkey rsa:2048 -nodes -days 2 -subj "/CN=bench CA" \
    -keyout "$tls/ca.key" -out "$tls/ca.crt" >/dev/null 2>&1 || die "openssl: CA"
  openssl req -newkey rsa:2048 -nodes -subj "/CN=127.0.0.1" \
    -keyout "$tls/server.key" -out "$tls/server.csr" >/dev/null 2>&1 || die "openssl: key"
  printf 'subjectAltName=IP:127.0.0.1\n' >"$tls/san.ext"
  openssl x509 -req -in "$tls/server.csr" -CA "$tls/ca.crt" -CAkey "$tls/ca.key" \
    -CAcreateserial -days 2 -extfile "$tls/san.ext" -out "$tls/server.crt" >/dev/null 2>&1 ||
    die "openssl: server certificate"
  free_port
  TLS_CLI=(--tls --cacert "$tls/ca.crt")
  dir=$WORK/redis-tls
  mkdir -p "$dir"
  redis-server --port 0 --tls-port "$FREE_PORT" --bind 127.0.0.1 --save "" --appendonly no \
    --tls-cert-file "$tls/server.crt" --tls-key-file "$tls/server.key" \
    --tls-ca-cert-file "$tls/ca.crt" --tls-auth-clients no \
    --dir "$dir" --logfile "$dir/log" &
  PIDS+=($!)
  for _ in $(seq 200); do
    [[ $(redis-cli "${TLS_CLI[@]}" -p "$FREE_PORT" PING 2>/dev/null) == PONG ]] && break
    sleep 0.05
  done
  [[ $(redis-cli "${TLS_CLI[@]}" -p "$FREE_PORT" PING 2>/dev/null) == PONG ]] ||
    { cat "$dir/log" >&2; die "the TLS redis-server did not answer PING"; }
  REDIS_TLS_URL=rediss://127.0.0.1:$FREE_PORT
  REDIS_TLS_PIDS=${PIDS[-1]}
  REDIS_TLS_PORTS=$FREE_PORT
fi

# A cluster of three masters without replicas (replication would only take CPU from the
# other processes on this machine). Skipped with a note when it cannot be formed.
CLUSTER_URLS=
CLUSTER_PIDS=
CLUSTER_PORTS=
start_cluster() {
  local ports=() addresses=() port
  for _ in 1 2 3; do
    free_port bus
    port=$FREE_PORT
    start_redis "$port" --cluster-enabled yes --cluster-config-file nodes.conf \
      --cluster-node-timeout 5000
    ports+=("$port")
    addresses+=("127.0.0.1:$port")
    CLUSTER_PIDS+="${PIDS[-1]} "
    CLUSTER_PORTS+="$port "
  done
  redis-cli --cluster create "${addresses[@]}" --cluster-replicas 0 --cluster-yes \
    </dev/null >"$WORK/cluster-create.log" 2>&1 || return 1
  for _ in $(seq 200); do
    local ok=0
    for port in "${ports[@]}"; do
      redis-cli -p "$port" CLUSTER INFO 2>/dev/null | grep -q '^cluster_state:ok' && ok=$((ok + 1))
    done
    if [[ $ok == 3 ]]; then
      CLUSTER_URLS=$(printf 'redis://%s,' "${addresses[@]}")
      CLUSTER_URLS=${CLUSTER_URLS%,}
      return 0
    fi
    sleep 0.1
  done
  return 1
}
if [[ " $MODES " == *" redis-cluster "* ]]; then
  if ! start_cluster; then
    cat "$WORK/cluster-create.log" >&2 2>/dev/null || true
    note "NOTE: could not form a Redis Cluster; skipping mode redis-cluster"
    MODES=$(echo " $MODES " | sed 's/ redis-cluster / /' | xargs)
  fi
fi

# --- one run ----------------------------------------------------------------------------
CLK_TCK=$(getconf CLK_TCK)
# CPU time (user + system, in clock ticks) the processes have used so far.
cpu_ticks() {
  local total=0 pid ticks
  for pid in "$@"; do
    # Fields after "pid (comm) ": utime and stime are the 12th and 13th.
    ticks=$(awk '{ sub(/^.*\) /, ""); print $12 + $13 }' "/proc/$pid/stat" 2>/dev/null) ||
      die "process $pid (server or Redis) ended during the run"
    total=$((total + ticks))
  done
  echo "$total"
}

# Script calls (and PINGs, and in-flight permits given back with ZREM) the Redis servers
# on these ports have run so far.
redis_commands() {
  local total=0 port n
  for port in "$@"; do
    # Top-level script calls, PINGs (a pool's checkout test) and ZREMs (the in-flight
    # modes' releases; no other mode sends one); the commands that scripts run inside
    # are not counted.
    local tls=()
    [[ $port == "$REDIS_TLS_PORTS" ]] && tls=("${TLS_CLI[@]}")
    n=$(redis-cli "${tls[@]}" -p "$port" INFO commandstats | tr -d '\r' |
      awk -F'[:=,]' '/^cmdstat_(evalsha|eval|fcall|ping|zrem):/ { n += $3 } END { print n + 0 }')
    [[ -n $n ]] || die "redis-cli -p $port INFO commandstats failed"
    total=$((total + n))
  done
  echo "$total"
}

# Latency as wrk prints it (850.00us, 1.23ms, 2.00s) in microseconds.
to_us() {
  awk -v v="$1" 'BEGIN {
    n = v + 0; u = v; sub(/^[0-9.]+/, "", u)
    if (u == "us") f = 1; else if (u == "ms") f = 1000; else if (u == "s") f = 1000000;
    else if (u == "m") f = 60000000; else { print "NaN"; exit }
    printf "%.0f", n * f }'
}

SERVER_LOG=
RUN=0
start_server() {
  local mode=$1 scenario=$2 log
  # A new log per run: the background job truncates its log only once it has started, so
  # a reused file could still show the previous server's port.
  RUN=$((RUN + 1))
  log=$WORK/server-$RUN.log
  SERVER_LOG=$log
  : >"$log"
  local args=(--mode "$mode" --scenario "$scenario" --port 0)
  [[ -n $REDIS_URL ]] && args+=(--redis "$REDIS_URL")
  [[ -n $CLUSTER_URLS ]] && args+=(--cluster "$CLUSTER_URLS")
  [[ -n $REDIS_TLS_URL ]] && args+=(--redis-tls "$REDIS_TLS_URL" --tls-ca "$WORK/tls/ca.crt")
  [[ -n $MAX_KEYS && $mode == memory* ]] && args+=(--max-keys "$MAX_KEYS")
  "$SERVER_BIN" "${args[@]}" >"$log" 2>&1 &
  SERVER_PID=$!
  for _ in $(seq 300); do
    if ! kill -0 "$SERVER_PID" 2>/dev/null; then
      cat "$log" >&2
      die "bench_server --mode $mode --scenario $scenario exited at start"
    fi
    SERVER_PORT=$(sed -n 's/^listening on 127\.0\.0\.1:\([0-9]*\)$/\1/p' "$log")
    [[ -n $SERVER_PORT ]] && return 0
    sleep 0.1
  done
  cat "$log" >&2
  die "bench_server --mode $mode did not start listening in 30 s"
}

stop_server() {
  stop_pid "$SERVER_PID"
  SERVER_PID=
}

run_one() {
  local round=$1 scenario=$2 mode=$3
  start_server "$mode" "$scenario"
  local url=http://127.0.0.1:$SERVER_PORT/
  # Every mode, plain included, gets the same requests: with a client header or without.
  local script=()
  [[ $scenario == clients ]] && script=(-s bench/clients.lua)
  [[ $scenario == flood ]] && script=(-s bench/flood.lua)
  [[ $scenario == zipf ]] && script=(-s bench/zipf.lua)
  if [[ $WARMUP -gt 0 ]]; then
    wrk -t"$THREADS" -c"$CONNECTIONS" -d"${WARMUP}s" "${script[@]}" "$url" >/dev/null ||
      die "wrk failed (warm-up, $mode $scenario)"
  fi
  # The Redis processes this mode uses, for their CPU time.
  local redis_pids='' redis_ports=''
  case $mode in
    redis-cluster) redis_pids=$CLUSTER_PIDS redis_ports=$CLUSTER_PORTS ;;
    redis-tls) redis_pids=$REDIS_TLS_PIDS redis_ports=$REDIS_TLS_PORTS ;;
    redis* | handwritten) redis_pids=$REDIS_PIDS redis_ports=$REDIS_PORTS ;;
  esac
  local server_before redis_before commands_before server_after redis_after commands_after
  # shellcheck disable=SC2086 # the PID and port lists are meant to split
  {
    commands_before=$(redis_commands $redis_ports)
    server_before=$(cpu_ticks "$SERVER_PID")
    redis_before=$(cpu_ticks $redis_pids)
    wrk -t"$THREADS" -c"$CONNECTIONS" -d"${DURATION}s" --latency "${script[@]}" "$url" >"$WORK/wrk.txt" ||
      die "wrk failed ($mode $scenario)"
    server_after=$(cpu_ticks "$SERVER_PID")
    redis_after=$(cpu_ticks $redis_pids)
    commands_after=$(redis_commands $redis_ports)
  }
  local rss
  rss=$(awk '/^VmRSS:/ {print $2}' "/proc/$SERVER_PID/status" 2>/dev/null) ||
    die "the server ended during the run ($mode $scenario)"
  stop_server
  local statuses
  statuses=$(sed -n 's/^statuses: 200=\([0-9]*\) 429=\([0-9]*\) other=\([0-9]*\)$/\1 \2 \3/p' \
    "$SERVER_LOG")
  [[ -n $statuses ]] || die "bench_server ($mode $scenario) did not report its statuses"
  read -r ok too_many other <<<"$statuses"

  local rps p50 p99 requests non2xx errors
  rps=$(awk '/^Requests\/sec:/ {print $2}' "$WORK/wrk.txt")
  p50=$(to_us "$(awk '$1 == "50%" {print $2}' "$WORK/wrk.txt")")
  p99=$(to_us "$(awk '$1 == "99%" {print $2}' "$WORK/wrk.txt")")
  requests=$(awk '/requests in/ {print $1}' "$WORK/wrk.txt")
  non2xx=$(awk '/Non-2xx or 3xx responses:/ {print $NF}' "$WORK/wrk.txt")
  errors=$(awk -F'[ ,]+' '/Socket errors:/ {for (i = 1; i <= NF; i++) if ($i ~ /^[0-9]+$/) n += $i; print n}' "$WORK/wrk.txt")
  non2xx=${non2xx:-0}
  errors=${errors:-0}
  [[ -n $rps && -n $requests && $p50 != NaN && $p99 != NaN ]] || {
    cat "$WORK/wrk.txt" >&2
    die "could not read wrk's output ($mode $scenario)"
  }
  # CPU microseconds per request served, in the server and in Redis.
  local server_cpu redis_cpu
  server_cpu=$(awk -v t=$((server_after - server_before)) -v n="$requests" -v hz="$CLK_TCK" \
    'BEGIN { printf "%.2f", (n > 0 ? t * 1000000 / hz / n : 0) }')
  redis_cpu=$(awk -v t=$((redis_after - redis_before)) -v n="$requests" -v hz="$CLK_TCK" \
    'BEGIN { printf "%.2f", (n > 0 ? t * 1000000 / hz / n : 0) }')
  # Redis calls per request: 1 for a script call each, less when coalesced.
  local commands
  commands=$(awk -v c=$((commands_after - commands_before)) -v n="$requests" \
    'BEGIN { printf "%.3f", (n > 0 ? c / n : 0) }')

  # Did the scenario do what it says? (The counts include the warm-up.)
  local valid=1 why=
  if [[ $errors != 0 ]]; then
    valid=0 why="$errors socket errors"
  elif [[ $other != 0 ]]; then
    valid=0 why="$other answers neither 200 nor 429 (store errors?)"
  elif [[ $mode == plain || $scenario != reject ]] && [[ $too_many != 0 ]]; then
    valid=0 why="$too_many rejected in a scenario that rejects nothing"
  elif [[ $mode != plain && $scenario == reject ]] && [[ $ok -gt 1 ]]; then
    valid=0 why="$ok allowed in a scenario that allows at most one"
  fi
  echo "$round,$scenario,$mode,$rps,$p50,$p99,$requests,$non2xx,$errors,$ok,$too_many,$other,$server_cpu,$redis_cpu,$commands,$valid,$rss" >>"$OUT"
  printf '  round %s/%s  %-7s %-16s %7.0f req/s  p50 %5.2f ms  p99 %6.2f ms  CPU/req %5.2f + %5.2f us  Redis calls/req %5.3f  RSS %4.0f MiB%s\n' \
    "$round" "$ROUNDS" "$scenario" "$mode" "$rps" "$(awk -v v="$p50" 'BEGIN {print v / 1000}')" \
    "$(awk -v v="$p99" 'BEGIN {print v / 1000}')" "$server_cpu" "$redis_cpu" "$commands" \
    "$(awk -v v="$rss" 'BEGIN {print v / 1024}')" "${why:+  INVALID: $why}"
  if [[ $valid == 0 ]]; then
    # What the server said about it (tollgate logs each store failure).
    grep -v -e '^listening on' -e '^statuses:' "$SERVER_LOG" | sort | uniq -c | sort -rn |
      head -3 | sed 's/^/      server log: /' || true
  fi
}

# --- the rounds -------------------------------------------------------------------------
read -r -a modes <<<"$MODES"
read -r -a scenarios <<<"$SCENARIOS"
runs=$((ROUNDS * ${#modes[@]} * ${#scenarios[@]}))
echo "machine: $(nproc) cores, load average $(cut -d' ' -f1-3 /proc/loadavg); $(wrk --version 2>&1 | head -1 | cut -d' ' -f1-2); $(redis-server --version | cut -d' ' -f1-3); $(rustc --version)"
echo "runs: $ROUNDS rounds x ${#scenarios[@]} scenarios x ${#modes[@]} modes = $runs runs of ${WARMUP}+${DURATION} s (about $((runs * (DURATION + WARMUP + 1) / 60 + 1)) min); wrk -t$THREADS -c$CONNECTIONS"
[[ -n $REDIS_URL ]] && echo "redis: $REDIS_URL${CLUSTER_URLS:+; cluster: $CLUSTER_URLS}"

mkdir -p "$(dirname "$OUT")"
echo "round,scenario,mode,rps,p50_us,p99_us,requests,non2xx,socket_errors,status_200,status_429,status_other,server_cpu_us,redis_cpu_us,redis_calls_per_req,valid,rss_kib" >"$OUT"
for round in $(seq "$ROUNDS"); do
  # Rotate the order every round, so that no mode always runs first or last.
  shift_by=$(((round - 1) % ${#modes[@]}))
  order=("${modes[@]:shift_by}" "${modes[@]:0:shift_by}")
  for scenario in "${scenarios[@]}"; do
    for mode in "${order[@]}"; do
      run_one "$round" "$scenario" "$mode"
    done
  done
done
echo "load average at the end: $(cut -d' ' -f1-3 /proc/loadavg)"
echo
"$CHART_BIN" "$OUT" "$CHART"
echo "raw results: $OUT"
