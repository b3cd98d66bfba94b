"""The pooling endpoints: /v1/embeddings, /score and /rerank, /classify."""
