#!/usr/bin/env bash
# The first run of this engine on a GPU, prepared to fit one lent card (H100 / H200) in at most 10 minutes, no
# network: the CUDA tests, the masked training attention's three forms timed (benchmarks/training_attention_forms.py),
# benchmarks/gpu_check.py's parity and rollout speed at the 1.5B shape, and one GRPO step of
# configs/gpu12gb_qwen2.5-1.5b_lora.yaml (training tokens/s, step time, peak memory against `grpo plan`). Steps
# are joined by `;`: a failing one is recorded and the next runs. Whatever ran, one JSON lands in
# docs/measurements/ (and in $OUT, with the logs, where the device tool sets it).
#
#   bash benchmarks/gpu_first_run.sh             # on the GPU machine, from the repository root or anywhere
#   bash benchmarks/gpu_first_run.sh --dry-run   # on a CPU: prints every step, runs the CPU-runnable ones
#   options: --out DIR (default docs/measurements), PYTHON=... (default python3)
#
# Wheels: the device image lacks omegaconf, antlr4-python3-runtime, math-verify and torchao; they are installed
# (no index, no network) from the first of $GRPO_WHEELS, .whl/, shared/wheels/, shared/.whl/, /.whl/ holding
# wheels, into the run's own folder; without one the run says so and goes on (imports then name what is missing).
# Fetch them once where pip reaches a registry (benchmarks' own machine; one version of each):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .whl omegaconf \
#     antlr4-python3-runtime==4.9.3 math-verify latex2sympy2_extended torchao
# and keep .whl/ out of git (.git/info/exclude); the device tool carries it when a call names it.
set -u
cd "$(dirname "$0")/.."
DRY=0
OUTDIR=docs/measurements
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY=1 ;;
    --out) OUTDIR=$2; shift ;;
    *) echo "usage: bash benchmarks/gpu_first_run.sh [--dry-run] [--out DIR]" >&2; exit 2 ;;
  esac
  shift
done
PY=${PYTHON:-python3}
STAMP=$(date -u +%Y-%m-%dT%H%M%SZ)
RUN=${TMPDIR:-/tmp}/gpu_first_run_$STAMP
mkdir -p "$RUN" "$OUTDIR"
export GRPO_BENCH_CACHE=$RUN/cache PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
: > "$RUN/steps.tsv"
PRESET=configs/gpu12gb_qwen2.5-1.5b_lora.yaml
# every CUDA test: the files holding one, the tests a CUDA device runs (names or modules saying cuda / gpu, and the
# masked-GQA kernel check); -m "not slow": the CPU end-to-end runs stay with CI
CUDA_TEST_FILES="tests/model/test_decode_attention.py tests/model/test_grouped_sdpa.py tests/model/test_transformer.py
  tests/model/test_qlora_loading.py tests/model/test_lora.py tests/rollout/test_static_decode_cuda.py
  tests/rollout/test_generate_cuda.py tests/rollout/test_decode_front.py tests/rollout/test_transient_decode.py
  tests/plan/test_decode_state.py tests/train/test_shared_prompt_cuda.py tests/train/test_update_keeps_storage.py
  tests/train/test_memory.py tests/train/test_reference.py tests/train/test_optim.py tests/test_sizes_and_hints.py"
CUDA_TEST_FILTER="cuda or gpu or math_kernel"

# step NAME LIMIT_S WHERE COMMAND...: runs COMMAND under `timeout LIMIT_S` with its output in $RUN/NAME.log and one
# line in steps.tsv (name, exit status, seconds); WHERE=gpu steps are printed, not run, by --dry-run
step() {
  local name=$1 limit=$2 where=$3
  shift 3
  echo "== $name (at most ${limit} s): $*"
  if [ "$DRY" = 1 ] && [ "$where" = gpu ]; then
    printf '%s\t%s\t%s\t%s\n' "$name" "not run (--dry-run: needs a GPU)" 0 "$*" >> "$RUN/steps.tsv"
    return
  fi
  local t0 rc
  t0=$(date +%s)
  timeout "$limit" "$@" > "$RUN/$name.log" 2>&1
  rc=$?
  printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$(( $(date +%s) - t0 ))" "$*" >> "$RUN/steps.tsv"
  tail -n 4 "$RUN/$name.log"
}

