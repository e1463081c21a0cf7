"""`pitstop-agent`: the node daemon, and its installer."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from pathlib import Path
from typing import Annotated, NoReturn

import typer

# gRPC core logs at INFO when a rank process forks; only its errors belong in the
# agent's output. Set before grpc is first imported.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

from pitstop.agent import install as installer
from pitstop.agent import k8s_publisher
from pitstop.agent.checkpointd_watch import CheckpointdWatch
from pitstop.agent.config import AgentSettings, load_settings
from pitstop.agent.forkserver import ForkServerClient
from pitstop.agent.gpu import GpuBackend, GpuBackendError, open_backend
from pitstop.agent.host.drills import FaultInjector
from pitstop.agent.host.watch import open_host_watch
from pitstop.agent.identity import enroll, identity_for, keep_renewed
from pitstop.agent.link import SchedulerLink
from pitstop.agent.local import LocalEndpoint
from pitstop.agent.metrics import AgentMetrics, MetricsServer
from pitstop.agent.preflight import Preflight
from pitstop.agent.steps import StepSummarizer
from pitstop.agent.supervisor import RankSupervisor
from pitstop.agent.zygote import Zygote, zygote_socket
from pitstop.common.settings import EXIT_BAD_CONFIG, configure_logging, settings_or_exit
from pitstop.v1 import agent_pb2

app = typer.Typer(add_completion=False, no_args_is_help=True, help="The pitstop node agent.")
log = logging.getLogger("pitstop.agent")

EXIT_CANNOT_START = 1


class NodeAgent:
    """Every part of one agent, wired together: GPU backend, rank supervisor, local
    endpoint, step summarizer, metrics, the checkpoint daemon's watch and the scheduler
    link. It owns `backend`."""

    def __init__(self, settings: AgentSettings, backend: GpuBackend) -> None:
        self.settings = settings
        self.backend = backend
        self.metrics = AgentMetrics(settings.node_id)
        self.steps = StepSummarizer()
        self.identity = identity_for(settings.state_dir, settings.node_id) if settings.tls else None
        self.supervisor = RankSupervisor(
            settings.node_id,
            settings.socket_path,
            settings.state_dir / "ranks",
            on_exit=self._report_rank_exit,
            checkpointd_address=settings.checkpointd_address,
            scheduler_address=settings.scheduler,
            tls_dir=self.identity.directory if self.identity is not None else None,
            fork_server=_fork_client(settings),
        )
        self.zygote: Zygote | None = None
        if settings.fork_server == "auto":
            self.zygote = Zygote(
                zygote_socket(settings.socket_path),
                settings.fork_preload,
                settings.state_dir / "zygote.log",
            )
        self.local = LocalEndpoint(
            settings.socket_path,
            backend,
            self.supervisor,
            self.steps,
            checkpointd_address=settings.checkpointd_address,
            allow_fault_injection=settings.allow_fault_injection,
        )
        self.checkpointd: CheckpointdWatch | None = None
        if settings.checkpointd_address:
            self.checkpointd = CheckpointdWatch(
                settings, self.metrics, on_change=self._node_health_changed, identity=self.identity
            )
        self.preflight = Preflight(
            backend,
            self.supervisor,
            settings.preflight_interval_seconds,
            on_change=self._node_health_changed,
        )
        self.host = open_host_watch(settings, backend)
        if self.host is not None:
            self.supervisor.exit_cause = self.host.exit_cause
        self.faults = FaultInjector(
            backend, self.host.backend if self.host else None, self.supervisor.table.pids_on
        )
        self.local.inject = self.faults.inject
        self.link = SchedulerLink(
            settings,
            backend,
            self.supervisor,
            self.local,
            self.steps,
            self.metrics,
            conditions=[
                self.preflight,
                *([self.checkpointd] if self.checkpointd is not None else []),
            ],
            identity=self.identity,
            host=self.host,
            inject=self.faults.inject,
        )
        # A standby waiting for a rank is reported ready; one handed a rank no longer.
        self.supervisor.standby_waits = self.local.standby_waits
        self.local.report_soon = self.link.beat_soon
        self.local.on_finding = self._integrity_finding
        self.local.on_run_record = self.link.report_run_record
        self.metrics_server: MetricsServer | None = None
        self.node_conditions: k8s_publisher.NodeConditionPublisher | None = None

    async def _report_rank_exit(self, exited: agent_pb2.RankExited) -> None:
        await self.link.report_rank_exit(exited)

    def _integrity_finding(self, finding: agent_pb2.IntegrityFinding) -> None:
        """Send a rank's finding on; one that names this node's GPU as corrupt (SDC) also
        ends the ranks on it, after the finding (the scheduler quarantines the node
        before it sees the exits, and moves the ranks to a spare)."""
        self.link.report_finding(finding)
        if finding.kind == agent_pb2.FINDING_KIND_SDC:
            self.supervisor.kill_gpu(
                finding.gpu_index,
                f"silent data corruption at step {finding.step} of job {finding.job_id}",
            )

    def _node_health_changed(self) -> None:
        self.link.beat_soon()

    async def start(self) -> None:
        """Create the state directory, serve the ranks' socket and the metrics, and
        watch (or start) the checkpoint daemon."""
        state_dir = self.settings.state_dir
        try:
            await asyncio.to_thread(state_dir.mkdir, parents=True, exist_ok=True)
        except OSError as exc:
            raise OSError(
                f"cannot create the state directory {state_dir}: {exc.strerror}; "
                "give a writable --state-dir"
            ) from exc
        if self.identity is not None:
            ca_file = self.settings.ca_file or self.identity.ca_path
            await asyncio.to_thread(
                enroll, self.identity, self.settings.scheduler, self.settings.join_token, ca_file
            )
        if self.settings.kubernetes_node_conditions or self.settings.kubernetes_topology_labels:
            await self._start_kubernetes()
        await self.local.start()
        # Before the first heartbeat: a node that fails it never looks ready.
        await self.preflight.check()
        self.metrics_server = MetricsServer(
            self.metrics, self.settings.metrics_host, self.settings.metrics_port
        )
        self.metrics_server.start()
        if self.checkpointd is not None:
            self.checkpointd.start()

    async def _start_kubernetes(self) -> None:
        """Connect to the Kubernetes API; fill the topology labels from the Node's (before
        the first registration sends them) and set up the condition publisher."""
        settings = self.settings
        api = await asyncio.to_thread(k8s_publisher.connect)
        if settings.kubernetes_topology_labels:
            for field, value in (await k8s_publisher.topology_from_node(settings, api)).items():
                log.info("%s %r, from the node's labels", field, value)
                setattr(settings, field, value)  # the link reads them at registration
        if settings.kubernetes_node_conditions:
            self.node_conditions = k8s_publisher.NodeConditionPublisher(
                api,
                k8s_publisher.node_name(settings),
                self.link.latest_health,
                self.metrics,
                interval=settings.kubernetes_publish_seconds,
                taints=settings.kubernetes_taints,
            )

    async def run(self, stop: asyncio.Event) -> None:
        """Talk to the scheduler until `stop` is set (renewing the certificate, with TLS;
        publishing the node's health to Kubernetes, when asked)."""
        async with asyncio.TaskGroup() as tasks:
            if self.identity is not None:
                tasks.create_task(keep_renewed(self.identity, self.settings.scheduler, stop))
            if self.node_conditions is not None:
                tasks.create_task(self.node_conditions.run(stop))
            if self.zygote is not None:
                tasks.create_task(self.zygote.run(stop))
            tasks.create_task(self.link.run(stop))
            tasks.create_task(self.preflight.run(stop))

    async def close(self, grace_seconds: float = 10.0) -> None:
        """Stop every rank (none survives the agent), then an owned checkpoint daemon
        (after the ranks that use it), the endpoint, the metrics server and the backend."""
        try:
            await self.supervisor.shutdown(grace_seconds)
        finally:
            if self.supervisor.fork_server is not None:
                await self.supervisor.fork_server.close()
            if self.zygote is not None:
                await self.zygote.close()
            if self.checkpointd is not None:
                await self.checkpointd.close(grace_seconds)
            await self.local.stop()
            if self.metrics_server is not None:
                await asyncio.to_thread(self.metrics_server.shutdown)
            self.backend.close()
            if self.host is not None:
                self.host.close()


def _fork_client(settings: AgentSettings) -> ForkServerClient | None:
    """The connection to the fork server the settings name (the agent's own with
    `auto`); None with `off`."""
    if settings.fork_server == "off":
        return None
    if settings.fork_server == "auto":
        return ForkServerClient(zygote_socket(settings.socket_path))
    return ForkServerClient(Path(settings.fork_server))


class _StartFailed(Exception):
    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


@app.command()
def run(
    config: Annotated[Path | None, typer.Option("--config", "-c", help="YAML config file")] = None,
    node_id: Annotated[str | None, typer.Option(help="Node id [host name]")] = None,
    scheduler: Annotated[str | None, typer.Option(help="Scheduler host:port")] = None,
    gpus: Annotated[str | None, typer.Option(help="nvml, or sim:N simulated GPUs")] = None,
    zone: Annotated[str | None, typer.Option(help="Zone label")] = None,
    block: Annotated[str | None, typer.Option(help="Block label")] = None,
    rack: Annotated[str | None, typer.Option(help="Rack label")] = None,
    nvlink_domain: Annotated[str | None, typer.Option(help="NVLink domain label")] = None,
    role: Annotated[str | None, typer.Option(help="worker or spare, at first registration")] = None,
    state_dir: Annotated[Path | None, typer.Option(help="State directory")] = None,
    socket_path: Annotated[Path | None, typer.Option(help="Socket for the ranks")] = None,
    metrics_host: Annotated[str | None, typer.Option(help="Metrics address")] = None,
    metrics_port: Annotated[int | None, typer.Option(help="Metrics port; 0 picks one")] = None,
    checkpointd_address: Annotated[
        str | None, typer.Option(help="host:port of this node's checkpointd (probed)")
    ] = None,
    checkpointd_command: Annotated[
        str | None,
        typer.Option(
            help="Command line that starts this node's checkpointd on --checkpointd-address; "
            "given, the agent starts it, restarts it when it dies and stops it at exit"
        ),
    ] = None,
    advertise_host: Annotated[
        str | None,
        typer.Option(help="Host name or IP other nodes reach this node's ranks at [host name]"),
    ] = None,
    log_level: Annotated[str | None, typer.Option(help="DEBUG, INFO, WARNING [INFO]")] = None,
    tls: Annotated[
        bool | None,
        typer.Option("--tls/--insecure", help="Mutual TLS with this node's certificate"),
    ] = None,
    join_token: Annotated[
        str | None, typer.Option(help="One-time join token, to enroll (PITSTOP_AGENT_JOIN_TOKEN)")
    ] = None,
    ca_file: Annotated[
        Path | None, typer.Option(help="The cluster CA certificate, to enroll against")
    ] = None,
    fork_server: Annotated[
        str | None,
        typer.Option(
            help="Where ranks are forked from: auto (the agent's own fork server, the "
            "default), off (fresh processes), or the socket of a running fork server"
        ),
    ] = None,
) -> None:
    """Run the agent until SIGTERM or SIGINT; then stop its ranks and exit."""
    settings = settings_or_exit(
        "pitstop-agent",
        lambda: load_settings(
            config,
            node_id=node_id,
            scheduler=scheduler,
            gpus=gpus,
            zone=zone,
            block=block,
            rack=rack,
            nvlink_domain=nvlink_domain,
            role=role,
            state_dir=state_dir,
            socket_path=socket_path,
            metrics_host=metrics_host,
            metrics_port=metrics_port,
            checkpointd_address=checkpointd_address,
            checkpointd_command=checkpointd_command,
            advertise_host=advertise_host,
            log_level=log_level,
            tls=tls,
            join_token=join_token,
            ca_file=ca_file,
            fork_server=fork_server,
        ),
    )
    configure_logging(settings.log_level_number)
    try:
        backend = open_backend(settings.gpus, settings.node_id)
    except ValueError as exc:
        _fail(f"invalid configuration: {exc}", EXIT_BAD_CONFIG)
    except GpuBackendError as exc:
        _fail(f"cannot start the GPU backend: {exc}", EXIT_CANNOT_START)
    try:
        asyncio.run(_serve(settings, backend))
    except _StartFailed as exc:
        _fail(str(exc), exc.code)


async def _serve(settings: AgentSettings, backend: GpuBackend) -> None:
    agent = NodeAgent(settings, backend)
    try:
        try:
            await agent.start()
        except ValueError as exc:
            raise _StartFailed(f"invalid configuration: {exc}", EXIT_BAD_CONFIG) from None
        except (OSError, RuntimeError) as exc:
            raise _StartFailed(f"cannot start: {exc}", EXIT_CANNOT_START) from None
        assert agent.metrics_server is not None
        print(
            f"pitstop-agent {settings.node_id} started: metrics on {agent.metrics_server.url}, "
            f"socket {settings.socket_path}",
            flush=True,
        )
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await agent.run(stop)
        log.info("stopping: ranks first, then the endpoint")
    finally:
        await agent.close()
    log.info("stopped")


@app.command("install")
def install_command(
    prefix: Annotated[Path, typer.Option(help="Root to install under")] = Path("/"),
    join_token: Annotated[
        str,
        typer.Option(
            envvar="PITSTOP_AGENT_JOIN_TOKEN",
            help="One-time join token (pitstop token create --node-id ...): the node enrolls "
            "with it at its first start and runs mutual TLS",
            show_default=False,
        ),
    ] = "",
    ca_file: Annotated[
        Path | None,
        typer.Option(help="The cluster CA certificate (the scheduler's tls/ca.crt)"),
    ] = None,
    scheduler: Annotated[
        str, typer.Option(help="Scheduler host:port [the config's]", show_default=False)
    ] = "",
) -> None:
    """Write the systemd unit and an example /etc/pitstop/agent.yaml (kept if present);
    with --join-token and --ca-file, /etc/pitstop/agent.env (0600) that enrolls the node
    and turns mutual TLS on."""
    enrollment = None
    if join_token or ca_file is not None:
        if not (join_token and ca_file is not None):
            _fail(
                "give both --join-token and --ca-file (the node enrolls with the token and "
                "checks the scheduler against the CA)",
                EXIT_BAD_CONFIG,
            )
        assert ca_file is not None
        if not ca_file.is_file():
            _fail(
                f"--ca-file {ca_file} does not exist; copy the scheduler's tls/ca.crt",
                EXIT_BAD_CONFIG,
            )
        enrollment = installer.Enrollment(join_token, ca_file.absolute(), scheduler)
    try:
        result = installer.install(prefix, installer.current_executable(), enrollment)
    except OSError as exc:
        _fail(f"cannot install under {prefix}: {exc}", EXIT_CANNOT_START)
    for path in result.written:
        typer.echo(f"wrote {path}")
    for path in result.kept:
        typer.echo(f"kept {path}: it exists and is never overwritten")
    typer.echo("next: systemctl daemon-reload && systemctl enable --now pitstop-agent")


def _fail(message: str, code: int) -> NoReturn:
    typer.echo(f"pitstop-agent: {message}", err=True)
    raise typer.Exit(code)


def main() -> None:
    """Console entry point."""
    app()


if __name__ == "__main__":
    main()
