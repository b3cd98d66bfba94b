"""The gateway: an OpenAI-compatible HTTP app (app.py) that prepares each request (serving.py),
answers it (answer.py, responses_api/, pooling/) through the engine (engine.py) and parses
what the model wrote (parsers/); its NATS shell is shell/."""
