"""The Slurm adapter (optional; `slurm_adapter: true`): drains in Slurm the nodes pitstop
finds unhealthy or lost, and asks for replacement allocations when no spare is left.
`decide` is the pure logic, `commands` runs and reads Slurm's commands, `adapter` is the
leader's loop around them."""

from pitstop.scheduler.slurm.adapter import SlurmAdapter

__all__ = ["SlurmAdapter"]
