"""The installed package's version, as `--version` and the servers' metadata tell it."""

from __future__ import annotations

from importlib import metadata


def package_version() -> str:
    try:
        return metadata.version("inference-gateway")
    except metadata.PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown (not installed)"
