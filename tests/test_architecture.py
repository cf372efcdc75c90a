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
          "monitor", "eval", "sft", "gguf_export", "train", "bench", "plot", "api", "demo", "cli"]
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
# One loss settings type and the kernel plan on the model (issue 69, items 2 and 4): the loss reaches the step as one
# flat, frozen `ResolvedLoss`, resolved once and never written; the GEMM choice and the in-place-gradient switch are
# fields of the model's `Kernels`, not globals of kernels/onednn.py.

LOSS_TYPES = {"LossConfig", "ResolvedLoss"}


def _setattr_writes(source: str) -> list[str]:
    """Where `object.__setattr__` writes a loss value: outside a class's own `self`, a field named loss, or inside a
    class that holds (or is) a loss settings type."""
    found = []

    def visit(node: ast.AST, holds_loss: bool) -> None:
        if isinstance(node, ast.ClassDef):
            annotations = {ast.unparse(s.annotation) for s in node.body if isinstance(s, ast.AnnAssign)}
            holds_loss = node.name in LOSS_TYPES or any(t in a for a in annotations for t in LOSS_TYPES)
        if (isinstance(node, ast.Call) and ast.unparse(node.func) == "object.__setattr__" and node.args
                and (holds_loss or ast.unparse(node.args[0]) != "self"
                     or "loss" in ast.unparse(node.args[1:2]).lower())):
            found.append(f"{node.lineno}: {ast.unparse(node)}")
        for child in ast.iter_child_nodes(node):
            visit(child, holds_loss)

    visit(ast.parse(source), False)
    return found


@pytest.mark.parametrize("source", [
    "@dataclass(frozen=True)\nclass UpdateSettings:\n    loss: ResolvedLoss\n    def __post_init__(self):\n"
    "        object.__setattr__(self, 'loss', resolve(self.loss))",
    "object.__setattr__(settings.loss, 'beta', 0.0)",
    "class S:\n    def __post_init__(self):\n        object.__setattr__(self, 'policy_loss', x)"])
def test_the_loss_write_check_finds_each_form(source):
    assert _setattr_writes(source) != []


def test_no_loss_value_is_written_through_object_setattr():
    assert _setattr_writes("class S:\n    def __post_init__(self):\n        object.__setattr__(self, 'ks', x)") == []
    found = [f"{p.relative_to(REPO)}:{hit}" for p in _sources() for hit in _setattr_writes(p.read_text())]
    assert found == []


def test_the_resolved_loss_is_one_flat_value_resolved_once():
    """ResolvedLoss carries every LossConfig field itself (no `.cfg`, no nested settings), `resolve` takes a
    LossConfig only, no function takes `LossConfig | ResolvedLoss`, and only train/step.py resolves (once per run)."""
    import dataclasses
    import inspect
    import typing

    from grpo_engine.rl.losses import LossConfig, ResolvedLoss, resolve

    fields = {f.name: f for f in dataclasses.fields(ResolvedLoss)}
    assert "cfg" not in fields and not hasattr(ResolvedLoss, "cfg")
    assert {f.name for f in dataclasses.fields(LossConfig)} <= fields.keys()
    hints = typing.get_type_hints(ResolvedLoss)
    assert all(set(typing.get_args(t) or [t]) <= {str, int, float, type(None)} for t in hints.values()), hints
    assert ResolvedLoss.__dataclass_params__.frozen
    assert inspect.signature(resolve).parameters["cfg"].annotation in ("LossConfig", LossConfig)
    unions, callers = [], []
    for path in _sources():
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.arg) and node.annotation is not None:
                text = ast.unparse(node.annotation)
                if all(t in text for t in LOSS_TYPES):
                    unions.append(f"{path.relative_to(REPO)}:{node.lineno} {node.arg}: {text}")
            if isinstance(node, ast.Call) and ast.unparse(node.func) in ("resolve", "losses.resolve"):
                callers.append(str(path.relative_to(REPO)))
    assert unions == []
    assert callers == ["grpo_engine/train/step.py"]


