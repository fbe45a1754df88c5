#!/usr/bin/env bash
# Proxy benchmark: the gateway (tollgate-gateway) and nginx's `limit_req` in front of the
# same upstream (an nginx server block answering "ok"), measured with wrk over loopback,
# side by side in one run (see BENCHMARKS.md, "Proxying at nginx's cost").
#
#   bench/proxy.sh                        # 3 rounds x 10 s per proxy and scenario, ~3 min
#   ROUNDS=1 DURATION=3 bench/proxy.sh    # a quick look
#
# Environment:
#   ROUNDS=3 DURATION=10 WARMUP=2   rounds; seconds measured and warmed up per run
#   CONNECTIONS=64 THREADS=1        wrk -c / -t
#   SCENARIOS="allow reject"        allow: a limit that never rejects (every request is
#                                   proxied); reject: the client's key flooded (1 an hour
#                                   for the gateway, 1 a minute, nginx's least, for nginx):
#                                   every measured request is answered 429 by the proxy
#   PROXIES="gateway nginx"         which proxies; add baseline to measure a second gateway
#                                   binary, BASELINE_BIN, in the same rounds (before/after)
#   NGINX_WORKERS=auto              worker_processes of the proxying nginx and the upstream
#   GATEWAY_BIN=                    a gateway binary to measure instead of building one
#                                   (for a before/after: build each, run with each)
#   OUT=bench/results-proxy.csv
#
# It installs wrk and nginx with apt-get when missing (Debian 12's nginx is 1.22), builds
# the gateway once in release (CARGO_INCREMENTAL=0), starts an upstream nginx on a free
# loopback port (its own config, pid and logs under a temporary directory; never the
# default site), then for every round, scenario and proxy (the order rotated each round)
# starts that proxy anew in front of the upstream, warms it up, measures it with wrk and
# stops it. Both proxies keep upstream connections alive (nginx: `keepalive` in its
# upstream block, `proxy_http_version 1.1`) and set X-Forwarded-For and X-Real-IP; neither
# writes an access log (the gateway logs nothing per request at its default `info`).
#
# Each run records the CPU time (user + system, from /proc/<pid>/stat) per request of the
# proxy (the gateway's process; nginx's master and workers) and of the upstream nginx, so
# that "the proxy" and "proxying and serving" can be compared. A run whose answers were
# not what the scenario says (a non-200 where nothing is rejected, a 200 where the key is
# flooded, a socket error) is marked invalid and left out of the medians.
set -euo pipefail
cd "$(dirname "$0")/.."

ROUNDS=${ROUNDS:-3}
DURATION=${DURATION:-10}
WARMUP=${WARMUP:-2}
CONNECTIONS=${CONNECTIONS:-64}
THREADS=${THREADS:-1}
SCENARIOS=${SCENARIOS:-allow reject}
PROXIES=${PROXIES:-gateway nginx}
NGINX_WORKERS=${NGINX_WORKERS:-auto}
GATEWAY_BIN=${GATEWAY_BIN:-}
BASELINE_BIN=${BASELINE_BIN:-}
OUT=${OUT:-bench/results-proxy.csv}

die() {
  echo "proxy.sh: $*" >&2
  exit 1
}
note() { echo "proxy.sh: $*" >&2; }

for var in ROUNDS DURATION CONNECTIONS THREADS; do
  [[ ${!var} =~ ^[1-9][0-9]*$ ]] || die "$var must be a positive integer (got '${!var}')"
done
[[ $WARMUP =~ ^[0-9]+$ ]] || die "WARMUP must be a non-negative integer (got '$WARMUP')"
[[ $NGINX_WORKERS == auto || $NGINX_WORKERS =~ ^[1-9][0-9]*$ ]] ||
  die "NGINX_WORKERS must be auto or a positive integer (got '$NGINX_WORKERS')"
for scenario in $SCENARIOS; do
  [[ $scenario == allow || $scenario == reject ]] ||
    die "unknown scenario '$scenario' (allow or reject)"
done
for proxy in $PROXIES; do
  [[ $proxy == gateway || $proxy == nginx || $proxy == baseline ]] ||
    die "unknown proxy '$proxy' (gateway, nginx or baseline)"
  [[ $proxy != baseline || -x $BASELINE_BIN ]] ||
    die "the baseline proxy needs BASELINE_BIN, a gateway binary (got '$BASELINE_BIN')"
done

