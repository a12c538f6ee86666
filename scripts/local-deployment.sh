#!/usr/bin/env bash
# A whole Flower deployment of this app on one machine: SuperLink, N SuperNodes with resident
# workers, TLS and SuperNode authentication on by default; runs the app and stops everything.
#
#   scripts/local-deployment.sh --nodes N [--no-tls] [--no-auth] [--netns] [--workdir DIR]
#                               [--data DIR] [--kill-supernode I:MESSAGE-TYPE] -- <flwr run options>
#
# e.g.  scripts/local-deployment.sh --nodes 3 -- --run-config "num-server-rounds=2"   (--stream is passed)
#
# Each SuperNode i has its own state folder ($FLWR_HOME), node config "partition-id=i
# num-partitions=N worker='resident' worker-name='node-i' data-path='<data>/partition-i.jsonl'"
# (and eval-path='<data>/partition-i.eval.jsonl' where that file exists) and its own resident
# worker (a detached Ray actor, client_app/resident.py) on a Ray instance this script starts. Each
# node reads only its own file, as a host with private data would: --data DIR names the folder of
# those files; without it the run config's partitions are written to <work>/data first
# (python -m fedopd.data export), so a node trains on what partition i of a simulation would. Credentials
# (CA, SuperLink certificate, one EC key pair per SuperNode) are made by scripts/credentials.py
# and the public keys registered with `flwr supernode register`. --netns puts each SuperNode, with
# its own Ray instance, in its own network namespace with its own address (needs root and
# `ip netns`), so nothing relies on loopback. --kill-supernode I:TYPE kills SuperNode I (its whole
# process group) when it receives its first message of TYPE (train, query.score, evaluate):
# fault injection for tests. The last line printed is `run folder: <absolute path>`; the exit
# status is non-zero if the run failed. Everything started is stopped by process group, also on
# Ctrl-C. Logs stay in the work folder (printed first; --workdir to choose it).
#
# Ray security: whoever reaches a Ray instance's ports can run any code on its host, and Ray
# listens on all interfaces whatever --node-ip-address says. Every Ray instance here runs with
# token authentication: RAY_AUTH_MODE=token and RAY_AUTH_TOKEN_PATH=<work>/ray.token (ray-<i>.token
# with --netns), a random 256-bit token made by `scripts/deployment_tools.py ray-token` with mode
# 0600, never printed, kept if it is already there; the SuperNodes (and so their ClientApps and
# resident workers) get the same two variables, and client_app/resident.py refuses a Ray instance
# without authentication (node config ray-insecure = true opts out, trusted networks only).
# Firewall a GPU host's Ray ports from everything but itself anyway (the token travels in clear
# text). Seen listening with `ss -ltnp` (Ray 2.55.1): the GCS (--port, default 6379; all
# interfaces), the raylet's node manager and object manager (random unless --node-manager-port,
# --object-manager-port; all interfaces), the Ray Client server (10001, --ray-client-server-port;
# loopback and the host's address), the runtime-env agent (random, --runtime-env-agent-port; the
# host's address) and one port per worker process, e.g. each resident worker (10002-19999,
# --min-worker-port/--max-worker-port; all interfaces). With ray[default] installed also the
# dashboard (8265, --dashboard-port; 127.0.0.1 unless --dashboard-host), the dashboard agent (52365,
# --dashboard-agent-listen-port, and --dashboard-agent-grpc-port) and the metrics export port
# (--metrics-export-port).
set -euo pipefail

usage() { sed -n '2,/^set -euo/{/^#/p}' "$0" | sed 's/^# \{0,1\}//'; exit "${1:-2}"; }

NODES=2; TLS=1; AUTH=1; NETNS=0; WORK=""; DATA=""; KILLS=()
while (($#)); do
  case "$1" in
    --nodes) NODES="${2:?--nodes needs a number}"; shift 2 ;;
    --no-tls) TLS=0; shift ;;
    --no-auth) AUTH=0; shift ;;
    --netns) NETNS=1; shift ;;
    --workdir) WORK="${2:?--workdir needs a folder}"; shift 2 ;;
    --data) DATA="${2:?--data needs a folder}"; shift 2 ;;
    --kill-supernode) KILLS+=("${2:?--kill-supernode needs I:TYPE}"); shift 2 ;;
    -h|--help) usage 0 ;;
    --) shift; break ;;
    *) echo "error: unknown option $1 (options before --, flwr run options after it)" >&2; usage ;;
  esac
done
FLWR_RUN_ARGS=("$@")
[[ "$NODES" =~ ^[1-9][0-9]*$ ]] || { echo "error: --nodes must be a positive integer, got '$NODES'" >&2; exit 2; }
for k in "${KILLS[@]}"; do
  [[ "$k" =~ ^([0-9]+):(train|query\.score|evaluate)$ ]] && ((BASH_REMATCH[1] < NODES)) \
    || { echo "error: --kill-supernode '$k': expected I:TYPE with 0 <= I < $NODES and TYPE train, query.score or evaluate" >&2; exit 2; }
