FROM python:3.12-slim

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
WORKDIR /app
COPY pyproject.toml README.md ./
COPY pgflow ./pgflow
COPY sql ./sql
RUN pip install . && useradd --create-home --uid 10001 pgflow

USER pgflow
# pgflow expects an external database here: PGFLOW_DATABASE_URL=postgresql://user:pass@host/db
ENV PGFLOW_HOME=/home/pgflow/.local/share/pgflow PGFLOW_BIND=0.0.0.0:8080
EXPOSE 8080
ENTRYPOINT ["pgflow"]
CMD ["serve"]
