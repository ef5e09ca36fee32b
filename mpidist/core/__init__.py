"""The communication core: the process mesh, communicators, collectives (flat and
two-level), topology, flat buffers and shard arithmetic, device arrays."""
