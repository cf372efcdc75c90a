"""The shape of the code base (docs/architecture.md): small functions and files, config as a leaf package,
`grpo --help` without torch, the model file free of kernels and training code."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "grpo_engine"
MAX_FUNCTION_LINES = 60
MAX_FILE_LINES = 600


def _sources():
    return sorted(PACKAGE.rglob("*.py"))


def _imports(path: Path) -> set[str]:
    """Absolute names of the grpo_engine modules `path` imports (relative imports resolved)."""
    module = ".".join(path.relative_to(REPO).with_suffix("").parts)
    package = module.rsplit(".", 1)[0] if path.name != "__init__.py" else module.removesuffix(".__init__")
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            name = ".".join([*base, node.module] if node.module else base)
            found.add(name)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found


def test_no_function_over_60_lines_and_no_file_over_600():
    long_functions, long_files = [], []
    for path in _sources():
        text = path.read_text()
        if len(text.splitlines()) > MAX_FILE_LINES:
            long_files.append(f"{path.relative_to(REPO)}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    long_functions.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name}: {length} lines")
    assert long_functions == [] and long_files == []


def test_config_is_a_leaf():
    """config/ imports nothing from the rest of the engine, and no torch: everything else imports it."""
    for path in sorted((PACKAGE / "config").glob("*.py")):
        ours = {m for m in _imports(path) if m.startswith("grpo_engine") and not m.startswith("grpo_engine.config")}
        assert ours == set(), f"{path.name} imports {ours}"
        assert not any(m == "torch" or m.startswith("torch.") for m in _imports(path)), path.name


# Settings are resolved once (plan/resolved.py) and then only read: the config's dataclasses are frozen, and no
# module outside config/ assigns to a field of a config (a name cfg / config, an attribute chain through .cfg /
# .config, or a name annotated with a class of grpo_engine.config).
CONFIG_NAMES = {"cfg", "config"}


def _settings_types() -> set[str]:
    import grpo_engine.config as settings

    return {name for name in settings.__all__ if name[0].isupper() and name != "ConfigError"}


def _annotated_settings(tree: ast.AST, types: set[str]) -> set[str]:
    """Names annotated (arguments, `x: T = ...`) with a config class."""
    def typed(annotation) -> bool:
        return annotation is not None and ast.unparse(annotation).split("|")[0].strip().strip("'\"") in types

    return ({n.arg for n in ast.walk(tree) if isinstance(n, ast.arg) and typed(n.annotation)}
            | {n.target.id for n in ast.walk(tree)
               if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name) and typed(n.annotation)})


def _config_field_assignments(source: str, types: set[str]) -> list[str]:
    """Each `a.b... = / += ...` whose chain starts at a config name or passes through .cfg / .config."""
    tree = ast.parse(source)
    roots, found = _annotated_settings(tree, types) | CONFIG_NAMES, []
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else (
            [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
        for target in [e for t in targets for e in (t.elts if isinstance(t, (ast.Tuple, ast.List)) else [t])]:
            chain, inner = [], target
            while isinstance(inner, ast.Attribute):
                chain, inner = [inner.attr, *chain], inner.value
            if chain and ((isinstance(inner, ast.Name) and inner.id in roots) or CONFIG_NAMES & set(chain[:-1])):
                found.append(f"{node.lineno}: {ast.unparse(target)}")
    return found


@pytest.mark.parametrize("source", [
    "cfg.model.path = 'x'", "def f(c: Config):\n    c.run_dir = 'x'", "run.cfg.memory.micro_batch_tokens += 1",
    "config.seed, x = 1, 2", "def f(m: MemorySection | None):\n    m.precision = 'bf16'",
])
def test_the_config_assignment_check_finds_each_form(source):
    assert len(_config_field_assignments(source, _settings_types())) == 1


def test_no_module_assigns_to_a_config_field_and_the_config_is_frozen():
    import dataclasses

    from grpo_engine.config import load_config

    types = _settings_types()
    found = [f"{path.relative_to(REPO)}:{hit}" for path in _sources() if path.parent.name != "config"
             for hit in _config_field_assignments(path.read_text(), types)]
    assert found == []
    cfg = load_config(None, [])
    for section in (cfg, cfg.memory, cfg.algorithm, cfg.optimizer, cfg.model):
        with pytest.raises(dataclasses.FrozenInstanceError):
            section.seed = 1


def test_model_file_is_architecture_only():
    """transformer.py imports no kernel, training or rollout code (kernels/ applies those from outside): only its
    config and the declaration of the kernel slot it carries (model/kernels_slot.py, torch's products by default)."""
    ours = {m for m in _imports(PACKAGE / "model" / "transformer.py") if m.startswith("grpo_engine")}
    assert ours <= {"grpo_engine.model.config", "grpo_engine.model.kernels_slot"}, ours
    slot = {m for m in _imports(PACKAGE / "model" / "kernels_slot.py") if m.startswith("grpo_engine")}
    assert slot == set(), slot


# the attributes kernels once reached the code through, set from outside and probed for; now fields of the one
# declared `Transformer.kernels` (model/kernels_slot.py), which no code probes for either
KERNEL_ATTRIBUTES = {"kernels", "head_gemm", "decode_kernels", "weight_grads_in_place", "decode_attention",
                     "train_attention"}
PROBES = {"getattr", "hasattr", "setattr", "delattr"}


def _kernel_probes(source: str) -> list[str]:
    """Where `source` probes for a kernel attribute (getattr / hasattr / setattr / delattr with its name, a read of
    `__dict__` or vars() by its name), sets one of the old ad-hoc attributes on an object, or assigns `__class__`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in PROBES
                and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)
                and node.args[1].value in KERNEL_ATTRIBUTES):
            found.append(f"{node.lineno}: {node.func.id}(..., {node.args[1].value!r})")
        elif (isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant)
              and node.slice.value in KERNEL_ATTRIBUTES and _is_dict_of_object(node.value)):
            found.append(f"{node.lineno}: __dict__[{node.slice.value!r}]")
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            found += [f"{node.lineno}: .{t.attr} =" for target in targets for t in ast.walk(target)
                      if isinstance(t, ast.Attribute) and (t.attr == "__class__" or t.attr in KERNEL_ATTRIBUTES - {
                          "kernels"})]
    return found


def _is_dict_of_object(node: ast.expr) -> bool:
    """`x.__dict__` or `vars(x)`."""
    return ((isinstance(node, ast.Attribute) and node.attr == "__dict__")
            or (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "vars"))


@pytest.mark.parametrize("source", [
    'k = getattr(model, "decode_kernels", None)', 'ok = hasattr(model.lm_head, "head_gemm")',
    'getattr(getattr(model, "lm_head", None), "head_gemm", None)', 'k = model.__dict__["weight_grads_in_place"]',
    'k = vars(model)["kernels"]', 'module.__class__ = OneDNNLinear', 'block.attn.decode_attention = kernel',
    'model.lm_head.head_gemm: object = None', 'setattr(model, "weight_grads_in_place", f)'])
def test_the_kernel_probe_check_finds_each_way_of_probing(source):
    assert _kernel_probes(source) != [], source


def test_no_module_probes_for_kernel_attributes_or_swaps_a_class():
    """Kernels reach the code through the declared `Transformer.kernels` only (docs/architecture.md, kernels/): no
    module probes for them or sets them on objects ad hoc, and none swaps a module's class (kernels/ replaces a
    module by a new one holding the same parameters)."""
    clean = "model.kernels = replace(model.kernels, decode_attention=None)\nhead = model.kernels.head\n"
    assert _kernel_probes(clean) == []
    probes = [f"{p.relative_to(REPO)}:{hit}" for p in _sources() for hit in _kernel_probes(p.read_text())]
    assert probes == []


@pytest.mark.parametrize("argv", [["--help"], ["plot", "--help"]])
def test_cli_help_and_plot_load_no_torch(argv):
    code = ("import sys; from grpo_engine.cli import main\n"
            "try:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
            "assert 'torch' not in sys.modules, 'torch was imported'")
    out = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, cwd=REPO,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]


# ----------------------------------------------------------------------------------------------------
# The layer order (docs/architecture.md): each room imports only rooms to its left, and no files form a circle.

LAYERS = ["config", "world", "progress", "tasks", "model", "rollout", "rl", "kernels", "collect", "plan", "checkpoint",
          "monitor", "eval", "sft", "gguf_export", "train", "bench", "plot", "demo", "cli"]
MAX_TRAIN_MODULES = 12


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_edges(path: Path) -> list[tuple[str, str, int]]:
    """(imported module, imported name or "", line) of every import in `path`, function bodies included."""
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    edges = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            name = ".".join([*base, node.module] if node.module else base)
            edges += [(name, alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.Import):
            edges += [(alias.name, "", node.lineno) for alias in node.names]
    return [e for e in edges if e[0] == "grpo_engine" or e[0].startswith("grpo_engine.")]


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in _sources()}


def _target(modules: dict[str, Path], name: str, attr: str) -> str:
    """The module an import loads: `from pkg import mod` names the submodule, else the module itself."""
    return f"{name}.{attr}" if f"{name}.{attr}" in modules else name


def _room(module: str) -> str:
    return module.split(".")[1] if module.count(".") else ""


def test_every_room_has_a_place_in_the_layer_order():
    rooms = {_room(m) for m in _modules()} - {""}
    assert rooms == set(LAYERS), f"not in LAYERS: {rooms - set(LAYERS)}; no such room: {set(LAYERS) - rooms}"
    text = (REPO / "docs" / "architecture.md").read_text()
    assert "  ->  ".join(f"{r}/" if (PACKAGE / r).is_dir() else r for r in LAYERS) in text


def test_imports_point_left_only():
    """A room imports only rooms to its left (the root package's lazy public names aside)."""
    modules, upward = _modules(), []
    for module, path in modules.items():
        here = _room(module)
        if not here:
            continue
        for name, attr, line in _import_edges(path):
            there = _room(_target(modules, name, attr))
            if there and there != here and LAYERS.index(there) > LAYERS.index(here):
                upward.append(f"{path.relative_to(REPO)}:{line} imports {name} ({there} is right of {here})")
    assert upward == []


def test_no_circle_of_files():
    modules = _modules()
    graph = {m: {_target(modules, n, a) for n, a, _ in _import_edges(p)} - {m} for m, p in modules.items()}
    circles, state = [], {}

    def visit(m: str, stack: list[str]) -> None:
        state[m] = "open"
        for n in sorted(graph.get(m, ())):
            if n not in modules:
                continue
            if state.get(n) == "open":
                circles.append(" -> ".join([*stack[stack.index(n):], n]))
            elif n not in state:
                visit(n, [*stack, n])
        state[m] = "done"

    for m in sorted(modules):
        if m not in state:
            visit(m, [m])
    assert circles == []


def test_no_import_of_another_modules_underscore_names():
    private = [f"{p.relative_to(REPO)}:{line} imports {name}.{attr}"
               for m, p in _modules().items() for name, attr, line in _import_edges(p)
               if attr.startswith("_") and name != m]
    assert private == []


def test_train_is_the_loop_and_what_a_step_composes():
    modules = sorted(p.stem for p in (PACKAGE / "train").glob("*.py") if p.name != "__init__.py")
    text = (REPO / "docs" / "architecture.md").read_text()
    assert len(modules) <= MAX_TRAIN_MODULES, modules
    assert [m for m in modules if f"train/{m}.py" not in text] == []


# ----------------------------------------------------------------------------------------------------
# One decode loop over one decode cache (issue 69 item 3; docs/architecture.md, the rollout/ row): the cache is
# rollout/static_cache.py StaticDecodeState, and every object the model's forward writes a decode's keys/values
# through is a view of it; the loop is rollout/static_decode.py decode_static, the one caller of the one function
# that hands sampled tokens to rows. The training-time prompt caches (train/forward.py, sft/trainer.py) hold a
# prompt pass's keys/values for the gradient: no decode runs on them.

TRAINING_TIME_CACHES = ["sft/trainer.py:PrefixKV", "train/forward.py:PromptKV", "train/forward.py:SharedPromptKV"]


def _decode_classes() -> dict[str, ast.ClassDef]:
    """'path:Class' -> its node, for every class of the package."""
    return {f"{path.relative_to(PACKAGE).as_posix()}:{node.name}": node for path in _sources()
            for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.ClassDef)}


