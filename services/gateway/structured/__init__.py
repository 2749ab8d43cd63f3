"""What a request asks of the tokens beyond sampling: `logit_bias` and structured outputs
(`response_format`, vLLM's `structured_outputs`). Their body fields (`schema`) and their parsing
into engine terms (`constraints`); the grammar itself is compiled once, by the request core, with
the engine's own check. Imports only the engine and the gateway's root modules, never `api/`."""
