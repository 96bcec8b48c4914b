#!/usr/bin/env bash
# Start (or resume) issue 41's run in the background (see launch_12layer.sh, which it runs with ISSUE=41).
#
#   bash benchmarks/time_to_accuracy/launch_41.sh          # from the repository root
#   tail -f outputs/benchmarks/run_41.log                  # progress, one line per run
exec env ISSUE=41 bash "$(dirname "$0")/launch_12layer.sh" "$@"
