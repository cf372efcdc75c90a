"""`grpo eval` and `grpo generate`: load a model (HF dir or `grpo train` checkpoint), build a task, run.

Bad input (missing model / tokenizer / data file, unknown task option) is reported as one line naming the
file and the fix, exit code 2, before anything slow happens; errors during the run itself are bugs and keep
their traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from ..config.trust import add_allow_code_arg
from ..progress import Progress
from ..tasks import TASKS, build_task

DEFAULT_KS = (1, 4, 8)
INPUT_ERRORS = (ValueError, FileNotFoundError)  # CheckpointError, DataError and ConfigError are ValueErrors
NO_DATA_PATH = "(none: grpo generate reads no data file)"  # custom task placeholder; generate never loads rows


# ------------------------------------------------------------------------------------------------- parsers
def add_eval_parser(sub) -> None:
    p = sub.add_parser("eval", help="pass@1 / pass@k / maj@k, format rate, length, truncation on a task split")
    _model_args(p)
    p.add_argument("--task", default=None, choices=sorted(TASKS),
                   help="task to evaluate on (default: the run's own task and options, for a run or checkpoint)")
    p.add_argument("--data", default=None, help="local data file / directory (gsm8k, math, countdown, custom)")
    p.add_argument("--split", default="test", help="split to evaluate (default: test)")
    p.add_argument("--n", type=int, default=8, help="samples per problem (default 8)")
    p.add_argument("--k", default=None,
                   help="comma-separated k for pass@k and maj@k, each <= n (default: those of 1,4,8 that are <= n)")
    p.add_argument("--temperature", type=float, default=0.6, help="0 = greedy: forces n=1 and k=1")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--max-new", type=int, default=512, help="max new tokens per completion")
    p.add_argument("--max-examples", type=int, default=None, help="evaluate only the first N problems")
    p.add_argument("--batch-prompts", type=int, default=16, help="prompts per generate call (memory)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write the JSON report (with per-sample records) here")
    p.add_argument("--overwrite", action="store_true", help="replace the file --out names when it exists")
    p.add_argument("--json", action="store_true", help="print the JSON report on stdout (table goes to stderr)")
    _tools_arg(p)
    p.set_defaults(func=run_eval)


def add_generate_parser(sub) -> None:
    p = sub.add_parser("generate", help="sample completions of one question with a task's prompt template")
    _model_args(p)
    p.add_argument("question", help="the question text (the task's user message)")
    p.add_argument("--task", default=None, choices=sorted(TASKS),
                   help="prompt template and reward (default: the run's own task for a run or checkpoint, else "
                        "arithmetic)")
    p.add_argument("--answer", default=None, help="reference answer: also print correctness and reward")
    p.add_argument("--n", type=int, default=1, help="completions to sample")
    p.add_argument("--temperature", type=float, default=0.7, help="0 = greedy")
    p.add_argument("--max-new", type=int, default=256, help="max new tokens per completion")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--show-prompt", action="store_true", help="print the rendered prompt first")
    _tools_arg(p)
    p.set_defaults(func=run_generate)


def _tools_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tools", default=None, metavar="NAMES|none",
                   help="multi-turn with these built-in tools, comma-separated (e.g. calculator); none = single "
                        "turn (default: the run's own tools section, for a run or checkpoint)")


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="HF model directory, .gguf file, `grpo train` checkpoint (step-XXXXXX) or run dir")
    p.add_argument("--tokenizer", default=None, help="take the tokenizer from this directory (default: model's)")
    p.add_argument("--task-option", action="append", default=[], metavar="KEY=VALUE",
                   help="task option, e.g. format=partial or digits=3 (repeatable)")
    p.add_argument("--device", default=None, help="cpu | cuda | cuda:N (default: cuda if available)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="weights dtype (default: bfloat16 on GPU, float32 on CPU)")
    add_allow_code_arg(p, "the run's or checkpoint's stored config.yaml")


def fail(command: str, error: Exception) -> int:
    print(f"grpo {command}: error: {error}", file=sys.stderr)
    return 2


# ---------------------------------------------------------------------------------------------------- eval
def run_eval(args) -> int:
    from ..checkpoint.disk import user_can_fix
    from ..checkpoint.run_dir import replace_text
    from ..checkpoint.store import model_source
    from .evaluate import EvalConfig, evaluate, report_json, report_markdown

    try:
        ks = parse_ks(args.k) if args.k is not None else tuple(sorted({min(k, args.n) for k in DEFAULT_KS}))
        cfg = EvalConfig(n=args.n, ks=ks, temperature=args.temperature, top_p=args.top_p,
                         max_new_tokens=args.max_new, max_examples=args.max_examples, seed=args.seed,
                         prompts_per_batch=args.batch_prompts)
        name, task = task_for(args)
        tools = tools_for(args)
        examples = examples_for(task, name, args)
        check_out(args.out, args.overwrite)
        model_dir = model_source(args.model)
        model, tok = load_model_and_tokenizer(model_dir, args.tokenizer, args.device, args.dtype)
    except INPUT_ERRORS as e:
        return fail("eval", e)
    with_tools = f" with tools {', '.join(tools.names)}" if tools else ""
    problems = min(len(examples), cfg.max_examples or len(examples))
    print(f"evaluating {model_dir} on {name}/{args.split}{with_tools}: {problems} problems", file=sys.stderr)
    with Progress("evaluation", problems, stream=sys.stderr) as bar:
        report = evaluate(model, tok, task, examples, cfg, progress=lambda done, _: bar.update(done, "problems"),
                          tools=tools)
    document = {"model": str(model_dir), "split": args.split, **report_json(report)}
    if args.json:
        print(json.dumps(document))
        print(report_markdown(report), file=sys.stderr, end="")
    else:
        print(report_markdown(report), end="")
    if args.out:
        try:
            replace_text(Path(args.out), json.dumps(document, indent=1) + "\n")  # whole or not at all
        except OSError as e:
            print(f"grpo eval: error: --out {args.out}: {e.strerror or e}; nothing written there, the results are "
                  f"printed above", file=sys.stderr)
            return 2 if user_can_fix(e) else 1
        print(f"report written to {args.out}", file=sys.stderr)
    return 0


def examples_for(task, name: str, args) -> list:
    """The split's examples, refused when empty before the model loads; evaluate() would find it only after the
    model had loaded, naming neither the split nor its data."""
    examples = task.examples(args.split)
    if not examples:
        where = f"{name} --data {args.data}" if args.data else name
        raise ValueError(f"split {args.split!r} of {where} has no examples; check the data and the task's "
                         f"options, or pick another --split")
    return examples


def check_out(out: str | None, overwrite: bool = False) -> None:
    """Make --out's folder and refuse a path the report cannot be written to, before sampling: found only at
    the end, it would lose the whole evaluation to a traceback. An existing file is replaced only with --overwrite
    (--out may name a run's metrics.jsonl, a data file, a checkpoint's config.yaml)."""
    if not out:
        return
    path = Path(out)
    if path.is_dir():
        raise ValueError(f"--out {out} is a directory; name a file, e.g. --out {path / 'report.json'}")
    if (path.exists() or path.is_symlink()) and not overwrite:
        raise ValueError(f"--out {out} exists; name another file, or pass --overwrite to replace it")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"--out {out}: cannot create its folder ({e.strerror or e})") from None
    if not os.access(path.parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise ValueError(f"--out {out}: not writable")


def task_for(args):
    """(name, task): the run's own task, data and options when the model is a run or checkpoint and no --task
    is given (--task-option / --data still override them); else --task with the given options."""
    options, data = parse_task_options(args.task_option), getattr(args, "data", None)
    run_cfg = stored_run_config(args.model)
    stored = run_cfg.task if run_cfg is not None else None
    if args.task is None and stored is not None:
        if hasattr(args, "data"):  # eval reads the run's data: where the run read it, and only as it was
            return stored.name, build_task(stored.name, *run_data(args.model, run_cfg, options, data))
        return stored.name, build_task(stored.name, {**stored.options, **options}, stored.data_path)
    name = args.task or "arithmetic"
    if name == "custom" and data is None and "data_path" not in options:
        if hasattr(args, "data"):  # eval reads rows: the placeholder below read as the file it could not find
            raise ValueError("--task custom needs --data FILE: a .jsonl / .parquet file with 'prompt' and "
                             "'answer' fields")
        options["data_path"] = NO_DATA_PATH  # generate reads no rows: any path will do
    task = build_task(name, options, data)  # a task that generates its problems refuses --data first
    if data is not None and not Path(data).exists():
        raise FileNotFoundError(f"--data {data}: no such file or directory; pass a local .jsonl / .parquet file "
                                f"or a directory holding e.g. test.jsonl")
    return name, task


def run_data(model: str, run_cfg, given: dict, data: str | None) -> tuple[dict, str | None]:
    """(task options, data path) to evaluate a run's own task with: --data and --task-option as given; every data path
    of the run's config.yaml they leave where the run recorded it (checkpoint/data_record.py eval_data_paths: its
    absolute path, used only when the files there have their recorded fingerprints; else one line naming --data)."""
    from ..checkpoint.data_record import data_budget, eval_data_paths, named_paths
    from ..checkpoint.store import model_source

    chosen = {f"task.options.{k}" for k in given}
    if data is not None:
        chosen |= {"task.data_path", "task.options.data_path"}
    keys = set(named_paths(run_cfg)) - chosen
    budget = data_budget(given)  # yours; the stored config's is data
    paths = eval_data_paths(model_source(model).parent, run_cfg, keys, budget)
    options = {k: v for k, v in run_cfg.task.options.items() if not (data is not None and k == "data_path")}
    options.update({key.removeprefix("task.options."): v for key, v in paths.items() if key != "task.data_path"})
    return {**options, **given}, data if data is not None else paths.get("task.data_path", run_cfg.task.data_path)


def tools_for(args):
    """The ToolsSection to sample with, or None for single-turn: --tools when given (none = off), else the
    run's own tools section when the model is a run or checkpoint that trained with tools."""
    import dataclasses

    from ..config.tools import ToolsSection

    run_cfg = stored_run_config(args.model)
    stored = run_cfg.tools if run_cfg is not None else None
    if args.tools is None:
        return stored if stored is not None and stored.enabled else None
    names = [n.strip() for n in args.tools.split(",") if n.strip()]
    if names in ([], ["none"]):
        return None
    return dataclasses.replace(stored or ToolsSection(), enabled=True, names=names)  # re-validated


