"""`grpo_engine.GRPO`: the trainer object of the Python API (docs/python.md). It builds the config `grpo train`
would read from its arguments (api/inputs.py) and calls the command line's own code: train/loop.py `train`,
train/setup.py `check_config`, eval/evaluate.py `evaluate`, gguf_export.py `export_gguf`, plot.py `plot_run`. Its
run directory is a `grpo train` run directory: either one resumes the other."""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from ..checkpoint.run_dir import RunLock, holds_run, list_checkpoints, plan_run_dir
from ..config import Config, ConfigError, load_config
from ..tasks.custom import providing_rewards
from .inputs import Rewards, RowsFile, is_rows, override_items, reward_settings, rows_file, rows_path, yaml_value

MODEL_DIR = "model"  # RUN_DIR/model/: a model object given to GRPO, saved for the run to load


class GRPO:
    """GRPO training from Python: the same run as `grpo train`, with Python values for its inputs.

        trainer = GRPO("SmolLM2-135M-Instruct.gguf", reward=my_reward, train_data=rows, schedule__steps=50)
        trainer.check(); trainer.train(); trainer.evaluate(); trainer.generate("2+2?")

    Arguments:
      model       a path (an HF model directory or a .gguf file), or a model object from grpo_engine.load_model
                  (its weights as they are now are saved to RUN_DIR/model/ and trained).
      reward      None (the config's task), a built-in verifier name ('exact', 'numeric', 'choice', 'word',
                  'math'), "module:function", a function fn(example, completion) -> float | RewardResult, or a
                  list of functions / "module:function" names, each alone (weight 1) or as a (function, weight)
                  pair (the total is the weighted sum). `example` carries every column of its row:
                  example["difficulty"]. Every reward runs through the CLI's guarded scorer: an exception or a
                  run past the time limit scores 0 and is counted (metrics: reward_errors, reward_timeouts).
      train_data  a path (any data file the custom task reads), a list of dicts or a datasets.Dataset, each row
                  with 'prompt' and 'answer' (other columns are kept for the reward). Rows are checked as a
                  file's lines are (errors name the row's index: train_data[3]) and written to
                  RUN_DIR/data/train_data.jsonl, which data.json fingerprints like any data file (other rows
                  on resume: train(allow_data_change=True), as --allow-data-change).
      test_data   the same, for the held-out split (without it: a seeded share of train_data, as in the CLI).
      config      a YAML path or a dict of the same sections; None = the defaults.
      **overrides the command line's dotted keys with `__` for the dots (rollout__group_size=16), or dotted keys
                  in a dict (**{"rollout.group_size": 16}), or a section as a dict (rollout={"group_size": 16});
                  validated as the CLI's are.

    Methods:
      check()                  the signal check (`grpo check`): prints its report, returns it.
      train(steps=None)        train (`grpo train`), `steps` more steps (a checkpoint after the last), or to
                               schedule.steps; resumes the run in run_dir when it has checkpoints (made here or by
                               `grpo train`). overwrite=True starts over (the old run renamed, not deleted).
      evaluate(data=None)      the current model (the newest checkpoint, else the starting model) on the
                               held-out split, or on `data` (path / rows), greedy: an EvalReport (.summary).
      generate(prompts, ...)   replies of the current model to a prompt or a list of them, rendered as training
                               renders them (chat template, system prompt, instruction, prefill).
      save(path)               the current model as an HF directory (with its tokenizer).
      export_gguf(path, type="f16")  the current model as a .gguf file (`grpo export`: f16, q8_0, bf16, f32).
      plot(show=True)          RUN_DIR/curves.png (`grpo plot`), shown inline in Jupyter.
      history                  metrics.jsonl: a list of dicts, a pandas DataFrame when pandas is installed.

    Stored runs stay data: each function's "module:qualname" is stored in the config (task.options.reward_fn /
    reward_fns), so `grpo train RUN_DIR --resume --allow-code module:function` resumes the run from the CLI. A
    function that cannot be imported by name (a lambda, one defined in a notebook cell: `__main__`) makes the run
    resumable from Python only, by a GRPO object given the same function; the CLI refuses it in one line.
    """

    def __init__(self, model, reward=None, train_data=None, test_data=None, config: str | Path | Mapping | None = None,
                 **overrides):
        self._user = override_items(overrides)
        base = load_config(config, self._user)  # the user's own settings, validated before anything else
        self.run_dir = Path(base.run_dir)
        self._rewards: Rewards = reward_settings(reward)
        self._model_object = None if isinstance(model, (str, Path)) else _model_object(model)
        self._model_written = False
        rows = {what: data for what, data in (("train_data", train_data), ("test_data", test_data)) if is_rows(data)}
        derived = [*(["task.name=custom"] if rows else []), *self._data_items(train_data, test_data),
                   *self._rewards.overrides, f"model.path={yaml_value(self._model_path(model))}"]
        self.config: Config = load_config(config, [*_reset_items(base, train_data, self._rewards), *self._user,
                                                   *derived])
        limits = _task_options(self.config).limits  # the budgets the task reads its files under
        self._files: dict[str, RowsFile] = {what: rows_file(data, what, self.run_dir, limits)
                                            for what, data in rows.items()}

    # ------------------------------------------------------------------------------------------ the inputs
    def _model_path(self, model) -> str:
        if self._model_object is None:  # absolute: the run is resumed from anywhere, the CLI included
            return str(_absolute(model))
        return str(self.run_dir.resolve() / MODEL_DIR)

    def _data_items(self, train_data, test_data) -> list[str]:
        items = []
        for what, data, key in (("train_data", train_data, "data_path"), ("test_data", test_data, "test_path")):
            if data is not None:
                path = rows_path(self.run_dir, what) if is_rows(data) else _absolute(data)
                items.append(f"task.options.{key}={yaml_value(str(path))}")
        return items + (["task.data_path=null"] if train_data is not None else [])

    def _materialize(self, replace_data: bool = False) -> None:
        """Write what the run reads from RUN_DIR: the rows given in Python (other rows than a run's checkpoints were
        trained on only with replace_data) and a model object's weights (once per run: a resumed run loads the
        checkpoint's)."""
        trained = bool(list_checkpoints(self.run_dir / "checkpoints"))
        for f in self._files.values():
            f.write(replace=replace_data or not trained)
        target = self.run_dir / MODEL_DIR
        resumed = trained and target.is_dir()
        if self._model_object is not None and not self._model_written and not resumed:
            from ..model.loading import save_model

            save_model(self._model_object, target, tokenizer_dir=self._model_object.loaded_from)
        self._model_written = True

    def _engine(self):
        """The block in which the engine runs: the reward functions given here are handed over by name."""
        return providing_rewards(self._rewards.functions)

    # ------------------------------------------------------------------------------------------ the methods
    def check(self):
        """The signal check of `grpo check` on the starting model: prints its report and returns it (RolloutFit;
        .report.verdict.ok says whether GRPO has something to learn)."""
        from ..train.setup import check_config

        self._materialize()
        with self._engine():
            fit = check_config(self.config)
        print("\n".join(fit.lines()), flush=True)
        return fit

    def train(self, steps: int | None = None, *, overwrite: bool = False, allow_data_change: bool = False,
              check: bool = True):
        """Train `steps` more steps (a checkpoint after the last), or on to schedule.steps; resume when run_dir has
        checkpoints. overwrite: start over (the old run is renamed RUN_DIR.prev-<time>); allow_data_change: resume on
        data other than the checkpoint's; check: the signal check before step 1 (check.enabled). Returns the
        loop's RunResult (last_step, checkpoint, stopped_by, and before / after with eval.before_after)."""
        from ..train.loop import train

        if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
            raise ValueError(f"steps={steps!r} must be a whole number >= 1 (or None: on to schedule.steps)")
        resume = "latest" if list_checkpoints(self.run_dir / "checkpoints") and not overwrite else None
        if overwrite:
            _move_old_run_aside(self.run_dir)
        for name in self._rewards.python_only:
            print(f"note: the reward {name} cannot be imported by name (a lambda, or defined in __main__: a notebook "
                  f"cell): this run resumes from Python only, by a GRPO given the same function", file=sys.stderr)
        self._materialize(replace_data=allow_data_change)
        with self._engine():
            return train(self.config, resume=resume, stop_after=steps, allow_data_change=allow_data_change,
                         command=f"grpo train {self.run_dir}", check=check, held_out=self.config.eval.before_after)

    def evaluate(self, data=None, *, max_examples: int | None = None, max_new_tokens: int | None = None,
                 temperature: float | None = None, n: int = 1):
        """The current model on the held-out split (the first eval.max_examples of task.eval_split), or on `data`
        (a path, a list of dicts or a datasets.Dataset), at eval.temperature (0: greedy) with replies up to
        rollout.max_new_tokens, as the run's before / after evaluation. Returns the EvalReport of `grpo eval`
        (.summary.pass_at[1] is the accuracy; its markdown: eval.evaluate.report_markdown)."""
        from ..eval.evaluate import EvalConfig, evaluate
        from ..train.setup import split_examples

        cfg = self.config
        task = self._task(data)
        examples = split_examples(task, cfg, "eval_split") if data is None else task.examples("test")
        settings = EvalConfig(n=n, ks=(1,), temperature=cfg.eval.temperature if temperature is None else temperature,
                              max_new_tokens=max_new_tokens or cfg.rollout.max_new_tokens, seed=cfg.seed,
                              max_examples=max_examples or (cfg.eval.max_examples if data is None else None))
        model, tokenizer = self._loaded()
        with self._engine():
            return evaluate(model, tokenizer, task, examples, settings)

    def generate(self, prompts: str | Sequence[str], *, max_new_tokens: int | None = None, temperature: float = 0.0,
                 n: int = 1, seed: int | None = None) -> str | list:
        """Replies of the current model: a string for one prompt, a list for a list; with n > 1 each is a list of n.
        Each prompt is rendered as training renders it (the task's chat template, system prompt, instruction and
        prefill); temperature 0 is greedy."""
        import torch

        from ..rollout import SamplingParams, generate
        from ..tasks import Example, render_prompt

        texts = [prompts] if isinstance(prompts, str) else list(prompts)
        task = self._task(None)
        model, tokenizer = self._loaded()
        params = SamplingParams(n=n, temperature=temperature, stop_token_ids=list(tokenizer.eos_token_ids),
                                max_new_tokens=max_new_tokens or self.config.rollout.max_new_tokens)
        ids = [tokenizer.encode(render_prompt(task, tokenizer, Example(f"prompt-{i}", t, ""))) for i, t in
               enumerate(texts)]
        with torch.no_grad():
            out = generate(model, ids, params, seed=self.config.seed if seed is None else seed, tokenizer=tokenizer)
        replies = [tokenizer.decode(c, skip_special_tokens=True) for c in out.completion_ids]
        grouped = [replies[i * n:(i + 1) * n] if n > 1 else replies[i] for i in range(len(texts))]
        return grouped[0] if isinstance(prompts, str) else grouped

    def save(self, path: str | Path) -> Path:
        """The current model as an HF model directory (weights, config, tokenizer files) at `path` (a new folder)."""
        from ..model.loading import load_model, save_model

        source, out = self.current_model(), Path(path)
        if out.exists():
            raise FileExistsError(f"{out} exists; choose a new folder (nothing is overwritten)")
        if source.is_dir():
            shutil.copytree(source, out)
        else:
            save_model(load_model(source), out, tokenizer_dir=source)
        return out

    def export_gguf(self, path: str | Path, type: str = "f16", *, overwrite: bool = False) -> Path:  # noqa: A002
        """The current model as a .gguf file for llama.cpp / Ollama (`grpo export`): type f16, q8_0, bf16 or f32."""
        from ..gguf_export import export_gguf

        return export_gguf(str(self.current_model()), str(path), type, overwrite=overwrite)

    def plot(self, show: bool = True) -> Path:
        """Draw RUN_DIR/curves.png from metrics.jsonl (`grpo plot`); show it inline when running in IPython."""
        from ..plot import plot_run

        out = plot_run(self.run_dir, self.run_dir / "curves.png", overwrite=True)
        if show and "IPython" in sys.modules:
            from IPython.display import Image, display

            display(Image(filename=str(out)))
        return out

    @property
    def history(self):
        """The run's metrics.jsonl, one record per step: a pandas DataFrame when pandas is installed, else a list of
        dicts (empty before the first step)."""
        path = self.run_dir / "metrics.jsonl"
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []
        try:
            import pandas
        except ImportError:
            return rows
        return pandas.DataFrame(rows)

    def current_model(self) -> Path:
        """The newest checkpoint's model (its manifest checked), else the starting model."""
        from ..checkpoint.store import model_source

        if list_checkpoints(self.run_dir / "checkpoints"):
            return model_source(self.run_dir)
        self._materialize()
        return Path(self.config.model.path)

    # ---------------------------------------------------------------------------------------------- helpers
    def _task(self, data):
        """The run's task; with `data`, the same task (options, reward) on those rows or that file as its test split."""
        from ..tasks import build_task
        from ..train.setup import task_of

        self._materialize()
        cfg = self.config
        with self._engine():
            if data is None:
                return task_of(cfg)
            path = rows_file(data, "eval_data", self.run_dir, _task_options(cfg).limits, hashed=True).write() \
                if is_rows(data) else Path(data)
            if cfg.task.name != "custom":  # a task that reads its own files: `path` as its data (`grpo eval --data`)
                return build_task(cfg.task.name, {k: v for k, v in cfg.task.options.items() if k != "data_path"},
                                  str(path))
            return build_task("custom", {**cfg.task.options, "data_path": str(path), "test_path": str(path)})

    def _loaded(self):
        from ..eval.cli import load_model_and_tokenizer

        device = None if self.config.model.device == "auto" else self.config.model.device
        source = self.current_model()
        return load_model_and_tokenizer(source, self.config.tokenizer.path, device, None)

    def __repr__(self) -> str:
        return f"GRPO(run_dir={str(self.run_dir)!r}, model={self.config.model.path!r}, task={self.config.task.name!r})"


