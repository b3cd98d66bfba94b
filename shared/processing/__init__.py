"""Request output processing shared by the offline LLM and the gateway: the incremental detokenizer, the output processor, beam search's bookkeeping, scoring."""
