"""ORM rows <-> wire messages. Nothing else happens here."""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

from google.protobuf import json_format, timestamp_pb2

from pitstop.scheduler.config import ApiToken
from pitstop.scheduler.db import models
from pitstop.scheduler.domain import (
    GpuReport,
    HealthReport,
    HealthVerdict,
    JobState,
    NodeRole,
    NodeState,
    Registration,
    RestorePoint,
    Role,
    ShardHeld,
    ShardKey,
    ShardReport,
    XidReport,
)
from pitstop.scheduler.errors import InvalidArgument
from pitstop.scheduler.hotstate import STANDBY_READY
from pitstop.scheduler.services.jobs import spec_from_json
from pitstop.scheduler.services.views import JobInFull, NodeInFull
from pitstop.scheduler.topology import Placement, shape_of
from pitstop.v1 import agent_pb2, checkpoint_pb2, common_pb2, jobs_pb2, nodes_pb2

if TYPE_CHECKING:
    from pitstop.scheduler.services.projects import ProjectUse

_JOB_STATE_TO_PB: dict[JobState, common_pb2.JobState] = {
    s: getattr(common_pb2, f"JOB_STATE_{s.name}") for s in JobState
}
_JOB_STATE_FROM_PB: dict[int, JobState] = {int(v): k for k, v in _JOB_STATE_TO_PB.items()}
NODE_STATE_TO_PB: dict[NodeState, common_pb2.NodeState] = {
    s: getattr(common_pb2, f"NODE_STATE_{s.name}") for s in NodeState
}
_NODE_STATE_FROM_PB: dict[int, NodeState] = {int(v): k for k, v in NODE_STATE_TO_PB.items()}
NODE_ROLE_TO_PB: dict[NodeRole, common_pb2.NodeRole] = {
    r: getattr(common_pb2, f"NODE_ROLE_{r.name}") for r in NodeRole
}
_NODE_ROLE_FROM_PB: dict[int, NodeRole] = {int(v): k for k, v in NODE_ROLE_TO_PB.items()}


def _enum_or_zero(wrapper: Any, name: str) -> Any:
    """The enum value stored by name, or 0 (UNSPECIFIED) for a name this build lacks."""
    try:
        return wrapper.Value(name)
    except ValueError:
        return 0


def timestamp(value: dt.datetime | None) -> timestamp_pb2.Timestamp | None:
    if value is None:
        return None
    ts = timestamp_pb2.Timestamp()
    ts.FromDatetime(value)
    return ts


def job_states_from_pb(values: Sequence[int], field: str = "states") -> list[JobState]:
    try:
        return [_JOB_STATE_FROM_PB[v] for v in values]
    except KeyError as exc:
        raise InvalidArgument(field, exc.args[0], "use a JobState other than UNSPECIFIED") from None


def node_states_from_pb(values: Sequence[int], field: str = "states") -> list[NodeState]:
    try:
        return [_NODE_STATE_FROM_PB[v] for v in values]
    except KeyError as exc:
        raise InvalidArgument(
            field, exc.args[0], "use a NodeState other than UNSPECIFIED"
        ) from None


def node_roles_from_pb(values: Sequence[int], field: str = "roles") -> list[NodeRole]:
    try:
        return [_NODE_ROLE_FROM_PB[v] for v in values]
    except KeyError as exc:
        raise InvalidArgument(field, exc.args[0], "use worker or spare") from None


# Stored as short lowercase words ("nvml_event", "fatal"), the enum names less prefix.
_XID_SOURCE_NAMES = {
    v: k.removeprefix("XID_SOURCE_").lower() for k, v in common_pb2.XidSource.items()
}
_VERDICT_FROM_PB = {v: HealthVerdict(k) for k, v in common_pb2.HealthVerdict.items()}


def xid_from_pb(xid: common_pb2.XidEvent) -> XidReport:
    """An agent's XidEvent as the services take it."""
    return XidReport(
        xid=xid.xid,
        gpu_index=xid.gpu_index,
        gpu_uuid=xid.gpu_uuid,
        message=xid.message,
        source=_XID_SOURCE_NAMES.get(xid.source, "unspecified"),
        time=xid.time.ToDatetime(dt.UTC) if xid.HasField("time") else None,
    )


def health_from_pb(health: common_pb2.NodeHealth) -> HealthReport:
    """A heartbeat's NodeHealth as the services take it."""
    return HealthReport(
        verdict=_VERDICT_FROM_PB.get(health.verdict),
        reasons=tuple(health.reasons),
        document=json_format.MessageToDict(health, preserving_proto_field_name=True),
    )


_SHARD_TIERS = {
    checkpoint_pb2.SHARD_TIER_LOCAL: "local",
    checkpoint_pb2.SHARD_TIER_REPLICA: "replica",
    checkpoint_pb2.SHARD_TIER_DURABLE: "durable",
}


