"""What importing grpo_engine sets for its process: MKL's memory manager off unless the user chose otherwise."""

import os
import subprocess
import sys

import pytest


@pytest.mark.parametrize("user_value, expected", [(None, "1"), ("0", "0")])
def test_mkl_fast_memory_manager_is_off_unless_the_user_set_it(user_value, expected):
    env = {k: v for k, v in os.environ.items() if k != "MKL_DISABLE_FAST_MM"}
    if user_value is not None:
        env["MKL_DISABLE_FAST_MM"] = user_value
    code = ("import grpo_engine, os, sys; "
            "sys.stdout.write(os.environ['MKL_DISABLE_FAST_MM'] + ' ' + str('torch' in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out == f"{expected} False"  # set before torch is loaded: MKL reads it when torch loads it
