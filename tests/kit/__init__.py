"""The test kit: every helper the tests share, by theme.

- `ports`: a free TCP port (`free_port`; `free_listen_port` outside the ephemeral range).
- `dirs`: a short temporary folder (Unix socket paths are limited to 107 bytes).
- `waits`: poll a condition until it holds (`wait_until`, and `until` in an event loop).
- `hardware`: the reason prefix of a skip for missing hardware (`NO_HARDWARE`).
- `stores`: the test run's PostgreSQL and Redis (`StoreUrls`), unique ids, a PostgreSQL
  of a process of its own.
- `schedulers`: a scheduler in a thread (`SchedulerThread`), one in a process
  (`SchedulerProcess`, `tls_scheduler`), their settings.
- `streams`: a hand-driven agent stream (`AgentStream`).
- `events`: following the scheduler's event stream (`follow_events`, `wait_for`).
- `agents`: real `pitstop-agent` processes (`run_agents`), a whole agent in the test's
  event loop (`running_agent`), an agent's settings for a test (`agent_settings`).
- `processes`: stopping a process for sure (`terminate`), whether one runs, which run
  under a folder.
- `forking`: a fork server and a test's connection to it; ranks of a gloo world
  (`run_mesh_ranks`).
- `ranks`: the test side of `tests/integration/fake_rank.py`.
- `checkpointd`, `abandon`, `clustercli`, `kube_api`, `slurm`, `gpu`, `fuzzing`,
  `monitoring`, `console_scripts`: what the tests of one area share.

`tests/` is on `sys.path` (pytest puts the folder of the root conftest.py there, as
`tests/` is no package), so a test imports `from kit.stores import StoreUrls`; a
subprocess that needs the kit gets `PYTHONPATH=tests`. Fixtures stay in
tests/conftest.py; tests never import each other.
"""
