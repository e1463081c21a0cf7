"""What a training rank imports to talk to its node's daemons.

The agent's rank endpoint (`rankclient`: attach, report steps, read commands) and the
checkpoint daemon's snapshot path (`writer`: copy a state into a slot of shared memory,
restore it, pull it from another holder). With them, what the ranks and the checkpoint
daemon must agree on, so both import it from here: the shard layout (`format`), the
tensor copies in and out of a slot (`tensorcopy`), where the slots live (`shm`), what
names and checks a shard (`shards`), pulling a shard from a holder (`peers`) and the
durable store's files (`durable`).

Nothing here imports the agent, the checkpoint daemon, the trainer or the scheduler
(an import contract keeps it so): a training image needs this part, the wire types and
`pitstop.common`, not the daemons.
"""
