"""AutoDP: process groups, state transfer to joining replicas, idle (shadow) ranks and the transition."""
