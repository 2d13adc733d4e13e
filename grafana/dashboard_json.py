"""Building blocks of Grafana dashboard JSON: panel kinds, grid layout, the dashboard.

``make_dashboards.py`` (beside this file) composes them into the dashboards under
``dashboards/``. Panels query the Prometheus data source provisioned with uid ``prometheus``
and select their run with the dashboard variable ``$run`` (and ``$engine`` where it applies).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

DATASOURCE: dict[str, str] = {"type": "prometheus", "uid": "prometheus"}
"""The data source every panel uses; its uid is the one provisioning/datasources gives it."""
GRID_WIDTH = 24
SCHEMA_VERSION = 41

Json = dict[str, Any]


@dataclass(frozen=True)
class Query:
    """One PromQL expression of a panel; ``table`` asks for one instant row per series."""

    expr: str
    legend: str = ""
    table: bool = False


@dataclass(frozen=True)
class PanelSpec:
    """A panel before layout: its kind, queries, size and plugin settings."""

    kind: str
    title: str
    description: str
    queries: tuple[Query, ...]
    width: int
    height: int
    unit: str = "short"
    options: Json = field(default_factory=dict)
    defaults: Json = field(default_factory=dict)
    transformations: tuple[Json, ...] = ()


# --- panel kinds --------------------------------------------------------------------------


def _queries(queries: Sequence[Query | str]) -> tuple[Query, ...]:
    return tuple(q if isinstance(q, Query) else Query(q) for q in queries)


def threshold_config(*steps: tuple[float | None, str]) -> Json:
    """Absolute thresholds: each (from value, colour); the first step's value is None (from -inf)."""
    return {"mode": "absolute", "steps": [{"color": color, "value": value} for value, color in steps]}


OK_ONLY = threshold_config((None, "green"))
BAD_FROM_ONE = threshold_config((None, "green"), (1, "red"))


def timeseries(
    title: str,
    description: str,
    *queries: Query | str,
    unit: str = "short",
    width: int = 8,
    stepped: bool = False,
    bars: bool = False,
) -> PanelSpec:
    """A time series panel; ``stepped`` for values that jump (versions), ``bars`` for counts."""
    custom: Json = {
        "drawStyle": "bars" if bars else "line",
        "lineInterpolation": "stepAfter" if stepped else "linear",
        "lineWidth": 1,
        "fillOpacity": 60 if bars else 10,
        "showPoints": "never",
        "spanNulls": True,
    }
    options = {
        "legend": {"calcs": [], "displayMode": "list", "placement": "bottom", "showLegend": True},
        "tooltip": {"mode": "multi", "sort": "desc"},
    }
    return PanelSpec(
        "timeseries",
        title,
        description,
        _queries(queries),
        width,
        8,
        unit,
        options,
        {"custom": custom, "color": {"mode": "palette-classic"}, "thresholds": OK_ONLY},
    )


def stat(
    title: str,
    description: str,
    *queries: Query | str,
    unit: str = "short",
    thresholds: Json = OK_ONLY,
    no_value: str | None = None,
    width: int = 4,
    height: int = 4,
) -> PanelSpec:
    """A single-number panel showing the last value of each series, coloured by thresholds."""
    options = {
        "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
        "orientation": "auto",
        "textMode": "auto",
        "colorMode": "value",
        "graphMode": "none",
        "justifyMode": "auto",
        "wideLayout": True,
        "showPercentChange": False,
    }
    defaults: Json = {"color": {"mode": "thresholds"}, "thresholds": thresholds}
    if no_value is not None:
        defaults["noValue"] = no_value
    return PanelSpec("stat", title, description, _queries(queries), width, height, unit, options, defaults)


def gauge(title: str, description: str, query: Query | str, *, unit: str, maximum: float) -> PanelSpec:
    """A gauge from 0 to ``maximum``."""
    options = {
        "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
        "orientation": "auto",
        "showThresholdLabels": False,
        "showThresholdMarkers": False,
    }
    defaults = {
        "color": {"mode": "thresholds"},
        "thresholds": threshold_config((None, "blue")),
        "min": 0,
        "max": maximum,
    }
    return PanelSpec("gauge", title, description, _queries([query]), 4, 4, unit, options, defaults)


def table(
    title: str, description: str, expr: str, *, width: int, height: int, hide: Sequence[str]
) -> PanelSpec:
    """One row per series of an instant query; ``hide`` drops columns (``Time``, ``Value``)."""
    organize = {"id": "organize", "options": {"excludeByName": dict.fromkeys(hide, True)}}
    return PanelSpec(
        "table",
        title,
        description,
        (Query(expr, table=True),),
        width,
        height,
        "short",
        {"showHeader": True},
        {"custom": {"align": "auto"}, "thresholds": OK_ONLY},
        (organize,),
    )


