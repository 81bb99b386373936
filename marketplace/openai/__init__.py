"""The customer's door: the OpenAI-shaped API (`/v1/`), its WebSocket and the usage pages.

    apis              the views under /v1/ (`urls`)
    consumers         the chat stream's WebSocket
    usage_apis        /v1/usage and its CSV
    serializers       a request body, checked
    admission         a request admitted: the key, the model, the hold
    choices           one request per choice; their chunks merged
    streaming         a request's chunks as SSE, and a whole answer
    render            chunks and whole answers in OpenAI's shapes
    outputs           the text of an answer, split into its parts
    responses         the Responses API on top of chat completions
    stored_responses  responses kept for `previous_response_id`
    tool_calls        tools and tool calls, as a chat model writes them

The door calls `marketplace.services` and reads `marketplace.selectors`; no room below
imports it.
"""
