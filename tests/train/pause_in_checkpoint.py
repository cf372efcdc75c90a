"""`python pause_in_checkpoint.py STEP train CONFIG ...`: `grpo train`, paused inside the write of checkpoint
step-STEP (after its weights, before its trainer state), with a marker file `paused-STEP` next to it, so a
test can kill -9 the process mid-checkpoint. The pause is patched into the real save from outside: the
library has no test hook."""

import sys
import time
from pathlib import Path

import grpo_engine.checkpoint.store as checkpoint
from grpo_engine.cli import main

STEP = int(sys.argv[1])
real_save_weights = checkpoint.save_weights


def save_weights_then_pause(model, out, **kw):
    real_save_weights(model, out, **kw)
    if Path(out).name == f"{checkpoint.TMP_PREFIX}{checkpoint.step_dir_name(STEP)}":
        (Path(out).parent / f"paused-{STEP}").touch()
        time.sleep(3600)


checkpoint.save_weights = save_weights_then_pause
sys.exit(main(sys.argv[2:]))
