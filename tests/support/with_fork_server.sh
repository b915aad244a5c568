#!/usr/bin/env bash
# Runs a test program whose tpipe commands (TPIPE_BINARY) run in forks of
# the tests' fork server (fork_server.sh), where ctest names one.
#   with_fork_server.sh PROGRAM ARGUMENTS...
set -uo pipefail
tpipe=${TPIPE_BINARY:?TPIPE_BINARY names the tpipe binary}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
source "$(dirname "$0")/fork_server.sh"
# TPIPE_PROCESS_BINARY: the binary itself, for commands the program signals
# or runs in the background; TPIPE_FORK_SERVER_PID: the server, whose forks
# share its command line (no fork may outlive a test).
TPIPE_BINARY=$tpipe TPIPE_PROCESS_BINARY=$tpipe_process TPIPE_FORK_SERVER_PID=${fork_server:-} "$@"
