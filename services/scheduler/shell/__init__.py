"""The scheduler's NATS shell: the service's main, the fleet of workers, the gateways it answers, the executor that sends steps over the bus, and the stall-aware silence clock."""
