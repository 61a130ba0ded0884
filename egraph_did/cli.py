"""Command line: `egraph-did demo` (or `python -m egraph_did demo`)."""
from __future__ import annotations

import argparse


def main(argv: list[str] | None = None) -> int:
    """Entry point.

    >>> main(["demo", "--tokens", "4", "--hidden", "8", "--ndev", "2", "--no-launch"])  # doctest: +ELLIPSIS
    egraph-did demo: ...
    0
    """
    parser = argparse.ArgumentParser(prog="egraph-did", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    demo = sub.add_parser("demo", help="tensor-parallel MLP on a CPU mesh: layouts, shards, numerics")
    demo.add_argument("--tokens", type=int, default=8)
    demo.add_argument("--hidden", type=int, default=16)
    demo.add_argument("--ndev", type=int, default=4)
    demo.add_argument("--no-launch", action="store_true", help="simulate only; no gloo processes")
    args = parser.parse_args(argv)
    if args.cmd == "demo":
        from .demo import main as demo_main
        return demo_main(args.tokens, args.hidden, args.ndev, launch=not args.no_launch)
    return 2  # pragma: no cover - argparse rejects other commands


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
