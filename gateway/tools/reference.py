"""The docs' generated reference pages: every metric the gateway exports, read from the registry the
running program builds, and the command line, read from its parser. A test holds the pages in
docs/reference/ to what this writes; after a change, write them anew:

    python -m gateway.tools.reference metrics > docs/reference/metrics.md
    python -m gateway.tools.reference cli > docs/reference/cli.md
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml
from prometheus_client import CollectorRegistry

SAMPLE_CONFIG = Path(__file__).parents[2] / "deploy" / "config" / "gateway.yaml"


def program_registry() -> CollectorRegistry:
    """The registry `serve` builds for the sample config with a Redis store (whose metrics the memory
    store has not) and a config file to reload; nothing is started or connected."""
    from gateway.programs.app import build_runtime, create_app
    from gateway.server.client_connections import ClientConnections
    from gateway.server.client_limits import ClientLimits
    from gateway.settings import Settings

    document = yaml.safe_load(SAMPLE_CONFIG.read_text())
    document["store"] = {"kind": "redis", "url": "redis://127.0.0.1:1/0", "peer_port": None}
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "gateway.yaml"
        path.write_text(yaml.safe_dump(document))
        settings = Settings.model_validate(document)
        runtime = build_runtime(settings)
        create_app(settings, runtime=runtime, config_path=str(path))
    registry = runtime.metrics.registry
    registry.register(ClientConnections(ClientLimits.from_settings(settings.limits)))
    return registry


def _families(registry: CollectorRegistry) -> Iterator[tuple[str, str, str, tuple[str, ...]]]:
    """(name, type, help, label names) of every family the registry exports."""
    labels_of: dict[str, tuple[str, ...]] = {}
    for collector, names in registry._collector_to_names.items():  # no public view
        label_names = getattr(collector, "_labelnames", None)
        if label_names is not None:
            for name in names:
                labels_of[name] = tuple(label_names)
    for family in registry.collect():
        labels = labels_of.get(family.name) or tuple(getattr(family, "_labelnames", ()))
        if not labels:
            seen = {label for sample in family.samples for label in sample.labels}
            labels = tuple(sorted(seen - {"le", "quantile"}))
        yield family.name, family.type, family.documentation, labels


def metrics_page(registry: CollectorRegistry | None = None) -> str:
    exported = {"counter": "_total", "histogram": "_bucket, _sum, _count"}
    lines = [
        "# Metrics",
        "",
        "Every metric the gateway exports on `/metrics` (the admin listener's where `admin_listen` is",
        "set), generated from the registry the program builds (`python -m gateway.tools.reference",
        "metrics`). Counters are exposed with `_total`, histograms as `_bucket`, `_sum` and `_count`.",
        "The `gateway_redis_*` and `gateway_replica_probes` families exist only with the Redis store.",
        "",
        "| metric | type | labels | what it counts |",
        "|---|---|---|---|",
    ]
    rows = sorted(_families(registry or program_registry()))
    for name, kind, help_text, labels in rows:
        suffix = exported.get(kind, "")
        shown = f"`{name}`" + (f" ({suffix})" if suffix else "")
        label_text = ", ".join(f"`{label}`" for label in labels) or "-"
        lines.append(f"| {shown} | {kind} | {label_text} | {help_text.replace('|', '&#124;')} |")
    return "\n".join(lines) + "\n"


def cli_page() -> str:
    from gateway.programs.cli import _parser

    parser = _parser()
    lines = [
        "# Command line",
        "",
        "`inference-gateway` (or `python3 -m gateway`), generated from its parser",
        "(`python -m gateway.tools.reference cli`).",
        "",
        "```text",
        _help(parser),
        "```",
    ]
    for name, command in _subcommands(parser).items():
        lines += ["", f"## `{name}`", "", "```text", _help(command), "```"]
    return "\n".join(lines) + "\n"


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:  # argparse has no public view of subparsers
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _help(parser: argparse.ArgumentParser) -> str:
    # A fixed width, so that the page does not change with the terminal it is written from.
    formatter: Any = parser.formatter_class
    parser.formatter_class = lambda prog: formatter(prog, width=100)
    try:
        return parser.format_help().rstrip()
    finally:
        parser.formatter_class = formatter


def main(argv: list[str] | None = None) -> int:
    arguments = argparse.ArgumentParser(description=__doc__)
    arguments.add_argument("page", choices=["metrics", "cli"])
    page = arguments.parse_args(argv).page
    sys.stdout.write(metrics_page() if page == "metrics" else cli_page())
    return 0


if __name__ == "__main__":
    sys.exit(main())