def _shard_key(key: checkpoint_pb2.ShardKey) -> ShardKey:
    return ShardKey(key.job_id, key.step, key.rank, key.generation)


def shard_report_from_pb(request: checkpoint_pb2.ReportShardsRequest) -> ShardReport:
    """A checkpoint daemon's ReportShards as the catalog takes it."""
    return ShardReport(
        node_id=request.node_id,
        added=tuple(
            ShardHeld(
                _shard_key(info.header.key),
                _SHARD_TIERS.get(info.tier, "local"),
                info.header.checksum,
                info.header.size_bytes,
            )
            for info in request.added
        ),
        removed=tuple(_shard_key(k) for k in request.removed),
        removed_durable=tuple(_shard_key(k) for k in request.removed_durable),
        flush_errors=tuple(request.flush_errors),
        fresh_start=request.fresh_start,
    )


def restore_point_to_pb(point: RestorePoint) -> checkpoint_pb2.GetRestorePointResponse:
    response = checkpoint_pb2.GetRestorePointResponse(
        committed_step=point.committed_step, durable_step=point.durable_step
    )
    response.member_node_ids.extend(point.member_node_ids)
    for rank, copies in point.locations.items():
        for node_id, address in copies:
            response.locations[rank].node_ids.append(node_id)
            response.locations[rank].addresses.append(address)
    return response


def registration_from_pb(reg: agent_pb2.Register) -> Registration:
    """A node's Register as the services take it."""
    inv, labels = reg.inventory, reg.labels
    return Registration(
        node_id=reg.node_id,
        gpus=tuple(
            GpuReport(
                index=g.index,
                uuid=g.uuid,
                name=g.name,
                memory_bytes=g.memory_bytes,
                pci_bus_id=g.pci_bus_id,
                fabric_cluster_uuid=g.fabric_cluster_uuid,
                fabric_clique_id=g.fabric_clique_id,
            )
            for g in inv.gpus
        ),
        hostname=inv.hostname,
        driver_version=inv.driver_version,
        gpu_backend=inv.gpu_backend,
        agent_version=inv.agent_version,
        checkpointd_address=inv.checkpointd_address,
        zone=labels.zone,
        block=labels.block,
        rack=labels.rack,
        nvlink_domain=labels.nvlink_domain,
        role=(
            NodeRole.SPARE if reg.requested_role == common_pb2.NODE_ROLE_SPARE else NodeRole.WORKER
        ),
        agent_started_at=(
            reg.agent_started_at.ToDatetime(dt.UTC) if reg.HasField("agent_started_at") else None
        ),
    )


def job_to_pb(
    job: models.Job, ranks: Sequence[models.RankAssignment] = (), *, queue_position: int = 0
) -> jobs_pb2.Job:
    msg = jobs_pb2.Job(
        id=job.id,
        spec=spec_from_json(job.spec),
        state=_JOB_STATE_TO_PB[job.state],
        reason=job.reason,
        generation=job.generation,
        created_at=timestamp(job.created_at),
        updated_at=timestamp(job.updated_at),
        restarts=job.restarts,
        current_step=job.current_step,
        committed_step=job.committed_step,
        durable_step=job.durable_step,
        result={str(k): str(v) for k, v in job.result.items()},
        skipped_steps=skipped_steps(job),
        queue_position=queue_position,
        preemptions=job.preemptions or 0,
    )
    if job.goodput:
        json_format.ParseDict(job.goodput, msg.goodput, ignore_unknown_fields=True)
    if ranks:
        msg.rank_map.CopyFrom(rank_map_to_pb(job.generation, ranks))
    return msg


def skipped_steps(job: models.Job) -> list[int]:
    """The steps whose batch the job skips, ascending (its integrity record)."""
    return sorted(int(step) for step in (job.integrity or {}).get("skipped_steps", []))


def rank_map_to_pb(generation: int, ranks: Sequence[Any]) -> common_pb2.RankMap:
    """The whole RankMap from rank rows or placement slots (anything with the rank
    fields)."""
    dp, pp, tp = shape_of(ranks)
    return common_pb2.RankMap(
        generation=generation,
        world_size=len(ranks),
        ranks=[_assignment(r) for r in ranks],
        dp_size=dp,
        pp_size=pp,
        tp_size=tp,
    )


def node_rank_map(generation: int, placement: Placement, node_id: str) -> common_pb2.RankMap:
    """A node's share of the map, as its commands carry it: its own ranks, the job's
    sizes and the whole map's digest."""
    dp, pp, tp = placement.shape
    return common_pb2.RankMap(
        generation=generation,
        world_size=placement.world_size,
        ranks=[_assignment(r) for r in placement.ranks_on(node_id)],
        dp_size=dp,
        pp_size=pp,
        tp_size=tp,
        node_local=True,
        digest=placement.digest,
    )


