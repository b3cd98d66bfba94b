"""OpenAI's Responses API: the request and the chat it means (request.py), the answer (answer.py), its
output items (items.py) and the stored responses (store.py)."""
