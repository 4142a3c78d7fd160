"""pgflow's SQL: numbered schema migrations and named queries.

This folder is installed as the package ``pgflow.sql`` (see ``package-dir`` in
pyproject.toml) so that ``importlib.resources`` finds the ``.sql`` files inside
the wheel, an editable install and the Docker image alike.
"""
