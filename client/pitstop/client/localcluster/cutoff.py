"""Cutting a node of a local cluster off the network and bringing it back (a cluster
brought up with network namespaces, ``--netns``)."""

from __future__ import annotations

from pitstop.client.localcluster.errors import ClusterError, checked
from pitstop.client.localcluster.statefile import ClusterState
from pitstop.client.netns import Network


def cut(record: ClusterState, node_id: str) -> None:
    """Cut the node off the network, its processes alive (needs ``--netns``)."""
    checked(lambda: _network(record).cut(record.node(node_id).node_id))


def heal(record: ClusterState, node_id: str) -> None:
    """Bring a node that was cut off back onto the network."""
    checked(lambda: _network(record).heal(record.node(node_id).node_id))


def cut_off(record: ClusterState) -> list[str]:
    """The nodes cut off now (none without ``--netns``)."""
    network = record.network
    if network is None:
        return []
    return [link.node_id for link in network.links if network.is_cut(link.node_id)]


def _network(record: ClusterState) -> Network:
    if record.network is None:
        raise ClusterError(
            f"the cluster in {record.state_dir} runs without network namespaces; "
            "bring it up with pitstop cluster up --netns (as root) to cut nodes off"
        )
    return record.network
