"""The `llmbus` command: its subcommands (main.py), each service's flags (services.py), the engine's flags (args.py) and vLLM's --config FILE.yaml (config_file.py)."""
