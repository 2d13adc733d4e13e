"""The Grafana dashboards, their provisioning, the Prometheus config and the compose file.

Checked with the real tools: ``promtool`` on the Prometheus config, ``tsc`` against Grafana's
own schema (npm ``@grafana/schema``) on every dashboard, and a real Prometheus scraping a real
run (live, and rebuilt from its event log by ``replay --serve-metrics``) on every PromQL
expression of every panel. A missing tool skips its tests, unless
``MILES_REQUIRE_OBSERVABILITY=1`` (CI), which makes it a failure; ``.ci/install-observability``
installs them.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
GRAFANA = REPO / "grafana"
DASHBOARDS = sorted((GRAFANA / "dashboards").glob("*.json"))
TYPES = GRAFANA / ".typecheck" / "dashboard-types.ts"
TSC = GRAFANA / ".typecheck" / "node_modules" / ".bin" / "tsc"
REQUIRE = os.environ.get("MILES_REQUIRE_OBSERVABILITY") == "1"
LIVE_ONLY_METRICS = ("miles_bus_mailbox_depth", "miles_bus_mailbox_high_water_mark")
"""Read from the live bus: absent from metrics rebuilt from an event log (docs/metrics.md)."""
SERVER_METRIC = re.compile(r"\b(vllm|sglang):\w+")
"""The inference servers' own metrics: a run on the embedded engine has none; they are
checked against a real vLLM server (tests/test_vllm_engine.py) and SGLang's own source."""


def require(present: bool, what: str) -> None:
    """Skip when a tool is missing; fail instead when CI requires the observability tools."""
    if present:
        return
    message = f"{what} is missing: run .ci/install-observability"
    if REQUIRE:
        pytest.fail(f"{message} (MILES_REQUIRE_OBSERVABILITY=1)")
    pytest.skip(message)


def load_yaml(path: Path) -> Any:
    yaml = pytest.importorskip("yaml")
    return yaml.safe_load(path.read_text())


def panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel, rows and the panels inside collapsed rows included."""
    for panel in dashboard.get("panels", []):
        yield panel
        yield from panel.get("panels", [])


def query_panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    return (p for p in panels(dashboard) if p["type"] not in ("row", "text"))


def expressions(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """(panel title + refId, expr) of every query of every panel."""
    return [
        (f"{panel['title']} [{target['refId']}]", target["expr"])
        for panel in query_panels(dashboard)
        for target in panel["targets"]
    ]


@pytest.fixture(scope="module", params=[path.name for path in DASHBOARDS])
def dashboard(request: pytest.FixtureRequest) -> dict[str, Any]:
    return json.loads((GRAFANA / "dashboards" / request.param).read_text())


# --- the dashboard JSON ---------------------------------------------------------------------


def test_the_overview_dashboard_exists() -> None:
    assert (GRAFANA / "dashboards" / "miles-rl-overview.json") in DASHBOARDS


def test_panel_ids_are_unique(dashboard: dict[str, Any]) -> None:
    ids = [panel["id"] for panel in panels(dashboard)]
    assert len(ids) == len(set(ids)), sorted(i for i in ids if ids.count(i) > 1)


def test_every_panel_has_queries_with_an_expression(dashboard: dict[str, Any]) -> None:
    for panel in query_panels(dashboard):
        assert panel.get("targets"), panel["title"]
        for target in panel["targets"]:
            assert target.get("expr", "").strip() and target.get("refId"), (panel["title"], target)


def test_every_query_selects_the_run(dashboard: dict[str, Any]) -> None:
    missing = [name for name, expr in expressions(dashboard) if not re.search(r"\$(run\b|\{run\})", expr)]
    assert not missing


def test_every_panel_queries_the_provisioned_datasource(dashboard: dict[str, Any]) -> None:
    provisioned = load_yaml(GRAFANA / "provisioning" / "datasources" / "prometheus.yml")["datasources"][0]
    expected = {"type": provisioned["type"], "uid": provisioned["uid"]}
    for panel in query_panels(dashboard):
        assert panel["datasource"] == expected, panel["title"]
        assert all(target["datasource"] == expected for target in panel["targets"]), panel["title"]


def test_panels_fit_the_grid_without_overlapping(dashboard: dict[str, Any]) -> None:
    taken: dict[tuple[int, int], str] = {}
    for panel in dashboard["panels"]:
        pos = panel["gridPos"]
        assert pos["x"] >= 0 and pos["x"] + pos["w"] <= 24, panel["title"]
        columns, lines = range(pos["x"], pos["x"] + pos["w"]), range(pos["y"], pos["y"] + pos["h"])
        for cell in ((x, y) for x in columns for y in lines):
            assert cell not in taken, f"{panel['title']} overlaps {taken[cell]}"
            taken[cell] = panel["title"]


def test_run_and_engine_variables_come_from_the_metrics(dashboard: dict[str, Any]) -> None:
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["run"]["query"] == "label_values(miles_rollout_id, run)"
    engines = r'label_values\(miles_weight_version\{.*role="engine".*\}, engine\)'
    assert re.fullmatch(engines, variables["engine"]["query"])
    assert any("$engine" in expr for _, expr in expressions(dashboard))


def test_queries_use_only_documented_metrics(dashboard: dict[str, Any]) -> None:
    docs = REPO / "docs" / "metrics.md"
    if not docs.exists():
        pytest.skip("docs/metrics.md (the exporter's metric reference) is not there")
    documented = set(re.findall(r"^\| `(miles_\w+)` \|", docs.read_text(), flags=re.M))
    names = {name for _, expr in expressions(dashboard) for name in re.findall(r"\bmiles_\w+", expr)}
    used = {re.sub(r"_(bucket|sum|count)$", "", name) for name in names}  # a histogram's series
    assert used - documented == set()


def row_panels(dashboard: dict[str, Any], title: str) -> list[dict[str, Any]]:
    """The panels of the expanded row ``title``: those after it, up to the next row."""
    found: list[dict[str, Any]] | None = None
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            if found is not None:
                break
            if panel["title"] == title:
                found = []
        elif found is not None:
            found.append(panel)
    assert found, f"no row {title!r}"
    return found


def test_the_trainer_ranks_row_shows_each_ranks_step_time_and_memory_from_the_exporters_gauges() -> None:
    from miles_events.sinks.metrics import SPECS_BY_NAME

    overview = json.loads((GRAFANA / "dashboards" / "miles-rl-overview.json").read_text())
    by_title = {panel["title"]: panel for panel in row_panels(overview, "Trainer ranks")}
    per_rank = {
        "Step time per rank": ("miles_trainer_rank_step_seconds", "s"),
        "Peak memory per rank": ("miles_trainer_rank_peak_memory_bytes", "bytes"),
        "Train state per rank": ("miles_trainer_rank_state_bytes", "bytes"),
    }
    for title, (metric, unit) in per_rank.items():
        (target,) = by_title[title]["targets"]
        assert target["expr"] == f'max by (rank) ({metric}{{run=~"$run"}})', title
        assert (
            target["legendFormat"] == "rank {{rank}}"
            and by_title[title]["fieldConfig"]["defaults"]["unit"] == unit
        )
        assert SPECS_BY_NAME[metric].labels == ("rank",)
    (count,) = by_title["Trainer ranks"]["targets"]
    assert "miles_trainer_ranks{" in count["expr"]
    used = {
        name
        for panel in by_title.values()
        for t in panel["targets"]
        for name in re.findall(r"\bmiles_\w+", t["expr"])
    }
    assert used <= set(SPECS_BY_NAME)


def test_the_engines_row_asks_each_server_backend_for_metrics_it_defines() -> None:
    """SGLang's names from its own source (the pinned package; its servers cannot run here);
    vLLM's are checked on a real server by tests/test_vllm_engine.py."""
    overview = json.loads((GRAFANA / "dashboards" / "miles-rl-overview.json").read_text())
    used = {m.group(0) for _, e in expressions(overview) for m in SERVER_METRIC.finditer(e)}
    assert {name.split(":")[0] for name in used} == {"vllm", "sglang"}
    import importlib.util

    # Found, not imported: importing SGLang patches transformers (tests/sglang_validator.py).
    spec = importlib.util.find_spec("sglang")
    if spec is None or spec.origin is None:
        pytest.skip("sglang is not installed (bash .ci/setup installs it)")
    observability = Path(spec.origin).parent / "srt" / "observability"
    defined = set(
        re.findall(r'name="(sglang:\w+)"', "".join(p.read_text() for p in observability.glob("*.py")))
    )
    names = {re.sub(r"_(bucket|sum|count)$", "", n) for n in used if n.startswith("sglang:")}
    assert names and names - defined == set()


