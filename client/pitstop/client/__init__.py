"""Typed Python client and ``pitstop`` CLI for the pitstop scheduler.

>>> from pitstop.client import PitstopClient, load_job_spec
>>> with PitstopClient.from_env() as client:  # doctest: +SKIP
...     job = client.submit_job(load_job_spec("examples/jobs/tiny.yaml"))
"""

from pitstop.client.client import PitstopClient
from pitstop.client.errors import PitstopError
from pitstop.client.jobspec import JobSpecError, load_job_spec, parse_job_spec

__all__ = ["JobSpecError", "PitstopClient", "PitstopError", "load_job_spec", "parse_job_spec"]