def test_the_gemm_choice_is_the_models_not_a_global_of_onednn():
    """kernels/onednn.py keeps no plan and no switch of its own: its only module-level mutable state is the one-time
    check of what this torch build runs (`_state`), nothing declares a `global`, and the plan reaches a projection
    through its model's `Kernels` (the `gemm` and `weight_grads_in_place` fields)."""
    import dataclasses

    from grpo_engine.kernels import onednn
    from grpo_engine.model.kernels_slot import Kernels

    tree = ast.parse((PACKAGE / "kernels" / "onednn.py").read_text())
    mutable = []
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(
                node.value, (ast.Dict, ast.List, ast.Set, ast.Call, ast.DictComp, ast.ListComp, ast.SetComp)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            mutable += [ast.unparse(t) for t in targets]
    assert mutable == ["_state"]
    assert not [n for n in ast.walk(tree) if isinstance(n, (ast.Global, ast.Nonlocal))]
    assert not hasattr(onednn, "activate") and not hasattr(onednn, "active_plan")
    assert {"gemm", "weight_grads_in_place"} <= {f.name for f in dataclasses.fields(Kernels)}
    assert Kernels().weight_grads_in_place is not Kernels().weight_grads_in_place  # one switch per value


# One place for each decision (docs/architecture.md, "Where each decision is made"): the KV bytes, the rows in
# flight and the precision are each computed by one function, which every other module asks.

def _functions_matching(predicate) -> list[str]:
    """'path:function' of every function (innermost) in the package with a node for which predicate(node) holds."""
    hits = []
    for path in _sources():
        tree = ast.parse(path.read_text())
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            inner = {n for child in ast.walk(fn) if child is not fn and isinstance(child, ast.FunctionDef)
                     for n in ast.walk(child)}
            if any(predicate(n) for n in ast.walk(fn) if n not in inner):
                hits.append(f"{path.relative_to(PACKAGE).as_posix()}:{fn.name}")
    return sorted(set(hits))


def _product_names(node: ast.AST) -> set[str]:
    """The attribute and variable names multiplied together in a chain of `*` rooted at node."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):
        return _product_names(node.left) | _product_names(node.right)
    if isinstance(node, ast.Attribute):
        return {node.attr}
    return {node.id} if isinstance(node, ast.Name) else set()


def _is_kv_bytes(node: ast.AST) -> bool:
    """A product of layers x KV heads x head size: the KV cache's size per token (any multiple of it)."""
    return isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult) and {
        "num_hidden_layers", "num_key_value_heads", "head_dim"} <= _product_names(node)


def _is_rows_in_flight(node: ast.AST) -> bool:
    """A floor division of the decode's token budget (rollout.max_tokens_in_flight, or a budget / cap divided by a
    group's rows x slots) into rows."""
    if not (isinstance(node, ast.BinOp) and isinstance(node.op, ast.FloorDiv)):
        return False
    left, per_group = ast.unparse(node.left), _product_names(node.right)
    return "tokens_in_flight" in left or (left in ("budget", "cap") and bool(per_group & {"samples", "group", "slots"}))


def test_the_kv_bytes_are_computed_in_one_function():
    assert _is_kv_bytes(ast.parse("2 * c.num_hidden_layers * B * c.num_key_value_heads * S * c.head_dim * b").body[0]
                        .value)
    assert not _is_kv_bytes(ast.parse("c.num_key_value_heads * c.head_dim").body[0].value)  # a projection's width
    assert _functions_matching(_is_kv_bytes) == ["plan/decode_state.py:kv_bytes_per_token"]


def test_the_rows_in_flight_are_computed_in_one_function():
    for formula in ("cfg.rollout.max_tokens_in_flight // (g * s)", "cap // (group * slots)",
                    "budget // (samples * (1 + new_tokens))"):
        assert _is_rows_in_flight(ast.parse(formula).body[0].value)
    assert not _is_rows_in_flight(ast.parse("budget // (vocab * 4)").body[0].value)  # a log-prob block's rows
    assert _functions_matching(_is_rows_in_flight) == ["rollout/generate.py:rows_in_flight"]


def test_the_precision_is_decided_in_one_function():
    """Only plan/precision.py asks the card or the CPU for bf16, inside choose_precision (its two branches) and the
    readers they call, and builds a precision choice (plan/from_config.py precision_choice passes a resumed run's on);
    everything else asks choose_precision or reads Resolved."""
    asks = {"native_bf16", "native_bf16_isa", "is_bf16_supported", "get_device_capability"}

    def asks_the_hardware(node: ast.AST) -> bool:
        name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None
        return name in asks

    def chooses(node: ast.AST) -> bool:
        return isinstance(node, ast.Call) and ast.unparse(node.func) == "PrecisionChoice"

    assert _functions_matching(asks_the_hardware) == sorted(f"plan/precision.py:{f}" for f in (
        "_on_card", "_on_cpu", "card_name", "native_bf16", "planned_card_native_bf16"))
    assert [c for c in _functions_matching(chooses) if not c.startswith("plan/precision.py:")] == [
        "plan/from_config.py:precision_choice"]


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
