"""Build the Grafana dashboards under ``grafana/dashboards/`` from the definitions below.

    python grafana/make_dashboards.py           # rewrite the JSON files
    python grafana/make_dashboards.py --check   # exit 1 if a committed file is out of date

The dashboards are written as code so that every PromQL expression sits in one reviewable
place and the grid layout is computed; tests/test_grafana.py checks the committed JSON
against this file, against Grafana's schema, and runs every expression on a real
Prometheus scraping a real run. Edit here, not in the JSON (or in Grafana's UI).

Every query selects the dashboard's run with ``run=~"$run"`` (metric names and labels are
in docs/metrics.md); engine-level series also honour ``$engine``. The "Inference engines"
row reads the servers' own metrics (vLLM's ``vllm:*``, SGLang's ``sglang:*``), which
Prometheus scrapes from the file_sd targets the run writes (``metrics.engine_targets_dir``).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

# The building blocks sit beside this script, which is run as a file, not imported as a package.
sys.path.insert(0, str(Path(__file__).resolve().parent))
from dashboard_json import (
    BAD_FROM_ONE,
    Json,
    PanelSpec,
    Query,
    dashboard,
    gauge,
    quantiles,
    render,
    stat,
    table,
    threshold_config,
    timeseries,
)

DASHBOARDS_DIR = Path(__file__).resolve().parent / "dashboards"


# --- the RL overview ------------------------------------------------------------------------

TRAINER_VERSION = 'max by (run) (miles_weight_version{run=~"$run", role="trainer"})'
ENGINES = 'run=~"$run", role="engine", engine=~"$engine"'
# A healthy run has no failure series at all; "(none)" = 0 keeps the panels from showing "No data".
NO_FAILURE = 'label_replace(0 * max(miles_rollout_id{run=~"$run"}), "actor", "(none)", "", "")'
NO_FAULT = 'label_replace(0 * max(miles_rollout_id{run=~"$run"}), "cell", "(none)", "", "")'


def _last_value_series(
    title: str, description: str, metric: str, unit: str = "short", width: int = 8
) -> PanelSpec:
    query = Query(f'max by (run) ({metric}{{run=~"$run"}})', title.lower())
    return timeseries(title, description, query, unit=unit, width=width)


def _weights_and_verification() -> list[PanelSpec]:
    return [
        timeseries(
            "Weight version",
            'The version each engine serves and the version the trainer last staged ("default" = 0).',
            Query(f"max by (engine) (miles_weight_version{{{ENGINES}}})", "{{engine}}"),
            Query(TRAINER_VERSION, "trainer"),
            width=12,
            stepped=True,
        ),
        stat(
            "Version skew",
            "Trainer version minus the oldest version an engine serves: 1 while a publication is in "
            "flight, more when engines fall behind.",
            Query(f"{TRAINER_VERSION} - min by (run) (miles_weight_version{{{ENGINES}}})", "skew"),
            thresholds=threshold_config((None, "green"), (2, "orange"), (3, "red")),
        ),
        stat(
            "Distinct digests",
            "Different weight digests among the trainer and the engines: 1 when all hold the same "
            "weights (2 between a stage and its load).",
            Query(
                'count by (run) (count by (run, digest) (miles_weight_checksum_info{run=~"$run"}))', "digests"
            ),
            thresholds=threshold_config((None, "green"), (2, "orange"), (3, "red")),
        ),
        stat(
            "Engines on the trainer's digest",
            "Engines whose served weights have the digest of the weights the trainer staged last, "
            "out of all engines.",
            Query(
                f"count by (run) (miles_weight_checksum_info{{{ENGINES}}} * on (run, digest) group_left () "
                'max by (run, digest) (miles_weight_checksum_info{run=~"$run", role="trainer"}))',
                "on trainer digest",
            ),
            Query(f"count by (run) (miles_weight_version{{{ENGINES}}})", "engines"),
            no_value="0",
        ),
        stat(
            "Verified publications",
            "Publications whose engine checksums matched the trainer's.",
            Query('sum by (run) (miles_publications_total{run=~"$run", outcome="verified"})', "verified"),
        ),
        stat(
            "Mismatches and failures",
            "Publications whose checksums differed (mismatch) or that did not complete (failed).",
            Query(
                'sum by (outcome) (miles_publications_total{run=~"$run", outcome=~"mismatch|failed"})',
                "{{outcome}}",
            ),
            thresholds=BAD_FROM_ONE,
        ),
        stat(
            "Mismatched tensors",
            "Tensors that differed in the last mismatching publication (0 until one).",
            Query('max by (run) (miles_publication_mismatched_tensors{run=~"$run"})', "tensors"),
            thresholds=BAD_FROM_ONE,
        ),
        timeseries(
            "Publications by outcome",
            "Publications per interval, by verification outcome.",
            Query(
                'sum by (outcome) (increase(miles_publications_total{run=~"$run"}[$__rate_interval]))',
                "{{outcome}}",
            ),
            width=12,
            bars=True,
        ),
        table(
            "Weight digests",
            "The digest and version of the weights the trainer staged last and each engine serves.",
            'max by (role, engine, weight_version, digest) (miles_weight_checksum_info{run=~"$run", engine=~"$engine|"})',
            width=12,
            height=8,
            hide=("Time", "Value"),
        ),
    ]


def _learning() -> list[PanelSpec]:
    return [
        stat(
            "Rollout",
            "The last rollout generated.",
            Query('max by (run) (miles_rollout_id{run=~"$run"})', "rollout"),
        ),
        gauge(
            "Progress",
            "Rollouts generated out of the run's num_rollout.",
            Query(
                '(max by (run) (miles_rollout_id{run=~"$run"}) + 1) / max by (run) (miles_rollout_num{run=~"$run"})',
                "progress",
            ),
            unit="percentunit",
            maximum=1,
        ),
        table(
            "Run",
            "Runtime and status (running, completed, failed, stopped).",
            'max by (run, runtime, status) (miles_run_info{run=~"$run"})',
            width=8,
            height=4,
            hide=("Time", "Value"),
        ),
        stat(
            "Reward mean",
            "Mean reward of the last rollout.",
            Query('max by (run) (miles_rollout_reward_mean{run=~"$run"})', "reward"),
        ),
        stat(
            "Staleness",
            "Trainer version minus the oldest version a sample of the last trained batch was generated with.",
            Query('max by (run) (miles_rollout_staleness{run=~"$run"})', "staleness"),
            thresholds=threshold_config((None, "green"), (2, "orange")),
        ),
        _last_value_series("Reward", "Mean reward of each rollout.", "miles_rollout_reward_mean"),
        timeseries(
            "Eval scores",
            "The last evaluation, one series per metric it reports (sample counts and lengths left out).",
            Query(
                'max by (metric) (miles_eval_score{run=~"$run", metric!~".*(num_samples|length).*"})',
                "{{metric}}",
            ),
        ),
        _last_value_series(
            "Staleness", "Staleness of each trained batch, in weight versions.", "miles_rollout_staleness"
        ),
        timeseries(
            "Token staleness",
            "Response tokens trained per interval, by how many publications behind the trainer's "
            "version they were sampled (asynchronous training: up to run.max_staleness), and the "
            "tokens past the bound left out (run.staleness_policy drop or mask).",
            Query(
                'sum by (staleness) (increase(miles_trained_tokens_by_staleness_total{run=~"$run"}[$__rate_interval]))',
                "{{staleness}} behind",
            ),
            Query('sum(increase(miles_stale_tokens_total{run=~"$run"}[$__rate_interval]))', "past the bound"),
            Query(
                'sum(increase(miles_stale_samples_total{run=~"$run"}[$__rate_interval]))', "samples dropped"
            ),
            width=24,
            bars=True,
        ),
        _last_value_series("Loss", "Loss of each train step.", "miles_train_loss"),
        _last_value_series("KL", "KL to the reference policy of each train step.", "miles_train_kl"),
        _last_value_series("Grad norm", "Gradient norm of each train step.", "miles_train_grad_norm"),
        _last_value_series("Entropy", "Policy entropy of each train step.", "miles_train_entropy", width=12),
        _last_value_series(
            "Clip fraction",
            "Fraction of clipped ratios of each train step.",
            "miles_train_clipfrac",
            "percentunit",
            12,
        ),
    ]


def _throughput_and_latency() -> list[PanelSpec]:
    def p95(metric: str, legend: str) -> Query:
        return Query(
            f'histogram_quantile(0.95, sum by (le) (rate({metric}_bucket{{run=~"$run"}}[$__rate_interval])))',
            legend,
        )

    return [
        timeseries(
            "Tokens per second",
            "Response tokens generated for training rollouts, and tokens trained on.",
            Query(
                'sum by (run) (rate(miles_tokens_generated_total{run=~"$run"}[$__rate_interval]))',
                "generated",
            ),
            Query('sum by (run) (rate(miles_train_tokens_total{run=~"$run"}[$__rate_interval]))', "trained"),
        ),
        timeseries(
            "Step time (p95)",
            "Time to generate a rollout, to train on it, and to evaluate.",
            p95("miles_rollout_duration_seconds", "generate"),
            p95("miles_train_duration_seconds", "train"),
            p95("miles_eval_duration_seconds", "eval"),
            unit="s",
        ),
        timeseries(
            "Publication latency",
            "Publication time by phase: stage (trainer), load (engines), total.",
            *quantiles("miles_publication_duration_seconds", by="phase", legend="{{phase}}"),
            unit="s",
        ),
        timeseries(
            "Verification latency",
            "Time to compare the trainer's and the engines' checksums.",
            *quantiles("miles_verification_duration_seconds"),
            unit="s",
        ),
        timeseries(
            "Checkpoint save latency",
            "Time to save a checkpoint.",
            *quantiles("miles_checkpoint_duration_seconds"),
            unit="s",
        ),
        stat(
            "Last checkpoint",
            "Rollout of the last saved checkpoint.",
            Query('max by (run) (miles_checkpoint_last_rollout_id{run=~"$run"})', "rollout"),
        ),
        stat(
            "Checkpoint size",
            "Size of the last saved checkpoint.",
            Query('max by (run) (miles_checkpoint_bytes{run=~"$run"})', "size"),
            unit="bytes",
        ),
        stat(
            "Checkpoints",
            "Checkpoints saved and failed.",
            Query('sum by (outcome) (miles_checkpoints_total{run=~"$run"})', "{{outcome}}"),
        ),
        stat(
            "Publication p95 (range)",
            "95th percentile of publication time by phase over the dashboard's time range.",
            Query(
                "histogram_quantile(0.95, sum by (le, phase) "
                '(increase(miles_publication_duration_seconds_bucket{run=~"$run"}[$__range])))',
                "{{phase}}",
            ),
            unit="s",
        ),
    ]


def _trainer_ranks() -> list[PanelSpec]:
    def per_rank(metric: str) -> Query:
        return Query(f'max by (rank) ({metric}{{run=~"$run"}})', "rank {{rank}}")

    step = 'miles_trainer_rank_step_seconds{run=~"$run"}'
    return [
        stat(
            "Trainer ranks",
            "The trainer's ranks (trainer.num_ranks): one process each, in one torch.distributed group.",
            Query('max by (run) (miles_trainer_ranks{run=~"$run"})', "ranks"),
        ),
        stat(
            "Slowest / fastest rank",
            "The last train step's slowest rank time over its fastest: 1 when the ranks are balanced.",
            Query(f"max by (run) ({step}) / min by (run) ({step})", "ratio"),
            thresholds=threshold_config((None, "green"), (1.2, "orange"), (1.5, "red")),
        ),
        timeseries(
            "Step time per rank",
            "Wall time of each rank's part of each train step.",
            per_rank("miles_trainer_rank_step_seconds"),
            unit="s",
            width=16,
        ),
        stat(
            "Peak memory (largest rank)",
            "The largest peak memory of any rank: CUDA's max allocated bytes on a GPU, peak RSS on CPU.",
            Query('max by (run) (miles_trainer_rank_peak_memory_bytes{run=~"$run"})', "peak"),
            unit="bytes",
            width=8,
        ),
        timeseries(
            "Peak memory per rank",
            "Each rank's peak memory so far: CUDA's max allocated bytes on a GPU, the process's peak RSS on CPU.",
            per_rank("miles_trainer_rank_peak_memory_bytes"),
            unit="bytes",
            width=12,
        ),
        timeseries(
            "Train state per rank",
            "Parameters, gradients and optimizer state each rank holds: its shard under FSDP2, a replica under DDP.",
            per_rank("miles_trainer_rank_state_bytes"),
            unit="bytes",
            width=12,
        ),
    ]


def _bus_and_failures() -> list[PanelSpec]:
    return [
        timeseries(
            "Mailbox depth",
            "Most events waiting in each actor's bus mailbox per interval (live runs only).",
            Query(
                'max by (actor) (max_over_time(miles_bus_mailbox_depth{run=~"$run"}[$__rate_interval]))',
                "{{actor}}",
            ),
        ),
        timeseries(
            "Mailbox high-water mark",
            "Most events a mailbox ever held; near its capacity means backpressure (live runs only).",
            Query('max by (actor) (miles_bus_mailbox_high_water_mark{run=~"$run"})', "{{actor}}"),
        ),
        timeseries(
            "Events per second",
            "Events on the bus, by event type.",
            Query('sum by (type) (rate(miles_bus_events_total{run=~"$run"}[$__rate_interval]))', "{{type}}"),
        ),
        stat(
            "Actor failures",
            "Handler errors and dead actor processes, by actor.",
            Query(
                f'sum by (actor) (miles_actor_failures_total{{run=~"$run"}}) or on () {NO_FAILURE}',
                "{{actor}}",
            ),
            thresholds=BAD_FROM_ONE,
            width=8,
            height=8,
        ),
        timeseries(
            "Actor failures over time",
            "Actor failures per interval, by actor.",
            Query(
                f'sum by (actor) (increase(miles_actor_failures_total{{run=~"$run"}}[$__rate_interval])) or on () {NO_FAILURE}',
                "{{actor}}",
            ),
            width=16,
            bars=True,
        ),
    ]


def _faults_and_restarts() -> list[PanelSpec]:
    return [
        timeseries(
            "Cell health",
            "1 while an engine (rollout-{i}) or a trainer rank (actor-{i}) runs and answers its health checks; "
            "0 while it fails them, is restarted or is suspended (run.ft_components).",
            Query('max by (cell) (miles_cell_healthy{run=~"$run"})', "{{cell}}"),
            width=8,
        ),
        stat(
            "Restarts",
            "Engines, trainer ranks and the Saver's process started again after dying, hanging or a "
            "suspension, by cell.",
            Query('sum by (cell) (miles_cell_restarts_total{run=~"$run"})', "{{cell}}"),
            thresholds=BAD_FROM_ONE,
            width=8,
        ),
        timeseries(
            "Failures over time",
            "Engines, trainer ranks and the Saver's process found dead or hung per interval, by cell and kind.",
            Query(
                'sum by (cell, kind) (increase(miles_cell_failures_total{run=~"$run"}[$__rate_interval]))',
                "{{cell}} {{kind}}",
            ),
            width=8,
            bars=True,
        ),
        timeseries(
            "Restart time",
            "From a failure seen to the cell running again: an engine's weights loaded again, the trainer's "
            "ranks started (95th percentile, and the mean).",
            Query(
                "histogram_quantile(0.95, sum by (le) "
                '(rate(miles_cell_restart_duration_seconds_bucket{run=~"$run"}[$__rate_interval])))',
                "p95",
            ),
            Query(
                'sum(miles_cell_restart_duration_seconds_sum{run=~"$run"}) '
                '/ sum(miles_cell_restart_duration_seconds_count{run=~"$run"})',
                "mean",
            ),
            unit="s",
            width=12,
        ),
        timeseries(
            "Faults injected",
            "Faults delivered through the control server's inject-fault, by cell and mode.",
            Query(
                f'sum by (cell, mode) (miles_fault_injections_total{{run=~"$run"}}) or on () {NO_FAULT}',
                "{{cell}} {{mode}}",
            ),
            width=12,
        ),
        timeseries(
            "Trainer restores and rollouts done again",
            "The trainer's group given the latest checkpoint back after a rank failed or the group was "
            "suspended, and the rollouts generated and trained again after it, per interval.",
            Query('sum(increase(miles_trainer_restores_total{run=~"$run"}[$__rate_interval]))', "restores"),
            Query(
                'sum(increase(miles_rollouts_redone_total{run=~"$run"}[$__rate_interval]))',
                "rollouts done again",
            ),
            width=24,
            bars=True,
        ),
    ]


SERVERS = 'run=~"$run", engine=~"$engine"'
"""The series of the run's inference servers, scraped through their file_sd targets
(``metrics.engine_targets_dir``), which label them with the run and the engine."""


def _either(vllm: str, sglang: str) -> str:
    """A vLLM expression, or the SGLang one for a run on SGLang servers."""
    return f"({vllm}) or ({sglang})"


def _server_p95(vllm_metric: str, sglang_metric: str, legend: str) -> Query:
    def p95(metric: str) -> str:
        rate = f"rate({metric}_bucket{{{SERVERS}}}[$__rate_interval])"
        return f"histogram_quantile(0.95, sum by (le, engine) ({rate}))"

    return Query(_either(p95(vllm_metric), p95(sglang_metric)), f"{{{{engine}}}} {legend}")


def _inference_engines() -> list[PanelSpec]:
    """The servers' own metrics (``vllm:*``, ``sglang:*``): a run on the embedded engine has none."""
    return [
        timeseries(
            "Engine requests",
            "Requests each inference server is running and has queued.",
            Query(
                _either(
                    f"sum by (engine) (vllm:num_requests_running{{{SERVERS}}})",
                    f"sum by (engine) (sglang:num_running_reqs{{{SERVERS}}})",
                ),
                "{{engine}} running",
            ),
            Query(
                _either(
                    f"sum by (engine) (vllm:num_requests_waiting{{{SERVERS}}})",
                    f"sum by (engine) (sglang:num_queue_reqs{{{SERVERS}}})",
                ),
                "{{engine}} queued",
            ),
        ),
        timeseries(
            "Engine generation throughput",
            "Tokens each inference server generates per second.",
            Query(
                _either(
                    f"sum by (engine) (rate(vllm:generation_tokens_total{{{SERVERS}}}[$__rate_interval]))",
                    f"sum by (engine) (sglang:gen_throughput{{{SERVERS}}})",
                ),
                "{{engine}}",
            ),
        ),
        timeseries(
            "Engine KV cache use",
            "Fraction of each server's KV cache in use.",
            Query(
                _either(
                    f"max by (engine) (vllm:kv_cache_usage_perc{{{SERVERS}}})",
                    f"max by (engine) (sglang:token_usage{{{SERVERS}}})",
                ),
                "{{engine}}",
            ),
            unit="percentunit",
        ),
        timeseries(
            "Engine request latency (p95)",
            "Each server's end-to-end request latency and time to first token.",
            _server_p95(
                "vllm:e2e_request_latency_seconds", "sglang:e2e_request_latency_seconds", "end to end"
            ),
            _server_p95(
                "vllm:time_to_first_token_seconds", "sglang:time_to_first_token_seconds", "first token"
            ),
            unit="s",
            width=12,
        ),
        timeseries(
            "Engine inter-token latency (p95)",
            "Time between two output tokens of a request, on each server.",
            _server_p95("vllm:inter_token_latency_seconds", "sglang:inter_token_latency_seconds", ""),
            unit="s",
            width=12,
        ),
    ]


