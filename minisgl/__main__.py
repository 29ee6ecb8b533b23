"""`python -m minisgl`: serve the model over HTTP, or chat with it with `--shell`; with
`--node-rank K > 0`, run node K's tensor-parallel ranks of a server whose node 0 runs elsewhere."""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence

from minisgl.config import ServerConfig
from minisgl.server.args import parse_args


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_args(argv)
    logging.basicConfig(
        level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    from minisgl.runtime.launch import StartupError

    try:
        if not config.serves_http:
            return _run_node(config)
        if config.shell:
            from minisgl.shell import run_shell

            run_shell(config)
        else:
            from minisgl.runtime.launch import run_server

            return run_server(config)
    except StartupError as e:
        print(f"minisgl: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


def _run_node(config: ServerConfig) -> int:
    from minisgl.runtime.launch import run_node

    try:
        return run_node(config)
    except ValueError as e:  # flags that do not fit node 0's engine
        print(f"minisgl: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
