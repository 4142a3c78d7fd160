"""Defining jobs in Python: a ``Flow`` collects JobSpecs, by decorator or by call.

    flow = Flow()

    @flow.job(schedule="0 * * * *", retry={"max_attempts": 5})
    def extract(ctx): ...

    flow.add("load", command=["psql", "-f", "load.sql"], depends_on=["extract"])

``pgflow apply mypkg.jobs:flow`` registers them; they go through the same model
and the same graph checks as TOML.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from pgflow.spec import JobSpec, RegistrationError, SpecError, parse_job

F = TypeVar("F", bound=Callable[..., Any])


class Flow:
    def __init__(self) -> None:
        self._specs: dict[str, JobSpec] = {}

    def add(self, name: str, **definition: Any) -> JobSpec:
        """Add one job; raise RegistrationError if the definition is invalid or the name taken."""
        if name in self._specs:
            raise RegistrationError([SpecError(job=name, key=None, reason="defined twice")])
        spec, errors = parse_job(name, definition)
        if errors or spec is None:
            raise RegistrationError(errors)
        self._specs[name] = spec
        return spec

    def job(self, name: str | None = None, **definition: Any) -> Callable[[F], F]:
        """Decorator: the function becomes the job's entrypoint (named after it by default)."""

        def register(function: F) -> F:
            entrypoint = f"{function.__module__}:{function.__qualname__}"
            self.add(name or function.__name__, entrypoint=entrypoint, **definition)
            return function

        return register

    def specs(self) -> list[JobSpec]:
        return list(self._specs.values())

