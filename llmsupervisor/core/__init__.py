"""The pure core: states and their edges, restarts, findings, observations, the policy and its
memory, the reload plan. Nothing here does I/O, awaits, or reads a clock: time is ``now``."""
