"""The `llmbus` command: its subcommands (main.py), the service commands (services.py) and their
flags (service_args.py), the engine's flags (args.py) and vLLM's --config FILE.yaml (config_file.py)."""
