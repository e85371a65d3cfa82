# Sourced by bench/transfer.sh and bench/registry.sh: start and stop one registry at a
# time on 127.0.0.1, on a free port. The caller sets SNAPCTL (the binary), SERVER_LOGS (a
# directory for the servers' logs and docker-registry's config) and PIDS (an array its
# EXIT trap kills).
#
#   start_server snapctl|distribution STORAGE_DIR   sets PORT and SERVER_PID, waits for /v2/
#   stop_server
# WAIT_PORT_TRIES (default 600, 50 ms apart) bounds the wait for a server to answer.

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
wait_port() { for _ in $(seq "${WAIT_PORT_TRIES:-600}"); do curl -s -o /dev/null "http://127.0.0.1:$1/v2/" && return 0; sleep 0.05; done; echo "server on :$1 did not start" >&2; return 1; }

SERVER_PID="" PORT=""
start_server() { # kind storage-dir
  local kind=$1 dir=$2
  PORT=$(free_port)
  mkdir -p "$dir"
  if [ "$kind" = snapctl ]; then
    SNAPCTL_LOG=warn "$SNAPCTL" serve --storage "$dir" --listen "127.0.0.1:$PORT" >>"$SERVER_LOGS/snapctl.log" 2>&1 &
  else
    cat > "$SERVER_LOGS/distribution.yml" <<EOF
version: 0.1
log:
  level: error
storage:
  filesystem:
    rootdirectory: $dir
  delete:
    enabled: true
http:
  addr: 127.0.0.1:$PORT
EOF
    docker-registry serve "$SERVER_LOGS/distribution.yml" >>"$SERVER_LOGS/distribution.log" 2>&1 &
  fi
  SERVER_PID=$!
  PIDS+=("$SERVER_PID")
  wait_port "$PORT"
}
stop_server() { kill "$SERVER_PID" 2>/dev/null || true; wait "$SERVER_PID" 2>/dev/null || true; }