# --- everything started here is stopped on exit -----------------------------------------
WORK=$(mktemp -d "${TMPDIR:-/tmp}/tollgate-proxy.XXXXXX")
PIDS=()
PROXY_PID=

stop_pid() {
  local pid=$1
  kill -0 "$pid" 2>/dev/null || return 0
  # nginx stops at once on TERM (QUIT would wait for its keep-alive connections).
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
  [[ -n $PROXY_PID ]] && stop_pid "$PROXY_PID"
  for pid in "${PIDS[@]}"; do stop_pid "$pid"; done
  rm -rf "$WORK"
  exit "$status"
}
trap cleanup EXIT
trap 'echo "proxy.sh: command failed at line $LINENO: $BASH_COMMAND" >&2' ERR
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

command -v wrk >/dev/null || apt_install wrk
command -v wrk >/dev/null || die "wrk still missing after apt-get install wrk"
NGINX=$(command -v nginx || true)
[[ -z $NGINX && -x /usr/sbin/nginx ]] && NGINX=/usr/sbin/nginx
if [[ -z $NGINX ]]; then
  apt_install nginx-light
  NGINX=$(command -v nginx || echo /usr/sbin/nginx)
fi
[[ -x $NGINX ]] || die "nginx still missing after apt-get install nginx-light"

# --- build once -------------------------------------------------------------------------
if [[ -z $GATEWAY_BIN ]]; then
  command -v cargo >/dev/null || die "cargo not found on PATH"
  note "building the gateway (release)"
  CARGO_INCREMENTAL=0 cargo build --release --quiet -p tollgate-gateway --bin gateway ||
    die "cargo build failed"
  TARGET_DIR=$(cargo metadata --format-version 1 --no-deps |
    sed -n 's/.*"target_directory":"\([^"]*\)".*/\1/p')
  [[ -n $TARGET_DIR ]] || die "could not read the target directory from cargo metadata"
  GATEWAY_BIN=$TARGET_DIR/release/gateway
fi
[[ -x $GATEWAY_BIN ]] || die "gateway binary not found at $GATEWAY_BIN"

# --- ports and the upstream -------------------------------------------------------------
TAKEN=" "
# Sets FREE_PORT to a port on 127.0.0.1 that nothing listens on. (Not called as
# $(free_port): TAKEN must outlive the call.)
free_port() {
  local port
  for _ in $(seq 500); do
    port=$((15000 + RANDOM % 7000))
    [[ $TAKEN == *" $port "* ]] && continue
    (: </dev/tcp/127.0.0.1/"$port") 2>/dev/null && continue
    TAKEN+="$port "
    FREE_PORT=$port
    return 0
  done
  die "found no free port"
}

# Waits until something accepts connections on 127.0.0.1:$2 while process $1 lives.
wait_listening() {
  local pid=$1 port=$2 what=$3 log=$4
  for _ in $(seq 300); do
    kill -0 "$pid" 2>/dev/null || { cat "$log" >&2; die "$what exited at start"; }
    (: </dev/tcp/127.0.0.1/"$port") 2>/dev/null && return 0
    sleep 0.1
  done
  cat "$log" >&2
  die "$what did not listen on port $port in 30 s"
}

# nginx_head DIR: the part of an nginx config every instance here shares: its own prefix,
# pid, error log and temporary paths, in the foreground, without an access log.
nginx_head() {
  local dir=$1
  mkdir -p "$dir"
  local user=
  [[ $(id -u) == 0 ]] && user="user root;"
  cat <<EOF
$user
daemon off;
master_process on;
worker_processes $NGINX_WORKERS;
pid $dir/nginx.pid;
error_log $dir/error.log warn;
events { worker_connections 4096; }
http {
  access_log off;
  client_body_temp_path $dir/client_body;
  proxy_temp_path $dir/proxy;
  fastcgi_temp_path $dir/fastcgi;
  uwsgi_temp_path $dir/uwsgi;
  scgi_temp_path $dir/scgi;
  keepalive_requests 1000000;
EOF
}

# start_nginx NAME CONF: runs nginx in the foreground with CONF; sets NGINX_PID.
start_nginx() {
  local name=$1 conf=$2 dir=$WORK/$1
  "$NGINX" -p "$dir" -e "$dir/error.log" -c "$conf" -t >"$dir/test.log" 2>&1 ||
    { cat "$dir/test.log" >&2; die "nginx ($name) refused its config"; }
  "$NGINX" -p "$dir" -e "$dir/error.log" -c "$conf" >"$dir/stdout.log" 2>&1 &
  NGINX_PID=$!
}

# The nginx processes of master $1 (the master and its workers).
nginx_pids() {
  echo "$1 $(pgrep -P "$1" | tr '\n' ' ')"
}

free_port
UPSTREAM_PORT=$FREE_PORT
conf=$WORK/upstream.conf
{
  nginx_head "$WORK/upstream"
  cat <<EOF
  server {
    listen 127.0.0.1:$UPSTREAM_PORT backlog=4096;
    location / { default_type text/plain; return 200 "ok"; }
  }
}
EOF
} >"$conf"
start_nginx upstream "$conf"
UPSTREAM_MASTER=$NGINX_PID
PIDS+=("$UPSTREAM_MASTER")
wait_listening "$UPSTREAM_MASTER" "$UPSTREAM_PORT" "the upstream nginx" "$WORK/upstream/error.log"
[[ $(curl -s "http://127.0.0.1:$UPSTREAM_PORT/") == ok ]] ||
  die "the upstream nginx does not answer ok"

