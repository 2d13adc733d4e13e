/**
 * Types a dashboard JSON file is checked against (tests/test_grafana.py).
 *
 * The test wraps each dashboard as `export const d = <json> satisfies DashboardJson;` and
 * `... satisfies TypedDashboardJson;` and runs `tsc --noEmit --strict` on it.
 *
 * - `DashboardJson` is Grafana's own `Dashboard` type from `@grafana/schema`, with every
 *   string enum replaced by its string values: a JSON file holds `"absolute"`, which
 *   TypeScript does not accept where the enum `ThresholdsMode` is expected.
 * - `TypedDashboardJson` is stricter: every panel is a row or one of the panel plugins the
 *   dashboards use, and its `options` and `fieldConfig.defaults.custom` are checked against
 *   that plugin's own schema (Grafana leaves them untyped in `Dashboard`); every query is a
 *   Prometheus query with an `expr` and a `refId`.
 */
import type { DataSourceRef, Dashboard, Panel, RowPanel } from '@grafana/schema';
import type * as gauge from '@grafana/schema/dist/esm/raw/composable/gauge/panelcfg/x/GaugePanelCfg_types.gen';
import type * as stat from '@grafana/schema/dist/esm/raw/composable/stat/panelcfg/x/StatPanelCfg_types.gen';
import type * as table from '@grafana/schema/dist/esm/raw/composable/table/panelcfg/x/TablePanelCfg_types.gen';
import type * as text from '@grafana/schema/dist/esm/raw/composable/text/panelcfg/x/TextPanelCfg_types.gen';
import type * as timeseries from '@grafana/schema/dist/esm/raw/composable/timeseries/panelcfg/x/TimeSeriesPanelCfg_types.gen';

/** `T` as it can be written in JSON: string enums become their string values. */
export type JsonOf<T> = T extends string
  ? `${T}`
  : T extends number | boolean | null | undefined
    ? T
    : T extends Array<infer U>
      ? Array<JsonOf<U>>
      : T extends object
        ? { [K in keyof T]: JsonOf<T[K]> }
        : T;

/** A query of Grafana's Prometheus data source, as the dashboards write it. */
export interface PrometheusQuery {
  refId: string;
  expr: string;
  datasource?: DataSourceRef;
  legendFormat?: string;
  range?: boolean;
  instant?: boolean;
  format?: 'time_series' | 'table' | 'heatmap';
  editorMode?: 'code' | 'builder';
  interval?: string;
  intervalFactor?: number;
  exemplar?: boolean;
  hide?: boolean;
}

/**
 * A panel of plugin `TType`. Grafana merges a panel's `options` with the plugin's defaults,
 * so top-level options may be left out; what is written must match the plugin's schema.
 */
type PanelOf<TType extends string, TOptions, TCustom> = Omit<Panel<TOptions, Partial<TCustom>>, 'type' | 'options' | 'targets'> & {
  type: TType;
  options?: Partial<TOptions>;
  targets?: PrometheusQuery[];
};

/** Every panel kind the dashboards use. */
export type TypedPanel =
  | PanelOf<'timeseries', timeseries.Options, timeseries.FieldConfig>
  | PanelOf<'stat', stat.Options, Record<string, never>>
  | PanelOf<'gauge', gauge.Options, Record<string, never>>
  | PanelOf<'table', table.Options, table.FieldConfig>
  | (PanelOf<'text', text.Options, Record<string, never>> & { targets?: never });

/** A row; an expanded row lists no panels of its own (they follow it on the grid). */
export type TypedRow = Omit<RowPanel, 'panels'> & { panels: TypedPanel[] };

export type DashboardJson = JsonOf<Dashboard>;

export type TypedDashboardJson = JsonOf<Omit<Dashboard, 'panels'> & { panels?: Array<TypedPanel | TypedRow> }>;
