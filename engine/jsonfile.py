"""Reading a JSON file that a user names (a link, a trace): its text parsed, or one error line
naming the file, and the line where the JSON breaks."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_json(path: str | Path, what: str, error: type[ValueError]) -> Any:
    """The parsed JSON of ``path``; ``error`` names the file (and the line) when it cannot."""
    p = Path(path)
    try:
        return json.loads(p.read_text())
    except FileNotFoundError:
        raise error(f"{what} file {p} not found") from None
    except json.JSONDecodeError as e:
        raise error(f"{p}:{e.lineno}: not JSON ({e.msg})") from None