# --- the proxies ------------------------------------------------------------------------
RUN=0
PROXY_LOG=
PROXY_PORT=
# The CPU of the proxy process(es) is read from these.
PROXY_PIDS=

start_gateway() {
  local scenario=$1 bin=$2 dir=$WORK/gateway-$RUN
  mkdir -p "$dir"
  free_port
  PROXY_PORT=$FREE_PORT
  local limit
  case $scenario in
    # Never rejects: a bucket far larger than any run can spend.
    allow) limit=$'algorithm = "token_bucket"\nlimit = 1000000000\nwindow = "1s"' ;;
    # One request an hour: the warm-up spends it, every measured request is rejected.
    reject) limit=$'algorithm = "fixed_window"\nlimit = 1\nwindow = "1h"' ;;
  esac
  cat >"$dir/gateway.toml" <<EOF
listen = "127.0.0.1:$PROXY_PORT"

[server]
max_connections = 4096

[store]
backend = "memory"

[[routes]]
path = "/"
upstream = "http://127.0.0.1:$UPSTREAM_PORT"

[[routes.limits]]
key = "ip"
$limit
EOF
  PROXY_LOG=$dir/log
  "$bin" --config "$dir/gateway.toml" >"$PROXY_LOG" 2>&1 &
  PROXY_PID=$!
  PROXY_PIDS=$PROXY_PID
  wait_listening "$PROXY_PID" "$PROXY_PORT" "the gateway" "$PROXY_LOG"
}

start_nginx_proxy() {
  local scenario=$1 name=nginx-$RUN
  free_port
  PROXY_PORT=$FREE_PORT
  local rate burst
  case $scenario in
    # nginx counts in milliseconds: without a burst, a second request within the same
    # millisecond is rejected whatever the rate.
    allow) rate=1000000r/s burst=" burst=1000000 nodelay" ;;
    # nginx's least rate: the warm-up spends the one request, the rest are rejected.
    reject) rate=1r/m burst= ;;
  esac
  local conf=$WORK/$name.conf
  {
    nginx_head "$WORK/$name"
    cat <<EOF
  limit_req_zone \$binary_remote_addr zone=ip:10m rate=$rate;
  limit_req_status 429;
  # Rejections are not logged (the error log takes warn and up), as the gateway's are not.
  limit_req_log_level info;
  upstream up {
    server 127.0.0.1:$UPSTREAM_PORT;
    keepalive 128;
    keepalive_requests 1000000;
  }
  server {
    listen 127.0.0.1:$PROXY_PORT backlog=4096;
    location / {
      limit_req zone=ip$burst;
      proxy_pass http://up;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_set_header X-Real-IP \$remote_addr;
      proxy_set_header X-Forwarded-For \$proxy_add_x_forwarded_for;
    }
  }
}
EOF
  } >"$conf"
  start_nginx "$name" "$conf"
  PROXY_PID=$NGINX_PID
  PROXY_LOG=$WORK/$name/error.log
  wait_listening "$PROXY_PID" "$PROXY_PORT" "the proxying nginx" "$PROXY_LOG"
  PROXY_PIDS=$(nginx_pids "$PROXY_PID")
}

