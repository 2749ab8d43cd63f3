"""Tool calling in chat completions (docs/tool_calling.md): the fields' shapes (`schema`), the
request they make (`request`), the prompt that shows the tools (`prompt`), the answers read back
as calls (`calls`, with the incremental scanner `scan`), and the hooks the chat endpoint calls
(`hooks`). Imports only the engine and the gateway's root modules, never `api/`."""