# wheels: installed here (not in a step) because the later steps need the PYTHONPATH it sets
WHEELS=""
for d in ${GRPO_WHEELS:-} .whl shared/wheels shared/.whl /.whl; do
  if [ -d "$d" ] && ls "$d"/*.whl > /dev/null 2>&1; then WHEELS=$d; break; fi
done
if [ -z "$WHEELS" ]; then
  WHEEL_NOTE="no wheels found (looked in \$GRPO_WHEELS, .whl/, shared/wheels/, shared/.whl/, /.whl/): omegaconf, antlr4-python3-runtime, math-verify and torchao must already be importable"
elif [ "$DRY" = 1 ]; then
  WHEEL_NOTE="--dry-run: would install $(ls "$WHEELS"/*.whl | wc -l) wheels from $WHEELS"
elif "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$RUN/site" \
    "$WHEELS"/*.whl > "$RUN/wheels.log" 2>&1; then
  export PYTHONPATH=$RUN/site:$PYTHONPATH
  WHEEL_NOTE="installed $(ls "$WHEELS"/*.whl | wc -l) wheels from $WHEELS"
else
  WHEEL_NOTE="installing the wheels from $WHEELS failed: see wheels.log"
fi
echo "== wheels: $WHEEL_NOTE"
export WHEEL_NOTE

step imports 60 cpu "$PY" -c "import importlib.util as u; m = [n for n in ('torch', 'omegaconf', 'math_verify', 'torchao', 'transformers', 'safetensors') if u.find_spec(n) is None]; print('missing:', ', '.join(m) or 'none')"
step gpu 30 cpu "$PY" -c "import torch; print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA device')"
# shellcheck disable=SC2086
step cuda_tests 120 gpu "$PY" -m pytest -q -p no:cacheprovider -m "not slow" -k "$CUDA_TEST_FILTER" \
  --junitxml="$RUN/cuda_tests.xml" $CUDA_TEST_FILES
GPU_CHECK=(benchmarks/gpu_check.py --out "$RUN/gpu_check" --sections parity,speed --speed-shapes qwen2.5-1.5b
           --engines ours_training,ours_training_stops,ours_training_top_p)
PRESET_STEP=(benchmarks/gpu_check.py --out "$RUN/preset" --sections memory --presets "$PRESET" --memory-steps 1)
if [ "$DRY" = 1 ]; then
  step gpu_check_plan 60 cpu "$PY" "${GPU_CHECK[@]}" --dry-run
  step preset_step_plan 60 cpu "$PY" "${PRESET_STEP[@]}" --dry-run
fi
step attention_forms 40 gpu "$PY" benchmarks/training_attention_forms.py --out "$RUN/attention_forms.json"
step gpu_check 210 gpu "$PY" "${GPU_CHECK[@]}"
step preset_step 200 gpu "$PY" "${PRESET_STEP[@]}"

# the report: always written, whatever ran
REPORT="$OUTDIR/gpu_first_run_$STAMP.json"
RUN=$RUN REPORT=$REPORT DRY=$DRY PRESET=$PRESET "$PY" - <<'PYEOF'
import json, os, subprocess, time
import xml.etree.ElementTree as ET
from pathlib import Path

run, dry = Path(os.environ["RUN"]), os.environ["DRY"] == "1"


def read_json(path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def git(*args):
    out = subprocess.run(["git", *args], capture_output=True, text=True)
    return out.stdout.strip() if out.returncode == 0 else None


steps = []
for line in (run / "steps.tsv").read_text().splitlines():
    name, rc, seconds, command = line.split("\t", 3)
    log = run / f"{name}.log"
    steps.append({"name": name, "exit": int(rc) if rc.lstrip("-").isdigit() else rc, "seconds": int(seconds),
                  "command": command,
                  "output_tail": log.read_text(errors="replace").splitlines()[-4:] if log.exists() else []})
tests = None
if (run / "cuda_tests.xml").exists():
    suite = ET.parse(run / "cuda_tests.xml").getroot()
    suite = suite.find("testsuite") if suite.tag == "testsuites" else suite
    failed = [f"{c.get('classname')}::{c.get('name')}" for c in suite.iter("testcase")
              if c.find("failure") is not None or c.find("error") is not None]
    tests = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")} | {"failed": failed}
check = read_json(run / "gpu_check" / "gpu_check.json")
forms = read_json(run / "attention_forms.json")
preset = read_json(run / "preset" / "gpu_check.json")
step = None
for m in (preset or {}).get("memory", []) if isinstance((preset or {}).get("memory"), list) else []:
    if "error" in m:
        step = {"config": m.get("config"), "error": m["error"]}
        continue
    step = {"config": m["config"], "seconds_per_step": m["sec_per_step"], "generate_s": m["time_generate_s"],
            "logprobs_s": m["time_logprobs_s"], "update_s": m["time_update_s"], "train_tokens": m["train_tokens"],
            "train_tokens_per_s": m["train_tokens"] / max(m["time_update_s"], 1e-9),
            "peak_reserved_gib": m["max_reserved_gib"], "peak_allocated_gib": m["max_allocated_gib"],
            "planned_gib": m["plan_total_gib"], "planned_phase": m["plan_peak_phase"],
            "reserved_over_planned": m["max_reserved_gib"] / m["plan_total_gib"], "update_mfu": m.get("update_mfu"),
            "peaks_per_phase": m["peaks"], "planned_per_phase_gib": m["plan_phases_gib"]}
report = {"script": "benchmarks/gpu_first_run.sh", "dry_run": dry, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
          "commit": git("rev-parse", "HEAD"), "tree_changed": bool(git("status", "--porcelain", "--untracked-files=no")),
          "wheels": os.environ.get("WHEEL_NOTE"), "steps": steps, "cuda_tests": tests,
          "training_attention_forms": forms,
          "gpu_check": check, "preset": os.environ["PRESET"], "preset_step": step}
Path(os.environ["REPORT"]).write_text(json.dumps(report, indent=1) + "\n")
print(f"== report: {os.environ['REPORT']}")
for s in steps:
    print(f"   {s['name']:<18} exit {s['exit']}  {s['seconds']} s")
if tests:
    print(f"   CUDA tests: {tests['tests']} run, {tests['failures']} failed, {tests['errors']} errors, {tests['skipped']} skipped")
if step and "error" not in step:
    print(f"   {step['config']}: {step['seconds_per_step']:.1f} s/step, {step['train_tokens_per_s']:.0f} training tokens/s, "
          f"peak reserved {step['peak_reserved_gib']:.2f} GiB vs planned {step['planned_gib']:.2f} GiB")
PYEOF
if [ -n "${OUT:-}" ] && [ -d "${OUT:-}" ]; then  # the device tool's folder: the report and the logs come back
  cp "$REPORT" "$OUT/" 2>/dev/null
  tar -czf "$OUT/gpu_first_run_logs.tar.gz" -C "$RUN" --exclude=cache --exclude=site . 2>/dev/null
fi
exit 0
