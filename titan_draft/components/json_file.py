"""One reader for the small JSON records titan_draft keeps and reads back (tokenizer files,
an export's provenance, a run's ``run_info.json`` and ``model_args.json``)."""

from __future__ import annotations

import json


def read_json_object(path: str) -> dict:
    """The JSON object in ``path``; a ``ValueError`` naming the file where it cannot be read, is
    not JSON, or holds something other than an object."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as e:
        raise ValueError(f"{path}: cannot read: {e.strerror}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object at the top level")
    return data
