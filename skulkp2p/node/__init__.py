"""The composition root: the one place that wires the cluster (control and data planes), the
HTTP API and the engines together. Nothing below it imports it. See docs/architecture.md."""
