"""Ray: a job runs as a Ray task on a node that holds its cards, or across the fewest nodes as a gang."""
