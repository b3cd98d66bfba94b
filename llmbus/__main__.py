from llmbus.cli import main

raise SystemExit(main())