# --- one run ----------------------------------------------------------------------------
CLK_TCK=$(getconf CLK_TCK)
# CPU time (user + system, in clock ticks) the processes have used so far.
cpu_ticks() {
  local total=0 pid ticks
  for pid in "$@"; do
    # Fields after "pid (comm) ": utime and stime are the 12th and 13th.
    ticks=$(awk '{ sub(/^.*\) /, ""); print $12 + $13 }' "/proc/$pid/stat" 2>/dev/null) ||
      die "process $pid (a proxy or the upstream) ended during the run"
    total=$((total + ticks))
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

run_one() {
  local round=$1 scenario=$2 proxy=$3
  RUN=$((RUN + 1))
  case $proxy in
    gateway) start_gateway "$scenario" "$GATEWAY_BIN" ;;
    baseline) start_gateway "$scenario" "$BASELINE_BIN" ;;
    nginx) start_nginx_proxy "$scenario" ;;
  esac
  local url=http://127.0.0.1:$PROXY_PORT/
  local upstream_pids
  upstream_pids=$(nginx_pids "$UPSTREAM_MASTER")
  if [[ $WARMUP -gt 0 ]]; then
    wrk -t"$THREADS" -c"$CONNECTIONS" -d"${WARMUP}s" "$url" >/dev/null ||
      die "wrk failed (warm-up, $proxy $scenario)"
  else
    # The reject scenario's one allowed request is spent before the measurement.
    curl -s -o /dev/null "$url" || true
  fi
  local proxy_before upstream_before proxy_after upstream_after load
  # shellcheck disable=SC2086 # the PID lists are meant to split
  {
    proxy_before=$(cpu_ticks $PROXY_PIDS)
    upstream_before=$(cpu_ticks $upstream_pids)
    wrk -t"$THREADS" -c"$CONNECTIONS" -d"${DURATION}s" --latency "$url" >"$WORK/wrk.txt" ||
      die "wrk failed ($proxy $scenario)"
    proxy_after=$(cpu_ticks $PROXY_PIDS)
    upstream_after=$(cpu_ticks $upstream_pids)
  }
  load=$(cut -d' ' -f1 /proc/loadavg)
  stop_pid "$PROXY_PID"
  PROXY_PID=

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
    die "could not read wrk's output ($proxy $scenario)"
  }
  # CPU microseconds per request, in the proxy and in the upstream.
  local proxy_cpu upstream_cpu
  proxy_cpu=$(awk -v t=$((proxy_after - proxy_before)) -v n="$requests" -v hz="$CLK_TCK" \
    'BEGIN { printf "%.2f", (n > 0 ? t * 1000000 / hz / n : 0) }')
  upstream_cpu=$(awk -v t=$((upstream_after - upstream_before)) -v n="$requests" -v hz="$CLK_TCK" \
    'BEGIN { printf "%.2f", (n > 0 ? t * 1000000 / hz / n : 0) }')

  local valid=1 why=
  if [[ $errors != 0 ]]; then
    valid=0 why="$errors socket errors"
  elif [[ $scenario == allow && $non2xx != 0 ]]; then
    valid=0 why="$non2xx answers not 2xx where nothing is rejected"
  elif [[ $scenario == reject && $non2xx -lt $((requests - 1)) ]]; then
    valid=0 why="$((requests - non2xx)) answered 2xx where the key is flooded"
  fi
  echo "$round,$scenario,$proxy,$rps,$p50,$p99,$requests,$non2xx,$errors,$proxy_cpu,$upstream_cpu,$load,$valid" >>"$OUT"
  printf '  round %s/%s  %-6s %-7s %7.0f req/s  p50 %5.2f ms  p99 %6.2f ms  CPU/req proxy %5.2f us + upstream %5.2f us  load %s%s\n' \
    "$round" "$ROUNDS" "$scenario" "$proxy" "$rps" "$(awk -v v="$p50" 'BEGIN {print v / 1000}')" \
    "$(awk -v v="$p99" 'BEGIN {print v / 1000}')" "$proxy_cpu" "$upstream_cpu" "$load" \
    "${why:+  INVALID: $why}"
  if [[ $valid == 0 ]]; then
    sort "$PROXY_LOG" | uniq -c | sort -rn | head -3 | sed 's/^/      proxy log: /' || true
  fi
}