done
for tool in python flwr flower-superlink flower-supernode ray setsid; do
  command -v "$tool" >/dev/null || { echo "error: '$tool' not found on PATH (activate the project's environment)" >&2; exit 2; }
done
if ((NETNS)); then
  [[ $(id -u) == 0 ]] && command -v ip >/dev/null || { echo "error: --netns needs root and the ip command" >&2; exit 2; }
fi

REPO="$(cd "$(dirname "$0")/.." && pwd)"
TOOLS="$REPO/scripts/deployment_tools.py"
WORK="${WORK:-$(mktemp -d "${TMPDIR:-/tmp}/fedtops-deploy.XXXXXX")}"
mkdir -p "$WORK"; WORK="$(cd "$WORK" && pwd)"
echo "local deployment: $NODES SuperNodes, TLS $( ((TLS)) && echo on || echo off), auth $( ((AUTH)) && echo on || echo off), netns $( ((NETNS)) && echo on || echo off); logs in $WORK" >&2

PGIDS=(); NAMESPACES=(); VETHS=(); RAY_TMP=""
cleanup() {
  local status=$?
  trap - EXIT INT TERM
  for pg in "${PGIDS[@]}"; do kill -TERM -- "-$pg" 2>/dev/null || true; done
  for _ in $(seq 50); do
    local alive=0
    for pg in "${PGIDS[@]}"; do kill -0 -- "-$pg" 2>/dev/null && alive=1; done
    ((alive)) || break
    sleep 0.1
  done
  for pg in "${PGIDS[@]}"; do kill -KILL -- "-$pg" 2>/dev/null || true; done
  # What the runtime started in sessions of its own (the SuperLink's flwr-serverapp, which may still
  # be writing its last lines) escapes the process groups; it names the work folder on its command line.
  local sig pid left cmd
  for sig in TERM KILL; do
    for _ in $(seq 50); do
      left=0
      for pid in $(pgrep -f -- "$WORK" 2>/dev/null || true); do
        cmd=$({ tr '\0' ' ' <"/proc/$pid/cmdline"; } 2>/dev/null) || continue  # gone since pgrep listed it
        [[ "$cmd" == *local-deployment.sh* ]] && continue  # this script and its subshells
        left=1; kill "-$sig" "$pid" 2>/dev/null || true
      done
      ((left)) || break
      sleep 0.1
    done
  done
  for ns in "${NAMESPACES[@]}"; do ip netns delete "$ns" 2>/dev/null || true; done
  for veth in "${VETHS[@]}"; do ip link delete "$veth" 2>/dev/null || true; done
  [[ -n "${RAY_TMP:-}" ]] && rm -rf "$RAY_TMP"
  exit "$status"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# start LOG CMD...: CMD in a new session (its own process group, led by its pid), output to LOG.
start() {
  local log="$1"; shift
  setsid "$@" >"$log" 2>&1 </dev/null &
  PGIDS+=("$!")
  LAST_PID=$!
}

# --- addresses -----------------------------------------------------------------------------
SL_PORT="$(python "$TOOLS" free-port)"
if ((NETNS)); then
  # SuperNode i lives in namespace fedtops-<pid>-i behind a veth pair 10.<a>.<i>.1 (host side,
  # where it reaches the SuperLink) <-> 10.<a>.<i>.2 (its own address).
  NET=$(( 100 + $$ % 100 ))
  SL_HOST="0.0.0.0"
  for ((i = 0; i < NODES; i++)); do
    ns="fedtops-$$-$i"; host_if="ftd$$h$i"; node_if="ftd$$n$i"
    ip netns add "$ns"; NAMESPACES+=("$ns")
    ip link add "$host_if" type veth peer name "$node_if"; VETHS+=("$host_if")
    ip link set "$node_if" netns "$ns"
    ip addr add "10.$NET.$i.1/30" dev "$host_if"; ip link set "$host_if" up
    ip netns exec "$ns" ip addr add "10.$NET.$i.2/30" dev "$node_if"
    ip netns exec "$ns" ip link set "$node_if" up
    ip netns exec "$ns" ip link set lo up
  done
else
  SL_HOST="127.0.0.1"
fi
superlink_address() { if ((NETNS)); then echo "10.$NET.$1.1:$SL_PORT"; else echo "127.0.0.1:$SL_PORT"; fi; }

# --- credentials ---------------------------------------------------------------------------
CREDS="$WORK/credentials"
if ((TLS || AUTH)); then
  SANS=()
  if ((NETNS)); then for ((i = 0; i < NODES; i++)); do SANS+=(--superlink-address "10.$NET.$i.1"); done; fi
  python "$REPO/scripts/credentials.py" "$CREDS" --supernodes "$NODES" $( ((TLS)) || echo --no-tls ) "${SANS[@]}" >/dev/null
fi

# --- SuperLink and the flwr CLI's connection -----------------------------------------------
mkdir -p "$WORK/superlink" "$WORK/cli"
SL_ARGS=(--host "$SL_HOST" --port "$SL_PORT" --disable-runtime-dependency-installation)
if ((TLS)); then
  SL_ARGS+=(--ssl-ca-certfile "$CREDS/ca.crt" --ssl-certfile "$CREDS/superlink.crt" --ssl-keyfile "$CREDS/superlink.key")
else
  SL_ARGS+=(--insecure)
fi
((AUTH)) && SL_ARGS+=(--enable-supernode-auth)
start "$WORK/superlink.log" env FLWR_HOME="$WORK/superlink" flower-superlink "${SL_ARGS[@]}"

{
  echo '[superlink]'
  echo 'default = "local-deployment"'
  echo
  echo '[superlink.local-deployment]'
  echo "address = \"127.0.0.1:$SL_PORT\""
  if ((TLS)); then echo "root-certificates = \"$CREDS/ca.crt\""; else echo 'insecure = true'; fi
} >"$WORK/cli/config.toml"
export FLWR_HOME="$WORK/cli"

python "$TOOLS" wait-port 127.0.0.1 "$SL_PORT" 60 || { echo "error: the SuperLink did not start; see $WORK/superlink.log" >&2; exit 1; }
if ((AUTH)); then
  for ((i = 0; i < NODES; i++)); do
    flwr supernode register "$CREDS/supernode-$i.pub" local-deployment >"$WORK/register-$i.log" 2>&1 \
      || { echo "error: registering SuperNode $i failed; see $WORK/register-$i.log" >&2; exit 1; }
  done
fi

# --- Preflight: the run's config, models, stop set, prompts and memory, before any SuperNode ---
PREFLIGHT_ARGS=(--num-clients "$NODES")
for ((k = 0; k < ${#FLWR_RUN_ARGS[@]}; k++)); do
  [[ "${FLWR_RUN_ARGS[$k]}" == "--run-config" || "${FLWR_RUN_ARGS[$k]}" == "-c" ]] && PREFLIGHT_ARGS+=(--run-config "${FLWR_RUN_ARGS[$((k + 1))]}")
done
python -m fedopd.preflight "${PREFLIGHT_ARGS[@]}" >"$WORK/preflight.txt" 2>&1 \
  || { cat "$WORK/preflight.txt" >&2; echo "error: preflight failed (table above); no SuperNode was started" >&2; exit 1; }

# --- Each SuperNode's own data: partition-<i>.jsonl (and .eval.jsonl) --------------------------
if [[ -z "$DATA" ]]; then
  DATA="$WORK/data"
  python -m fedopd.data export "${PREFLIGHT_ARGS[@]/--num-clients/--num-partitions}" --out "$DATA" >"$WORK/data.log" 2>&1 \
    || { cat "$WORK/data.log" >&2; echo "error: writing each node's data failed; no SuperNode was started" >&2; exit 1; }
fi
DATA="$(cd "$DATA" && pwd)"
for ((i = 0; i < NODES; i++)); do
  [[ -f "$DATA/partition-$i.jsonl" ]] || { echo "error: --data: no $DATA/partition-$i.jsonl for SuperNode $i" >&2; exit 2; }
done

# --- Ray (the resident workers' engine) and the SuperNodes ---------------------------------
# Ray's socket paths must stay short: its session folders go to a short temp folder, removed at exit.
RAY_TMP="$(mktemp -d /tmp/ftr.XXXXXX)"
RAY_PIDS=()
RAY_ARGS=(--head --block --include-dashboard=false --disable-usage-stats --num-cpus "$(nproc)")
node_prefix() { if ((NETNS)); then echo ip netns exec "fedtops-$$-$1"; fi; }
ray_address() { if ((NETNS)); then echo "10.$NET.$1.2:6379"; else echo "127.0.0.1:$RAY_PORT"; fi; }
# Token authentication (see the top): one token file per Ray instance, i.e. per simulated host.
ray_token() { if ((NETNS)); then echo "$WORK/ray-$1.token"; else echo "$WORK/ray.token"; fi; }
# ray_env I: RAY_ENV=(the env command giving Ray instance I's token; an outer RAY_AUTH_TOKEN would win).
ray_env() { RAY_ENV=(env -u RAY_AUTH_TOKEN RAY_AUTH_MODE=token "RAY_AUTH_TOKEN_PATH=$(ray_token "$1")"); }
if ((NETNS)); then
  for ((i = 0; i < NODES; i++)); do
    python "$TOOLS" ray-token "$(ray_token "$i")"; ray_env "$i"
    start "$WORK/ray-$i.log" $(node_prefix "$i") "${RAY_ENV[@]}" ray start "${RAY_ARGS[@]}" --node-ip-address "10.$NET.$i.2" \
      --port 6379 --temp-dir "$RAY_TMP/$i"
    RAY_PIDS[$i]=$LAST_PID
  done
else
  python "$TOOLS" ray-token "$(ray_token 0)"; ray_env 0
  RAY_PORT="$(python "$TOOLS" free-port)"
  start "$WORK/ray.log" "${RAY_ENV[@]}" ray start "${RAY_ARGS[@]}" --node-ip-address 127.0.0.1 --port "$RAY_PORT" \
    --ray-client-server-port "$(python "$TOOLS" free-port)" --dashboard-agent-listen-port "$(python "$TOOLS" free-port)" \
    --temp-dir "$RAY_TMP/0"
  RAY_PIDS[0]=$LAST_PID
fi
# A client's resident worker refuses at once when nothing answers at its ray-address (it would
# otherwise wait minutes in ray.init), so every Ray instance must be up before a SuperNode starts:
# `ray start` prints "Ray runtime started." once its node has registered (its GCS port answers
# earlier, and on a loaded host it then gave up on its raylet after 30 s and exited, stop 44).
ray_up() {  # ray_up LOG PID: wait for the started line; fail if ray start exits first
  local log="$1" pid="$2"
  for _ in $(seq 360); do
    grep -q "Ray runtime started" "$log" 2>/dev/null && return 0
    kill -0 "$pid" 2>/dev/null || return 1
    sleep 0.5
  done
  return 1
}
for ((i = 0; i < (NETNS ? NODES : 1); i++)); do
  log="$WORK/ray.log"; ((NETNS)) && log="$WORK/ray-$i.log"
  ray_up "$log" "${RAY_PIDS[$i]}" \
    || { tail -5 "$log" >&2; echo "error: Ray instance $i did not start within 180 s; see $log" >&2; exit 1; }
done

node_data() {  # SuperNode $1's own files, as node config keys
  echo -n "data-path=\"$DATA/partition-$1.jsonl\""
  [[ -f "$DATA/partition-$1.eval.jsonl" ]] && echo -n " eval-path=\"$DATA/partition-$1.eval.jsonl\""
  return 0
}
declare -A NODE_PGID
for ((i = 0; i < NODES; i++)); do
  mkdir -p "$WORK/supernode-$i"
  SN_ARGS=(--superlink "$(superlink_address "$i")" --port 9094
           --node-config "partition-id=$i num-partitions=$NODES worker=\"resident\" worker-name=\"node-$i\" ray-address=\"$(ray_address "$i")\" $(node_data "$i")")
  ((NETNS)) || SN_ARGS[3]="$(python "$TOOLS" free-port)"
  if ((TLS)); then SN_ARGS+=(--root-certificates "$CREDS/ca.crt"); else SN_ARGS+=(--insecure); fi
  ((AUTH)) && SN_ARGS+=(--auth-supernode-private-key "$CREDS/supernode-$i")
  ray_env "$((NETNS ? i : 0))"
  start "$WORK/supernode-$i.log" $(node_prefix "$i") "${RAY_ENV[@]}" FLWR_HOME="$WORK/supernode-$i" \
    FLWR_SUPEREXEC_TASK_POLL_INTERVAL=0.1 flower-supernode "${SN_ARGS[@]}"
  NODE_PGID[$i]=$LAST_PID
done
for k in "${KILLS[@]}"; do
  i="${k%%:*}"; type="${k#*:}"
  start "$WORK/kill-$i.log" python "$TOOLS" kill-on "$WORK/supernode-$i.log" "Receiving: $type message" "${NODE_PGID[$i]}"
done

python "$TOOLS" wait-nodes "$NODES" 120 -- flwr supernode ls local-deployment --format json \
  || { echo "error: not all $NODES SuperNodes came online; see $WORK/supernode-*.log" >&2; exit 1; }

# --- the run ---------------------------------------------------------------------------------
set +e
flwr run "$REPO" local-deployment --stream "${FLWR_RUN_ARGS[@]}" 2>&1 | tee "$WORK/run.log"
RUN_STATUS=${PIPESTATUS[0]}
set -e
RUN_DIR="$(sed -n 's/.*FedTOPS run finished: //p' "$WORK/run.log" | tail -n 1 | tr -d '\r')"
if [[ $RUN_STATUS != 0 || -z "$RUN_DIR" ]]; then
  echo "error: the run failed (flwr run exit status $RUN_STATUS); see $WORK/run.log and $WORK/superlink.log" >&2
  exit 1
fi
echo "run folder: $RUN_DIR"
