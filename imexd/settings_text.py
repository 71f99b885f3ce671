"""Settings as text: TOML for the demo, the benchmark and the tests, the shipped
config/imexd.toml and the reference table of docs/configuration.md.

Apart from imexd.settings, which says what the settings are and loads them, because
writing them out is a different job with its own readers (the CLI's `config --example`
and `--reference`, and the harnesses that write agents' settings files).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from imexd.settings import SECTIONS, iter_settings


def toml_value(value: Any) -> str:
    """One TOML value: booleans, numbers, strings, lists and (inline) tables."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a valid TOML basic string
    if isinstance(value, tuple | list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, Mapping):
        items = ", ".join(f"{k} = {toml_value(v)}" for k, v in value.items())
        return "{" + (f" {items} " if items else "") + "}"
    raise TypeError(f"no TOML form for {value!r}")


def render_toml(sections: Mapping[str, Mapping[str, Any]]) -> str:
    """A settings file from nested mappings; a mapping inside a section becomes a
    sub-table such as [imex.env]. For the demo, the benchmark and the tests."""
    lines: list[str] = []
    for section, table in sections.items():
        lines.append(f"[{section}]")
        subtables = {k: v for k, v in table.items() if isinstance(v, Mapping)}
        lines += [f"{k} = {toml_value(v)}" for k, v in table.items() if k not in subtables]
        for name, sub in subtables.items():
            lines.append(f"[{section}.{name}]")
            lines += [f"{k} = {toml_value(v)}" for k, v in sub.items()]
        lines.append("")
    return "\n".join(lines)


HOST_SPECIFIC = {("node", "name"), ("node", "address")}
"""Keys whose default depends on the host: the example shows them commented out."""


def example_toml() -> str:
    """The shipped config/imexd.toml: every key at its default, with a comment each."""
    lines = [
        "# imexd settings. Every key is shown at its default; delete what you keep as is.",
        "# Each key can also be set by the environment: IMEXD_<SECTION>_<KEY>",
        "# (e.g. IMEXD_NODE_NAME=gpu-01), which wins over this file.",
        "# Durations are seconds (integer or float).",
    ]
    section = ""
    for info in iter_settings():
        if info.section != section:
            section = info.section
            doc = (SECTIONS[section].__doc__ or "").strip()
            lines += ["", f"# {doc}", f"[{section}]"]
        lines += [f"# {line}" for line in _wrap(info.doc, 86)]
        if (info.section, info.key) in HOST_SPECIFIC:
            example = "gpu-node-01" if info.key == "name" else "10.0.0.11"
            lines.append(f"# {info.key} = {toml_value(example)}")
        else:
            lines.append(f"{info.key} = {toml_value(info.default)}")
    return "\n".join(lines) + "\n"


def _wrap(text: str, width: int) -> list[str]:
    out: list[str] = []
    line = ""
    for word in text.split():
        if line and len(line) + 1 + len(word) > width:
            out.append(line)
            line = word
        else:
            line = f"{line} {word}" if line else word
    if line:
        out.append(line)
    return out


def reference_markdown() -> str:
    """The settings reference table of docs/configuration.md, generated from the code."""
    out: list[str] = []
    section = ""
    for info in iter_settings():
        if info.section != section:
            section = info.section
            out += ["", f"### [{section}]", "", "| key | environment | default | meaning |"]
            out.append("| --- | --- | --- | --- |")
        default = (
            "host name"
            if (info.section, info.key) == ("node", "name")
            else "auto"
            if (info.section, info.key) == ("node", "address")
            else toml_value(info.default)
        )
        doc = info.doc.replace("|", "\\|")
        out.append(f"| `{info.key}` | `{info.env}` | `{default}` | {doc} |")
    return "\n".join(out).strip() + "\n"
