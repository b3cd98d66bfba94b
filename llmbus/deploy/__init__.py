"""What `llmbus serve` deploys on one machine: the nats-server (and its auth, TLS and cluster config), the service processes and the supervisor that restarts them."""
