"""Device and memory plumbing that transports and backends share: flat buckets of weights,
staging pools, pinned host copies, the fused fingerprint kernel, thread budgets."""