def test_prometheus_scrapes_the_inference_servers_from_the_targets_the_run_writes() -> None:
    config = load_yaml(GRAFANA / "prometheus.yml")
    (job,) = [job for job in config["scrape_configs"] if job["job_name"] == "inference-engines"]
    (discovery,) = job["file_sd_configs"]
    assert discovery["files"] == ["targets/*.json"] and (GRAFANA / "targets").is_dir()
    prometheus = mounts(load_yaml(GRAFANA / "docker-compose.yml")["services"]["prometheus"])
    assert prometheus["./targets"] == "/etc/prometheus/targets", "beside the config, where the glob resolves"


def test_dashboards_are_up_to_date_with_their_source() -> None:
    command = [sys.executable, str(GRAFANA / "make_dashboards.py"), "--check"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


# --- Grafana's schema (tsc) -----------------------------------------------------------------


def typecheck(dashboards: dict[str, str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """``tsc`` on each dashboard JSON text, both as Grafana's ``Dashboard`` and with typed panels."""
    require(
        TSC.exists() and shutil.which("node") is not None, "tsc with @grafana/schema (grafana/.typecheck)"
    )
    types = TYPES.with_suffix("").as_posix()
    files = []
    for name, text in dashboards.items():
        source = tmp_path / f"{Path(name).stem}.ts"
        body = text.strip()
        source.write_text(
            f'import type {{ DashboardJson, TypedDashboardJson }} from "{types}";\n'
            f"export const dashboard = {body} satisfies DashboardJson;\n"
            f"export const typed = {body} satisfies TypedDashboardJson;\n"
        )
        files.append(str(source))
    options = ["--noEmit", "--strict", "--skipLibCheck", "--target", "es2022"]
    options += ["--module", "esnext", "--moduleResolution", "bundler"]  # resolves the package's exports map
    return subprocess.run([str(TSC), *options, *files], capture_output=True, text=True, timeout=120)


def test_dashboards_satisfy_grafanas_schema(tmp_path: Path) -> None:
    result = typecheck({path.name: path.read_text() for path in DASHBOARDS}, tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


def broken(mutate: Any) -> dict[str, str]:
    """The overview dashboard with one mistake made by ``mutate(dashboard)``."""
    dashboard = json.loads((GRAFANA / "dashboards" / "miles-rl-overview.json").read_text())
    mutate(dashboard)
    return {"broken.json": json.dumps(dashboard)}


def test_schema_check_rejects_a_malformed_grid_position(tmp_path: Path) -> None:
    result = typecheck(broken(lambda d: next(query_panels(d)).update(gridPos="oops")), tmp_path)
    assert result.returncode != 0
    assert "TS2322" in result.stdout and "'string' is not assignable" in result.stdout, result.stdout


def test_schema_check_rejects_an_unknown_panel_option_value(tmp_path: Path) -> None:
    def misspell_legend_mode(dashboard: dict[str, Any]) -> None:
        timeseries = next(p for p in query_panels(dashboard) if p["type"] == "timeseries")
        timeseries["options"]["legend"]["displayMode"] = "tabel"

    result = typecheck(broken(misspell_legend_mode), tmp_path)
    assert result.returncode != 0
    assert '"tabel"' in result.stdout, result.stdout


# --- Prometheus config, provisioning, compose -----------------------------------------------


def test_promtool_accepts_the_prometheus_config() -> None:
    promtool = shutil.which("promtool")
    require(promtool is not None, "promtool (Debian package prometheus)")
    command = [promtool, "check", "config", str(GRAFANA / "prometheus.yml")]
    result = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_prometheus_scrapes_the_exporters_default_port_every_5s() -> None:
    config = load_yaml(GRAFANA / "prometheus.yml")
    (job,) = [job for job in config["scrape_configs"] if job["job_name"] == "miles-events"]
    assert job["scrape_interval"] == "5s"
    assert job["static_configs"][0]["targets"] == ["host.docker.internal:9464"]


def test_datasource_points_at_the_compose_prometheus_with_its_scrape_interval() -> None:
    (source,) = load_yaml(GRAFANA / "provisioning" / "datasources" / "prometheus.yml")["datasources"]
    compose = load_yaml(GRAFANA / "docker-compose.yml")
    scrape_interval = load_yaml(GRAFANA / "prometheus.yml")["global"]["scrape_interval"]
    assert (source["uid"], source["type"], source["url"]) == (
        "prometheus",
        "prometheus",
        "http://prometheus:9090",
    )
    assert "9090:9090" in compose["services"]["prometheus"]["ports"]
    assert source["jsonData"]["timeInterval"] == scrape_interval


def mounts(service: dict[str, Any]) -> dict[str, str]:
    """Host path (relative to grafana/) -> container path of a service's bind mounts."""
    pairs = (volume.split(":")[:2] for volume in service["volumes"])
    return {host: container for host, container in pairs if host.startswith(".")}


def test_compose_mounts_the_configs_where_the_services_read_them() -> None:
    services = load_yaml(GRAFANA / "docker-compose.yml")["services"]
    prometheus, grafana = mounts(services["prometheus"]), mounts(services["grafana"])
    assert f"--config.file={prometheus['./prometheus.yml']}" in services["prometheus"]["command"]
    assert grafana["./provisioning"] == "/etc/grafana/provisioning"
    (provider,) = load_yaml(GRAFANA / "provisioning" / "dashboards" / "miles.yml")["providers"]
    assert provider["type"] == "file" and provider["options"]["path"] == grafana["./dashboards"]
    home = Path(services["grafana"]["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"])
    assert home.parent.as_posix() == grafana["./dashboards"] and (GRAFANA / "dashboards" / home.name).exists()
    assert all((GRAFANA / host).exists() for host in (*prometheus, *grafana))


def test_compose_pins_images_and_reaches_the_host_exporter() -> None:
    services = load_yaml(GRAFANA / "docker-compose.yml")["services"]
    assert set(services) == {"prometheus", "grafana"}
    assert "3000:3000" in services["grafana"]["ports"]
    for name, service in services.items():
        tag = service["image"].partition(":")[2]
        assert tag and tag != "latest", name
        assert "host.docker.internal:host-gateway" in service["extra_hosts"], name


# --- every PromQL expression on a real Prometheus scraping a real run -----------------------


GRAFANA_VARIABLES = {"engine": ".*", "__rate_interval": "1m", "__interval": "15s", "__range": "10m"}
"""What Grafana puts in place of its variables: every engine, and intervals of a short dashboard."""


def substitute(expr: str, run_id: str) -> str:
    """``expr`` as Grafana sends it for run ``run_id``."""
    values = {**GRAFANA_VARIABLES, "run": run_id}
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: values[m.group(1) or m.group(2)], expr)


def api(url: str, path: str, **params: str) -> Any:
    """The ``data`` of a Prometheus HTTP API answer; a rejected query fails the test at once."""
    try:
        with urllib.request.urlopen(f"{url}{path}?{urllib.parse.urlencode(params)}", timeout=10) as answer:
            body = json.load(answer)
    except urllib.error.HTTPError as error:
        pytest.fail(f"Prometheus rejected {params}: {error.read().decode(errors='replace')}")
    return body["data"]


def query(url: str, promql: str) -> list[Any]:
    """The series an instant query returns now."""
    return api(url, "/api/v1/query", query=promql)["result"]


def wait_until_ready(url: str, server: subprocess.Popen[bytes], log: Path, timeout_s: float = 60) -> None:
    """Returns once Prometheus at ``url`` answers ``/-/ready`` (it answers 503 to every query
    while its storage starts); fails the test if it exits or is not ready in ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            pytest.fail(f"prometheus exited with {server.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"{url}/-/ready", timeout=5) as answer:
                if answer.status == 200:
                    return
        except OSError:
            pass  # not listening yet, or 503 while starting
        time.sleep(0.2)
    pytest.fail(f"prometheus at {url} was not ready within {timeout_s:.0f} s:\n{log.read_text()[-3000:]}")


def free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    for sock in sockets:
        sock.bind(("127.0.0.1", 0))
    ports = [sock.getsockname()[1] for sock in sockets]
    for sock in sockets:
        sock.close()
    return ports


@dataclass
class ObservedRuns:
    """A Prometheus that scrapes a live run and the replay of a finished run."""

    prometheus_url: str
    replayed_run: str
    live_run: str
    processes: dict[str, tuple[subprocess.Popen[bytes], Path]]

    def check_alive(self) -> None:
        for name, (process, log) in self.processes.items():
            if process.poll() is not None:
                pytest.fail(f"{name} exited with {process.returncode}:\n{log.read_text()[-3000:]}")

    def poll(self, deadline_s: float, every_s: float = 1.0) -> Iterator[None]:
        """Yields about every ``every_s`` until ``deadline_s`` passed, while every process still runs."""
        deadline = time.monotonic() + deadline_s
        while time.monotonic() < deadline:
            self.check_alive()
            yield
            time.sleep(every_s)

    def label_values(self, label: str, selector: str) -> list[str]:
        return api(self.prometheus_url, f"/api/v1/label/{label}/values", **{"match[]": selector})


def run_command(
    run_dir: Path, *, num_rollout: int, interval: int, overrides: tuple[str, ...] = ()
) -> list[str]:
    """A tiny local run evaluating and saving every ``interval`` rollouts."""
    settings = (
        f"run.dir={run_dir}",
        "run.runtime=local",
        f"run.num_rollout={num_rollout}",
        f"run.eval_interval={interval}",
        f"run.save_interval={interval}",
        *overrides,
    )
    sets = [arg for setting in settings for arg in ("--set", setting)]
    return [sys.executable, "-m", "miles_events.run", "examples/tiny.toml", *sets]


@contextlib.contextmanager
def observe_runs(prometheus: str, config: Path, tmp: Path) -> Iterator[ObservedRuns]:
    """Prometheus (1 s scrapes) on a live run and on ``replay --serve-metrics`` of a finished run.

    The live run goes on until the tests are done: the bus mailbox metrics exist only while a
    run runs. The finished run evaluates and saves after every one of its 3 rollouts.
    """
    live_port, replay_port, prometheus_port = free_ports(3)
    settings = load_yaml(config)
    settings["global"].update(scrape_interval="1s", evaluation_interval="1s")
    for job in settings["scrape_configs"]:
        job.update(scrape_interval="1s", scrape_timeout="1s")
        job["static_configs"] = [{"targets": [f"127.0.0.1:{live_port}", f"127.0.0.1:{replay_port}"]}]
    (tmp / "prometheus.yml").write_text(json.dumps(settings))  # JSON is YAML
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "RAY_USAGE_STATS_ENABLED": "0"}
    processes: dict[str, tuple[subprocess.Popen[bytes], Path]] = {}

    def start(name: str, args: list[str]) -> subprocess.Popen[bytes]:
        log = tmp / f"{name}.log"
        with log.open("wb") as out:
            process = subprocess.Popen(args, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
        processes[name] = (process, log)
        return process

    url = f"http://127.0.0.1:{prometheus_port}"
    runs = ObservedRuns(url, "", "", processes)
    try:
        config_file, storage = (
            f"--config.file={tmp / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp / 'data'}",
        )
        listen = f"--web.listen-address=127.0.0.1:{prometheus_port}"
        server = start("prometheus", [prometheus, config_file, storage, listen, "--log.level=warn"])
        wait_until_ready(url, server, processes["prometheus"][1])
        # Far more rollouts than it will reach: it is stopped when the tests are done.
        live_settings = ("saver.keep_last=1", "saver.fsync=false", f"metrics.port={live_port}")
        start("live run", run_command(tmp / "live", num_rollout=100_000, interval=2, overrides=live_settings))
        finished_settings = ("metrics.enabled=false",)  # the replay serves its metrics
        finished_run = run_command(tmp / "finished", num_rollout=3, interval=1, overrides=finished_settings)
        finished = start("finished run", finished_run)
        try:
            status: int | None = finished.wait(timeout=180)
        except subprocess.TimeoutExpired:
            status = None
        if status != 0:
            output = processes["finished run"][1].read_text()[-3000:]
            pytest.fail(f"the finished run ended with {status}:\n{output}")
        del processes["finished run"]
        replay = [sys.executable, "-m", "miles_events.replay", str(tmp / "finished" / "events.log")]
        start("replay", [*replay, "--serve-metrics", str(replay_port)])
        for _ in runs.poll(deadline_s=120):
            found = {
                port: [
                    s["metric"]["run"] for s in query(url, f'miles_rollout_id{{instance="127.0.0.1:{port}"}}')
                ]
                for port in (live_port, replay_port)
            }
            if found[live_port] and found[replay_port]:
                runs.live_run, runs.replayed_run = found[live_port][0], found[replay_port][0]
                break
        else:
            pytest.fail(f"Prometheus at {url} did not see both runs' miles_rollout_id within 120 s")
        yield runs
    finally:
        for process, _ in reversed(processes.values()):
            if process.poll() is None:
                process.send_signal(signal.SIGINT)  # the run and the replay stop cleanly on Ctrl-C
        for process, _ in processes.values():
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


@pytest.fixture(scope="module")
def observed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ObservedRuns]:
    prometheus = shutil.which("prometheus")
    require(prometheus is not None, "prometheus (Debian package prometheus)")
    replay_help = [sys.executable, "-m", "miles_events.replay", "--help"]
    help_text = subprocess.run(replay_help, capture_output=True, text=True, cwd=REPO, timeout=60).stdout
    if "--serve-metrics" not in help_text:
        pytest.skip("python -m miles_events.replay has no --serve-metrics option yet")
    tmp = tmp_path_factory.mktemp("observability")
    with observe_runs(str(prometheus), GRAFANA / "prometheus.yml", tmp) as runs:
        yield runs


def assert_all_return_data(
    observed: ObservedRuns, run_id: str, named: list[tuple[str, str]], deadline_s: float
) -> None:
    """Poll until every expression has returned at least one series once, or list those that never did."""
    pending = {name: substitute(expr, run_id) for name, expr in named}
    for _ in observed.poll(deadline_s):
        for name, promql in list(pending.items()):
            if query(observed.prometheus_url, promql):
                del pending[name]
        if not pending:
            return
    lines = "\n".join(f"  {name}: {promql}" for name, promql in pending.items())
    pytest.fail(f"{len(pending)} of {len(named)} expressions returned no data for run {run_id}:\n{lines}")


def run_expressions(observed: ObservedRuns, dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """The expressions on the run's own metrics (``miles_*``); every trainer reports its
    ranks (one, for the single-process trainer), so the per-rank ones are among them."""
    return [(n, e) for n, e in expressions(dashboard) if not SERVER_METRIC.search(e)]


@pytest.mark.slow
def test_every_query_returns_data_for_a_replayed_run(
    observed: ObservedRuns, dashboard: dict[str, Any]
) -> None:
    named = [
        (n, e) for n, e in run_expressions(observed, dashboard) if not any(m in e for m in LIVE_ONLY_METRICS)
    ]
    assert_all_return_data(observed, observed.replayed_run, named, deadline_s=45)


@pytest.mark.slow
def test_every_query_returns_data_for_a_live_run(observed: ObservedRuns, dashboard: dict[str, Any]) -> None:
    assert_all_return_data(observed, observed.live_run, run_expressions(observed, dashboard), deadline_s=45)


@pytest.mark.slow
def test_template_variables_list_the_runs_and_their_engines(
    observed: ObservedRuns, dashboard: dict[str, Any]
) -> None:
    for variable in dashboard["templating"]["list"]:
        parsed = re.fullmatch(r"label_values\((.*), (\w+)\)", variable["query"])
        assert parsed, variable["query"]
        selector, label = parsed.groups()
        for run_id in (observed.replayed_run, observed.live_run):
            values = observed.label_values(label, substitute(selector, run_id))
            assert values, (variable["name"], run_id)
            if variable["name"] == "run":
                assert run_id in values
