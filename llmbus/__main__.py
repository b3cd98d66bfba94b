from llmbus.cli.main import main

raise SystemExit(main())
