"""YAML parsed under a budget: every YAML text the engine reads (a config file, the config.yaml a run or a
checkpoint stored) goes through `load_yaml`.

Why: YAML aliases let ~500 bytes name a billion nodes ("billion laughs"). PyYAML builds them as shared
references, cheaply, but OmegaConf then copies every one of them before it rejects an unknown key: a hang.
So the document is composed into nodes first (linear in the text, and stopped once it passes the node
budget), its size is counted as if every alias were expanded (each distinct node counted once, memoized), and
the objects are constructed only when that size, the nesting depth and the text's length are within the limits
below. No config comes near them; at their worst they cost PyYAML ~3 s.
"""

from __future__ import annotations

import functools

import yaml

from .fields import ConfigError

MAX_YAML_NODES = 100_000  # nodes after alias expansion; a full config is ~300
MAX_YAML_DEPTH = 64  # nesting of mappings / lists; a config nests ~4 deep
MAX_YAML_CHARS = 1024 * 1024  # a config is a few KiB


class _Counting:
    """A loader mixin that counts nodes (alias references included) as they are composed and stops at the
    budget: a large document costs what 100k nodes cost, not what its size would."""

    nodes = 0

    def compose_node(self, parent, index):
        self.nodes += 1
        if self.nodes > MAX_YAML_NODES:
            raise _OverBudget
        return super().compose_node(parent, index)


class _OverBudget(Exception):
    pass


@functools.cache
def _counting(loader: type) -> type:
    return type(f"Counting{loader.__name__}", (_Counting, loader), {})


def load_yaml(text: str, source: str, loader: type = yaml.SafeLoader):
    """The Python objects of one YAML document (None when empty), parsed with `loader` (a SafeLoader
    subclass). Raises ConfigError naming `source` over a budget; yaml.YAMLError for malformed YAML."""
    if len(text) > MAX_YAML_CHARS:
        raise ConfigError(f"{source}: {len(text):,} characters of YAML, over the limit of {MAX_YAML_CHARS:,}; "
                          f"is this a config file?")
    parser = _counting(loader)(text)
    try:
        node = parser.get_single_node()
        if node is None:
            return None
        _check_budget(node, source)
        return parser.construct_document(node)
    except _OverBudget:
        raise ConfigError(_over_budget(source)) from None
    except RecursionError:
        raise ConfigError(f"{source}: YAML nested too deeply (over {MAX_YAML_DEPTH} levels); flatten it") from None
    finally:
        parser.dispose()


def _over_budget(source: str) -> str:
    return (f"{source}: YAML expands to over {MAX_YAML_NODES:,} nodes (aliases *name repeat what they name: "
            f"an alias bomb?); write the config out without them")


def _children(node: yaml.Node) -> list:
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    return []


def _check_budget(root: yaml.Node, source: str) -> None:
    """Count the nodes `root` expands to (an alias counts as the whole node it names) and its depth, without
    expanding anything: one memoized post-order walk over the distinct nodes, iterative (no recursion)."""
    done: dict[int, tuple[int, int]] = {}  # id(node) -> (expanded size, depth)
    on_path: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, finished = stack.pop()
        key = id(node)
        if finished:
            on_path.discard(key)
            parts = [done[id(child)] for child in _children(node)]
            size, depth = 1 + sum(p[0] for p in parts), 1 + max((p[1] for p in parts), default=0)
            if size > MAX_YAML_NODES:
                raise ConfigError(_over_budget(source))
            if depth > MAX_YAML_DEPTH:
                raise ConfigError(f"{source}: YAML nested too deeply (over {MAX_YAML_DEPTH} levels); flatten it")
            done[key] = (size, depth)
        elif key in on_path:
            raise ConfigError(f"{source}: a YAML alias refers to a node that contains it (line "
                              f"{node.start_mark.line + 1}); a config cannot be recursive")
        elif key not in done:
            on_path.add(key)
            stack.append((node, True))
            stack.extend((child, False) for child in _children(node) if id(child) not in done)
