"""JSON responses encoded with orjson: a page of jobs carries each job's spec and memory
plan, and the standard library's encoder was the largest single cost of listing them."""

from __future__ import annotations

from typing import Any

import orjson
from fastapi.responses import JSONResponse


class FastJSONResponse(JSONResponse):
    def render(self, content: Any) -> bytes:
        return orjson.dumps(content, option=orjson.OPT_NON_STR_KEYS)