def quantiles(metric: str, by: str = "", legend: str = "") -> tuple[Query, Query]:
    """p50 and p95 of a histogram over ``$__rate_interval``, per ``by`` label if given."""
    group = f"le, {by}" if by else "le"
    suffix = f" {legend}" if legend else ""

    def at(quantile: float) -> Query:
        rate = f'rate({metric}_bucket{{run=~"$run"}}[$__rate_interval])'
        return Query(
            f"histogram_quantile({quantile}, sum by ({group}) ({rate}))", f"p{round(quantile * 100)}{suffix}"
        )

    return at(0.5), at(0.95)


# --- layout -------------------------------------------------------------------------------


class Grid:
    """Places panels on Grafana's 24-column grid: each at the highest free spot, leftmost first."""

    def __init__(self) -> None:
        self.skyline = [0] * GRID_WIDTH
        self.next_id = 1

    def _take_id(self) -> int:
        self.next_id += 1
        return self.next_id - 1

    def row(self, title: str) -> Json:
        """A full-width expanded row below everything placed so far."""
        y = max(self.skyline)
        self.skyline = [y + 1] * GRID_WIDTH
        return {
            "type": "row",
            "id": self._take_id(),
            "title": title,
            "collapsed": False,
            "gridPos": {"h": 1, "w": GRID_WIDTH, "x": 0, "y": y},
            "panels": [],
        }

    def place(self, spec: PanelSpec) -> Json:
        """The panel's JSON at the best spot for its size."""
        x, y = min(
            ((x, max(self.skyline[x : x + spec.width])) for x in range(GRID_WIDTH - spec.width + 1)),
            key=lambda spot: (spot[1], spot[0]),
        )
        for column in range(x, x + spec.width):
            self.skyline[column] = y + spec.height
        return _panel_json(spec, self._take_id(), {"h": spec.height, "w": spec.width, "x": x, "y": y})


def _target(query: Query, ref_id: str) -> Json:
    target: Json = {
        "datasource": dict(DATASOURCE),
        "refId": ref_id,
        "editorMode": "code",
        "expr": query.expr,
        "legendFormat": query.legend or "__auto",
        "range": not query.table,
        "instant": query.table,
    }
    if query.table:
        target["format"] = "table"
    return target


def _panel_json(spec: PanelSpec, panel_id: int, grid_pos: Json) -> Json:
    panel: Json = {
        "type": spec.kind,
        "id": panel_id,
        "title": spec.title,
        "description": spec.description,
        "datasource": dict(DATASOURCE),
        "gridPos": grid_pos,
        "targets": [_target(q, chr(ord("A") + i)) for i, q in enumerate(spec.queries)],
        "fieldConfig": {"defaults": {"unit": spec.unit, **spec.defaults}, "overrides": []},
        "options": spec.options,
    }
    if spec.transformations:
        panel["transformations"] = list(spec.transformations)
    return panel


def _query_variable(name: str, label: str, query: str, **extra: Any) -> Json:
    return {
        "name": name,
        "label": label,
        "type": "query",
        "datasource": dict(DATASOURCE),
        "query": query,
        "refresh": 2,  # on time-range change: new runs and engines appear without a reload
        "regex": "",
        "hide": 0,
        "skipUrlSync": False,
        **extra,
    }


def dashboard(
    uid: str, title: str, description: str, sections: Sequence[tuple[str, Sequence[PanelSpec]]]
) -> Json:
    """A whole dashboard: ``sections`` are (row title, panels) in order."""
    grid = Grid()
    panels: list[Json] = []
    for row_title, specs in sections:
        panels.append(grid.row(row_title))
        panels.extend(grid.place(spec) for spec in specs)
    builtin_annotations = {
        "builtIn": 1,
        "datasource": {"type": "grafana", "uid": "-- Grafana --"},
        "enable": True,
        "hide": True,
        "iconColor": "rgba(0, 211, 255, 1)",
        "name": "Annotations & Alerts",
        "type": "dashboard",
    }
    return {
        "uid": uid,
        "title": title,
        "description": description,
        "tags": ["miles-events", "rl"],
        "schemaVersion": SCHEMA_VERSION,
        "version": 1,
        "editable": True,
        "graphTooltip": 1,
        "fiscalYearStartMonth": 0,
        "liveNow": False,
        "refresh": "10s",
        "time": {"from": "now-30m", "to": "now"},
        "timepicker": {},
        "timezone": "browser",
        "links": [],
        "annotations": {"list": [builtin_annotations]},
        "templating": {
            "list": [
                # Run ids start with their start time: alphabetical descending puts the newest first.
                _query_variable(
                    "run", "Run", "label_values(miles_rollout_id, run)", sort=2, multi=False, includeAll=False
                ),
                _query_variable(
                    "engine",
                    "Engine",
                    'label_values(miles_weight_version{run=~"$run", role="engine"}, engine)',
                    sort=7,
                    multi=True,
                    includeAll=True,
                    allValue=".*",
                    current={"text": ["All"], "value": ["$__all"]},
                ),
            ]
        },
        "panels": panels,
    }


def render(dashboard_json: Json) -> str:
    """A dashboard's file content: stable key order, two-space indent, final newline."""
    return json.dumps(dashboard_json, indent=2, ensure_ascii=False) + "\n"
