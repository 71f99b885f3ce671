"""The JSON Schemas shipped under docs/schemas/, generated from the payload types.

Control planes written in other languages validate against these files, so they must be
exactly what `imexd.messages.json_schemas()` generates: `imexd schemas --write DIR`
regenerates them, `imexd schemas --check DIR` (and a test) fails when they differ.
"""

from __future__ import annotations

import json
from pathlib import Path

from imexd.messages import json_schemas


def schema_texts() -> dict[str, str]:
    """File name -> content of each shipped schema, generated from the payload types."""
    return {
        f"{name}.json": json.dumps(schema, indent=2, sort_keys=True) + "\n"
        for name, schema in json_schemas().items()
    }


def write_schemas(folder: Path) -> list[Path]:
    """(Re)write the schemas into `folder`; the paths written."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for filename, text in schema_texts().items():
        path = folder / filename
        path.write_text(text, encoding="utf-8")
        paths.append(path)
    return paths


def outdated_schemas(folder: Path) -> list[str]:
    """The schema files in `folder` that are missing or differ from the generated ones."""
    out = []
    for filename, text in schema_texts().items():
        path = folder / filename
        if not path.is_file() or path.read_text(encoding="utf-8") != text:
            out.append(filename)
    return out
