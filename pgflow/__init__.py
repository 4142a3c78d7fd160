"""pgflow: scheduled ETL jobs with dependencies and retries, coordinated by PostgreSQL only."""

from pgflow.flow import Flow
from pgflow.spec import JobSpec, RetryPolicy

__all__ = ["Flow", "JobSpec", "RetryPolicy", "__version__"]
__version__ = "0.1.0"
