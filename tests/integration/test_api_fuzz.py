"""Bad input at the scheduler's API (issue 28): every RPC of every service a person or a
node calls, fuzzed with hypothesis-built requests.

A person's calls go to the API port with an admin token (server TLS), a node's calls
to the node port over mutual TLS as an enrolled node, each as its declared role says.
Whatever the request: it is answered, or refused with a code a user can act on and
details (never UNKNOWN or INTERNAL, never a traceback), and the scheduler still serves.
The agent stream (AgentService.Connect) has its own fuzzers in
test_trust_boundary_fuzz.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from google.protobuf.descriptor import MethodDescriptor
from hypothesis import event, given
from hypothesis import strategies as st

from kit.fuzzing import (
    FUZZ_TIMEOUT,
    Enrolled,
    assert_clear,
    call_method,
    enrolled_node,
    fuzz_settings,
    messages,
    register,
)
from kit.stores import StoreUrls
from pitstop.common.tls import channel_options
from pitstop.v1 import (
    agent_pb2,
    agent_pb2_grpc,
    checkpoint_pb2,
    common_pb2,
    jobs_pb2,
    nodes_pb2,
    rendezvous_pb2,
)

pytestmark = FUZZ_TIMEOUT
ADMIN = "admin-token-apifuzz-0123456789"
TIMEOUT = 15.0
# A Watch streams until its deadline: it is given a short one, and reaching it is fine.
WATCH_TIMEOUT = 0.3

# The scheduler's services; AgentService.Connect is fuzzed on its own.
SERVICES = [
    jobs_pb2.DESCRIPTOR.services_by_name["JobService"],
    nodes_pb2.DESCRIPTOR.services_by_name["NodeService"],
    nodes_pb2.DESCRIPTOR.services_by_name["EventService"],
    nodes_pb2.DESCRIPTOR.services_by_name["TokenService"],
    checkpoint_pb2.DESCRIPTOR.services_by_name["CheckpointCatalogService"],
    rendezvous_pb2.DESCRIPTOR.services_by_name["RendezvousService"],
    agent_pb2.DESCRIPTOR.services_by_name["EnrollmentService"],
]
METHODS = {
    f"{service.name}.{method.name}": method
    for service in SERVICES
    for method in service.methods
    if not method.client_streaming
}


def role(method: MethodDescriptor) -> int:
    return int(method.GetOptions().Extensions[common_pb2.required_role])


@pytest.fixture(scope="module")
def node(stores: StoreUrls, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Enrolled]:
    with enrolled_node(stores, tmp_path_factory.mktemp("apifuzz"), ADMIN) as enrolled:
        yield enrolled


@pytest.fixture(scope="module")
def api(node: Enrolled) -> Iterator[grpc.Channel]:
    """A person's channel: server TLS checked against the cluster CA."""
    assert node.scheduler.ca is not None
    credentials = grpc.ssl_channel_credentials(root_certificates=node.scheduler.ca.read_bytes())
    with grpc.secure_channel(
        node.scheduler.address, credentials, options=channel_options()
    ) as channel:
        yield channel


def call(channel: grpc.Channel, method: MethodDescriptor, request: Any, token: str) -> None:
    metadata = (("authorization", f"Bearer {token}"),) if token else None
    streams = method.server_streaming
    timeout = WATCH_TIMEOUT if streams else TIMEOUT
    call_method(channel, method, request, metadata, timeout, until_deadline=streams)


def assert_still_serving(node: Enrolled, api: grpc.Channel) -> None:
    """The scheduler is up and answers a person's List and a node's Register."""
    assert node.scheduler.proc.poll() is None, node.scheduler.log.read_text()[-3000:]
    call(api, METHODS["JobService.List"], jobs_pb2.ListJobsRequest(page_size=1), ADMIN)
    stub = agent_pb2_grpc.AgentServiceStub(node.channel)
    answers = list(stub.Connect(iter([register(node.node_id)]), timeout=TIMEOUT))
    assert answers[0].registered.node_id == node.node_id


@pytest.mark.parametrize("name", sorted(METHODS))
@fuzz_settings(10)
@given(data=st.data())
def test_any_api_request_is_answered_or_refused_clearly(
    node: Enrolled, api: grpc.Channel, name: str, data: Any
) -> None:
    method = METHODS[name]
    request = data.draw(messages(method.input_type), label="request")
    as_node = role(method) == common_pb2.ROLE_AGENT
    try:
        call(node.channel if as_node else api, method, request, "" if as_node else ADMIN)
        event("served")
    except grpc.RpcError as err:
        assert_clear(err, (name, request))
        event(err.code().name)  # type: ignore[attr-defined]
    assert_still_serving(node, api)


# Requests the fuzzer found answered INTERNAL, checked on every run: PostgreSQL text
# cannot hold NUL, and a NUL reached the database as a lookup key.
FOUND = [
    ("EventService.Watch", nodes_pb2.WatchEventsRequest(job_id="\x00"), "job_id"),
    ("EventService.List", nodes_pb2.ListEventsRequest(node_id="a\x00"), "node_id"),
    ("JobService.Get", jobs_pb2.GetJobRequest(job_id="job\x00"), "job_id"),
    (
        "JobService.Submit",
        jobs_pb2.SubmitJobRequest(spec=jobs_pb2.JobSpec(name="a", env={"K\x00": "v"})),
        "spec.env key",
    ),
    ("NodeService.Cordon", nodes_pb2.NodeControlRequest(node_id="n\x00", reason="r"), "node_id"),
]


@pytest.mark.parametrize(("name", "request_", "field"), FOUND, ids=[f[0] for f in FOUND])
def test_a_nul_in_any_field_is_refused_naming_the_field(
    node: Enrolled, api: grpc.Channel, name: str, request_: Any, field: str
) -> None:
    with pytest.raises(grpc.RpcError) as refused:
        call(api, METHODS[name], request_, ADMIN)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (refused.value.details() or "").startswith(f"{field}: ")
    assert_still_serving(node, api)
