"""The rendezvous port of a job's generation: below the kernel's ephemeral range (an
outgoing connection once held it and rank 0 could not listen), and never the previous
generation's."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from pitstop.scheduler.reconcile.commands import rendezvous_port

LINUX_EPHEMERAL_FIRST = 32768  # the default net.ipv4.ip_local_port_range starts here
PRIVILEGED_LAST = 1023


@given(job_id=st.text(min_size=1, max_size=40), generation=st.integers(1, 2**40))
def test_the_port_is_below_the_ephemeral_range_and_moves_on_with_the_generation(
    job_id: str, generation: int
) -> None:
    port = rendezvous_port(job_id, generation)
    assert PRIVILEGED_LAST < port < LINUX_EPHEMERAL_FIRST
    assert rendezvous_port(job_id, generation + 1) != port