def _method(cls: ast.ClassDef, name: str) -> ast.FunctionDef | None:
    return next((n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == name), None)


def _is_cache(cls: ast.ClassDef) -> bool:
    """A KVCacheLike (model/transformer.py): a class with update(self, layer, k, v) that is not the protocol."""
    update = _method(cls, "update")
    return update is not None and [a.arg for a in update.args.args][:2] == ["self", "layer"] and \
        "Protocol" not in {ast.unparse(b) for b in cls.bases}


ALLOCATIONS = ("torch.zeros", "torch.empty", "torch.ones", "torch.full")


def _allocates_kv(cls: ast.ClassDef) -> bool:
    """Whether the class makes key/value storage: self.k / self.v assigned (or a k= / v= argument given) a value in
    which it allocates a tensor, in any of its methods."""
    def allocates(value: ast.AST) -> bool:
        return any(isinstance(c, ast.Call) and ast.unparse(c.func) in ALLOCATIONS for c in ast.walk(value))

    for node in ast.walk(cls):
        if isinstance(node, ast.Assign) and any(ast.unparse(t) in ("self.k", "self.v") for t in node.targets) \
                and allocates(node.value):
            return True
        if isinstance(node, ast.Call) and any(kw.arg in ("k", "v") and allocates(kw.value) for kw in node.keywords):
            return True
    return False