def stored_run_config(model: str):
    """The Config a run stored next to `model` (a run dir or checkpoint), or None for a plain model."""
    from ..checkpoint.store import model_source, stored_config_text, stored_settings_file
    from ..config import config_from_yaml_text

    text = stored_config_text(model) if Path(model).exists() else None
    if not text:
        return None
    return config_from_yaml_text(text, str(stored_settings_file(model_source(model).parent)))  # errors name it


def parse_ks(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(k) for k in text.split(",") if k.strip())
    except ValueError:
        raise ValueError(f"--k {text!r} must be comma-separated integers, e.g. --k 1,4,8") from None


# ------------------------------------------------------------------------------------------------ generate
def run_generate(args) -> int:
    import torch

    from ..checkpoint.store import model_source
    from ..rollout import SamplingParams, generate
    from ..tasks import Example, render_prompt, safe_reward

    try:
        check_text("the question", args.question)
        check_text("--answer", args.answer)
        _, task = task_for(args)
        tools = tools_for(args)
        model, tok = load_model_and_tokenizer(model_source(args.model), args.tokenizer, args.device, args.dtype)
        params = SamplingParams(n=args.n, temperature=args.temperature, max_new_tokens=args.max_new,
                                stop_token_ids=tok.eos_token_ids)
    except INPUT_ERRORS as e:
        return fail("generate", e)
    parse = getattr(task, "parse_question", None)  # a generated task's own example (e.g. its named operands)
    example = (parse(args.question, args.answer or "") if parse else None) or \
        Example("cli", args.question, args.answer or "")
    if tools is not None:  # (its first prompt declares the tools: shown from the rollout itself)
        return _generate_with_tools(model, tok, task, example, params, args, tools)
    prompt = render_prompt(task, tok, example)
    if args.show_prompt:
        print(f"--- prompt ---\n{prompt}")
    model.eval()
    with torch.no_grad():
        out = generate(model, [tok.encode(prompt)], params, seed=args.seed, tokenizer=tok)
    for i, (ids, reason) in enumerate(zip(out.completion_ids, out.finish_reason)):
        text = tok.decode(ids, skip_special_tokens=True)
        print(f"--- sample {i + 1}/{len(out)} ({len(ids)} tokens, {reason}) ---\n{printable(text)}")
        print(reward_line(safe_reward(task, example, text), args.answer is not None))
    return 0


