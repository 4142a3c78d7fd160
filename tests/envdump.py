"""A Python job for the secrets test: it writes ``os.environ`` (as the job sees it,
inside its replica) as JSON to the file named by ``params['path']``."""

from __future__ import annotations

import json
import os
from typing import Any


async def dump(ctx: Any) -> None:
    with open(ctx.params["path"], "w") as out:
        json.dump(dict(os.environ), out)
