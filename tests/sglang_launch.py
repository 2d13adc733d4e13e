"""Stands for ``python -m sglang.launch_server`` in tests (SGLang needs CUDA): reads the
command line the sglang engine launches a server with, using SGLang's own argument parser
(``tests/sglang_validator.py``: it must accept every flag), and serves the contract server
(``tests/sglang_server.py``) on its ``--host``/``--port`` until it is killed.

    python -m tests.sglang_launch --model-path DIR --host 127.0.0.1 --port N [...]
"""

from __future__ import annotations

import sys
import time

from tests import sglang_validator
from tests.sglang_server import VARIANTS, serve


def main(argv: list[str]) -> None:
    args = sglang_validator.launch_args(argv)
    print(f"contract server for {args['model_path']} on {args['host']}:{args['port']}", flush=True)
    with serve(VARIANTS[0], args["model_path"], tp_size=args["tp_size"], port=args["port"]):
        while True:
            time.sleep(3600)


if __name__ == "__main__":
    main(sys.argv[1:])
