"""The tokenizer's NATS shell: request/reply in a queue group."""
