# Sourced by scripts/demo and the bench scripts: the local stack without Docker. Builds
# the binaries, checks that NATS and PostgreSQL are reachable, starts the five services on
# their default ports under one subject prefix with logs in .keel/logs/, and stops them.
#
#   stack_build release|debug   sets KEEL_BIN and LD_LIBRARY_PATH
#   stack_check_infra
#   stack_start PREFIX MODEL_DIR  sets KEEL_API_URL
#   stack_stop
# The functions use `say` when the caller defines it.

KEEL_STATE=${KEEL_STATE:-.keel}
stack_pids=()

stack_say() { if declare -F say >/dev/null; then say "$@"; else printf '\n== %s\n' "$*"; fi; }

stack_build() {
  scripts/setup
  local torch_lib
  torch_lib=$(.venv/bin/python -c 'import os, torch; print(os.path.join(os.path.dirname(torch.__file__), "lib"))')
  export LD_LIBRARY_PATH="$torch_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  stack_say "build ($1)"
  if [ "$1" = release ]; then
    cargo build --release --bins
    KEEL_BIN=$PWD/target/release
  else
    cargo build --bins
    KEEL_BIN=$PWD/target/debug
  fi
  export KEEL_BIN
}

stack_reachable() { (exec 3<>"/dev/tcp/$1/$2") 2>/dev/null; }

stack_check_infra() {
  export KEEL_NATS_URL=${KEEL_NATS_URL:-nats://127.0.0.1:4222}
  export KEEL_DATABASE_URL=${KEEL_DATABASE_URL:-postgres://postgres@127.0.0.1:5432/keel}
  local nats=${KEEL_NATS_URL#nats://}
  if ! stack_reachable "${nats%:*}" "${nats##*:}"; then
    echo "NATS is not reachable at $KEEL_NATS_URL (start nats-server -js)" >&2
    return 1
  fi
  if ! stack_reachable 127.0.0.1 5432; then
    echo "PostgreSQL is not reachable at 127.0.0.1:5432" >&2
    return 1
  fi
}

# stack_service NAME PORT [VAR=VALUE ...]: starts keel-NAME and waits for /healthz.
stack_service() {
  local name=$1 port=$2 logs=$KEEL_STATE/logs
  shift 2
  mkdir -p "$logs"
  env "$@" "KEEL_${name^^}__LISTEN=127.0.0.1:$port" "$KEEL_BIN/keel-$name" >"$logs/$name.log" 2>&1 &
  stack_pids+=($!)
  for _ in $(seq 1 300); do
    if curl -fsS "http://127.0.0.1:$port/healthz" >/dev/null 2>&1; then
      echo "keel-$name on http://127.0.0.1:$port (log: $logs/$name.log)"
      return 0
    fi
    sleep 0.2
  done
  echo "keel-$name did not start; its log:" >&2
  tail -20 "$logs/$name.log" >&2
  return 1
}

stack_start() {
  local prefix=$1 model=$2
  stack_say "starting the services (subject prefix $prefix)"
  stack_service checkpoint 8083 KEEL_CHECKPOINT__SUBJECT_PREFIX="$prefix" KEEL_CHECKPOINT__STORAGE__KIND=local \
    KEEL_CHECKPOINT__STORAGE__ROOT="$KEEL_STATE/checkpoints"
  stack_service trainer 8084 KEEL_TRAINER__SUBJECT_PREFIX="$prefix"
  stack_service generator 8081 KEEL_GENERATOR__SUBJECT_PREFIX="$prefix" KEEL_GENERATOR__MODEL="$model" \
    KEEL_GENERATOR__MAX_NUM_SEQS=128
  stack_service reward 8082 KEEL_REWARD__SUBJECT_PREFIX="$prefix"
  stack_service orchestrator 8080 KEEL_ORCHESTRATOR__SUBJECT_PREFIX="$prefix" \
    KEEL_ORCHESTRATOR__CHECKPOINT_URL=http://127.0.0.1:8083 KEEL_ORCHESTRATOR__WORK_DIR="$KEEL_STATE/orchestrator"
  export KEEL_API_URL=http://127.0.0.1:8080
}

stack_stop() {
  if [ ${#stack_pids[@]} -gt 0 ]; then
    stack_say "stopping the services"
    kill -TERM "${stack_pids[@]}" 2>/dev/null || true
    wait "${stack_pids[@]}" 2>/dev/null || true
    stack_pids=()
  fi
}