def overview() -> Json:
    """The RL overview of one run: weights, learning, throughput and latency, the trainer's
    ranks, the bus, faults and restarts, and the inference servers' own metrics."""
    return dashboard(
        "miles-rl-overview",
        "miles-events: RL overview",
        "Weights and their verification, learning curves, throughput and latency, and the event bus "
        "of a miles-events run (metrics: docs/metrics.md).",
        [
            ("Weights & verification", _weights_and_verification()),
            ("Learning", _learning()),
            ("Throughput & latency", _throughput_and_latency()),
            ("Trainer ranks", _trainer_ranks()),
            ("Bus & failures", _bus_and_failures()),
            ("Faults & restarts", _faults_and_restarts()),
            ("Inference engines", _inference_engines()),
        ],
    )


DASHBOARDS: dict[str, Callable[[], Json]] = {"miles-rl-overview.json": overview}
"""File name under ``dashboards/`` -> the function building it."""


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="compare instead of writing")
    args = parser.parse_args(argv)
    stale = []
    for name, build in DASHBOARDS.items():
        path = DASHBOARDS_DIR / name
        text = render(build())
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(name)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    for name in stale:
        print(
            f"{DASHBOARDS_DIR / name} is out of date: run python grafana/make_dashboards.py", file=sys.stderr
        )
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
