"""`grpo` command line (thin). Only `grpo bench generate` so far; the lead wires the rest."""

from __future__ import annotations

import argparse

from .rollout.bench import add_bench_generate_parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="grpo")
    commands = parser.add_subparsers(dest="command", required=True)
    bench = commands.add_parser("bench", help="measure speed")
    add_bench_generate_parser(bench.add_subparsers(dest="what", required=True))
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()
