# Sourced by a shell test once it has set `tpipe` (the binary) and `work`
# (its scratch directory). Where ctest names the tests' fork server
# (TPIPE_FORK_SERVER, TPIPE_FORK_CLIENT; tests/support/fork_server.cpp),
# starts it and points `tpipe` at its client, so that each short command runs
# in a fork of a process that paid LibTorch's start once. `tpipe_process`
# stays the binary: for commands the test runs in the background, signals,
# kills or measures (peak RSS), which must be tpipe's own process.
# The server is a job of the script: a bare `wait` would wait for it too,
# so waits name their pids.
tpipe_process=$tpipe
if [[ -n ${TPIPE_FORK_SERVER:-} && -n ${TPIPE_FORK_CLIENT:-} ]]; then
  export TPIPE_FORK_SOCKET=$work/fork.sock
  "$TPIPE_FORK_SERVER" --fork-server "$TPIPE_FORK_SOCKET" "$tpipe" </dev/null >/dev/null &
  fork_server=$!
  for _ in $(seq 600); do
    [[ -S $TPIPE_FORK_SOCKET ]] && break
    kill -0 "$fork_server" 2>/dev/null || break
    sleep 0.05
  done
  if [[ -S $TPIPE_FORK_SOCKET ]]; then
    tpipe=$TPIPE_FORK_CLIENT
  else
    echo "note: the fork server did not start; each command starts tpipe anew"
  fi
fi