def _callers(name: str, method: bool) -> list[str]:
    """'path:function' of the package's functions that call `name` (as an attribute: x.name(...), with three
    arguments, when method; else by its plain name)."""
    hits = set()
    for path in _sources():
        for fn in ast.walk(ast.parse(path.read_text())):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for c in ast.walk(fn):
                if not isinstance(c, ast.Call):
                    continue
                if method and isinstance(c.func, ast.Attribute) and c.func.attr == name and len(c.args) == 3 or \
                        not method and isinstance(c.func, ast.Name) and c.func.id == name:
                    hits.add(f"{path.relative_to(PACKAGE).as_posix()}:{fn.name}")
    return sorted(hits)


def test_one_decode_cache_class():
    classes = _decode_classes()
    assert [c for c, node in classes.items() if _allocates_kv(node)] == ["rollout/static_cache.py:StaticDecodeState"]
    caches = {c: node for c, node in classes.items() if _is_cache(node)}
    views = {c: node for c, node in caches.items() if c not in TRAINING_TIME_CACHES}
    assert sorted(views) == ["rollout/static_cache.py:BucketCache", "rollout/static_cache.py:FeedCache",
                             "rollout/static_cache.py:PromptCache"]
    for name, node in views.items():  # each is built over the state: storage of its own it has none
        init = _method(node, "__init__")
        assert init is not None and "StaticDecodeState" in {ast.unparse(a.annotation) for a in init.args.args
                                                            if a.annotation is not None}, name
    assert sorted(c for c in caches if c in TRAINING_TIME_CACHES) == TRAINING_TIME_CACHES
    assert not any(c.endswith(":KVCache") for c in classes)


def test_one_decode_loop():
    assert _callers("take", method=True) == ["rollout/static_decode.py:take_tokens"]  # Row.take(token, logp, ...)
    assert _callers("take_tokens", method=False) == ["rollout/static_decode.py:decode_static"]
    assert _callers("decode_static", method=False) == ["rollout/generate.py:_decode_waves"]
    assert _callers("_decode_waves", method=False) == ["rollout/generate.py:generate_rows"]
