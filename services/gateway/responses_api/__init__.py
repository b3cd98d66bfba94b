"""OpenAI's Responses API: the answer (answer.py), its output items (items.py) and the stored responses (store.py)."""