def _absolute(path: str | Path) -> Path:
    """An existing path made absolute (the run resumes from anywhere, the CLI included); a missing one as given, for
    the error that names it."""
    return Path(path).resolve() if Path(path).exists() else Path(path)


def _model_object(model):
    """A model object to train: one loaded by grpo_engine.load_model (it knows its tokenizer's path)."""
    if getattr(model, "loaded_from", None) is None:
        raise TypeError(f"model={type(model).__name__}: pass a path (an HF model directory or a .gguf file) or a "
                        f"model loaded with grpo_engine.load_model(path)")
    return model


def _task_options(cfg: Config):
    """The task's options (ChatTaskOptions), checked now as the run's set-up checks them (no data read): a missing
    data path or a bad option is a ConfigError when the object is made, not at train()."""
    from ..tasks import task_options

    options = {**cfg.task.options, **({"data_path": cfg.task.data_path} if cfg.task.data_path else {})}
    try:
        return task_options(cfg.task.name, **options)
    except ValueError as e:
        raise ConfigError(f"task: {e}") from None


def _reads_data(cfg: Config) -> bool:
    from ..tasks import TASKS

    spec = TASKS.get(cfg.task.name)
    return spec is not None and "data_path" in spec.options.__dataclass_fields__


def _reset_items(cfg: Config, train_data, rewards: Rewards) -> list[str]:
    """Data or a reward make a task that generates its problems (the default, arithmetic) the custom task, its
    options dropped; rows are the custom task's whatever the config's task (set after the user's overrides)."""
    if (train_data is not None or rewards.overrides) and not _reads_data(cfg):
        return ["task.name=custom", "task.options=null"]
    return []