def _assignment(r: Any) -> common_pb2.RankAssignment:
    return common_pb2.RankAssignment(
        rank=r.rank,
        node_id=r.node_id,
        gpu_index=r.gpu_index,
        local_rank=r.local_rank,
        dp=r.dp,
        pp=r.pp,
        tp=r.tp,
    )


def node_to_pb(
    node: models.Node,
    *,
    xids: Sequence[models.XidRecord] = (),
    job_ids: Sequence[str] = (),
    live_health: dict[str, Any] | None = None,
) -> nodes_pb2.Node:
    msg = nodes_pb2.Node(
        id=node.id,
        role=NODE_ROLE_TO_PB[node.role],
        state=NODE_STATE_TO_PB[node.state],
        reason=node.reason,
        labels=common_pb2.TopologyLabels(
            zone=node.zone, block=node.block, rack=node.rack, nvlink_domain=node.nvlink_domain
        ),
        inventory=common_pb2.Inventory(
            hostname=node.hostname,
            driver_version=node.driver_version,
            agent_version=node.agent_version,
            gpu_backend=node.gpu_backend,
            checkpointd_address=node.checkpointd_address,
            gpus=[
                common_pb2.GpuInfo(
                    index=g.index,
                    uuid=g.uuid,
                    name=g.name,
                    memory_bytes=g.memory_bytes,
                    pci_bus_id=g.pci_bus_id,
                    fabric_cluster_uuid=g.fabric_cluster_uuid,
                    fabric_clique_id=g.fabric_clique_id,
                )
                for g in node.gpus
            ],
        ),
        connected=node.connected,
        last_heartbeat=timestamp(node.last_seen_at),
        registered_at=timestamp(node.registered_at),
        job_ids=list(job_ids),
    )
    health = live_health if live_health is not None else node.health
    if health:
        json_format.ParseDict(health, msg.health, ignore_unknown_fields=True)
    if live_health is not None:
        msg.standby_job_ids.extend(live_health.get(STANDBY_READY, ()))
    for x in xids:
        msg.xid_history.add(
            gpu_index=x.gpu_index,
            gpu_uuid=x.gpu_uuid,
            xid=x.xid,
            message=x.message,
            time=timestamp(x.time),
            source=_enum_or_zero(common_pb2.XidSource, "XID_SOURCE_" + x.source.upper()),
            verdict=_enum_or_zero(common_pb2.HealthVerdict, "HEALTH_VERDICT_" + x.verdict.upper()),
        )
    return msg


def event_to_pb(event: models.Event) -> common_pb2.Event:
    return common_pb2.Event(
        id=event.id,
        time=timestamp(event.time),
        kind=event.kind,
        job_id=event.job_id or "",
        node_id=event.node_id or "",
        from_state=event.from_state,
        to_state=event.to_state,
        reason=event.reason,
        actor=event.actor,
        attributes={str(k): str(v) for k, v in event.attributes.items()},
    )


def issued_token_to_pb(row: models.ApiToken) -> nodes_pb2.ApiToken:
    """An issued API token's record: never its hash."""
    return nodes_pb2.ApiToken(
        name=row.name,
        role=cast(common_pb2.Role, Role[row.role.upper()].value),
        source=nodes_pb2.API_TOKEN_SOURCE_API,
        created_at=timestamp(row.created_at),
        created_by=row.created_by,
        expires_at=timestamp(row.expires_at),
        revoked_at=timestamp(row.revoked_at),
        revoked_by=row.revoked_by,
        projects=list(row.projects or ()),
    )


def configured_token_to_pb(token: ApiToken) -> nodes_pb2.ApiToken:
    """A token from the config file: its name and role only."""
    return nodes_pb2.ApiToken(
        name=token.name,
        role=cast(common_pb2.Role, token.role.value),
        source=nodes_pb2.API_TOKEN_SOURCE_CONFIG,
        projects=token.projects,
    )


def project_to_pb(use: ProjectUse) -> jobs_pb2.Project:
    """A project's quota and use."""
    return jobs_pb2.Project(
        name=use.name,
        gpu_quota=use.gpu_quota or 0,
        unlimited=use.gpu_quota is None,
        gpus_in_use=use.gpus_in_use,
        pending_jobs=use.pending_jobs,
        updated_at=timestamp(use.updated_at),
        updated_by=use.updated_by,
    )


def job_in_full_to_pb(full: JobInFull) -> jobs_pb2.Job:
    """One job with its rank map and per-rank step statistics."""
    message = job_to_pb(full.job, full.ranks, queue_position=full.queue_position)
    message.rank_stats.extend(jobs_pb2.RankStepStats(**s) for s in full.rank_stats)
    return message


def node_in_full_to_pb(full: NodeInFull) -> nodes_pb2.Node:
    """One node with its Xid history, its jobs and its live health."""
    return node_to_pb(full.node, xids=full.xids, job_ids=full.job_ids, live_health=full.live_health)