def check_text(what: str, text: str | None) -> None:
    """Refuse text no tokenizer takes: a lone surrogate, which is how Python hands over command-line bytes that are
    not UTF-8 (a TypeError from the tokenizer otherwise)."""
    try:
        (text or "").encode("utf-8")
    except UnicodeEncodeError as e:
        bad = e.object[e.start:e.start + 1].encode("unicode_escape").decode()
        raise ValueError(f"{what} holds a lone surrogate ({bad}) at character {e.start}, which is not text (bytes "
                         f"that are not UTF-8?); pass UTF-8 text") from None


def _generate_with_tools(model, tok, task, example, params, args, tools) -> int:
    """n trajectories with tools; each printed whole (turn markers and tool results included)."""
    import torch

    from ..collect.tool_groups import generate_tool_groups

    with torch.no_grad():
        (group,), _ = generate_tool_groups(model, tok, task, [example], params, args.seed, None, tools=tools)
    if args.show_prompt:
        print(f"--- prompt ---\n{group.prompt_text}")
    for i, (text, metrics, result, reason) in enumerate(zip(group.texts, group.trajectory_metrics, group.rewards,
                                                            group.finish_reasons)):
        print(f"--- trajectory {i + 1}/{len(group.texts)} ({metrics.model_tokens} model + {metrics.env_tokens} tool "
              f"tokens, {metrics.turns} turns, {metrics.tool_calls} tool calls, {metrics.tool_errors} errors, "
              f"{reason}) ---\n{printable(text)}")
        print(reward_line(result, args.answer is not None))
    return 0


