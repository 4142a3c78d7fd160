"""pgflow: scheduled ETL jobs with dependencies and retries, coordinated by PostgreSQL only."""

__version__ = "0.1.0"

from pgflow.context import Context, PermanentError, SourceUnavailable
from pgflow.flow import Flow
from pgflow.spec import JobSpec, RetryPolicy

__all__ = ["Context", "Flow", "JobSpec", "PermanentError", "RetryPolicy", "SourceUnavailable",
           "__version__"]
