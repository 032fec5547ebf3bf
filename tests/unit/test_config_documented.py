"""deploy/config/gateway.yaml documents every config key: each field of the settings models appears
in it as a key (`name:`, commented out or not), inside the part of the file of its top-level key."""

from __future__ import annotations

import re
import types
import typing
from collections.abc import Iterator
from pathlib import Path

from pydantic import BaseModel

from gateway.settings import Settings

SAMPLE = Path(__file__).parents[2] / "deploy" / "config" / "gateway.yaml"


def nested_models(annotation: object) -> Iterator[type[BaseModel]]:
    """The pydantic models a field's type holds: itself, or inside list[...], X | None, Annotated."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        yield annotation
        return
    if typing.get_origin(annotation) is not None or isinstance(annotation, types.UnionType):
        for argument in typing.get_args(annotation):
            yield from nested_models(argument)


def fields(model: type[BaseModel], path: str = "") -> Iterator[tuple[str, str]]:
    """(dotted path, key) of every field of `model` and of the models inside it."""
    for name, info in model.model_fields.items():
        key = info.alias or name
        where = f"{path}.{key}" if path else key
        yield where, key
        for inner in nested_models(info.annotation):
            yield from fields(inner, where)


def sections(text: str) -> dict[str, str]:
    """The text of each top-level key: from its line (`key:` or `# key:`), with the comment block
    just above it (unless that block holds a commented-out key of its own), to the next top-level
    key. A key that appears twice (set, and commented out as an alternative) gets both parts."""
    top = "|".join(re.escape(name) for name in Settings.model_fields)
    start = re.compile(rf"^(?:#\s?)?({top}):")
    lines = text.splitlines()
    starts: list[tuple[int, str]] = []
    for number, line in enumerate(lines):
        if found := start.match(line):
            first = number
            while first > 0 and lines[first - 1].startswith("#"):
                first -= 1
                if start.match(lines[first]):
                    first = number
                    break
            starts.append((first, found.group(1)))
    parts: dict[str, str] = {}
    for index, (first, name) in enumerate(starts):
        end = starts[index + 1][0] if index + 1 < len(starts) else len(lines)
        parts[name] = parts.get(name, "") + "\n".join(lines[first:end]) + "\n"
    return parts


def undocumented(text: str) -> list[str]:
    parts = sections(text)
    missing = []
    for path, key in fields(Settings):
        section = parts.get(path.split(".")[0], "")
        if not re.search(rf"(?<![\w.-]){re.escape(key)}\s*:", section):
            missing.append(path)
    return missing


def test_every_settings_field_appears_in_the_sample_config():
    missing = undocumented(SAMPLE.read_text())
    assert not missing, f"{SAMPLE.name} does not document: {', '.join(missing)}"


def edited(old: str, new: str) -> str:
    text = SAMPLE.read_text()
    assert old in text, f"the sample no longer holds {old!r}: update this test"
    return text.replace(old, new)


def test_the_check_sees_a_missing_key_a_key_in_the_wrong_section_and_a_commented_key():
    assert undocumented(edited("jitter: 0.1}", "jiggle: 0.1}")) == ["retry_after.jitter"]
    # timeout_ms is also a key of health: the store's must be in the store's part of the file.
    assert undocumented(edited("timeout_ms: 1000, on_store", "on_store")) == ["store.timeout_ms"]
    assert undocumented(edited("#   verify: true", "#")) == ["models.backends.tls.verify"]
    assert not undocumented(edited("  max_utilization: 0.8", "  # max_utilization: 0.8"))


def test_the_walk_reaches_nested_models():
    paths = {path for path, _ in fields(Settings)}
    assert {"models.backends.tls.ca_file", "kueue.cluster_queue", "store.lease_ttl_ms"} <= paths
