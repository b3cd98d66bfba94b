"""The tokenizer: chat templates and encoding (tokenizer.py), structured-output spec checks
(grammar_check.py); its NATS shell is shell/."""
