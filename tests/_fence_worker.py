"""Writer A of the fencing tests (tests/test_fencing.py): a manager on a bucket root that is
paused (SIGSTOP, by itself at a chosen storage operation or by the test between saves) or starved
of the GIL while another writer takes the root over.  Reports on stdout, one line per event."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import sys
import time

import ckptcore
from ckptcore import _storage

from _support import tiny_state  # the state test_fencing.py saves too (n=1000)

root, options, mode = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]


def say(*words: object) -> None:
    print(*words, flush=True)


mgr = ckptcore.CheckpointManager(root, storage_options=options, keep=1, lease=ckptcore.Lease(seconds=3.0,
                                 heartbeat=1.0), save_on_preemption=False,
                                 async_save=mode.endswith("async"))
for s in (10, 20):
    mgr.save(s, tiny_state(s)).result()
say("SAVED", 20)

if mode.startswith("pause-in-save"):
    def hook(op: str, path: str) -> None:  # stops right before the manifest of step 30 is PUT
        if op == "publish" and "step-000000000030" in path:
            say("PAUSING")
            os.kill(os.getpid(), signal.SIGSTOP)
    _storage._op_hook = hook
elif mode == "pause-between":
    say("READY")  # the test stops this process now, and lets it go once the other writer is done
    while not os.path.exists(sys.argv[4]):
        time.sleep(0.05)
elif mode == "gil":
    # A C call that never releases the GIL, long enough for the lease (3 s) to lapse: the
    # heartbeat thread cannot run meanwhile.  The other writer takes the root over then.
    t0 = time.monotonic()
    re.match(r"(a|aa)*c", "a" * 30)  # backtracking grows by the golden ratio per character
    n = 30 + max(0, round(math.log(float(sys.argv[4]) / (time.monotonic() - t0), 1.618)))
    say("STARVING")
    started = time.monotonic()
    re.match(r"(a|aa)*c", "a" * n)
    say("STARVED", round(time.monotonic() - started, 1))
    while not os.path.exists(sys.argv[5]):
        time.sleep(0.05)

for s in (30, 40):
    try:
        mgr.save(s, tiny_state(s)).result()
        mgr.wait()
        say("RESULT", s, "saved")
    except Exception as e:  # noqa: BLE001 - reported to the test
        say("RESULT", s, type(e).__name__, str(e).replace("\n", " ")[:300])
try:
    mgr.close()
    say("CLOSED")
except Exception as e:  # noqa: BLE001
    say("CLOSE", type(e).__name__)