def printable(text: str) -> str:
    """Model output shown on a terminal: control characters (e.g. ESC sequences) escaped, newlines and tabs kept."""
    return "".join(c if c.isprintable() or c in "\n\t" else repr(c)[1:-1] for c in text)


def reward_line(result, has_reference: bool) -> str:
    """One line on how the task read the completion; correctness only means something with --answer."""
    if "error" in result.info:
        return f"[reward unavailable for a bare question with this task: {result.info.get('message', '')}]"
    parts = [f"answer: {result.answer if result.answer is not None else '(none found)'}"]
    if "format" in result.components:
        parts.append(f"format: {result.components['format']:g}")
    if has_reference:
        parts += [f"correct: {'yes' if result.components.get('answer', 0.0) >= 1.0 else 'no'}",
                  f"reward: {result.total:.3f}"]
    else:
        parts.append("(pass --answer REF to score correctness)")
    return "[" + " | ".join(parts) + "]"


# ---------------------------------------------------------------------------------------- shared loading
def parse_task_options(pairs: list[str]) -> dict:
    """["digits=3", "operations=[+, *]"] -> {"digits": 3, "operations": ("+", "*")}; values parsed as YAML."""
    import yaml

    options = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--task-option {pair!r} must look like KEY=VALUE, e.g. --task-option format=partial")
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError:
            value = raw  # not YAML: keep the text as a string
        options[key.strip()] = tuple(value) if isinstance(value, list) else value
    return options


def load_model_and_tokenizer(model_dir: Path, tokenizer_dir: str | None, device: str | None, dtype: str | None):
    """Tokenizer first (cheap, and the commonest mistake), then the weights."""
    import torch

    from ..kernels import apply_kernels
    from ..model.finite import refuse_nonfinite
    from ..model.hf_io import CheckpointError
    from ..model.loading import load_model, load_tokenizer

    source = Path(tokenizer_dir) if tokenizer_dir else model_dir
    try:
        tok = load_tokenizer(source)
    except CheckpointError as e:
        hint = "" if tokenizer_dir else "; or pass --tokenizer BASE_MODEL_DIR to use the base model's tokenizer"
        raise CheckpointError(f"{e}{hint}") from None
    device = check_device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = dtype or ("bfloat16" if device.startswith("cuda") else "float32")
    model = load_model(model_dir, dtype=getattr(torch, dtype), device=device).requires_grad_(False)
    refuse_nonfinite(model, model_dir)  # one line, as --resume refuses them (not a sampler traceback)
    return apply_kernels(model), tok  # frozen: inference only, and decode keeps one copy of the weights


def check_device(device: str) -> str:
    """`device` if this machine has it. Left to torch, `--device cuda` without a GPU would be a traceback from the
    weight loader and `--device tpu` would be reported as a truncated safetensors file to re-download."""
    import torch

    try:
        dev = torch.device(device)
    except RuntimeError:
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):
        raise ValueError(f"--device {device!r} is not a device name; use cpu, cuda or cuda:N")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {device} but no CUDA device is visible; use --device cpu")
    if dev.type == "cuda" and (dev.index or 0) >= torch.cuda.device_count():
        raise ValueError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return "cpu" if dev.type == "cpu" else device  # the weight loader takes cpu, not cpu:0
