#!/bin/bash
# Keeps builds, tests and emulator runs at nice 19 so the paced simulation gets the cores.
while [ ! -f /work/simruns/stop-renice ]; do
  for p in $(pgrep -f 'cc1plus|cc1 |ninja|ctest|tandem-tests|tandem-gpu-tests|tandem-c-api|python3 .*test|cargo|rustc|go build|ld |collect2|cmake'); do renice -n 19 -p $p >/dev/null 2>&1; done
  sleep 3
done
