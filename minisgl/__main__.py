"""`python -m minisgl`: serve the model over HTTP, or chat with it with `--shell`."""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence

from minisgl.server.args import parse_args


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_args(argv)
    logging.basicConfig(
        level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    from minisgl.server.launch import StartupError

    try:
        if config.shell:
            from minisgl.shell import run_shell

            run_shell(config)
        else:
            from minisgl.server.launch import run_server

            run_server(config)
    except StartupError as e:
        print(f"minisgl: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
