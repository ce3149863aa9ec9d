"""The simulator backend: a discrete-event model of a GPU cluster (simpy + networkx)."""
