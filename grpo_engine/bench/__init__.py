"""`grpo bench`: throughput of the rollout sampler (generate.py) and seconds per training step (step.py), each
driving the engine's real code, printed as one JSON line with --json. Peer comparisons live in benchmarks/."""


def add_bench_parser(sub) -> None:
    from .generate import add_bench_generate_parser
    from .step import add_bench_step_parser

    p = sub.add_parser("bench", help="benchmarks (one JSON line with --json)")
    bsub = p.add_subparsers(dest="bench_command", required=True)
    add_bench_generate_parser(bsub)
    add_bench_step_parser(bsub)
