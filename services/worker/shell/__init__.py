"""The worker's NATS shell: the service's main and the steps it serves off the bus."""