def run_dir_config(run_dir: str | Path, overrides: Sequence[str] = ()) -> Config:
    """`grpo train RUN_DIR --resume`: the config the run's newest checkpoint stored (config.yaml), run_dir set to
    RUN_DIR, with `overrides`. A stored config is data: its code keys are marked by config/trust.py's rule, as every
    stored config's are, so each reward it names runs only with --allow-code (a run made from Python names its
    functions so), and one that cannot be imported by name is refused in one line (when the run builds its task,
    before a model loads)."""
    from ..config.trust import mark_stored_code

    checkpoints = list_checkpoints(Path(run_dir) / "checkpoints")
    if not checkpoints:
        raise ConfigError(f"{run_dir} is a directory with no checkpoints: grpo train takes a YAML config, or a run "
                          f"directory with --resume")
    stored = checkpoints[-1] / "config.yaml"
    if not stored.is_file():
        raise ConfigError(f"{stored} is missing: resume with the run's YAML config (grpo train CONFIG --resume)")
    return mark_stored_code(load_config(stored, [f"run_dir={yaml_value(str(run_dir))}", *overrides]), str(stored))


def _move_old_run_aside(run_dir: Path) -> None:
    """train(overwrite=True): the old run renamed RUN_DIR.prev-<time> (checkpoint/run_dir.py) before this run writes
    its inputs into RUN_DIR."""
    if not holds_run(run_dir):
        return
    plan = plan_run_dir(run_dir, resume_step=None, newest_step=None, overwrite=True)
    lock = RunLock(run_dir).acquire()
    try:
        plan.apply(lock=lock)
    finally:
        lock.release()
