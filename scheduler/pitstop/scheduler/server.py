"""Assemble and run the scheduler: stores, migrations, gRPC services, health, reflection."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from pitstop.common.tls import CertificateAuthority, cert_pem, key_pem, new_key
from pitstop.scheduler.api.agent import AgentServicer, Beats
from pitstop.scheduler.api.catalog import CatalogServicer
from pitstop.scheduler.api.enrollment import EnrollmentServicer
from pitstop.scheduler.api.jobs import JobServicer
from pitstop.scheduler.api.nodes import EventServicer, NodeServicer
from pitstop.scheduler.api.projects import ProjectServicer
from pitstop.scheduler.api.rendezvous import RendezvousServicer
from pitstop.scheduler.api.tokens import TokenServicer
from pitstop.scheduler.auth import AuthorizationInterceptor, TokenBook
from pitstop.scheduler.cancelling import reraise_if_cancelling
from pitstop.scheduler.config import SchedulerSettings
from pitstop.scheduler.dashboard.server import Dashboard, tls_context
from pitstop.scheduler.db.engine import create_engine_for, migrate, session_factory
from pitstop.scheduler.embedded import EmbeddedStores, start_embedded
from pitstop.scheduler.gateway import AgentGateway, CommandRouter
from pitstop.scheduler.hotstate import EventBus, HotState
from pitstop.scheduler.interceptors import ErrorMappingInterceptor
from pitstop.scheduler.issued_tokens import IssuedTokenRefresher
from pitstop.scheduler.leader import LeaderElection
from pitstop.scheduler.liveness import LivenessMonitor
from pitstop.scheduler.metrics import SchedulerMetrics
from pitstop.scheduler.reconcile import Reconciler, Timeouts
from pitstop.scheduler.slurm import SlurmAdapter
from pitstop.scheduler.store import Store
from pitstop.v1 import (
    agent_pb2,
    agent_pb2_grpc,
    checkpoint_pb2,
    checkpoint_pb2_grpc,
    jobs_pb2,
    jobs_pb2_grpc,
    nodes_pb2,
    nodes_pb2_grpc,
    rendezvous_pb2,
    rendezvous_pb2_grpc,
)

log = logging.getLogger(__name__)

SERVICE_NAMES = (
    jobs_pb2.DESCRIPTOR.services_by_name["JobService"].full_name,
    jobs_pb2.DESCRIPTOR.services_by_name["ProjectService"].full_name,
    nodes_pb2.DESCRIPTOR.services_by_name["NodeService"].full_name,
    nodes_pb2.DESCRIPTOR.services_by_name["EventService"].full_name,
    nodes_pb2.DESCRIPTOR.services_by_name["TokenService"].full_name,
    agent_pb2.DESCRIPTOR.services_by_name["AgentService"].full_name,
    agent_pb2.DESCRIPTOR.services_by_name["EnrollmentService"].full_name,
    checkpoint_pb2.DESCRIPTOR.services_by_name["CheckpointCatalogService"].full_name,
    rendezvous_pb2.DESCRIPTOR.services_by_name["RendezvousService"].full_name,
)
HEALTH_CHECK_SECONDS = 2.0
# The most any one shutdown step may take beyond its own grace.
STEP_SECONDS = 5.0


async def _bounded(what: str, step: Awaitable[Any], seconds: float) -> None:
    try:
        await asyncio.wait_for(step, seconds)
    except TimeoutError:
        log.warning("shutdown: could not %s within %.0fs; going on", what, seconds)


@dataclass
class Scheduler:
    """A running scheduler process. ``port`` is the bound port (useful with port 0)."""

    settings: SchedulerSettings
    server: grpc.aio.Server
    engine: AsyncEngine
    hot: HotState
    bus: EventBus
    port: int
    agents: AgentServicer
    embedded: EmbeddedStores | None = None
    election: LeaderElection | None = None
    metrics: SchedulerMetrics | None = None
    metrics_port: int | None = None
    node_port: int = 0
    """The port nodes connect to with their certificates (TLS on); 0 without TLS."""
    dashboard: Dashboard | None = None
    dashboard_port: int | None = None
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)
    _stoppers: list[Callable[[], Awaitable[None]]] = field(default_factory=list)

    @property
    def address(self) -> str:
        return f"{self.settings.host}:{self.port}"

    @property
    def dashboard_url(self) -> str:
        """Where the dashboard is; "" when it is off."""
        if self.dashboard is None or self.dashboard_port is None:
            return ""
        scheme = "https" if self.dashboard.tls else "http"
        return f"{scheme}://{self.settings.dashboard_host}:{self.dashboard_port}/"

    async def stop(self, grace: float | None = None) -> None:
        """Stop accepting calls, let in-flight ones finish within ``grace``, close the stores.
        Every step is bounded: a step that hangs is logged by name and shutdown goes on."""
        self.agents.stopping = True  # streams we close now are not lost nodes
        # Agent streams never end by themselves: without this a stop always waited out
        # the whole grace (and for an unreachable node's stream it still would).
        self.agents.gateway.close_all("the scheduler process is stopping; reconnect")
        grace = self.settings.shutdown_grace_seconds if grace is None else grace
        await _bounded("stop the gRPC server", self.server.stop(grace), grace + STEP_SECONDS)
        for task in self._tasks:
            task.cancel()
        if self._tasks:
            await _bounded("stop the background loops", asyncio.wait(self._tasks), STEP_SECONDS)
        if self.election is not None:
            await _bounded("release the leader lease", self.election.release(), STEP_SECONDS)
        for stop in self._stoppers:
            await _bounded("stop the command router", stop(), STEP_SECONDS)
        await _bounded("stop the acknowledgement writer", self.agents.acks.stop(), STEP_SECONDS)
        await _bounded("stop the step summary writer", self.agents.steps.stop(), STEP_SECONDS)
        await _bounded("record the lost agent streams", self.agents.drain(), STEP_SECONDS)
        if self.metrics is not None:
            await asyncio.to_thread(self.metrics.stop)
        if self.dashboard is not None:
            await _bounded("stop the dashboard", self.dashboard.stop(), STEP_SECONDS)
        await _bounded("stop the event bus", self.bus.stop(), STEP_SECONDS)
        await _bounded("close Redis", self.hot.close(), STEP_SECONDS)
        await _bounded("close the PostgreSQL pool", self.engine.dispose(), STEP_SECONDS)
        if self.embedded is not None:
            await asyncio.to_thread(self.embedded.stop)

    async def wait(self) -> None:
        await self.server.wait_for_termination()


async def start_scheduler(settings: SchedulerSettings) -> Scheduler:
    """Start stores (embedded if no URLs), migrate, bind, serve. Returns once serving."""
    embedded: EmbeddedStores | None = None
    dashboard: Dashboard | None = None
    dashboard_port: int | None = None
    database_url, redis_url = settings.database_url, settings.redis_url
    if not database_url or not redis_url:
        embedded = await asyncio.to_thread(
            start_embedded, settings.state_dir, not database_url, not redis_url
        )
        database_url = database_url or embedded.database_url
        redis_url = redis_url or embedded.redis_url
    try:
        await asyncio.to_thread(migrate, database_url)
        engine = create_engine_for(database_url, settings.db_pool_size)
        hot = HotState.from_url(redis_url, settings.redis_prefix)
        bus = EventBus(hot)
        bus.start()
        store = Store(session_factory(engine), bus)
        gateway = AgentGateway()
        ca = CertificateAuthority.load_or_create(settings.tls_directory) if settings.tls else None
        tokens = TokenBook(settings.tokens, nodes_by_certificate=settings.tls)
        issued_tokens = IssuedTokenRefresher(store, tokens)
        await issued_tokens.reload()  # before the first call: it may need an issued token
        if tokens.open:
            log.warning(
                "no API tokens configured or issued: the scheduler runs OPEN (every caller "
                "is admin). Set tokens in the config file, or issue an admin token (pitstop "
                "token create --role admin --name NAME), for anything but a local trial."
            )
        server = grpc.aio.server(
            interceptors=[ErrorMappingInterceptor(), AuthorizationInterceptor(tokens)],
            options=[("grpc.so_reuseport", 0), *settings.agent_keepalive_options()],
        )
        router = CommandRouter(gateway, hot)
        router.start()
        jobs_pb2_grpc.add_JobServiceServicer_to_server(JobServicer(store, hot, router), server)
        jobs_pb2_grpc.add_ProjectServiceServicer_to_server(ProjectServicer(store), server)
        nodes_pb2_grpc.add_NodeServiceServicer_to_server(NodeServicer(store, hot, router), server)
        nodes_pb2_grpc.add_EventServiceServicer_to_server(EventServicer(store), server)
        nodes_pb2_grpc.add_TokenServiceServicer_to_server(
            TokenServicer(store, settings.tokens, issued_tokens), server
        )
        checkpoint_pb2_grpc.add_CheckpointCatalogServiceServicer_to_server(
            CatalogServicer(store), server
        )
        rendezvous_pb2_grpc.add_RendezvousServiceServicer_to_server(
            RendezvousServicer(store), server
        )
        metrics = SchedulerMetrics()
        agent_servicer = AgentServicer(
            store,
            hot,
            gateway,
            Beats(
                settings.heartbeat_interval_seconds,
                settings.refresh_seconds,
                settings.liveness_timeout_seconds,
                settings.step_report_seconds,
            ),
            metrics,
            accept=settings.agent_streams,
            send=router.send,
            loss_probe_seconds=settings.loss_probe_seconds,
            shed_lag_seconds=settings.shed_lag_seconds,
        )
        agent_pb2_grpc.add_AgentServiceServicer_to_server(agent_servicer, server)
        liveness = LivenessMonitor(
            store,
            hot,
            gateway,
            tick_seconds=settings.liveness_tick_seconds,
            startup_grace_seconds=settings.liveness_startup_grace_seconds,
        )
        health_servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        reflection.enable_server_reflection(
            (*SERVICE_NAMES, health.SERVICE_NAME, reflection.SERVICE_NAME), server
        )
        enrollment_pb = agent_pb2_grpc.add_EnrollmentServiceServicer_to_server
        ttl = dt.timedelta(seconds=settings.node_certificate_ttl_seconds)
        enrolling = EnrollmentServicer(store, ca, ttl)
        enrollment_pb(enrolling, server)
        where = f"{settings.host}:{settings.port}"
        node_port = 0
        dashboard_tls: ssl.SSLContext | None = None
        if ca is not None:
            key = new_key()
            cert = ca.issue_server(key, settings.tls_hosts, dt.timedelta(days=365))
            pair = [(key_pem(key), cert_pem(cert))]
            dashboard_tls = tls_context(cert_pem(cert), key_pem(key), settings.tls_directory)
            # gRPC asks for a client certificate on a port only where it requires one:
            # people's clients (server TLS, bearer tokens, and enrollment) on `port`,
            # nodes (mutual TLS, their certificate required) on `node_port`.
            port = server.add_secure_port(where, grpc.ssl_server_credentials(pair))
            node_port = server.add_secure_port(
                f"{settings.host}:{settings.node_port}",
                grpc.ssl_server_credentials(
                    pair, root_certificates=ca.pem, require_client_auth=True
                ),
            )
            if node_port == 0:
                raise OSError(
                    f"cannot bind {settings.host}:{settings.node_port} for nodes; is the port "
                    "in use? (node_port)"
                )
            enrolling.node_port = node_port
        else:
            port = server.add_insecure_port(where)
        if port == 0:
            raise OSError(f"cannot bind {settings.host}:{settings.port}; is the port in use?")
        if settings.dashboard_port is not None:
            dashboard = Dashboard(store, hot, tokens)
            where_dashboard = f"{settings.dashboard_host}:{settings.dashboard_port}"
            try:
                dashboard_port = await dashboard.start(
                    settings.dashboard_host, settings.dashboard_port, dashboard_tls
                )
            except OSError as exc:
                raise OSError(
                    f"cannot bind the dashboard at {where_dashboard}: {exc.strerror or exc}; "
                    "give another dashboard_port (0 picks a free one; none turns it off)"
                ) from None
        await server.start()
    except BaseException:
        if dashboard is not None:
            await dashboard.stop()
        if embedded is not None:
            await asyncio.to_thread(embedded.stop)
        raise
    scheduler = Scheduler(settings, server, engine, hot, bus, port, agent_servicer, embedded)
    scheduler.node_port = node_port
    scheduler.metrics = metrics
    scheduler.dashboard, scheduler.dashboard_port = dashboard, dashboard_port
    if settings.metrics_port is not None:
        scheduler.metrics_port = metrics.serve(settings.metrics_host, settings.metrics_port)
    election = LeaderElection(
        store, database_url=database_url, period_seconds=settings.leader_lease_seconds
    )
    metrics.leader.set_function(lambda: 1.0 if election.leading else 0.0)
    await _report_health(health_servicer, engine, hot, store, metrics, election)
    scheduler._tasks.append(asyncio.create_task(metrics.watch_loop_lag(), name="loop-lag"))
    if settings.agent_streams:
        scheduler._tasks.append(
            asyncio.create_task(agent_servicer.judge_streams(), name="judge-streams")
        )
    scheduler._tasks.append(asyncio.create_task(issued_tokens.run(), name="api-tokens"))
    scheduler._tasks.append(
        asyncio.create_task(
            _health_loop(health_servicer, engine, hot, store, metrics, election), name="health"
        )
    )
    # Every process campaigns; the lease holder runs the loops that decide.
    reconciler = Reconciler(
        store,
        hot,
        router,
        election,
        metrics,
        timeouts=Timeouts(settings.recovery_timeout_seconds, settings.restart_timeout_seconds),
        mass_loss=settings.mass_loss_policy,
        step_report_seconds=settings.step_report_seconds + settings.heartbeat_interval_seconds,
        ended_job_retention_seconds=settings.ended_job_retention_seconds,
    )
    scheduler.election = election
    slurm = (
        SlurmAdapter.from_settings(settings, store, election) if settings.slurm_adapter else None
    )

    async def lead(token: int) -> None:
        del token  # every deciding transaction re-checks it through the election
        async with asyncio.TaskGroup() as loops:
            loops.create_task(liveness.run())
            loops.create_task(reconciler.run(settings.reconcile_tick_seconds))
            if slurm is not None:
                loops.create_task(slurm.run(settings.slurm_reconcile_seconds))

    if settings.leader_loops:
        scheduler._tasks.append(asyncio.create_task(election.run(lead), name="election"))
    scheduler._stoppers.append(router.stop)
    return scheduler


async def _stores_reachable(engine: AsyncEngine, hot: HotState) -> bool:
    try:
        async with asyncio.timeout(HEALTH_CHECK_SECONDS):
            async with engine.connect() as conn:
                await conn.execute(text("SELECT 1"))
            return await hot.ping()
    except Exception:
        reraise_if_cancelling()
        return False


async def _report_health(
    servicer: health.aio.HealthServicer,
    engine: AsyncEngine,
    hot: HotState,
    store: Store,
    metrics: SchedulerMetrics,
    election: LeaderElection,
) -> None:
    ok = await _stores_reachable(engine, hot)
    if ok:
        with contextlib.suppress(Exception):  # metrics never fail a health check
            async with store.read() as session:
                await metrics.refresh(session)
    status = (
        health_pb2.HealthCheckResponse.SERVING
        if ok
        else (health_pb2.HealthCheckResponse.NOT_SERVING)
    )
    for name in ("", *SERVICE_NAMES):
        await servicer.set(name, status)


async def _health_loop(
    servicer: health.aio.HealthServicer,
    engine: AsyncEngine,
    hot: HotState,
    store: Store,
    metrics: SchedulerMetrics,
    election: LeaderElection,
) -> None:
    # Load balancers and `grpc_health_probe` see NOT_SERVING while a store is down.
    while True:
        await asyncio.sleep(HEALTH_CHECK_SECONDS)
        await _report_health(servicer, engine, hot, store, metrics, election)