# --- the rounds -------------------------------------------------------------------------
read -r -a proxies <<<"$PROXIES"
read -r -a scenarios <<<"$SCENARIOS"
runs=$((ROUNDS * ${#proxies[@]} * ${#scenarios[@]}))
echo "machine: $(nproc) cores, uptime: $(uptime); $(wrk --version 2>&1 | head -1 | cut -d' ' -f1-2); $("$NGINX" -v 2>&1 | cut -d' ' -f3); $(rustc --version 2>/dev/null || echo 'rustc ?')"
echo "runs: $ROUNDS rounds x ${#scenarios[@]} scenarios x ${#proxies[@]} proxies = $runs runs of ${WARMUP}+${DURATION} s (about $((runs * (DURATION + WARMUP + 2) / 60 + 1)) min); wrk -t$THREADS -c$CONNECTIONS; nginx worker_processes $NGINX_WORKERS; upstream 127.0.0.1:$UPSTREAM_PORT"
echo "gateway: $GATEWAY_BIN${BASELINE_BIN:+; baseline: $BASELINE_BIN}"

mkdir -p "$(dirname "$OUT")"
echo "round,scenario,proxy,rps,p50_us,p99_us,requests,non2xx,socket_errors,proxy_cpu_us,upstream_cpu_us,load1,valid" >"$OUT"
for round in $(seq "$ROUNDS"); do
  # Rotate the order every round, so that no proxy always runs first.
  shift_by=$(((round - 1) % ${#proxies[@]}))
  order=("${proxies[@]:shift_by}" "${proxies[@]:0:shift_by}")
  for scenario in "${scenarios[@]}"; do
    for proxy in "${order[@]}"; do
      run_one "$round" "$scenario" "$proxy"
    done
  done
done
echo "uptime at the end: $(uptime)"
echo

# --- medians ----------------------------------------------------------------------------
# Medians over the valid rounds; the ratio is the gateway's against nginx's median.
awk -F, '
  function median(list,   n, a, i, j, t) {
    n = split(list, a, " ")
    for (i = 2; i <= n; i++) for (j = i; j > 1 && a[j - 1] + 0 > a[j] + 0; j--) {
      t = a[j]; a[j] = a[j - 1]; a[j - 1] = t
    }
    if (n == 0) return "nan"
    return n % 2 ? a[(n + 1) / 2] : (a[n / 2] + a[n / 2 + 1]) / 2
  }
  NR > 1 && $13 == 1 {
    k = $2 SUBSEP $3
    rps[k] = rps[k] " " $4; p99[k] = p99[k] " " $6
    cpu[k] = cpu[k] " " $10; up[k] = up[k] " " $11; both[k] = both[k] " " ($10 + $11)
    n[k]++
    if (!($2 in seen)) { seen[$2] = 1; order[++scenarios] = $2 }
  }
  END {
    printf "%-7s %-8s %5s %9s %9s %14s %14s %14s\n", "scenario", "proxy", "runs", "req/s", "p99 ms", "CPU/req proxy", "+ upstream", "= together"
    for (s = 1; s <= scenarios; s++) {
      sc = order[s]
      split("gateway baseline nginx", ps, " ")
      for (p = 1; p <= 3; p++) {
        k = sc SUBSEP ps[p]
        if (!(k in n)) continue
        m[ps[p], "rps"] = median(rps[k]); m[ps[p], "cpu"] = median(cpu[k])
        m[ps[p], "both"] = median(both[k])
        printf "%-8s %-8s %5d %9.0f %9.2f %11.2f us %11.2f us %11.2f us\n", sc, ps[p], n[k], m[ps[p], "rps"], median(p99[k]) / 1000, m[ps[p], "cpu"], median(up[k]), m[ps[p], "both"]
      }
      if ((sc SUBSEP "gateway") in n && (sc SUBSEP "nginx") in n) {
        printf "%-8s gateway/nginx: req/s %.2fx, CPU/req of the proxy %.2fx, proxy + upstream %.2fx\n", sc, m["gateway", "rps"] / m["nginx", "rps"], m["gateway", "cpu"] / m["nginx", "cpu"], m["gateway", "both"] / m["nginx", "both"]
      }
      if ((sc SUBSEP "baseline") in n && (sc SUBSEP "nginx") in n) {
        printf "%-8s baseline/nginx: req/s %.2fx, CPU/req of the proxy %.2fx, proxy + upstream %.2fx\n", sc, m["baseline", "rps"] / m["nginx", "rps"], m["baseline", "cpu"] / m["nginx", "cpu"], m["baseline", "both"] / m["nginx", "both"]
      }
    }
  }' "$OUT"
echo "raw results: $OUT"
