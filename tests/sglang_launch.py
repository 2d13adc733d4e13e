"""Stands for ``python -m sglang.launch_server`` in tests (SGLang needs CUDA): reads the
model, port and tensor-parallel size from the command line the sglang engine launches a
server with (SGLang's own parser accepts that whole line: tests/test_sglang_contract.py),
and serves the contract server (``tests/sglang_server.py``) there until it is killed.

    python -m tests.sglang_launch --model-path DIR --host 127.0.0.1 --port N [...]
"""

from __future__ import annotations

import argparse
import sys
import time

from tests.sglang_server import VARIANTS, serve


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    for flag in ("--model-path", "--host"):
        parser.add_argument(flag, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--tp-size", type=int, default=1)
    args, _ = parser.parse_known_args(argv)
    print(f"contract server for {args.model_path} on {args.host}:{args.port}", flush=True)
    with serve(VARIANTS[0], args.model_path, tp_size=args.tp_size, port=args.port):
        while True:
            time.sleep(3600)


if __name__ == "__main__":
    main(sys.argv[1:])
