"""The pitstop scheduler: the truth about jobs, nodes and topology, and the decisions."""
