"""A server in a child process: every failed start is one line naming the cause and the log,
never a hang, and nothing of the process group is left behind."""

from __future__ import annotations

import os
import signal
import socket
import sys
import time

import pytest

from actors.engine.server_process import ServerProcess, ServerStartError, free_port, log_gist


def _group_gone(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    return False


HTTP_SERVER = [sys.executable, "-m", "http.server", "--bind", "127.0.0.1"]


def test_a_server_that_answers_is_ready_and_close_ends_its_whole_group(tmp_path):
    port = free_port()
    # The server forks a sleeper: close must end the child too, not only the leader.
    command = ["sh", "-c", f"sleep 300 & exec {' '.join(HTTP_SERVER)} {port}"]
    server = ServerProcess.start(
        "test", command, port=port, log_path=tmp_path / "s.log", health_path="/", timeout=30
    )
    assert server.alive and server.url == f"http://127.0.0.1:{port}"
    assert server.ready_seconds > 0
    pgid = server.process.pid
    server.close()
    assert _group_gone(pgid)
    server.close()  # twice is allowed


def test_a_taken_port_is_one_line_before_anything_starts(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ServerStartError) as error:
            ServerProcess.start("engine-0", ["true"], port=port, log_path=tmp_path / "s.log", timeout=5)
    message = str(error.value)
    assert "\n" not in message
    assert f"port {port} on 127.0.0.1 is taken" in message and "engine-0" in message


def test_a_process_that_exits_during_start_names_its_exit_and_the_gist_of_its_log(tmp_path):
    log = tmp_path / "s.log"
    command = [
        "sh",
        "-c",
        "echo loading; echo 'ValueError: no config.json in /nowhere' >&2; echo bye; exit 3",
    ]
    started = time.monotonic()
    with pytest.raises(ServerStartError) as error:
        ServerProcess.start("engine-0", command, port=free_port(), log_path=log, timeout=30)
    assert time.monotonic() - started < 10
    message = str(error.value)
    assert "\n" not in message
    assert "exited during start (exit code 3)" in message
    assert "ValueError: no config.json in /nowhere" in message
    assert str(log) in message


@pytest.mark.slow
def test_a_server_that_never_answers_times_out_in_one_line_and_is_killed(tmp_path):
    command = ["sh", "-c", "trap '' TERM; echo still loading; sleep 300"]  # ignores SIGTERM too
    started = time.monotonic()
    with pytest.raises(ServerStartError) as error:
        ServerProcess.start("engine-0", command, port=free_port(), log_path=tmp_path / "s.log", timeout=1.5)
    assert time.monotonic() - started < 30
    message = str(error.value)
    assert "\n" not in message
    assert "did not answer within 1.5 s" in message and "still loading" in message


def test_a_missing_program_is_one_line(tmp_path):
    with pytest.raises(ServerStartError, match="cannot run /no/such/python"):
        ServerProcess.start("engine-0", ["/no/such/python"], port=free_port(), log_path=tmp_path / "s.log")


def test_the_gist_prefers_the_last_error_line_and_shortens_it(tmp_path):
    log = tmp_path / "s.log"
    log.write_text(
        "INFO start\nTraceback (most recent call last):\n  File x\nOSError: " + "x" * 500 + "\nINFO bye\n"
    )
    gist = log_gist(log)
    assert gist.startswith("OSError: x") and gist.endswith("...") and len(gist) == 300
    assert log_gist(tmp_path / "absent.log") == "no log"


def test_the_gist_of_a_vllm_log_is_the_root_cause_not_its_wrappers(tmp_path):
    log = tmp_path / "s.log"
    log.write_text(
        "(Worker pid=9) ERROR 12-01 18:47:27 [multiproc_executor.py:1063] RuntimeError: Unsupported CPU "
        "attention configuration: head_dim=16 isa=2 kv_cache_idx=0\n"
        "(EngineCore pid=8) ERROR 12-01 18:47:27 [core.py:1512] Traceback (most recent call last):\n"
        "(APIServer pid=7) ERROR 12-01 18:47:27 [async_llm.py:906] vllm.v1.engine.exceptions.EngineDeadError: "
        "EngineCore encountered an issue. See stack trace (above) for the root cause.\n"
        'INFO:     127.0.0.1:33540 - "POST /inference/v1/generate HTTP/1.1" 500 Internal Server Error\n'
    )
    assert (
        log_gist(log)
        == "RuntimeError: Unsupported CPU attention configuration: head_dim=16 isa=2 kv_cache_idx=0"
    )


def test_an_exit_by_signal_is_named(tmp_path):
    command = ["sh", "-c", f"kill -{int(signal.SIGKILL)} $$"]
    with pytest.raises(ServerStartError, match=r"killed by SIGKILL"):
        ServerProcess.start("engine-0", command, port=free_port(), log_path=tmp_path / "s.log", timeout=10)


def test_each_vllm_server_is_bound_to_a_cpu_of_its_own_by_default():
    from actors.engine.vllm_engine import server_env
    from schemas.config import VllmConfig

    cpus = sorted(os.sched_getaffinity(0))
    bound = [server_env(VllmConfig(), index)["VLLM_CPU_OMP_THREADS_BIND"] for index in range(len(cpus) + 1)]
    assert bound == [str(cpu) for cpu in cpus] + [str(cpus[0])]  # round-robin over the allowed CPUs
    assert server_env(VllmConfig(cpu_threads_bind="nobind"), 0)["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"


def test_servers_launched_at_once_are_never_given_the_same_port():
    from concurrent.futures import ThreadPoolExecutor

    from actors.engine.server_process import free_port

    with ThreadPoolExecutor(8) as pool:
        ports = list(pool.map(lambda _: free_port(), range(64)))
    assert len(set(ports)) == len(ports)


def test_a_request_that_fails_says_whether_the_server_has_exited(tmp_path):
    port = free_port()
    server = ServerProcess.start(
        "test", [*HTTP_SERVER, str(port)], port=port, log_path=tmp_path / "s.log", health_path="/", timeout=30
    )
    try:
        assert server.exit_note(wait=0.1) == "", "a live server: the connection failed, not the server"
        os.kill(server.process.pid, signal.SIGKILL)
        assert server.exit_note() == ", the server process has exited (killed by SIGKILL)"
    finally:
        server.close()


def test_a_picked_port_taken_before_the_server_binds_it_is_picked_again(tmp_path, monkeypatch):
    import actors.engine.server_process as server_process

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        picks = iter([busy])
        real_free_port = server_process.free_port
        monkeypatch.setattr(server_process, "free_port", lambda: next(picks, None) or real_free_port())
        server = server_process.start_on_a_port(
            "engine-0", lambda port: [*HTTP_SERVER, str(port)], port=0, log_path=tmp_path / "s.log",
            health_path="/", timeout=30,
        )  # fmt: skip
        try:
            assert server.port != busy and server.alive
        finally:
            server.close()


def test_a_configured_port_that_is_taken_is_not_replaced(tmp_path):
    from actors.engine.server_process import PortTaken, start_on_a_port

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(PortTaken, match=f"port {port} on 127.0.0.1 is taken"):
            start_on_a_port(
                "engine-0", lambda p: [*HTTP_SERVER, str(p)], port=port, log_path=tmp_path / "s.log"
            )


ULIMIT_WARNING = (
    "(APIServer pid=7) WARNING 12-03 22:44:20 [system_utils.py:256] Found ulimit of 1024 and failed to "
    "automatically increase with error current limit exceeds maximum limit. This can cause fd limit errors "
    "like `OSError: [Errno 24] Too many open files`. Consider increasing with ulimit -n"
)
"""What vLLM logs at every start here: a warning that reads like an error."""

DYING_SERVER = r"""
import os, signal, sys
from http.server import BaseHTTPRequestHandler, HTTPServer

print(sys.argv[2], flush=True)

class Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        if self.path == "/die":
            print("(APIServer pid=7) ERROR 12-03 22:48:37 [api_server.py:1] Traceback (most recent call last):")
            print('(APIServer pid=7) ERROR 12-03 22:48:37 [api_server.py:1]   File "model.py", line 3, in forward')
            print("(APIServer pid=7) ERROR 12-03 22:48:37 [api_server.py:1] RuntimeError: CPU out of memory "
                  "allocating 2048 MiB", flush=True)
            os._exit(1)
        if self.path == "/kill":
            print("(APIServer pid=7) INFO 12-03 22:48:37 [loggers.py:1] Engine 000: Running: 0 reqs", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, format, *args):
        print(f'INFO:     127.0.0.1:1 - "{self.requestline}" 200 OK', flush=True)

HTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
"""


def _dying_server(tmp_path) -> ServerProcess:
    port = free_port()
    command = [sys.executable, "-c", DYING_SERVER, str(port), ULIMIT_WARNING]
    return ServerProcess.start(
        "engine-0", command, port=port, log_path=tmp_path / "s.log", health_path="/", timeout=30
    )


def _request(server: ServerProcess, path: str) -> None:
    import httpx

    with pytest.raises(httpx.TransportError):
        httpx.get(server.url + path, timeout=10)


def test_a_server_that_dies_mid_run_is_reported_with_the_last_lines_of_its_traceback(tmp_path):
    server = _dying_server(tmp_path)
    try:
        _request(server, "/die")
        note = server.exit_note()
    finally:
        server.close()
    assert note == (
        ", the server process has exited (exit code 1): RuntimeError: CPU out of memory allocating 2048 MiB"
    ), note


def test_a_server_killed_mid_run_whose_log_says_nothing_is_reported_by_the_signal_alone(tmp_path):
    server = _dying_server(tmp_path)
    try:
        _request(server, "/kill")
        note = server.exit_note()
    finally:
        server.close()
    assert note == ", the server process has exited (killed by SIGKILL)", note


def test_the_gist_of_a_server_whose_engine_died_quotes_its_error_lines_not_a_warning(tmp_path):
    log = tmp_path / "s.log"
    log.write_text(
        ULIMIT_WARNING + "\n"
        'INFO:     127.0.0.1:51926 - "POST /inference/v1/generate HTTP/1.1" 200 OK\n'
        "(APIServer pid=7) WARNING 12-03 22:48:37 [core_client.py:817] [shutdown] MPClient: engine core exited "
        "unexpectedly; starting cleanup\n"
        "(APIServer pid=7) ERROR 12-03 22:48:37 [async_llm.py:906] AsyncLLM output_handler failed.\n"
        "(APIServer pid=7) ERROR 12-03 22:48:37 [async_llm.py:906] Traceback (most recent call last):\n"
        '(APIServer pid=7) ERROR 12-03 22:48:37 [async_llm.py:906]   File "core_client.py", line 1235, in get\n'
        "(APIServer pid=7) ERROR 12-03 22:48:37 [async_llm.py:906]     raise self._format_exception(outputs)\n"
        "(APIServer pid=7) ERROR 12-03 22:48:37 [async_llm.py:906] vllm.v1.engine.exceptions.EngineDeadError: "
        "EngineCore encountered an issue. See stack trace (above) for the root cause.\n"
        "INFO:     Shutting down\n"
        "(APIServer pid=7) INFO 12-03 22:48:40 [loggers.py:335] Engine 000: Avg prompt throughput: 0.0 tokens/s\n"
    )
    assert log_gist(log) == (
        "AsyncLLM output_handler failed. vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an "
        "issue. See stack trace (above) for the root cause."
    )


def test_the_gist_of_a_pydantic_error_adds_what_failed_from_the_indented_line_after_it(tmp_path):
    log = tmp_path / "s.log"
    log.write_text(
        "pydantic_core._pydantic_core.ValidationError: 1 validation error for ModelConfig\n"
        "  Value error, Unrecognized model in /m. Should have a `model_type` key in its config.json.\n"
        "    For further information visit https://errors.pydantic.dev/2.14/v/value_error\n"
    )
    assert log_gist(log) == (
        "pydantic_core._pydantic_core.ValidationError: 1 validation error for ModelConfig: Value error, "
        "Unrecognized model in /m. Should have a `model_type` key in its config.json."
    )
